"""Headless Chromium for tests that look at rendered pages (the HTML reports, the Prefect and MLflow UIs).

- `chromium_path()`: the browser binary, or None.
- `require_chromium()`: the binary for a test; skips the test without one, except under CI (env CI set), where
  the browser is installed by .ci/run and its absence is a failure.
- `screenshot(target, out_png)`: a PNG of a page (URL, or a local file path).
- `dump_dom(target)`: the page's DOM after load, as HTML text.
- `png_summary(path)`: width, height and number of distinct colours of a PNG (a blank page has one or two).

Every call starts a fresh browser with a throw-away profile and with networking extras (sync, component updates,
QUIC, background requests) off, so a test reaches nothing but the page it asked for.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
INSTALL_HINT = "install it with `apt-get install -y --no-install-recommends chromium` (.ci/run does so in CI)"

_FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in containers, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm, too small for the renderer
    "--hide-scrollbars",  # a scrollbar would change the screenshot's content width
    "--force-device-scale-factor=1",  # the PNG is exactly width x height pixels
)


def chromium_path() -> str | None:
    """The first Chromium or Chrome binary found (the usual /usr/bin names, then PATH), or None."""
    for candidate in CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    """The browser for a test: skip without one locally, fail without one under CI (CI installs it)."""
    import pytest

    path = chromium_path()
    if path is None:
        message = f"no Chromium found ({', '.join(CANDIDATES)}); {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _url(target: str | Path) -> str:
    if isinstance(target, Path) or "://" not in target:
        return Path(target).resolve().as_uri()
    return target


def _run(args: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
    binary = chromium_path()
    if binary is None:
        raise RuntimeError(f"no Chromium found ({', '.join(CANDIDATES)}); {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="trace-chromium-") as profile:
        cmd = [binary, *_FLAGS, f"--user-data-dir={profile}", *args]
        # Its own process group: on a timeout the browser's helper processes (zygote, renderer, GPU) go with it.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"Chromium did not finish within {timeout_s}s: {' '.join(cmd)}; raise timeout_s, or "
                               "check that the page loads (a URL that never answers keeps the browser waiting)")
    if proc.returncode != 0:
        raise RuntimeError(f"Chromium exited with {proc.returncode}: {' '.join(cmd)}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def screenshot(
    target: str | Path, out_png: Path, width: int = 1280, height: int = 1600, timeout_s: float = 60,
    *, settle_ms: int | None = None, extra_args: Sequence[str] = (),
) -> Path:
    """A width x height PNG of the page at `target` (a URL, or a local file) written to `out_png`.
    `settle_ms` lets scripts run that long in virtual time before the capture (single-page apps such as the
    Prefect and MLflow UIs render after load); `extra_args` go to Chromium as they are."""
    out_png = Path(out_png).resolve()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    out_png.unlink(missing_ok=True)
    args = [f"--screenshot={out_png}", f"--window-size={width},{height}", *extra_args]
    if settle_ms is not None:
        args.append(f"--virtual-time-budget={settle_ms}")
    result = _run([*args, _url(target)], timeout_s)
    if not out_png.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot to {out_png}\n{result.stderr[-2000:]}")
    return out_png


def dump_dom(
    target: str | Path, timeout_s: float = 60, *, settle_ms: int | None = None, extra_args: Sequence[str] = ()
) -> str:
    """The DOM of the page at `target` (a URL, or a local file) after load, serialised as HTML."""
    args = ["--dump-dom", *extra_args]
    if settle_ms is not None:
        args.append(f"--virtual-time-budget={settle_ms}")
    return _run([*args, _url(target)], timeout_s).stdout


# -- PNG inspection -----------------------------------------------------------------------------------------------


def png_summary(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct colours) of a PNG: with Pillow when installed, else by decoding it here (8-bit
    greyscale, RGB or RGBA, not interlaced: what Chromium writes)."""
    try:
        from PIL import Image
    except ImportError:
        return _png_summary_zlib(Path(path).read_bytes())
    with Image.open(path) as im:
        rgba = im.convert("RGBA")
        return rgba.width, rgba.height, len(rgba.getcolors(maxcolors=rgba.width * rgba.height))


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def _png_summary_zlib(blob: bytes) -> tuple[int, int, int]:
    if blob[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, idat, header = 8, bytearray(), None
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos : pos + 4])
        kind, body = blob[pos + 4 : pos + 8], blob[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("PNG without an IHDR chunk")
    width, height, depth, colour_type, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour_type)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG (bit depth {depth}, colour type {colour_type}, interlace {interlace}); "
                         "install Pillow to read it")
    raw = zlib.decompress(bytes(idat))
    stride = width * channels
    previous = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            upper_left = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                line[i] = (line[i] + _paeth(left, up, upper_left)) & 0xFF
        colours.update(bytes(line[i : i + channels]) for i in range(0, stride, channels))
        previous = line
    return width, height, len(colours)
