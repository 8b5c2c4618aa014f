"""report.html rendered in a real headless Chromium: no console errors, the summary, the findings and every
plot visible, a screenshot of the first screen written.

Chromium is driven through the DevTools protocol by the small websocket client below (stdlib only).
The report is the session's full run (conftest's ``data``: every case on every installed column but
keras-jax and keras-torch; workers in their own processes, this one imports no framework).  Without Chromium
the tests skip, except under CI (``CI=true``), where `.ci/run` installs Debian's ``chromium``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

WIDTH, HEIGHT = 1400, 1000


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


class DevTools:
    """A minimal DevTools-protocol client over one websocket (RFC 6455 text frames, client-masked)."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        host_port, path = url.removeprefix("ws://").split("/", 1)
        host, port = host_port.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())  # fmt: skip
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert b" 101 " in head.split(b"\r\n")[0], head
        self.next_id = 0
        self.events: list[dict] = []

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            buf += chunk
        return buf

    def _recv(self) -> dict:
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self._read(8))
            message += self._read(n)
            if b0 & 0x80:  # FIN
                return json.loads(message)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        payload = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n))  # fmt: skip
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        while True:
            msg = self._recv()
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events:
                if ev.get("method") == method:
                    return ev
            self.events.append(self._recv())
        raise TimeoutError(method)


#: JavaScript: for each selector, whether every match is rendered (size, display, visibility, not in a
#: closed <details>) and where it starts; plus the number of plots.
VISIBLE_JS = """
(() => {
  const shown = el => {
    const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.display !== 'none' && s.visibility !== 'hidden' &&
           parseFloat(s.opacity) > 0 && !el.closest('details:not([open])');
  };
  const out = {};
  for (const sel of ['#summary', '#legend', '#findings', '#findings tr.finding', '#plots', 'svg.plot']) {
    const els = [...document.querySelectorAll(sel)];
    out[sel] = {count: els.length, visible: els.filter(shown).length,
                top: els.length ? els[0].getBoundingClientRect().top : null};
  }
  out.svgContent = [...document.querySelectorAll('svg.plot')].map(s => s.querySelectorAll('circle,rect,polyline').length);
  out.innerHeight = innerHeight;
  return out;
})()
"""


def render(page: Path, screenshot: Path, expression: str = VISIBLE_JS) -> tuple[list[str], Any]:
    """Load ``page`` in headless Chromium; returns (console errors, what ``expression`` found) and writes a PNG."""
    profile = tempfile.mkdtemp(prefix="mpx-chromium-")
    proc = subprocess.Popen(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 300  # only catches a hang: a loaded machine starts chromium slowly
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("chromium did not start its DevTools server")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=300).read())
        tab = DevTools(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log"):
            tab.call(f"{domain}.enable")
        tab.call(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )
        tab.events.clear()
        tab.call("Page.navigate", url=page.resolve().as_uri())
        tab.wait_for("Page.loadEventFired")
        found = tab.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]
        shot = tab.call("Page.captureScreenshot", format="png")
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        errors = []
        for ev in tab.events:
            p = ev.get("params", {})
            if ev.get("method") == "Runtime.exceptionThrown":
                details = p.get("exceptionDetails", {})
                errors.append(
                    f"exception: {details.get('text')} {details.get('exception', {}).get('description')}"
                )
            elif ev.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append("console.error: " + json.dumps([a.get("value") for a in p.get("args", [])]))
            elif ev.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append("log: " + p["entry"].get("text", "") + " " + p["entry"].get("url", ""))
        return errors, found
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def rendered(data, tmp_path_factory):
    _chromium()
    shots = tmp_path_factory.mktemp("browser")
    errors, found = render(data["out"] / "report.html", shots / "screenshot.png")
    return data, data["out"], shots, errors, found


def test_no_console_errors(rendered):
    *_, errors, _ = rendered
    assert errors == []


def test_summary_findings_and_every_plot_are_visible(rendered):
    data, out, _, _, found = rendered
    plots = sorted(p.name for p in (out / "plots").iterdir())
    ran = [b for b, meta in data["backends"].items() if not meta.get("skipped")]
    assert len(plots) == 2 * len(ran) >= 2  # numerics and traces per backend
    for sel in ("#summary", "#legend", "#findings", "#plots"):
        assert found[sel] == {"count": 1, "visible": 1, "top": found[sel]["top"]}, sel
    assert found["#findings tr.finding"]["count"] == len(data["findings"]) >= 1
    assert found["#findings tr.finding"]["visible"] == len(data["findings"])
    assert found["svg.plot"]["count"] == found["svg.plot"]["visible"] == len(plots)
    assert all(n > 0 for n in found["svgContent"])  # every plot draws marks
    assert 0 <= found["#summary"]["top"] < found["innerHeight"]  # the summary is on the first screen


def test_screenshot_of_the_first_screen_is_written(rendered):
    _, _, shots, _, _ = rendered
    png = (shots / "screenshot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (WIDTH, HEIGHT)
    target = os.environ.get("MPX_SCREENSHOT")
    if target:  # keep it for a person to look at
        shutil.copyfile(shots / "screenshot.png", target)


def test_the_checks_catch_a_broken_page(tmp_path):
    _chromium()
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><html><body><div id='summary' style='display:none'>x</div>"
                    "<img src='missing.png'><script>console.error('boom'); throw new Error('bad')</script>"
                    "</body></html>")  # fmt: skip
    errors, found = render(page, tmp_path / "bad.png")
    assert any("boom" in e for e in errors) and any("Error: bad" in e for e in errors)
    assert any("missing.png" in e for e in errors)
    assert found["#summary"]["count"] == 1 and found["#summary"]["visible"] == 0


#: JavaScript: the rendered text of every case-table cell, and of the visible error cells.
CELLS_JS = """
(() => ({
  cells: [...document.querySelectorAll('#cases td')].map(td => td.innerText),
  errors: [...document.querySelectorAll('#cases td.error')].filter(td => td.getBoundingClientRect().height > 0)
          .map(td => td.innerText),
  errorSection: document.querySelector('#errors h2').innerText,
}))()
"""


def test_case_cells_render_as_text_and_errors_show(tmp_path):
    """A report from rows (no framework): the ``scaler.stuck`` cells and an adapter error, as a reader sees them."""
    from conformance import report
    from conformance.test_report import STUCK, _with_errors_and_stuck

    _chromium()
    data = _with_errors_and_stuck()
    report.write_all(data, tmp_path / "report")
    errors, found = render(tmp_path / "report" / "report.html", tmp_path / "cells.png", CELLS_JS)
    assert errors == []
    assert found["cells"] and not [c for c in found["cells"] if "{" in c or '"' in c]
    i = found["cells"].index(STUCK)
    assert found["cells"][i + 2 : i + 5] == ["stuck at step 5: gradients overflow at min_scale",
                                             "skip: no stuck detection",
                                             "✓ stuck at step 5: gradients overflow at min_scale"]  # fmt: skip
    assert "✗ never stuck" in found["cells"]
    assert (
        found["errors"] == ["error: KeyError: 'policy' (at conformance/adapters/torch.py:114 in run_op)"] * 2
    )
    assert found["errorSection"] == "Adapter errors (2)"
