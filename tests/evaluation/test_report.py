"""Stage evaluation's report: the data model's checks, a self-contained HTML page (no external reference of any
kind), the DVC plot files, and the page as headless Chromium renders it (screenshot and DOM)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from tests.browser import dump_dom, png_summary, require_chromium, screenshot
from trace_core.evaluation.report import (
    Confusion,
    CurvePoint,
    ReportData,
    Transfer,
    render_report,
    write_plot_files,
    write_report,
)
from trace_core.evaluation.stats import evaluate
from trace_core.schemas import Trajectory
from tests.defaults import PARAMS

# The bootstrap settings the evaluation stage passes from params.yaml (evaluation.ci, seed)
STATS = {"level": PARAMS.evaluation.ci, "seed": PARAMS.seed}

FAMILIES = ("airline", "retail")
# method -> (label, training rollouts, pass^1 per family, overall, pass^2, Δ vs base or None)
METHODS = {
    "base": ("base agent", None, (0.24, 0.368), 0.329, 0.21, None),
    "trace": ("TRACE (routed, 3 adapters)", 1800, (0.44, 0.482), 0.47, 0.39, 0.141),
    "oracle": ("oracle routing", None, (0.50, 0.53), 0.521, 0.44, 0.192),
    "single:schema_grounding": ("best single adapter", 600, (0.34, 0.43), 0.403, 0.33, 0.074),
    "merged_ties": ("merged adapters (TIES)", 1800, (0.32, 0.42), 0.396, 0.31, 0.067),
    "mixture": ("one LoRA on the mixture", 1800, (0.34, 0.44), 0.409, 0.33, 0.08),
    "grpo_target": ("GRPO on the target tasks", 1800, (0.32, 0.404), 0.378, 0.30, 0.049),
    "gepa": ("GEPA (prompt evolution)", 1800, (0.38, 0.404), 0.396, 0.32, 0.067),
}
CAPABILITIES = ("schema_grounding", "multi_step_completion", "policy_compliance")


def _score(v: float, half: float = 0.07) -> dict:
    return {"value": v, "ci": [max(0.0, v - half), min(1.0, v + half)]}


def report_data() -> ReportData:
    """A realistic report built by hand: 8 methods, 2 families, pass^2, a 3-method curve, a 4-label confusion
    matrix, a 4 x 3 transfer matrix, budgets with notes, notes and a warning."""
    rows = []
    for method, (label, budget, fams, overall, p2, delta) in METHODS.items():
        rows.append({
            "method": method, "label": label, "budget": budget, "reference": method == "base",
            "families": {f: _score(v, 0.1) for f, v in zip(FAMILIES, fams)},
            "overall": _score(overall), "pass_k": {"2": _score(p2)},
            "delta": None if delta is None else {"value": delta, "ci": [delta - 0.06, delta + 0.06]},
            "p_value": None if delta is None else round(0.4 / (1 + 100 * delta), 4),
            "improved": None if delta is None else 20 + round(100 * delta), "regressed": None if delta is None else 12,
        })
    curve = []
    for method, scores in {"trace": (0.329, 0.39, 0.44, 0.47), "grpo_target": (0.329, 0.34, 0.36, 0.378),
                           "gepa": (0.329, 0.37, 0.39, 0.396)}.items():
        for rollouts, s in zip((0, 600, 1200, 1800), scores):
            curve.append({"method": method, "rollouts": rollouts, "score": s, "ci_low": s - 0.07, "ci_high": s + 0.07})
    labels = [*CAPABILITIES, "base"]
    confusion = Confusion(labels=labels, counts=[[30, 4, 2, 4], [5, 41, 3, 6], [2, 3, 22, 5], [3, 4, 4, 26]])
    transfer = Transfer(
        rows=["base", *(f"single:{c}" for c in CAPABILITIES)], cols=list(CAPABILITIES),
        values=[[0.22, 0.31, 0.18], [0.61, 0.33, 0.20], [0.25, 0.58, 0.21], [0.20, 0.30, 0.47]],
        n=[[64] * 3] * 4,
    )
    budgets = [{"method": m, "label": v[0], "rollouts": v[1],
                "note": "3 adapters x 600 rollouts" if m == "trace" else ""} for m, v in METHODS.items()]
    return ReportData(
        title="TRACE — evaluation on τ²-bench (airline + retail)",
        intro="164 held-out instances (airline 50, retail 114), 2 trials each, greedy decoding, user simulator = the "
              "base model at T=0.",
        rows=rows, curve=curve, confusion=confusion, transfer=transfer, budgets=budgets,
        notes=["GEPA spent its rollouts on target training tasks, not on synthetic environments.",
               "oracle = per instance the best of base and the single adapters (no rollouts of its own)."],
        warnings=["merged_linear was skipped: the adapters' ranks differ (set evaluation.merge_rank to merge)."],
    )


# Anything a browser could fetch: an absolute URL, a protocol-relative one, an src/srcset attribute, a CSS url() or
# @import, a stylesheet link or a script.
_EXTERNAL = re.compile(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|\bsrc\s*=|srcset\s*=|url\((?!\s*['\"]?#)|@import|<link\b"
                       r"|<script\b", re.IGNORECASE)
_HREF = re.compile(r"\bhref\s*=\s*['\"]([^'\"]*)['\"]", re.IGNORECASE)


def external_references(page: str) -> list[str]:
    """What in `page` points outside it (in-page `#id` references are fine: SVG clip paths and glyphs)."""
    found = [m.group(0) for m in _EXTERNAL.finditer(page)]
    return found + [h for h in _HREF.findall(page) if not h.startswith("#")]


def test_external_reference_check_catches_what_it_should():
    assert external_references("<svg><use href='#glyph-1'/><g clip-path='url(#p1)'/></svg><p>a//b</p>") == []
    for bad in ("<img src='x.png'>", "<a href='page.html'>", "<p style=\"background:url(a.png)\">", "http://x",
                "<script>1</script>", "<link rel=stylesheet href=a.css>", "<style>@import 'a.css'</style>"):
        assert external_references(bad), bad


def test_report_is_self_contained_and_deterministic(tmp_path):
    data = report_data()
    page = render_report(data)
    assert external_references(page) == []
    assert page.count("<svg") == 2  # the bar chart and the curve; the matrices are HTML tables
    for method, (label, *_rest) in METHODS.items():
        assert f"data-method='{method}'" in page and label in page
    assert "Routing accuracy <b>" in page and "Warnings" in page and "merge_rank" in page
    assert render_report(data) == page
    path = write_report(tmp_path / "sub" / "report.html", data.model_dump())  # a plain dict is accepted too
    assert path.read_text(encoding="utf-8") == page


def test_report_table_marks_reference_best_and_significance():
    page = render_report(report_data())
    trace_row = re.search(r"<tr data-method='trace'>.*?</tr>", page).group(0)
    assert "1,800" in trace_row and "<td class='best'>52.1" not in trace_row
    assert "<td class='up'>+14.1" in trace_row and "34 / 12" in trace_row
    assert re.search(r"<tr data-method='oracle'>.*<td class='best'>52\.1", page)
    assert "<tr class='reference' data-method='base'>" in page
    assert "pass^2" in page and "Δ vs base (pts)" in page


def test_confusion_accuracy_and_chance():
    c = Confusion(labels=["a", "b"], counts=[[3, 1], [0, 4]])
    assert (c.total, c.correct, c.accuracy) == (8, 7, 0.875)
    assert c.chance_accuracy == pytest.approx(0.5 * 3 / 8 + 0.5 * 5 / 8)  # Σ share_oracle x share_routed
    assert Confusion(labels=["a", "b"], counts=[[3, 1], [0, 4]], chance=0.5).chance_accuracy == 0.5
    assert Confusion(labels=["a"], counts=[[0]]).accuracy is None


def test_the_model_refuses_inconsistent_data():
    with pytest.raises(ValueError, match="outside its interval"):
        CurvePoint(method="trace", rollouts=10, score=0.5, ci_low=0.6, ci_high=0.7)
    with pytest.raises(ValueError, match="2 x 2"):
        Confusion(labels=["a", "b"], counts=[[1, 2]])
    with pytest.raises(ValueError, match="unique"):
        Confusion(labels=["a", "a"], counts=[[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="values must be 1 x 2"):
        Transfer(rows=["base"], cols=["x", "y"], values=[[0.1]])
    with pytest.raises(ValueError, match="fractions"):
        Transfer(rows=["base"], cols=["x"], values=[[12.0]])
    with pytest.raises(ValueError):
        ReportData(rows=[], unknown_field=1)
    with pytest.raises(ValueError, match="at least one table row"):
        render_report(ReportData(rows=[]))


def test_empty_parts_are_stated_not_drawn():
    data = report_data().model_copy(update={"curve": [], "confusion": None, "transfer": None, "budgets": []})
    page = render_report(data)
    assert page.count("<svg") == 1
    assert "No curve points were recorded" in page and "No routing was evaluated" in page
    assert "No transfer matrix was computed" in page and "3 adapters x 600" not in page
    assert "GEPA (prompt evolution)</td><td>1,800</td>" in page  # budgets fall back to the rows


def test_plot_files(tmp_path):
    paths = write_plot_files(tmp_path / "plots", report_data())
    with paths["curve"].open() as fh:
        curve = list(csv.DictReader(fh))
    assert len(curve) == 12 and curve[0] == {"method": "trace", "rollouts": "0", "score": "0.329",
                                             "ci_low": "0.259", "ci_high": "0.399"}
    with paths["confusion"].open() as fh:
        confusion = list(csv.DictReader(fh))
    assert len(confusion) == 40 + 55 + 32 + 37
    assert sum(r == {"actual": "schema_grounding", "predicted": "base"} for r in confusion) == 4
    assert sum(r["actual"] == r["predicted"] for r in confusion) == 30 + 41 + 22 + 26
    with paths["transfer"].open() as fh:
        transfer = list(csv.DictReader(fh))
    assert len(transfer) == 12
    assert transfer[3] == {"adapter": "single:schema_grounding", "slice": "schema_grounding", "success_rate": "0.61",
                           "n": "64"}
    empty = write_plot_files(tmp_path / "empty", ReportData(rows=report_data().rows))
    assert all(p.read_text().count("\n") == 1 for p in empty.values())  # header only: the DVC outputs exist


def _traj(method: str, instance: str, family: str, reward: float) -> Trajectory:
    return Trajectory(trajectory_id=f"{method}/{instance}", instance_id=instance, domain="retail", family=family,
                      source="tau2", messages=[], termination_reason="agent_stop", reward=reward,
                      success=reward == 1.0)


def test_report_data_from_an_evaluation_summary():
    instances = [(f"a{i}", "airline") for i in range(6)] + [(f"r{i}", "retail") for i in range(10)]
    results = {m: [_traj(m, i, f, float((n + shift) % 3 == 0)) for n, (i, f) in enumerate(instances)]
               for m, shift in (("base", 1), ("trace", 0))}
    summary = evaluate(results, budgets={"trace": 900}, labels={"trace": "TRACE"}, samples=100, **STATS)
    data = ReportData.from_evaluation(summary, notes=["hello"], warnings=["careful"])
    assert [r.method for r in data.rows] == ["base", "trace"] and data.rows[1].budget == 900
    assert data.reference == "base" and data.warnings == ["careful"] and data.intro.startswith("16 held-out")
    page = render_report(data)
    assert "airline (6), retail (10)" in page and "TRACE<code>trace</code>" in page


def test_report_renders_in_chromium(tmp_path):
    require_chromium()
    page = write_report(tmp_path / "report.html", report_data())
    png = screenshot(page, tmp_path / "report.png", width=1280, height=1600)
    width, height, colours = png_summary(png)
    assert (width, height) == (1280, 1600)
    assert colours > 50  # a blank or unstyled page has a handful; charts and shaded cells have many
    dom = dump_dom(page)
    for method, (label, *_rest) in METHODS.items():
        assert re.search(rf'<tr data-method="{re.escape(method)}">|<tr class="reference" data-method="{method}">',
                         dom), method
        assert label in dom
    assert "Routing accuracy" in dom and dom.count("<svg") == 2


def test_png_decoder_without_pillow_reads_chromium_screenshots(tmp_path):
    """Chromium's PNGs use all four scanline filters (Sub, Up, Average, Paeth): the fallback must undo each."""
    pytest.importorskip("PIL.Image")
    require_chromium()
    from tests.browser import _png_summary_zlib

    page = write_report(tmp_path / "report.html", report_data())
    png = screenshot(page, tmp_path / "small.png", width=320, height=240)
    assert _png_summary_zlib(png.read_bytes()) == png_summary(png)


def test_png_decoder_without_pillow_agrees_with_pillow_on_each_mode(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from tests.browser import _png_summary_zlib

    im = Image.new("RGB", (23, 9), "white")
    for x in range(23):
        for y in range(9):
            if (x * y) % 5 == 0:
                im.putpixel((x, y), (x * 11 % 256, y * 29 % 256, (x + y) * 7 % 256))
    for mode in ("RGB", "RGBA", "L"):
        path = tmp_path / f"{mode}.png"
        im.convert(mode).save(path, optimize=False)
        assert _png_summary_zlib(Path(path).read_bytes()) == png_summary(path)


def test_a_missing_browser_skips_locally_and_fails_under_ci(monkeypatch):
    from tests import browser

    monkeypatch.setattr(browser, "chromium_path", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install"):
        browser.require_chromium()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no Chromium found"):
        browser.require_chromium()
