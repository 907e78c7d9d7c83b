"""Matplotlib figures as inline SVG for the self-contained HTML reports (stage analysis, stage evaluation).

The SVG is meant to sit inside an HTML page, so what only a standalone .svg file needs is dropped: the XML prolog
and DOCTYPE, the RDF metadata block and the namespace declarations. What remains names no URL at all, which lets a
report be checked for external references with a plain text search. `<use xlink:href>` becomes SVG 2's `<use href>`
(every current browser reads it), so no xlink namespace is needed either.
"""

from __future__ import annotations

import io
import re

_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.DOTALL)
_NAMESPACE = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def pyplot(salt: str):
    """matplotlib.pyplot on the Agg backend, with SVG element ids derived from `salt` (stable ids keep a report
    byte-identical from run to run; distinct salts keep two figures' ids apart on one page)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = salt
    return plt


def svg(fig) -> str:
    """`fig` as an `<svg>` element to paste into HTML (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = _METADATA.sub("", text, count=1)
    head, sep, body = text.partition(">")  # namespace declarations sit on the root element only
    return _NAMESPACE.sub("", head) + sep + body.replace("xlink:href=", "href=")


__all__ = ["pyplot", "svg"]
