"""The server's front door: API keys, browser origins and CORS, as one ASGI middleware.

:class:`SecurityMiddleware` runs before routing, on every HTTP request and WebSocket
handshake, in this order:

0. **Host.** Unless ``allowed_hosts`` holds ``*``, a request whose ``Host`` header names
   another host is refused with 400 ``invalid_host``. A loopback server (``serve``'s
   default) answers only to loopback names, which defeats DNS rebinding: a page on
   ``evil.example`` whose name is re-pointed at 127.0.0.1 would otherwise reach the port as
   its own host, and its ``Origin`` would match its ``Host``.
1. **Origin.** A request with an ``Origin`` header (a browser's) is refused with 403
   ``origin_not_allowed`` unless the origin is in ``allowed_origins`` (or that list holds
   ``*``), or names the server's own host (its ``host:port`` equals the ``Host`` header).
   A web page the operator happens to visit therefore cannot drive a local server: a
   "simple" cross-site POST and a cross-site WebSocket both carry an ``Origin``.
2. **CORS preflight.** ``OPTIONS`` with ``Access-Control-Request-Method`` from an allowed
   origin is answered here (204, no key needed: browsers never send credentials in a
   preflight). Responses to allowed origins carry ``Access-Control-Allow-Origin``; the
   server's own host needs none, and no other origin ever gets any.
3. **API key.** With keys configured, every ``/v1`` route and the WebSocket need
   ``Authorization: Bearer KEY`` (browsers cannot set a WebSocket's headers, so it may
   pass the key as OpenAI's Realtime clients do, in the subprotocol
   ``openai-insecure-api-key.KEY``, or as ``?api_key=KEY``); ``/health`` and ``/metrics``
   only when protected. Otherwise 401 ``invalid_api_key``. Keys are compared in constant
   time, against every configured key, and never logged: ``api_key`` is removed from the
   query string, and the key's subprotocol from the offered ones, before anything
   (uvicorn's access log, the route) can see it.

Refusals are OpenAI-style JSON errors; a refused WebSocket handshake gets the same HTTP
status and body (ASGI's ``websocket.http.response``), so browsers and clients see 401/403.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnirelay.serving.errors import error_body
from omnirelay.serving.server_config import ServerConfig, host_of_header, normalize_host, normalize_origin

__all__ = ["SUBPROTOCOL_KEY_PREFIX", "SecurityMiddleware", "is_loopback_host"]

#: response headers a cross-origin page may read (the rest are hidden by the browser)
_EXPOSED = "X-Request-Id, X-Sample-Rate, X-Word-Timestamps, X-Word-Timestamps-Omitted, Retry-After"
_PREFLIGHT_MAX_AGE_S = "600"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable from this machine only."""
    name = host.strip("[]").lower()
    return name in ("localhost", "::1") or name.startswith("127.")


class SecurityMiddleware:
    """See the module docstring. ``config`` supplies the keys, origins and what is protected."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self._keys = tuple(k.encode("ascii") for k in config.api_keys)
        origins = {normalize_origin(o) for o in config.allowed_origins}
        self._any_origin = "*" in origins
        self._origins = frozenset(o for o in origins if o and o != "*")
        protected = [
            p for p, on in (("/health", config.protect_health), ("/metrics", config.protect_metrics)) if on
        ]
        self._protected_paths = frozenset(protected)
        hosts = {normalize_host(h) for h in config.allowed_hosts}
        self._hosts: frozenset[str] | None = None if "*" in hosts else frozenset(h for h in hosts if h)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        query_key = _take_query_key(scope)  # always removed, so it never reaches a log
        if kind == "websocket":
            query_key = _take_subprotocol_key(scope) or query_key
        if self._hosts is not None:
            given = headers.get("host")
            if given is None or host_of_header(given) not in self._hosts:
                await _refuse(scope, receive, send, 400, _host_message(given), "invalid_host")
                return
        origin = headers.get("origin")
        cors_origin: str | None = None
        if origin is not None:
            verdict = self._origin_verdict(origin, headers.get("host"))
            if verdict is None:
                await _refuse(scope, receive, send, 403, _origin_message(origin), "origin_not_allowed")
                return
            cors_origin = origin if verdict == "cors" else None
        if kind == "http" and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(send, cors_origin, headers)
            return
        if self._keys and self._needs_key(scope["path"]):
            problem = self._key_problem(
                headers.get("authorization"), query_key if kind == "websocket" else None
            )
            if problem is not None:
                await _refuse(scope, receive, send, 401, problem, "invalid_api_key", cors_origin)
                return
        if cors_origin is None or kind != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(cors_origin)]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _origin_verdict(self, origin: str, host: str | None) -> str | None:
        """``"same"`` (the server's own host), ``"cors"`` (an allowed foreign origin) or None."""
        normal = normalize_origin(origin)
        if normal not in (None, "*") and host is not None and _same_host(str(normal), host):
            return "same"
        if self._any_origin or (normal is not None and normal in self._origins):
            return "cors"
        return None

    def _needs_key(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in self._protected_paths

    def _key_problem(self, authorization: str | None, query_key: str | None) -> str | None:
        """None when a configured key was presented, else what is wrong (never the key)."""
        given: str | None = None
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return "the Authorization header must be 'Bearer <API key>'"
            given = token.strip()
        elif query_key is not None:
            given = query_key
        if given is None:
            return (
                "no API key provided; send the header 'Authorization: Bearer <API key>' "
                "(a WebSocket may pass the subprotocol 'openai-insecure-api-key.<API key>' or "
                "?api_key=<API key> instead)"
            )
        if not _matches_any(given.encode("utf-8", "surrogateescape"), self._keys):
            return "the API key is not valid"
        return None


def _matches_any(given: bytes, keys: Iterable[bytes]) -> bool:
    """Constant time in the key's content: every configured key is compared, always."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def _same_host(origin: str, host: str) -> bool:
    scheme, _, netloc = origin.partition("://")
    host = host.strip().lower()
    default = ":443" if scheme == "https" else ":80"
    if host.endswith(default):
        host = host[: -len(default)]
    return netloc == host


def _take_query_key(scope: Scope) -> str | None:
    """Remove ``api_key`` from the scope's query string (in place: the server's access
    log reads this scope) and return its value."""
    raw: bytes = scope.get("query_string", b"")
    if b"api_key" not in raw:
        return None
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    values = [v for k, v in pairs if k == "api_key"]
    if not values:
        return None
    scope["query_string"] = urlencode([(k, v) for k, v in pairs if k != "api_key"]).encode("latin-1")
    return values[-1]


#: OpenAI's browser Realtime clients offer the key as the subprotocol ``PREFIX + key``.
SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."


def _take_subprotocol_key(scope: Scope) -> str | None:
    """Remove ``openai-insecure-api-key.KEY`` from the offered subprotocols (the route never
    echoes it back) and return the key."""
    offered: list[str] = list(scope.get("subprotocols") or [])
    keys = [p[len(SUBPROTOCOL_KEY_PREFIX) :] for p in offered if p.startswith(SUBPROTOCOL_KEY_PREFIX)]
    if not keys:
        return None
    scope["subprotocols"] = [p for p in offered if not p.startswith(SUBPROTOCOL_KEY_PREFIX)]
    return keys[-1]


def _host_message(host: str | None) -> str:
    if host is None:
        return "the request has no Host header"
    shown = host if len(host) <= 200 else host[:200] + "..."
    return (
        f"this server does not answer to the host {shown!r}; it answers to the names given with "
        "--allowed-hosts (default for a loopback address: localhost, 127.0.0.1 and ::1)"
    )


def _origin_message(origin: str) -> str:
    shown = origin if len(origin) <= 200 else origin[:200] + "..."
    return (
        f"requests from the browser origin {shown!r} are not allowed; the server accepts its own host, "
        "and the origins given with --allowed-origins"
    )


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", _EXPOSED.encode()),
        (b"vary", b"Origin"),
    ]


async def _preflight(send: Send, cors_origin: str | None, headers: Headers) -> None:
    """Answer a CORS preflight (the origin was already allowed; the server's own host gets
    no CORS headers, as it needs none)."""
    out = [(b"content-length", b"0")]
    if cors_origin is not None:
        asked = headers.get("access-control-request-headers", "")
        allowed = asked if asked else "Authorization, Content-Type, X-Request-Id"
        out += _cors_headers(cors_origin)
        out += [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", allowed.encode("latin-1")),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE_S.encode()),
        ]
    await send({"type": "http.response.start", "status": 204, "headers": out})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(
    scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str, cors: str | None = None
) -> None:
    """An OpenAI-style JSON error; for a WebSocket, as the handshake's HTTP response.
    ``cors``: an allowed origin, which may read the error."""
    body = json.dumps(error_body(message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if cors is not None:
        headers += _cors_headers(cors)
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    first = await receive()
    if first["type"] != "websocket.connect":
        return  # the client left during the handshake
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:  # a server without the extension answers a close before accept with 403
        await send({"type": "websocket.close", "code": 1008})
