"""The analysis report: one self-contained HTML page (inline SVG plots, no external files) that shows which
capabilities were selected and why — coverage vs Δ with CIs, per-capability label counts, failure excerpts."""

from __future__ import annotations

import html

from trace_core.analysis.base import Item, compact_trajectory
from trace_core.figures import svg as _svg
from trace_core.schemas import CapabilityDictionary, LabelRow

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.sel{background:#e8f5e9}.ctl{color:#888}
pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;font-size:12px}.warn{color:#b00}
"""


def _plots(d: CapabilityDictionary) -> tuple[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "trace-analysis"  # stable element ids: byte-identical reports
    caps = d.capabilities
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for c in caps:
        s = c.stats
        color = "#2e7d32" if c.selected else ("#999999" if c.control else "#1565c0")
        ax.errorbar(
            s.coverage_mean,
            s.delta_mean,
            xerr=[[max(0.0, s.coverage_mean - s.coverage_ci[0])], [max(0.0, s.coverage_ci[1] - s.coverage_mean)]],
            yerr=[[max(0.0, s.delta_mean - s.delta_ci[0])], [max(0.0, s.delta_ci[1] - s.delta_mean)]],
            fmt="o",
            color=color,
            capsize=3,
        )
        ax.annotate(c.capability_id, (s.coverage_mean, s.delta_mean), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.axvline(d.thresholds["rho"], ls="--", color="#c62828", lw=1)
    ax.axhline(d.thresholds["delta"], ls="--", color="#c62828", lw=1)
    ax.set_xlabel("coverage (share of failed runs lacking it)")
    ax.set_ylabel("contrastive gap Δ = ER− − ER+")
    ax.set_title("capabilities: green = selected, grey = control; bars = bootstrap CI")
    scatter = _svg(fig)

    fig, ax = plt.subplots(figsize=(7.5, 0.4 * len(caps) + 1.2))
    names = [c.capability_id for c in caps][::-1]
    ys = range(len(names))
    er_minus = [c.stats.er_minus_mean for c in caps][::-1]
    er_plus = [c.stats.er_plus_mean for c in caps][::-1]
    ax.barh([y + 0.2 for y in ys], er_minus, height=0.4, color="#c62828", label="ER− (failed runs)")
    ax.barh([y - 0.2 for y in ys], er_plus, height=0.4, color="#2e7d32", label="ER+ (successful runs)")
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.set_xlim(0, 1)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("lacking rate among runs where the capability was needed")
    bars = _svg(fig)
    return scatter, bars


def _fmt_ci(ci: tuple[float, float]) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def render_report(d: CapabilityDictionary, table: list[LabelRow], items: list[Item], excerpts: int) -> str:
    """The HTML report; `excerpts`: failing trajectories shown per capability (params analysis.report_excerpts)."""
    scatter, bars = _plots(d)
    e = html.escape
    t = d.target
    th = d.thresholds
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>TRACE analysis</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>TRACE analysis — capability dictionary</h1>",
        (f"<p>{t.get('trajectories')} trajectories ({t.get('failed')} failed, {t.get('succeeded')} succeeded) on "
        f"{e(str(t.get('domain')))} / {e(str(t.get('source')))}; labellers: {e(', '.join(d.labellers))}. "
        f"Selection: coverage ≥ {th['rho']:g} and Δ ≥ {th['delta']:g} in ≥ {th['k']:g} of {th['n']:g} runs "
        f"(a labeller with R runs needs ceil(K·R/N)); CIs: {th['ci']:.0%} bootstrap over trajectories.</p>"),
    ]
    out += [f"<p class='warn'>⚠ {e(w)}</p>" for w in d.warnings]
    out.append(
        f"<h2>Selected ({len(d.selected)})</h2><p>{e(', '.join(d.selected)) if d.selected else 'none'}</p>"
        "<table><tr><th>capability</th><th>labeller</th><th>selected</th><th>runs passed</th><th>coverage</th>"
        "<th>coverage CI</th><th>Δ</th><th>Δ CI</th><th>ER−</th><th>ER+</th><th>LF / PF / LP / PP</th>"
        "<th>agreement</th></tr>"
    )
    for c in d.capabilities:
        s = c.stats
        cls = "sel" if c.selected else ("ctl" if c.control else "")
        agree = "—" if s.agreement is None else f"{s.agreement:.2f}" + ("" if s.kappa is None else f" (κ {s.kappa:.2f})")
        out.append(
            f"<tr class='{cls}'><td title='{e(c.definition)}'>{e(c.capability_id)}</td><td>{e(c.labeller)}</td>"
            f"<td>{'yes' if c.selected else 'no'}</td><td>{s.runs_passed}/{s.runs} (need {s.runs_required})</td>"
            f"<td>{s.coverage_mean:.2f} ± {s.coverage_std:.2f}</td><td>{_fmt_ci(s.coverage_ci)}</td>"
            f"<td>{s.delta_mean:.2f} ± {s.delta_std:.2f}</td><td>{_fmt_ci(s.delta_ci)}</td>"
            f"<td>{s.er_minus_mean:.2f}</td><td>{s.er_plus_mean:.2f}</td>"
            f"<td>{s.lacking_failed:g} / {s.present_failed:g} / {s.lacking_passed:g} / {s.present_passed:g}</td>"
            f"<td>{agree}</td></tr>"
        )
    out.append("</table>")
    out.append(f"<h2>Coverage vs contrastive gap</h2>{scatter}<h2>Lacking rates</h2>{bars}")

    by_task = {item.trajectory.trajectory_id: item for item in items}
    notes = {(r.capability_id, r.trajectory_id): r.note for r in table if r.run == 0 and r.label == "LACKING"}
    out.append("<h2>Capabilities and failure excerpts</h2>")
    for c in d.capabilities:
        if c.control:
            continue
        out.append(f"<h3>{e(c.capability_id)} — {e(c.name)}{' (selected)' if c.selected else ''}</h3>")
        out.append(f"<p>{e(c.definition)}</p>")
        for quote in c.excerpts:
            out.append(f"<pre>{e(quote)}</pre>")
        shown = 0
        for (cid, tid), note in notes.items():
            if cid != c.capability_id or shown >= excerpts:
                continue
            item = by_task.get(tid)
            if item is None or item.trajectory.success:
                continue
            shown += 1
            out.append(f"<p><b>{e(item.task_id)}</b>: {e(note)}</p>")
            out.append(f"<pre>{e(compact_trajectory(item.trajectory, max_chars=1500, step_chars=160))}</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
