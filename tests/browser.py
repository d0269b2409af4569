"""A headless Chromium (Debian's ``chromium`` package) driven over the DevTools protocol with
websocket-client: open a page, wait until its text shows what we look for, read it, screenshot it.
Started as a subprocess with a fresh profile and stopped by its PID, like the other test services.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.services import stop_pid

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1440,1000", "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium_or_skip() -> str:
    """The Chromium binary: skipped with a reason when absent, a failure when CI is set."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        why = "headless Chromium not found (apt-get install -y chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {why}")
        pytest.skip(why)
    return found


class Browser:
    """One Chromium, one page. ``open(url, needles)`` waits (up to ``timeout``) until the page's
    text contains every needle, so a test asserts on what a person would see, not on timing."""

    def __init__(self, binary: str):
        self.profile = Path(tempfile.mkdtemp(prefix="relaunch-chromium-"))
        self.log = self.profile / "chromium.log"
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("w"), start_new_session=True)
        port = self._devtools_port()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            page = next(t for t in json.load(resp) if t["type"] == "page")
        import websocket

        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _devtools_port(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", self.log.read_text())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"chromium did not start; its log:\n{self.log.read_text()[-2000:]}")

    def call(self, method: str, **params):
        """One DevTools command; returns its result (events in between are dropped)."""
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def text(self) -> str:
        result = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                           returnByValue=True)
        return result.get("result", {}).get("value") or ""

    def count(self, selector: str) -> int:
        result = self.call("Runtime.evaluate", expression=f"document.querySelectorAll({json.dumps(selector)}).length",
                           returnByValue=True)
        return int(result.get("result", {}).get("value") or 0)

    def click(self, selector: str) -> bool:
        """Click the first element matching ``selector``; False when there is none."""
        result = self.call("Runtime.evaluate", returnByValue=True, expression=(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (e) e.click(); return !!e; }})()"))
        return bool(result.get("result", {}).get("value"))

    def type_into(self, selector: str, text: str) -> None:
        """Focus the input matching ``selector`` and type ``text`` as a user would."""
        self.call("Runtime.evaluate", expression=f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def open(self, url: str, needles: list[str], timeout: float = 90) -> str:
        """Navigate to ``url`` and return the page text once it holds every needle (or at the
        deadline, for the caller's assertion to name what is missing)."""
        self.call("Page.navigate", url=url)
        return self.wait_for(needles, timeout)

    def wait_for(self, needles: list[str], timeout: float = 90) -> str:
        """The page text once it holds every needle, or at the deadline."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(n in text for n in needles):
                time.sleep(1.0)  # let charts finish drawing before a screenshot
                return self.text()
            time.sleep(0.5)
        return text

    def wait_for_selector(self, selector: str, timeout: float = 90) -> bool:
        """Whether an element matching ``selector`` appeared before the deadline (an input's
        placeholder is not page text, so :meth:`wait_for` cannot wait for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(selector):
                return True
            time.sleep(0.5)
        return False

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        stop_pid(self.proc)
        shutil.rmtree(self.profile, ignore_errors=True)
