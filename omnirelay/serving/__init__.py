"""omnirelay.serving: the OpenAI-compatible HTTP/WebSocket front of a pipeline.

The core, one file per role:

* ``app`` — :func:`create_app` (routes, error handlers) over a started ``Pipeline``;
* ``frontend`` — checks, sampling, submit; :class:`RequestStream` (abort on close);
* ``admission`` — :class:`AdmissionGate`: 429 + Retry-After over the concurrency or byte budget;
* ``security`` — API keys, origins and CORS as one middleware; ``audit`` — the leak audit;
* ``metrics`` — Prometheus; ``protocol`` — request bodies; ``text`` — the prompt side the
  endpoints use (the pipeline's, or bytes for a pipeline without a text model);
  ``streaming`` — responses that notice a client going away; ``errors`` — OpenAI's errors;
  ``tools`` — chat's tools, tool choices and the answer's calls as OpenAI's ``tool_calls``;
* ``server`` — uvicorn in a thread (:class:`ServerThread`) or in the foreground;
* ``server_config`` — :class:`ServerConfig`, every limit in one place.

And the rooms:

* ``routes/`` — ``chat`` / ``speech`` / ``speech_stream`` (docs/protocol.md §7.1, §7.2, §7.4);
* ``media/`` — ``audio_in`` / ``image_in`` (client media decoded within limits),
  ``audio_out`` (streaming emission, docs/protocol.md §7.3, PCM16 / WAV), ``encoding``
  (mp3, opus, aac, flac), ``chat_turns`` (turns with media into the pipeline);
* ``realtime/`` — ``/v1/realtime``: ``session``, ``events``, ``response``,
  ``conversation``, ``vad``, ``ui``.

::

    with Pipeline.start("qwen3-omni-tiny") as pipe, ServerThread(create_app(pipe)) as server:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="-").chat.completions.create(...)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirelay.serving.admission import AdmissionGate
    from omnirelay.serving.app import create_app
    from omnirelay.serving.errors import ApiError
    from omnirelay.serving.media.audio_out import AudioEmitter, OutputKind
    from omnirelay.serving.metrics import ServerMetrics
    from omnirelay.serving.server import ServerThread
    from omnirelay.serving.server_config import ServerConfig

__all__ = [
    "AdmissionGate",
    "ApiError",
    "AudioEmitter",
    "OutputKind",
    "ServerConfig",
    "ServerMetrics",
    "ServerThread",
    "create_app",
]

#: where each name lives; imported on first use, so that ``omnirelay serve`` binds its
#: port and answers ``/health`` before the app's heavy imports (torch, FastAPI) are done
_HOMES = {
    "AdmissionGate": "omnirelay.serving.admission",
    "ApiError": "omnirelay.serving.errors",
    "AudioEmitter": "omnirelay.serving.media.audio_out",
    "OutputKind": "omnirelay.serving.media.audio_out",
    "ServerConfig": "omnirelay.serving.server_config",
    "ServerMetrics": "omnirelay.serving.metrics",
    "ServerThread": "omnirelay.serving.server",
    "create_app": "omnirelay.serving.app",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'omnirelay.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
