"""omnirelay.serving: the OpenAI-compatible HTTP/WebSocket front of a pipeline.

One file per role:

* ``app`` — :func:`create_app` (routes, error handlers) over a started ``Pipeline``;
* ``chat`` / ``speech`` / ``websocket`` — the endpoints (docs/protocol.md §7.1, §7.2, §7.4);
* ``audio`` — streaming emission (DELTA / CUMULATIVE, ``emitted_samples``, ``prev_count``;
  docs/protocol.md §7.3) and PCM16 / WAV encoding;
* ``frontend`` — checks, sampling, submit; :class:`RequestStream` (abort on close);
* ``admission`` — 429 + Retry-After over the concurrency or byte budget;
* ``metrics`` — Prometheus; ``protocol`` — request bodies; ``text`` — prompts and
  detokenization; ``streaming`` — responses that notice a client going away;
* ``server`` — uvicorn in a thread (:class:`ServerThread`) or in the foreground;
* ``config`` — :class:`ServerConfig`, every limit in one place.

::

    with Pipeline.start("qwen3-omni-tiny") as pipe, ServerThread(create_app(pipe)) as server:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="-").chat.completions.create(...)
"""

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
