"""The report of stage `evaluation`: one self-contained HTML page, and the plot files DVC reads.

`write_report(path, data)` renders a `ReportData` (the fields are documented on each model below) into a single
HTML file with inline CSS and inline SVG only — no script, font, image or stylesheet is fetched, so the page reads
the same offline, from an artifact store or attached to a ticket. Sections: the results table (per method:
training rollouts, pass^1 per family and overall, pass^k, the paired difference with the reference), a bar chart
of overall pass^1, the score-vs-training-rollouts curve, the router's confusion matrix with its accuracy and
chance, the transfer matrix (each adapter on each capability slice), the budgets, notes and warnings.

`write_plot_files(out_dir, data)` writes curve.csv, confusion.csv (one row per routed instance: the shape of
`dvc plots`' confusion template) and transfer.csv (long format: one row per adapter x slice).

Scores are fractions in [0, 1] everywhere in the data and shown as percentages.
"""

from __future__ import annotations

import csv
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_core.evaluation.stats import format_budget, format_p, table_rows
from trace_core.figures import pyplot, svg

_TOLERANCE = 1e-6  # rounding slack when checking that a point lies inside its interval


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Score(_Model):
    """A score and its interval, fractions in [0, 1] (a difference lies in [-1, 1])."""

    value: float
    ci: tuple[float, float] | None = None


class TableRow(_Model):
    """One method's row of the results table; `stats.table_rows` produces exactly this shape."""

    method: str  # the method id, e.g. "trace", "single:<capability_id>"
    label: str  # its display name
    budget: int | None = None  # training rollouts spent; None: nothing trained (base, oracle) or unknown
    reference: bool = False  # the row the differences are taken against
    families: dict[str, Score] = Field(default_factory=dict)  # pass^1 per task family
    overall: Score  # pass^1 over all instances
    pass_k: dict[str, Score] = Field(default_factory=dict)  # "2", "3", ...: pass^k for k > 1
    delta: Score | None = None  # mean paired difference in success rate vs the reference
    p_value: float | None = None  # exact two-sided sign test of that difference
    improved: int | None = None  # instances better than the reference
    regressed: int | None = None  # instances worse than the reference


class CurvePoint(_Model):
    """One point of the score-vs-training-rollouts curve (one line per method)."""

    method: str
    rollouts: int = Field(ge=0)  # training rollouts spent to reach this point
    score: float = Field(ge=0, le=1)
    ci_low: float = Field(ge=0, le=1)
    ci_high: float = Field(ge=0, le=1)

    @model_validator(mode="after")
    def _inside(self) -> CurvePoint:
        if not self.ci_low - _TOLERANCE <= self.score <= self.ci_high + _TOLERANCE:
            raise ValueError(f"curve point {self.method}@{self.rollouts}: score {self.score} is outside its interval "
                             f"[{self.ci_low}, {self.ci_high}]; pass the interval of this score")
        return self


class Confusion(_Model):
    """The router's choices: `counts[i][j]` = instances whose oracle label is `labels[i]` and that were routed to
    `labels[j]` (rows = oracle, columns = predicted). Use a label such as "base" for "no adapter"."""

    labels: list[str]
    counts: list[list[int]]
    chance: float | None = None  # the accuracy to beat; None: that of a router guessing with the same label
    #                              frequencies as the one observed (Σ share_oracle × share_routed, Cohen's p_e)
    chance_note: str = ""  # how `chance` was obtained, when given

    @model_validator(mode="after")
    def _square(self) -> Confusion:
        n = len(self.labels)
        if len(set(self.labels)) != n:
            raise ValueError(f"confusion labels must be unique, got {self.labels}")
        if len(self.counts) != n or any(len(row) != n for row in self.counts):
            raise ValueError(f"confusion counts must be {n} x {n} (one row and one column per label {self.labels})")
        if any(c < 0 for row in self.counts for c in row):
            raise ValueError("confusion counts must be non-negative")
        return self

    @property
    def total(self) -> int:
        return sum(map(sum, self.counts))

    @property
    def correct(self) -> int:
        return sum(self.counts[i][i] for i in range(len(self.labels)))

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.total if self.total else None

    @property
    def chance_accuracy(self) -> float | None:
        if self.chance is not None:
            return self.chance
        if not self.total:
            return None
        n = len(self.labels)
        actual = [sum(self.counts[i]) / self.total for i in range(n)]
        predicted = [sum(self.counts[i][j] for i in range(n)) / self.total for j in range(n)]
        return sum(a * p for a, p in zip(actual, predicted))


class Transfer(_Model):
    """Success rate of each adapter (rows, "base" included) on each capability's slice (columns):
    `values[i][j]` in [0, 1], None where that pair was not played; `n[i][j]` episodes behind it (optional)."""

    rows: list[str]
    cols: list[str]
    values: list[list[float | None]]
    n: list[list[int]] | None = None
    reference: str | None = "base"  # the row each cell's difference is shown against (if present)

    @model_validator(mode="after")
    def _shape(self) -> Transfer:
        shape = (len(self.rows), len(self.cols))
        for name, grid in (("values", self.values), ("n", self.n)):
            if grid is not None and (len(grid) != shape[0] or any(len(r) != shape[1] for r in grid)):
                raise ValueError(f"transfer {name} must be {shape[0]} x {shape[1]} "
                                 f"(rows {self.rows}, cols {self.cols})")
        if any(v is not None and not 0 <= v <= 1 for r in self.values for v in r):
            raise ValueError("transfer values are success rates: fractions in [0, 1]")
        return self


class Budget(_Model):
    """What a method spent."""

    method: str
    label: str = ""  # display name (default: the method id)
    rollouts: int | None = None  # training rollouts; None: not applicable
    note: str = ""  # e.g. "4 adapters x 300 rollouts", "prompt evolution, 12 candidates"


class ReportData(_Model):
    """Everything the evaluation report shows. Only `rows` is required; empty parts are stated as absent."""

    title: str = "TRACE — evaluation"
    intro: str = ""  # one paragraph: target, instances, trials, model
    level: float = 0.95  # the interval level of every CI shown
    reference: str | None = "base"  # the method differences are taken against
    rows: list[TableRow]
    curve: list[CurvePoint] = Field(default_factory=list)
    confusion: Confusion | None = None
    transfer: Transfer | None = None
    budgets: list[Budget] = Field(default_factory=list)  # empty: taken from the rows' budgets
    notes: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @classmethod
    def from_evaluation(cls, summary: Mapping[str, Any], **fields: Any) -> ReportData:
        """The report data of a `stats.evaluate` summary: its rows, level, reference and warnings (extra warnings in
        `fields` come first); `fields` fills the rest (curve, confusion, transfer, budgets, notes, title, intro)."""
        families = ", ".join(f"{f} ({n})" for f, n in summary["families"].items())
        intro = (f"{summary['instances']} held-out instances ({families}), {summary['trials']} trial(s) each; "
                 f"every method played the same instances.")
        fields.setdefault("intro", intro)
        fields["warnings"] = list(fields.get("warnings", [])) + list(summary.get("warnings", []))
        return cls(rows=table_rows(summary), level=summary["bootstrap"]["level"], reference=summary["reference"],
                   **fields)


# -- rendering ----------------------------------------------------------------------------------------------------

_CSS = """
:root{--ink:#1d2430;--muted:#5f6b7a;--line:#d9dee5;--head:#f2f4f7;--accent:#1565c0}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--ink);
  margin:0;background:#f7f8fa;line-height:1.45}
main{max-width:1180px;margin:0 auto;padding:28px 32px 48px;background:#fff;min-height:100vh}
h1{font-size:26px;margin:0 0 6px}
h2{font-size:19px;margin:34px 0 8px;padding-bottom:4px;border-bottom:2px solid var(--line)}
p{margin:6px 0}.muted{color:var(--muted)}.caption{color:var(--muted);font-size:13px;margin-top:6px}
table{border-collapse:collapse;font-size:13.5px;margin:10px 0;font-variant-numeric:tabular-nums}
th,td{border:1px solid var(--line);padding:5px 9px;text-align:right;white-space:nowrap}
th{background:var(--head);font-weight:600;white-space:normal;vertical-align:bottom}th:first-child,td:first-child{text-align:left}
table.results tbody tr:nth-child(even){background:#fafbfc}
tr.reference td{background:#f1f3f6;font-style:italic}
td .ci{display:block;color:var(--muted);font-size:11px;font-weight:400}td .sub{display:block;font-size:11px;opacity:.8}
td.best{font-weight:700}.up{color:#1b7f3b}.down{color:#b3261e}
td.method code{display:block;color:var(--muted);font-size:11px}
.matrix td,.matrix th{min-width:74px;text-align:center}.matrix tbody th{text-align:left;vertical-align:middle}
.matrix td.own{outline:2px solid #222;outline-offset:-3px}
.matrix th.corner{font-weight:400;color:var(--muted);font-size:12px}
.scale{display:inline-block;width:180px;height:10px;vertical-align:middle;border:1px solid var(--line);margin:0 6px}
.bar{display:inline-block;height:10px;background:var(--accent);opacity:.75;vertical-align:middle}
.scroll{overflow-x:auto}th.left,td.left{text-align:left}
.warnings{border-left:4px solid #c77700;background:#fff8e6;padding:8px 14px;margin:14px 0}
.warnings li{margin:3px 0}.kpi{font-size:15px}.kpi b{font-size:18px}
figure{margin:12px 0}figure svg{max-width:100%;height:auto}
footer{margin-top:40px;color:var(--muted);font-size:12px}
"""

# Fixed colours for the methods the paper compares, so a method keeps its colour across reports; others cycle.
_COLOURS = {"trace": "#1565c0", "grpo_target": "#e65100", "gepa": "#2e7d32", "oracle": "#6a1b9a", "base": "#8a8f98",
            "mixture": "#00838f", "merged_linear": "#ad1457", "merged_ties": "#795548", "describe": "#9e9d24"}
_CYCLE = ("#37474f", "#c62828", "#5c6bc0", "#00897b", "#f9a825", "#8d6e63", "#7b1fa2", "#546e7a")

_e = html.escape


def _colours(methods: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    spare = iter(_CYCLE * (1 + len(methods) // len(_CYCLE)))
    for m in methods:
        out[m] = _COLOURS.get(m) or next(spare)
    return out


def _pct(x: float, signed: bool = False) -> str:
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _score_cell(s: Score | None, best: bool = False, signed: bool = False) -> str:
    if s is None:
        return "<td>—</td>"
    ci = "" if s.ci is None else f"<span class='ci'>[{_pct(s.ci[0], signed)}, {_pct(s.ci[1], signed)}]</span>"
    cls = ""
    if signed and s.ci is not None:
        cls = " class='up'" if s.ci[0] > 0 else " class='down'" if s.ci[1] < 0 else ""
    elif best:
        cls = " class='best'"
    return f"<td{cls}>{_pct(s.value, signed)}{ci}</td>"


def _blend(t: float) -> str:
    """White -> deep blue for t in [0, 1] (a sequential scale readable in grey print too)."""
    t = min(1.0, max(0.0, t))
    low, high = (255, 255, 255), (13, 71, 161)
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(low, high))


def _ink(t: float) -> str:
    return "#fff" if t > 0.55 else "#1d2430"


def _nice_ceiling(x: float) -> float:
    """The top of a colour scale: the smallest of 0.1, 0.2, 0.25, 0.5, 1 not below x (small rates stay visible)."""
    for top in (0.1, 0.2, 0.25, 0.5, 1.0):
        if x <= top + 1e-12:
            return top
    return 1.0


def _results_table(data: ReportData) -> str:
    rows = data.rows
    families: list[str] = []
    ks: list[str] = []
    for r in rows:
        families += [f for f in r.families if f not in families]
        ks += [k for k in r.pass_k if k not in ks]
    ks.sort(key=int)
    has_delta = any(r.delta is not None for r in rows)
    best = max(r.overall.value for r in rows)
    head = ["method", "training rollouts", *families, "overall pass^1", *[f"pass^{k}" for k in ks]]
    if has_delta:
        head += [f"Δ vs {data.reference} (pts)", "improved / regressed", "sign test p"]
    out = ["<div class='scroll'><table class='results'><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head)
           + "</tr></thead><tbody>"]
    for r in rows:
        cells = [f"<td class='method'>{_e(r.label)}" + (f"<code>{_e(r.method)}</code>" if r.label != r.method else "")
                 + "</td>", f"<td>{format_budget(r.budget)}</td>"]
        cells += [_score_cell(r.families.get(f)) for f in families]
        cells.append(_score_cell(r.overall, best=abs(r.overall.value - best) < 1e-12))
        cells += [_score_cell(r.pass_k.get(k)) for k in ks]
        if has_delta:
            changed = "—" if r.improved is None else f"{r.improved} / {r.regressed}"
            cells += [_score_cell(r.delta, signed=True), f"<td>{changed}</td>", f"<td>{format_p(r.p_value)}</td>"]
        cls = " class='reference'" if r.reference else ""
        out.append(f"<tr{cls} data-method='{_e(r.method)}'>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    caption = (f"pass^k in %; [low, high] = {data.level:.0%} bootstrap interval over instances; bold = best overall.")
    if has_delta:
        caption += (f" Δ = mean per-instance difference in success rate vs {_e(str(data.reference))} in percentage "
                    "points (paired bootstrap interval; green/red when the interval excludes 0); sign test p = exact, "
                    "two-sided, over the instances that changed.")
    out.append(f"<p class='caption'>{caption}</p>")
    return "\n".join(out)


def _bars(data: ReportData, colours: Mapping[str, str]) -> str:
    plt = pyplot("trace-evaluation-bars")
    rows = data.rows
    fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(rows) + 1.3))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        v = 100 * r.overall.value
        ax.barh(y, v, height=0.62, color=colours[r.method], alpha=0.9)
        if r.overall.ci is not None:
            lo, hi = (100 * c for c in r.overall.ci)
            ax.errorbar(v, y, xerr=[[v - lo], [hi - v]], fmt="none", ecolor="#222", capsize=3, lw=1)
        right = 100 * r.overall.ci[1] if r.overall.ci is not None else v
        ax.annotate(f"{v:.1f}", (right, y), xytext=(5, 0), textcoords="offset points", va="center", fontsize=8.5,
                    color="#333")
    reference = next((r for r in rows if r.reference), None)
    if reference is not None:
        ax.axvline(100 * reference.overall.value, color="#555", ls="--", lw=1)
    ax.set_yticks(ys, [r.label for r in rows], fontsize=9)
    top = max(100 * (r.overall.ci[1] if r.overall.ci else r.overall.value) for r in rows)
    ax.set_xlim(0, min(105, max(10, top * 1.15)))  # room for the value printed right of each interval
    ax.set_xlabel("overall pass^1 (%)")
    title = f"Overall pass^1 with {data.level:.0%} CI" + ("; dashed = reference" if reference else "")
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", color="#e3e6ea", lw=0.8)
    ax.set_axisbelow(True)
    fig.tight_layout()
    return svg(fig)


def _curve(data: ReportData, colours: Mapping[str, str]) -> str:
    plt = pyplot("trace-evaluation-curve")
    labels = {r.method: r.label for r in data.rows}
    methods: list[str] = []
    for p in data.curve:
        if p.method not in methods:
            methods.append(p.method)
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    for m in methods:
        pts = sorted((p for p in data.curve if p.method == m), key=lambda p: p.rollouts)
        xs = [p.rollouts for p in pts]
        colour = colours.get(m, "#37474f")
        ax.fill_between(xs, [100 * p.ci_low for p in pts], [100 * p.ci_high for p in pts], color=colour, alpha=0.13,
                        lw=0)
        ax.plot(xs, [100 * p.score for p in pts], marker="o", ms=5, lw=2, color=colour, label=labels.get(m, m))
    reference = next((r for r in data.rows if r.reference), None)
    if reference is not None and reference.method not in methods:
        ax.axhline(100 * reference.overall.value, color="#555", ls="--", lw=1,
                   label=f"{reference.label} (no training)")
    ax.set_xlabel("training rollouts spent")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_title(f"Score vs training rollouts (bands = {data.level:.0%} CI)", fontsize=10)
    ax.grid(color="#e3e6ea", lw=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="best", fontsize=9, frameon=False)
    fig.tight_layout()
    return svg(fig)


def _confusion(c: Confusion) -> str:
    n = len(c.labels)
    out = []
    acc, chance = c.accuracy, c.chance_accuracy
    if acc is not None:
        how = c.chance_note or "a router guessing with the observed label frequencies"
        out.append(f"<p class='kpi'>Routing accuracy <b>{_pct(acc)}%</b> ({c.correct} of {c.total}) · chance "
                   f"<b>{_pct(chance)}%</b> <span class='muted'>({_e(how)})</span></p>")
    else:
        out.append("<p class='muted'>No routed instances.</p>")
    out.append("<table class='matrix'><thead><tr><th class='corner'>oracle ↓ · routed →</th>"
               + "".join(f"<th>{_e(lab)}</th>" for lab in c.labels) + "<th>total</th></tr></thead><tbody>")
    for i, lab in enumerate(c.labels):
        total = sum(c.counts[i])
        cells = []
        for j in range(n):
            share = c.counts[i][j] / total if total else 0.0
            own = " own" if i == j else ""
            cells.append(f"<td class='cell{own}' style='background:{_blend(share)};color:{_ink(share)}' "
                         f"title='{_e(lab)} → {_e(c.labels[j])}: {share:.0%} of the row'>{c.counts[i][j]}</td>")
        out.append(f"<tr><th>{_e(lab)}</th>{''.join(cells)}<td>{total}</td></tr>")
    out.append("</tbody></table>")
    out.append("<p class='caption'>Rows: the oracle's adapter for the instance; columns: the router's choice. Colour = "
               f"share of the row <span class='scale' style='background:linear-gradient(90deg,{_blend(0)},"
               f"{_blend(1)})'></span> 0–100%; outlined = correct.</p>")
    return "\n".join(out)


def _transfer(t: Transfer) -> str:
    present = [v for r in t.values for v in r if v is not None]
    top = _nice_ceiling(max(present, default=1.0))
    ref = t.rows.index(t.reference) if t.reference in t.rows else None
    out = ["<table class='matrix'><thead><tr><th class='corner'>adapter ↓ · slice →</th>"
           + "".join(f"<th>{_e(c)}</th>" for c in t.cols) + "</tr></thead><tbody>"]
    for i, row in enumerate(t.rows):
        cells = []
        for j, col in enumerate(t.cols):
            v = t.values[i][j]
            if v is None:
                cells.append("<td class='muted'>—</td>")
                continue
            shade = v / top
            own = " own" if row == col or row.endswith(":" + col) else ""
            sub = ""
            if ref is not None and i != ref and t.values[ref][j] is not None:
                sub = f"<span class='sub'>{_pct(v - t.values[ref][j], signed=True)}</span>"
            n = f" (n={t.n[i][j]})" if t.n is not None else ""
            cells.append(f"<td class='cell{own}' style='background:{_blend(shade)};color:{_ink(shade)}' "
                         f"title='{_e(row)} on {_e(col)}: {_pct(v)}%{n}'>{_pct(v)}%{sub}</td>")
        out.append(f"<tr><th>{_e(row)}</th>{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    caption = ("Success rate of each adapter on each capability's slice. Colour "
               f"<span class='scale' style='background:linear-gradient(90deg,{_blend(0)},{_blend(1)})'></span> "
               f"0–{100 * top:g}%; outlined = the adapter's own slice.")
    if ref is not None:
        caption += f" Small figures: difference from {_e(t.reference)} in percentage points."
    out.append(f"<p class='caption'>{caption}</p>")
    return "\n".join(out)


def _budgets(data: ReportData) -> str:
    budgets = data.budgets or [Budget(method=r.method, label=r.label, rollouts=r.budget) for r in data.rows]
    top = max((b.rollouts or 0 for b in budgets), default=0)
    out = [("<table><thead><tr><th>method</th><th>training rollouts</th><th class='left'>relative</th>"
            "<th class='left'>note</th></tr></thead><tbody>")]
    for b in budgets:
        width = 0 if not top or b.rollouts is None else round(160 * b.rollouts / top)
        bar = f"<span class='bar' style='width:{width}px'></span>" if width else ""
        out.append(f"<tr><td>{_e(b.label or b.method)}</td><td>{format_budget(b.rollouts)}</td>"
                   f"<td class='left' style='width:170px'>{bar}</td><td class='left'>{_e(b.note)}</td></tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def render_report(data: ReportData | Mapping[str, Any]) -> str:
    """The report as one HTML string (deterministic: the same data gives the same bytes)."""
    data = data if isinstance(data, ReportData) else ReportData.model_validate(data)
    if not data.rows:
        raise ValueError("the report needs at least one table row (stats.table_rows of an evaluate summary)")
    colours = _colours([r.method for r in data.rows] + [p.method for p in data.curve])
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(data.title)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>{_e(data.title)}</h1>",
    ]
    if data.intro:
        out.append(f"<p class='muted'>{_e(data.intro)}</p>")
    if data.warnings:
        out.append("<div class='warnings'><b>Warnings</b><ul>" + "".join(f"<li>{_e(w)}</li>" for w in data.warnings)
                   + "</ul></div>")
    out.append("<h2 id='results'>Results</h2>")
    out.append(_results_table(data))
    out.append(f"<figure>{_bars(data, colours)}</figure>")
    out.append("<h2 id='curve'>Score vs training rollouts</h2>")
    if data.curve:
        out.append(f"<figure>{_curve(data, colours)}</figure>")
        out.append("<p class='caption'>Each line is one method's held-out success as its training budget grows; the "
                   "band is its interval. Methods are compared at equal rollouts along the x axis.</p>")
    else:
        out.append("<p class='muted'>No curve points were recorded.</p>")
    out.append("<h2 id='routing'>Routing</h2>")
    out.append(_confusion(data.confusion) if data.confusion else "<p class='muted'>No routing was evaluated.</p>")
    out.append("<h2 id='transfer'>Transfer</h2>")
    out.append(_transfer(data.transfer) if data.transfer else "<p class='muted'>No transfer matrix was computed.</p>")
    out.append("<h2 id='budgets'>Budgets</h2>")
    out.append(_budgets(data))
    if data.notes:
        out.append("<h2 id='notes'>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in data.notes) + "</ul>")
    out.append("<footer>Written by trace_core.evaluation.report; self-contained (no external resources).</footer>")
    out.append("</main></body></html>")
    return "\n".join(out) + "\n"


def write_report(path: str | Path, data: ReportData | Mapping[str, Any]) -> Path:
    """Render `data` (a `ReportData` or a dict of its fields) into the HTML file `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(data), encoding="utf-8")
    return path


# -- DVC plot files -----------------------------------------------------------------------------------------------


def _write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_plot_files(out_dir: str | Path, data: ReportData | Mapping[str, Any]) -> dict[str, Path]:
    """curve.csv (method, rollouts, score, ci_low, ci_high), confusion.csv (actual, predicted: one row per routed
    instance) and transfer.csv (adapter, slice, success_rate, n) in `out_dir`. A part the data lacks gets a
    header-only file, so the DVC outputs always exist. Returns {name: path}."""
    data = data if isinstance(data, ReportData) else ReportData.model_validate(data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curve = [(p.method, p.rollouts, round(p.score, 4), round(p.ci_low, 4), round(p.ci_high, 4)) for p in data.curve]
    confusion: list[tuple[str, str]] = []
    if data.confusion is not None:
        c = data.confusion
        for i, actual in enumerate(c.labels):
            for j, predicted in enumerate(c.labels):
                confusion += [(actual, predicted)] * c.counts[i][j]
    transfer: list[tuple[Any, ...]] = []
    if data.transfer is not None:
        t = data.transfer
        for i, row in enumerate(t.rows):
            for j, col in enumerate(t.cols):
                if t.values[i][j] is not None:
                    transfer.append((row, col, round(t.values[i][j], 4), "" if t.n is None else t.n[i][j]))
    return {
        "curve": _write_csv(out / "curve.csv", ("method", "rollouts", "score", "ci_low", "ci_high"), curve),
        "confusion": _write_csv(out / "confusion.csv", ("actual", "predicted"), confusion),
        "transfer": _write_csv(out / "transfer.csv", ("adapter", "slice", "success_rate", "n"), transfer),
    }


__all__ = [
    "Budget",
    "Confusion",
    "CurvePoint",
    "ReportData",
    "Score",
    "TableRow",
    "Transfer",
    "render_report",
    "write_plot_files",
    "write_report",
]
