"""Headless Chromium driven over the DevTools protocol with the ``websockets`` client
(no Playwright: its browsers come from a CDN). :func:`chromium` starts one with a fake
microphone that plays a WAV file; :class:`Page` evaluates JavaScript and takes screenshots."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import websockets

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str:
    """The browser. Without one the test is skipped with how to install it (``-ra`` prints
    the reason), as the CUDA tests are without a GPU — or fails, when
    ``OMNIRELAY_REQUIRE_CHROMIUM=1`` says this machine must run it."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    reason = "no Chromium found (looked for chromium, chromium-browser, google-chrome): apt-get install -y chromium"
    if os.environ.get("OMNIRELAY_REQUIRE_CHROMIUM") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


class Page:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def evaluate(self, expression: str, *, gesture: bool = False) -> Any:
        """The value of ``expression`` (awaited when it is a promise)."""
        result = await self.call(
            "Runtime.evaluate",
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            userGesture=gesture,
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, condition: str, timeout_s: float) -> Any:
        """Until the JavaScript ``condition`` is truthy, checked in the page on each animation
        frame; its value. A timeout is an error that names the condition."""
        script = f"""new Promise((resolve, reject) => {{
            const until = performance.now() + {timeout_s * 1000};
            const check = () => {{ const v = ({condition});
                if (v) resolve(v); else if (performance.now() > until) reject(new Error("timeout"));
                else setTimeout(check, 20); }};
            check(); }})"""
        try:
            return await self.evaluate(script)
        except AssertionError as exc:
            state = await self.evaluate("JSON.stringify(window.omnirelayUI || null)")
            raise AssertionError(f"not true within {timeout_s} s: {condition}; page state: {state}") from exc

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def chromium(fake_capture: Path, url: str) -> AsyncIterator[Page]:
    """A headless Chromium at ``url`` whose microphone plays ``fake_capture`` once."""
    profile = tempfile.mkdtemp(prefix="omnirelay-chromium-")
    args = [
        chromium_path(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--mute-audio",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={fake_capture}%noloop",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--window-size=900,700",
        "about:blank",
    ]
    # Chromium makes scratch directories under TMPDIR and leaves them behind on exit: keep
    # them inside the profile, which goes below.
    env = {**os.environ, "TMPDIR": profile}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        port = await _devtools_port(Path(profile), proc)
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with websockets.connect(page_ws, max_size=2**26) as ws:
            page = Page(ws)
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            await page.wait_for("document.readyState === 'complete' && window.omnirelayUI", 20)
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """Chromium writes the port it chose to DevToolsActivePort in its profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while not marker.exists() or not marker.read_text().strip():
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode} before it listened")
        if time.monotonic() > deadline:
            raise AssertionError(f"chromium did not open its DevTools port within {timeout_s} s")
        await asyncio.sleep(0.05)
    return int(marker.read_text().split()[0])
