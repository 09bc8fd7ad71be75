"""The browser page of ``omnirelay serve --ui`` at ``/``: talk to the pipeline.

One static page (``static/realtime.html``, no build step, nothing fetched from elsewhere):
it records the microphone with an AudioWorklet in an ``AudioContext`` at the session's
rate (the browser resamples the microphone), streams pcm16 to ``/v1/realtime`` with
server VAD on, plays each ``response.audio.delta`` as it comes and stops playing on
``speech_started`` (barge-in). A text box sends typed messages. Browsers give the
microphone to secure contexts only: open it as ``http://localhost``/``127.0.0.1`` or
behind HTTPS. ``window.omnirelayUI`` holds what the page did (state, samples sent and
received, event types), for tests.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.responses import HTMLResponse

__all__ = ["page_response"]


@cache
def _page() -> str:
    return (files("omnirelay.serving.realtime") / "static" / "realtime.html").read_text(encoding="utf-8")


def page_response() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})
