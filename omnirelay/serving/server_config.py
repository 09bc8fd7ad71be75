"""The serving layer's one flat config: :class:`ServerConfig`, validated at construction.

Every limit the HTTP and WebSocket front applies lives here, so a test can build an app
with small limits (one admission slot, a short idle timeout) without touching globals.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from omnirelay.errors import ConfigError

__all__ = [
    "DEFAULT_VOICES",
    "ServerConfig",
    "host_of_header",
    "normalize_host",
    "normalize_origin",
    "openai_voice_map",
]

#: The Qwen3-Omni speakers (the tiny model has the same table).
DEFAULT_VOICES = ("chelsie", "ethan", "aiden")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and names of one server. Every field is checked in ``__post_init__``."""

    #: the model name clients pass (default: the pipeline's name)
    model_name: str | None = None
    #: requests served at once (HTTP requests, and each response a WebSocket asks for);
    #: one more gets 429 with Retry-After
    max_concurrency: int = 64
    #: WebSockets open at once (``/v1/audio/speech/stream`` and ``/v1/realtime`` sessions
    #: together), each held for its whole life; one more is refused before its session
    #: starts: an ``error`` message, then close 1013 (try again later). A pool of its own:
    #: an open socket holds no request slot. None: as many as ``max_concurrency``.
    max_websockets: int | None = None
    #: live transfer bytes (all stages, from the last health probe) past which new
    #: requests get 429; None: no byte budget
    max_live_bytes: int | None = None
    #: the Retry-After value of a 429, in seconds
    retry_after_s: int = 1
    #: the largest HTTP request body accepted (413 past it)
    max_body_bytes: int = 4 * 1024 * 1024
    #: the longest speech ``input`` and chat prompt, in characters
    max_input_chars: int = 16384
    #: chat ``input_audio``: the most encoded audio bytes (all parts of a request together)
    max_audio_input_bytes: int = 2 * 1024 * 1024
    #: chat ``input_audio``: the longest decoded audio, in seconds (all parts together)
    max_audio_input_s: float = 60.0
    #: chat ``image_url``: the most encoded image bytes (all parts of a request together)
    max_image_input_bytes: int = 2 * 1024 * 1024
    #: chat ``image_url``: the most pixels of one decoded image (the model's processor
    #: then scales it down to its own maximum)
    max_image_input_pixels: int = 4096 * 4096
    #: the largest ``max_tokens`` a client may ask for
    max_tokens_limit: int = 8192
    #: voices a client may name (case-insensitive)
    voices: tuple[str, ...] = DEFAULT_VOICES
    default_voice: str = "chelsie"
    #: ``X-Word-Timestamps`` is sent only when its JSON fits (docs/protocol.md §7.2)
    max_timestamps_header_bytes: int = 4096
    # -- WebSocket /v1/audio/speech/stream (docs/protocol.md §7.4)
    ws_max_config_bytes: int = 4 * 1024 * 1024
    ws_max_text_bytes: int = 128 * 1024
    ws_first_config_timeout_s: float = 10.0
    ws_idle_timeout_s: float = 30.0
    #: text buffered in one utterance before the server refuses more
    ws_max_utterance_chars: int = 16384
    # -- WebSocket /v1/realtime (omnirelay.serving.realtime.session)
    #: the rate of the session's pcm16 audio, both ways: the pipeline's output rate
    sample_rate: int = 24000
    #: the largest client event (an ``input_audio_buffer.append`` carries base64 audio)
    realtime_max_event_bytes: int = 4 * 1024 * 1024
    #: the most audio the input buffer holds before an append is refused
    realtime_max_buffer_s: float = 60.0
    #: conversation items a session keeps; older ones are dropped first
    realtime_max_items: int = 64
    #: a session closes after this long without a client event while no response runs
    realtime_idle_timeout_s: float = 600.0
    #: serve the browser page at ``/`` (``omnirelay serve --ui``)
    ui: bool = False
    # -- security (omnirelay.serving.security)
    #: keys a client must present as ``Authorization: Bearer KEY`` on /v1 (WebSocket:
    #: also ``?api_key=KEY``); empty: no authentication. Never shown in a repr.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: browser origins (``scheme://host[:port]``, or ``*`` for any) allowed besides the
    #: server's own host; they get CORS headers. Other origins get 403.
    allowed_origins: tuple[str, ...] = ()
    #: ``Host`` header values (names or addresses, no port; ``*`` for any) the server
    #: answers; others get 400 ``invalid_host``. It defeats DNS rebinding: a web page whose
    #: name re-resolves to 127.0.0.1 reaches the port with its own name as ``Host`` (and a
    #: matching ``Origin``). ``serve`` fills it from ``--host``; the default here, for an app
    #: embedded in another server, is any.
    allowed_hosts: tuple[str, ...] = ("*",)
    #: require the API key on /health and /metrics too (they are open by default)
    protect_health: bool = False
    protect_metrics: bool = False
    #: histogram buckets of time to first audio / first token, in seconds
    latency_buckets_s: tuple[float, ...] = field(
        default=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("model_name", "max_live_bytes", "max_websockets") and value is None:
                continue
            if f.name in (
                "api_keys",
                "allowed_origins",
                "allowed_hosts",
                "protect_health",
                "protect_metrics",
            ):
                continue  # checked by _check_security
            if f.name == "ui":
                if type(value) is not bool:
                    raise ConfigError("ServerConfig.ui must be True or False")
                continue
            if f.name in ("model_name", "default_voice"):
                if not isinstance(value, str) or not value.strip():
                    raise ConfigError(f"ServerConfig.{f.name} must be a non-empty string, got {value!r}")
            elif f.name == "voices":
                if not value or not all(isinstance(v, str) and v for v in value):
                    raise ConfigError(f"ServerConfig.voices must be non-empty strings, got {value!r}")
            elif f.name == "latency_buckets_s":
                if not value or list(value) != sorted(value) or value[0] <= 0:
                    raise ConfigError(f"ServerConfig.latency_buckets_s must be increasing and > 0: {value!r}")
            elif f.name.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    raise ConfigError(f"ServerConfig.{f.name} must be a number > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ServerConfig.{f.name} must be an int > 0, got {value!r}")
        self._check_security()
        if self.default_voice.lower() not in {v.lower() for v in self.voices}:
            raise ConfigError(
                f"ServerConfig.default_voice {self.default_voice!r} is not one of voices {list(self.voices)}"
            )

    def _check_security(self) -> None:
        for name in ("protect_health", "protect_metrics"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"ServerConfig.{name} must be True or False")
        if not isinstance(self.api_keys, tuple):
            raise ConfigError("ServerConfig.api_keys must be a tuple of strings")
        for i, key in enumerate(self.api_keys):
            # The key's value is never part of a message: it may land in a log.
            if not isinstance(key, str) or not key or not all(33 <= ord(c) <= 126 for c in key):
                raise ConfigError(
                    f"ServerConfig.api_keys[{i}] must be non-empty printable ASCII without spaces "
                    "(it travels in an Authorization header)"
                )
            if "," in key:
                raise ConfigError(f"ServerConfig.api_keys[{i}] must not contain a comma")
        if not isinstance(self.allowed_hosts, tuple) or not self.allowed_hosts:
            raise ConfigError(
                "ServerConfig.allowed_hosts must be a non-empty tuple of host names ('*' for any)"
            )
        for name in self.allowed_hosts:
            if normalize_host(name) is None:
                raise ConfigError(
                    f"ServerConfig.allowed_hosts: {name!r} is not a host name or address; write e.g. "
                    "'api.example.com', '10.0.0.5' or '::1' (no scheme, no port), or '*' for any"
                )
        if not isinstance(self.allowed_origins, tuple):
            raise ConfigError("ServerConfig.allowed_origins must be a tuple of strings")
        for origin in self.allowed_origins:
            if normalize_origin(origin) is None:
                raise ConfigError(
                    f"ServerConfig.allowed_origins: {origin!r} is not an origin; write "
                    "scheme://host[:port] (e.g. https://app.example.com), or * for any origin"
                )


_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?$")


def normalize_host(host: object) -> str | None:
    """A host name or address as the ``Host`` check compares it (lower case, IPv6 without
    brackets, no trailing dot), ``*``, or None if it is neither."""
    if not isinstance(host, str):
        return None
    name = host.strip().lower()
    if name == "*":
        return name
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if len(name) > 253 or not _HOST_NAME.match(name):
        return None
    return name.rstrip(".")


def host_of_header(value: str) -> str | None:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``),
    normalized; None if malformed."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not _is_port_suffix(value[end + 1 :])):
            return None
        return normalize_host(value[: end + 1])
    name, sep, port = value.rpartition(":")
    if sep and _is_port_suffix(":" + port):
        return normalize_host(name) if name != "*" else None
    return normalize_host(value) if value != "*" else None


def _is_port_suffix(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit() and 0 < len(text) <= 6


def normalize_origin(origin: object) -> str | None:
    """``origin`` as ``scheme://host[:port]`` in lower case (``*`` stays), or None when it is
    not an origin (a path, a query, another scheme, ``null``)."""
    if not isinstance(origin, str):
        return None
    if origin == "*":
        return origin
    try:
        parts = urlsplit(origin.strip().rstrip("/"))
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        return None
    if parts.username is not None or parts.fragment:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    default = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{host}" if port in (None, default) else f"{parts.scheme}://{host}:{port}"


def openai_voice_map(openai_voices: Mapping[str, str], voices: Sequence[str], source: str) -> dict[str, str]:
    """A pipeline file's ``openai_voices`` as lower-case name → lower-case voice, checked
    against the voices the server speaks with: a target that is not one of them, or a
    name that is one of them (it would hide that voice), is a :class:`ConfigError`."""
    own = {v.lower() for v in voices}
    out: dict[str, str] = {}
    for name, voice in openai_voices.items():
        if voice.lower() not in own:
            raise ConfigError(
                f"{source}: openai_voices.{name}: {voice!r} is not one of the pipeline's voices "
                f"{sorted(own)}; map {name!r} to one of them"
            )
        if name.lower() in own:
            raise ConfigError(
                f"{source}: openai_voices.{name}: {name!r} is already one of the pipeline's voices; "
                "remove the entry"
            )
        out[name.lower()] = voice.lower()
    return out
