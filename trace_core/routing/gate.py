"""The trained gate: router scoring "gate" (params.yaml `evaluation.router.scoring: gate`).

A small classifier in front of the adapters, for base models too small to answer the lettered routing question
(label scoring) and whose likelihoods separate synthetic templates but not target tasks (channel scoring). It reads
a fixed representation of the task's opening — the MiniLM sentence embedding analysis already uses
(`trace_core.analysis.embedding.embed_texts`: 384 numbers, mean-pooled, unit length; CPU, bundled weights) — and a
multinomial logistic regression (scikit-learn, L2, lbfgs, seeded) turns it into one probability per routing option:
every routed capability plus "no adapter". Trained per pipeline run inside stage routing, on openings only:

- each capability's synthetic training instances (its first train seeds) -> that capability;
- the baseline's target trajectories with analysis' labels -> the capability a failed run lacked when it lacked
  exactly one of the routed capabilities, "no adapter" for a successful run (`truth.routing_label`); these are the
  only target-domain texts;
- off-topic distractors (`distractors`, a pure function of the seed) -> "no adapter".

No evaluation instance may be among them (`check_no_leak`, called before every fit). How much the synthetic
openings weigh against the baseline's (they outnumber them, and their template text differs from the target's) and
the regularisation are chosen per run by cross-validation over the baseline openings (`select_settings`: a grid in
params, accuracy on held-out baseline folds), never on evaluation instances. Calibration: the regression's
softmax is divided by one temperature fitted (maximum likelihood, bounded scalar search) on out-of-fold logits of
stratified folds, so that the probabilities top-p composition weighs adapters with are calibrated on data the
classifier did not fit. The gate is saved as a `GateRecord` (JSON: classes, coefficients, intercepts, temperature,
the embedding model's id and hash, library versions and the training openings' provenance), never a pickle.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_core.schemas import GateRecord, Instance

NONE = "none"  # the class name of "no adapter"
GATE_VERSION = 2  # 2: synthetic weight and C chosen by cross-validation (`selection`)
Embed = Callable[[list[str]], np.ndarray]


class GateError(ValueError):
    """Training data or a gate record that cannot route (the message says what to change)."""


class GateLeakError(GateError):
    """An evaluation instance (or its seed) is among the gate's training openings."""


@dataclass(frozen=True)
class Example:
    """One training opening: `label` is a capability id or None (no adapter); `source` is synthetic, baseline or
    distractor; the rest says which instance it came from (for the leakage check and the record)."""

    text: str
    label: str | None
    source: str
    instance_id: str | None = None
    family: str | None = None
    seed: int | None = None
    index: int | None = None
    task_key: str | None = None


def example_of(instance: Instance, text: str, label: str | None, source: str) -> Example:
    from trace_core.inputs import task_key

    return Example(text, label, source, instance.instance_id, instance.family, instance.seed, instance.index,
                   task_key(instance))


# ------------------------------------------------------------------------------------------------- distractors
# Requests no customer-service skill serves: the generator fills these templates from the word lists below.
_TEMPLATES = (
    "What's the weather going to be like in {city} this {day}?",
    "Can you recommend a good {genre} book for a long flight?",
    "How do I make {dish} at home without an oven?",
    "Translate '{phrase}' into {language}, please.",
    "Who won the {sport} game last {day}?",
    "Tell me a joke about {animal}s.",
    "What is {a} times {b}?",
    "Hi there! Just saying {phrase}, have a nice {day}.",
    "Can you help me write a short poem about {animal}s in {city}?",
    "What time does the sun set in {city} in {month}?",
    "I need ideas for a {genre}-themed birthday party in {month}.",
    "How many calories are in a bowl of {dish}?",
    "Explain the rules of {sport} to me like I'm five.",
    "What's the capital of the country where {dish} comes from?",
)
_WORDS = {
    "city": ("Lisbon", "Osaka", "Nairobi", "Denver", "Oslo", "Lima", "Hanoi", "Perth", "Quebec", "Tunis"),
    "day": ("weekend", "Monday", "Friday", "evening", "Sunday", "morning"),
    "genre": ("mystery", "science fiction", "history", "poetry", "fantasy", "travel"),
    "dish": ("lasagna", "ramen", "paella", "banana bread", "pancakes", "curry", "falafel"),
    "phrase": ("good morning", "thank you very much", "see you soon", "happy birthday", "where is the station"),
    "language": ("Italian", "Japanese", "Swahili", "Portuguese", "Finnish", "Korean"),
    "sport": ("football", "basketball", "cricket", "tennis", "hockey", "rugby"),
    "animal": ("cat", "penguin", "giraffe", "octopus", "dog", "owl"),
    "month": ("March", "July", "October", "December", "May"),
    "a": tuple(str(n) for n in range(3, 40)),
    "b": tuple(str(n) for n in range(3, 40)),
}

# The routing report's distractors (`distractors_to_base`): written apart from the generator and held out of every
# gate's training data — no template above produces them.
EVAL_DISTRACTORS = (
    "Good evening, I just wanted to say your website looks lovely today.",
    "Which planet in our solar system has the most moons?",
    "Could you suggest three names for my new puppy?",
    "How long should I boil an egg for a runny yolk?",
    "What does the word 'serendipity' mean?",
    "Is it better to learn guitar or piano as an adult?",
    "Write a haiku about autumn leaves.",
    "What year did the first moon landing happen?",
    "My neighbour's wifi name is funny, want to hear it?",
    "How do you say 'library' in German?",
)


def distractors(seed: int, n: int) -> list[str]:
    """`n` distinct off-topic openings drawn from the templates with a `random.Random(seed)`; a pure function of
    (seed, n), and the first k of n are those of k."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        template = rng.choice(_TEMPLATES)
        fields = {k: rng.choice(v) for k, v in _WORDS.items()}
        text = template.format(**fields)
        tries += 1
        if text not in seen or tries > 50 * max(n, 1):  # a very large n may have to repeat some
            seen.add(text)
            out.append(text)
    return out


def distractor_examples(seed: int, n: int) -> list[Example]:
    return [Example(text, None, "distractor", seed=seed, index=i) for i, text in enumerate(distractors(seed, n))]


# --------------------------------------------------------------------------------------------------- leakage
def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def _held_out_index(held_out: Sequence[Instance]) -> tuple[set, set, set, set]:
    """What names an evaluation instance: ids, procedural coordinates, task contents and normalised openings."""
    from trace_core.inputs import task_key
    from trace_core.routing.router import task_text

    return ({i.instance_id for i in held_out}, {(i.family, i.seed, i.index) for i in held_out if i.seed is not None},
            {task_key(i) for i in held_out}, {_norm(task_text(i)) for i in held_out})


def _leak(e: Example, index: tuple[set, set, set, set]) -> str | None:
    """How training opening `e` comes from an evaluation instance of `index` (`_held_out_index`): "instance",
    "coordinates", "task", "text", or None (distractors are generated text of no instance: EVAL_DISTRACTORS are
    checked apart, in the tests)."""
    ids, coords, keys, texts = index
    if e.source == "distractor":
        return None
    if e.instance_id in ids:
        return "instance"
    if e.seed is not None and (e.family, e.seed, e.index) in coords:
        return "coordinates"
    if e.task_key is not None and e.task_key in keys:
        return "task"
    return "text" if _norm(e.text) in texts else None


def shared_openings(examples: Sequence[Example], held_out: Sequence[Instance]) -> list[Example]:
    """The baseline openings that are the same text as a held-out task's opening but come from another task (on
    ToolSandbox a scenario and its state-dependency variant open with the same request yet sit in different halves:
    `find_days_till_holiday` and `..._wifi_off`). `fit_gate` leaves them out: the gate must not have seen a held-out
    opening, whatever its label."""
    index = _held_out_index(held_out)
    return [e for e in examples if e.source == "baseline" and _leak(e, index) == "text"]


def check_no_leak(examples: Sequence[Example], held_out: Sequence[Instance]) -> None:
    """Raise GateLeakError when a training opening comes from an evaluation instance: the same instance id, the
    same (family, seed, index) — the procedural coordinates that remake it —, the same task content (`task_key`)
    or the same opening text."""
    index = _held_out_index(held_out)
    clash = [e for e in examples if _leak(e, index) is not None]
    if clash:
        e = clash[0]
        raise GateLeakError(
            f"{len(clash)} of the gate's training openings come from evaluation instances (e.g. {e.source} "
            f"{e.instance_id!r}, family {e.family!r}, seed {e.seed}); the gate must never see a held-out task: "
            "use synthesis train seeds and a baseline.seed / evaluation.seed that differ")


# ------------------------------------------------------------------------------------------------- the gate
def embedding_id() -> dict[str, Any]:
    """What names the representation: the MiniLM package, its version and its weights' sha256."""
    from trace_core.analysis.embedding import MAX_TOKENS, MODEL_PACKAGE, model_dir

    weights = model_dir() / "model.safetensors"
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    package = MODEL_PACKAGE.replace("_", "-")
    return {"package": package, "version": importlib.metadata.version(package), "weights_sha256": digest.hexdigest(),
            "max_tokens": MAX_TOKENS, "pooling": "mean, L2-normalised"}


def _versions() -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in ("scikit-learn", "numpy", "scipy")}


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _fit_lr(x: np.ndarray, y: np.ndarray, w: np.ndarray, k: int, c: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(coef k x d, intercept k) of a multinomial logistic regression; classes are 0..k-1 (all present)."""
    from sklearn.linear_model import LogisticRegression

    lr = LogisticRegression(C=c, max_iter=5000, random_state=seed)
    lr.fit(x, y, sample_weight=w)
    if list(lr.classes_) != list(range(k)):
        raise GateError(f"classes {list(lr.classes_)} in the fitted gate, expected 0..{k - 1}")
    coef, intercept = lr.coef_.astype(np.float64), lr.intercept_.astype(np.float64)
    if k == 2:  # scikit-learn's binary model: p(1) = sigmoid(z) = softmax([0, z])
        coef = np.vstack([np.zeros_like(coef[0]), coef[0]])
        intercept = np.array([0.0, intercept[0]])
    return coef, intercept


def _temperature(x: np.ndarray, y: np.ndarray, w: np.ndarray, k: int, c: float, seed: int, folds: int) -> float:
    """The temperature that maximises the weighted likelihood of out-of-fold logits (1.0 when a class has fewer
    members than two folds need)."""
    from scipy.optimize import minimize_scalar
    from sklearn.model_selection import StratifiedKFold

    folds = min(folds, int(np.bincount(y, minlength=k).min()))
    if folds < 2:
        return 1.0
    logits = np.zeros((len(y), k))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(x, y):
        if len(set(y[train].tolist())) < k:
            return 1.0
        coef, intercept = _fit_lr(x[train], y[train], w[train], k, c, seed)
        logits[test] = x[test] @ coef.T + intercept

    def nll(t: float) -> float:
        p = _softmax(logits / t)[np.arange(len(y)), y]
        return float(-(w * np.log(np.clip(p, 1e-300, None))).sum() / w.sum())

    return float(minimize_scalar(nll, bounds=(0.05, 20.0), method="bounded", options={"xatol": 1e-6}).x)


def _weights(used: Sequence[Example], synthetic_weight: float) -> np.ndarray:
    """Sample weights: a baseline or distractor opening 1, a synthetic one `synthetic_weight`."""
    return np.array([synthetic_weight if e.source == "synthetic" else 1.0 for e in used])


def _fit_present(x: np.ndarray, y: np.ndarray, w: np.ndarray, k: int, c: float,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`_fit_lr` when some of the k classes may have no training row (a cross-validation fold): those get a zero
    coefficient row and a very negative intercept, so they are never predicted."""
    present = sorted(set(y.tolist()))
    if len(present) == k:
        return _fit_lr(x, y, w, k, c, seed)
    coef, intercept = np.zeros((k, x.shape[1])), np.full(k, -1e3)
    if len(present) == 1:
        intercept[present[0]] = 0.0
        return coef, intercept
    remap = {cls: i for i, cls in enumerate(present)}
    sub_coef, sub_intercept = _fit_lr(x, np.array([remap[v] for v in y.tolist()]), w, len(present), c, seed)
    coef[present], intercept[present] = sub_coef, sub_intercept
    return coef, intercept


def select_settings(used: Sequence[Example], x: np.ndarray, y: np.ndarray, k: int, cfg: Any,
                    seed: int) -> dict[str, Any]:
    """Choose (synthetic weight, C) from the grid `cfg.synthetic_weights` x `cfg.inverse_regularizations` by
    cross-validation on the BASELINE openings only (the labelled target-domain text, the closest data to the
    evaluation's tasks, which come from the same families at another seed): `cfg.folds` stratified folds grouped by
    baseline instance (trials of one task never straddle folds); each fold's model trains on every synthetic and
    distractor opening plus the other folds' baseline openings and is scored on the held-out fold's baseline openings.
    Score: accuracy (the routing report's measure; its class mix is the target's), ties broken by the lower mean
    log-loss, then by grid order (first listed wins). Without baseline openings of two instances or more the first grid
    point is used (`cv` None in the record); fewer folds when the baseline openings are too few for `cfg.folds`.
    Evaluation instances are never here: `fit_gate` checks for them first."""
    import warnings

    from sklearn.model_selection import StratifiedGroupKFold

    grid = [(sw, c) for sw in cfg.synthetic_weights for c in cfg.inverse_regularizations]
    base = np.array([e.source == "baseline" for e in used])
    groups = np.array([str(e.instance_id or e.task_key or e.text) for e in used])
    # StratifiedGroupKFold needs a class with at least as many members as folds (and as many groups as folds)
    largest = int(np.bincount(y[base], minlength=k).max()) if base.any() else 0
    folds = min(cfg.folds, len(set(groups[base].tolist())), largest)
    if folds < 2:
        sw, c = grid[0]
        return {"synthetic_weight": sw, "inverse_regularization": c, "cv": None,
                "reason": "fewer than two baseline instances with a routing label: first grid point"}
    rows = np.flatnonzero(base)
    with warnings.catch_warnings():  # a class with fewer members than folds is allowed (it lands in fewer folds)
        warnings.simplefilter("ignore", UserWarning)
        splits = list(StratifiedGroupKFold(folds, shuffle=True, random_state=seed).split(
            rows, y[rows], groups[rows]))
    others = np.flatnonzero(~base)
    scores = []
    for n, (sw, c) in enumerate(grid):
        w = _weights(used, sw)
        hits, losses = 0, 0.0
        for train, test in splits:
            fit_rows, test_rows = np.concatenate([others, rows[train]]), rows[test]
            coef, intercept = _fit_present(x[fit_rows], y[fit_rows], w[fit_rows], k, c, seed)
            p = _softmax(x[test_rows] @ coef.T + intercept)
            hits += int((p.argmax(axis=1) == y[test_rows]).sum())
            losses -= float(np.log(np.clip(p[np.arange(len(test_rows)), y[test_rows]], 1e-12, None)).sum())
        scores.append({"synthetic_weight": sw, "inverse_regularization": c, "accuracy": hits / len(rows),
                       "log_loss": losses / len(rows), "order": n})
    best = min(scores, key=lambda s: (-s["accuracy"], round(s["log_loss"], 9), s["order"]))
    return {"synthetic_weight": best["synthetic_weight"], "inverse_regularization": best["inverse_regularization"],
            "cv": {"folds": folds, "grouped_by": "baseline instance", "metric": "accuracy", "openings": len(rows),
                   "instances": len(set(groups[rows].tolist())), "grid": scores}}


def fit_gate(examples: Sequence[Example], embed: Embed, capability_ids: Sequence[str], cfg: Any, seed: int,
             held_out: Sequence[Instance], embedding: dict[str, Any]) -> GateRecord:
    """Train the gate over `capability_ids` plus no adapter on `examples` (after `check_no_leak` against
    `held_out`, the evaluation instances). `embed` maps texts to unit vectors (the stage passes MiniLM, described
    by `embedding_id()` as `embedding`); `cfg` is params' `evaluation.router.gate`. The synthetic openings' weight
    and C come from `select_settings` (cross-validation on the baseline openings), then the gate is refit on every
    opening. Baseline openings whose text is a held-out opening of another task are left out first (listed in the
    record's `selection["shared_openings_dropped"]`). Raises GateError when a class has no opening."""
    shared = shared_openings(examples, held_out)
    left_out = {id(e) for e in shared}
    examples = [e for e in examples if id(e) not in left_out]
    check_no_leak(examples, held_out)
    classes = [NONE, *capability_ids]
    index = {None: 0, **{c: i + 1 for i, c in enumerate(capability_ids)}}
    used = [e for e in examples if e.label in index]
    counts = Counter(classes[index[e.label]] for e in used)
    missing = [c for c in classes if not counts[c]]
    if missing:
        raise GateError(f"the gate has no training opening for {missing}: each capability needs synthetic training "
                        "instances (synthesis) and no adapter needs distractors (evaluation.router.gate.distractors "
                        "> 0) or successful baseline runs")
    x = np.asarray(embed([e.text for e in used]), dtype=np.float64)
    y = np.array([index[e.label] for e in used])
    k = len(classes)
    selection = select_settings(used, x, y, k, cfg, seed)
    if shared:
        selection["shared_openings_dropped"] = sorted(e.instance_id for e in shared)
    c = selection["inverse_regularization"]
    w = _weights(used, selection["synthetic_weight"])
    coef, intercept = _fit_lr(x, y, w, k, c, seed)
    temperature = _temperature(x, y, w, k, c, seed, cfg.folds)
    fitted = _softmax((x @ coef.T + intercept) / temperature).argmax(axis=1)
    by_source = Counter(f"{e.source}:{classes[index[e.label]]}" for e in used)
    return GateRecord(
        gate_version=GATE_VERSION, classes=classes, coef=coef.tolist(), intercept=intercept.tolist(),
        temperature=temperature, embedding=embedding, settings={**cfg.model_dump(), "seed": seed},
        selection=selection, libraries=_versions(), train_accuracy=float((fitted == y).mean()),
        counts=dict(sorted(by_source.items())),
        training=[{"source": e.source, "label": e.label, "instance_id": e.instance_id, "family": e.family,
                   "seed": e.seed, "index": e.index} for e in used])


class Gate:
    """A fitted gate (`GateRecord`) with the embedder it was trained with."""

    def __init__(self, record: GateRecord, embed: Embed):
        if record.gate_version != GATE_VERSION:
            raise GateError(f"gate record version {record.gate_version}, this code reads {GATE_VERSION}; retrain it "
                            "(re-run stage routing)")
        self.record, self.embed = record, embed
        self.coef = np.asarray(record.coef, dtype=np.float64)
        self.intercept = np.asarray(record.intercept, dtype=np.float64)

    @property
    def classes(self) -> list[str]:
        return list(self.record.classes)

    def class_probabilities(self, texts: Sequence[str]) -> np.ndarray:
        """n x classes probabilities (rows sum to 1)."""
        if not texts:
            return np.zeros((0, len(self.classes)))
        x = np.asarray(self.embed(list(texts)), dtype=np.float64)
        return _softmax((x @ self.coef.T + self.intercept) / self.record.temperature)

    def probabilities(self, options: Sequence[Any], texts: Sequence[str]) -> list[dict[str, float]]:
        """label -> α per task for the routing options (`router.build_options`), ready for `router.select`."""
        cls = [NONE if o.capability_id is None else o.capability_id for o in options]
        if sorted(cls) != sorted(self.classes):
            raise GateError(f"the gate routes {self.classes}, the options are {cls}; train it on these adapters")
        col = [self.classes.index(c) for c in cls]
        return [{o.label: float(row[j]) for o, j in zip(options, col)} for row in self.class_probabilities(texts)]
