"""The server's front door, probed from outside against a live server over the toy
pipeline (counter -> relay -> synth): API keys on every route kind (plain HTTP, SSE,
WebSocket), browser origins and CORS, content types, body size and depth, malformed
WebSocket frames, OpenAI parity (models.retrieve, refusals, default modalities) and
over-capacity answers. Each test ends with a leak audit; the module with shutdown's.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from omnirelay.cli.serve import security_limits
from omnirelay.errors import ConfigError
from omnirelay.serving import AdmissionGate, ServerConfig
from omnirelay.serving.frontend import Frontend
from omnirelay.serving.protocol import MAX_JSON_DEPTH
from omnirelay.serving.security import SecurityMiddleware
from omnirelay.serving.server_config import host_of_header
from omnirelay.serving.text import ByteCodec
from tests.serving_support import Served, serve

KEYS = ("sk-first-key", "sk-second-key")
ALLOWED = "https://app.example"
CONFIG = ServerConfig(
    max_concurrency=8,
    max_body_bytes=64 * 1024,
    api_keys=KEYS,
    allowed_origins=(ALLOWED,),
    allowed_hosts=("localhost", "127.0.0.1", "::1"),
    ws_max_config_bytes=64 * 1024,
    ws_first_config_timeout_s=5,
    ws_idle_timeout_s=5,
)
HI = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve("toy-3stage", CONFIG, AdmissionGate(8, retry_after_s=3))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def _post(srv: Served, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers={**JSON, **(headers or {})}, timeout=30)


def _error(resp: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error of ``resp`` (every field present, ``code`` a string)."""
    assert resp.headers["content-type"] == "application/json", resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str)
    return dict(error)


# ------------------------------------------------------------------- API keys

ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/toy-3stage", None),
    ("POST", CHAT, {"messages": HI, "max_tokens": 2}),
    ("POST", CHAT, {"messages": HI, "max_tokens": 2, "stream": True}),  # SSE
    ("POST", SPEECH, {"input": "Hi", "response_format": "pcm"}),
    ("POST", SPEECH, {"input": "Hi", "response_format": "pcm", "stream_format": "sse"}),
    ("GET", "/v1/no/such/route", None),  # no hint of what exists without a key
]
BAD_AUTH = [
    ("none", {}),
    ("wrong key", {"Authorization": "Bearer sk-wrong"}),
    ("a prefix of a key", {"Authorization": "Bearer sk-first"}),
    ("another scheme", {"Authorization": f"Basic {KEYS[0]}"}),
    ("bearer only", {"Authorization": "Bearer"}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("auth", [h for _, h in BAD_AUTH], ids=[n for n, _ in BAD_AUTH])
def test_every_v1_route_needs_a_valid_key(
    srv: Served, method: str, path: str, body: Any, auth: dict[str, str]
) -> None:
    content = None if body is None else json.dumps(body).encode()
    resp = httpx.request(method, srv.url + path, content=content, headers={**JSON, **auth})
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    error = _error(resp)
    assert error["code"] == "invalid_api_key"
    assert not any(k in resp.text for k in KEYS)  # never echoed


def test_either_key_opens_every_route_kind(srv: Served) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)
        srv.clients.append(client)
        assert [m.id for m in client.models.list().data] == ["toy-3stage"]
        assert client.models.retrieve("toy-3stage").id == "toy-3stage"
        r = client.chat.completions.create(model=srv.model, messages=HI, max_tokens=3)
        assert r.choices[0].message.content == "jkl"
        chunks = client.chat.completions.create(model=srv.model, messages=HI, max_tokens=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "jkl"
        speech = client.audio.speech.create(model=srv.model, voice="ethan", input="Hi", response_format="pcm")
        assert len(speech.content) > 0


def test_the_openai_client_sees_an_authentication_error(srv: Served) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    srv.clients.append(client)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=srv.model, messages=HI, stream=True)
    assert info.value.code == "invalid_api_key"


def test_health_and_metrics_are_open_by_default(srv: Served) -> None:
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_protected_health_and_metrics_need_the_key() -> None:
    cfg = ServerConfig(api_keys=KEYS, protect_health=True, protect_metrics=False)
    paths: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=SecurityMiddleware(app, cfg))

    async def probe() -> list[int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                (await client.get("/health")).status_code,
                (await client.get("/health", headers=AUTH)).status_code,
                (await client.get("/metrics")).status_code,
                (await client.get("/openapi.json")).status_code,
            ]

    assert asyncio.run(probe()) == [401, 200, 200, 200]
    assert paths == ["/health", "/metrics", "/openapi.json"]


async def _ws_status(url: str, **kwargs: Any) -> int:
    """The HTTP status a WebSocket handshake is refused with."""
    with pytest.raises(InvalidStatus) as info:
        async with websockets.connect(url, **kwargs):
            pass
    return info.value.response.status_code


async def _ws_speak(url: str, **kwargs: Any) -> tuple[list[Any], int | None]:
    msgs = [
        {"type": "session.config", "response_format": "pcm"},
        {"type": "input.text", "text": "Hi"},
        {"type": "session.close"},
    ]
    got: list[Any] = []
    async with websockets.connect(url, **kwargs) as ws:
        for m in msgs:
            await ws.send(json.dumps(m))
        got = [m async for m in ws]
        return got, ws.close_code


def test_websocket_needs_a_key_in_the_header_or_the_query(srv: Served) -> None:
    assert asyncio.run(_ws_status(srv.ws_url)) == 401
    assert asyncio.run(_ws_status(srv.ws_url, additional_headers={"Authorization": "Bearer sk-no"})) == 401
    assert asyncio.run(_ws_status(srv.ws_url + "?api_key=sk-no")) == 401
    for got, code in (
        asyncio.run(_ws_speak(srv.ws_url, additional_headers=AUTH)),
        asyncio.run(_ws_speak(srv.ws_url + f"?api_key={KEYS[1]}")),
    ):
        assert code == 1000
        assert any(isinstance(m, bytes) and m for m in got)
        assert json.loads(got[-1]) == {"type": "session.done", "num_utterances": 0}


def test_a_browser_realtime_client_passes_its_key_as_a_subprotocol(srv: Served) -> None:
    """OpenAI's browser Realtime clients cannot set headers: they offer ``realtime`` and
    ``openai-insecure-api-key.KEY``; the server takes the key and answers ``realtime``
    (never echoing the key). A wrong key in it is a 401."""
    url = srv.url.replace("http://", "ws://") + "/v1/realtime"

    def offered(key: str) -> list[Any]:
        return ["realtime", f"openai-insecure-api-key.{key}", "openai-beta.realtime-v1"]

    assert asyncio.run(_ws_status(url, subprotocols=offered("sk-no"))) == 401

    async def session() -> tuple[str | None, dict[str, Any]]:
        async with websockets.connect(url, subprotocols=offered(KEYS[1])) as ws:
            return ws.subprotocol, json.loads(await ws.recv())

    chosen, created = asyncio.run(session())
    assert chosen == "realtime" and created["type"] == "session.created"


def test_the_query_key_is_removed_before_anything_logs_the_path() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["query_string"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/health",
        "headers": [(b"host", b"127.0.0.1:8000")],
        "query_string": f"a=1&api_key={KEYS[0]}&b=2".encode(),
    }

    async def run() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        async def send(message: Any) -> None:
            pass

        await SecurityMiddleware(app, CONFIG)(scope, receive, send)

    asyncio.run(run())
    assert seen == [b"a=1&b=2"] and scope["query_string"] == b"a=1&b=2"  # the server's own scope too
    assert KEYS[0] not in repr(CONFIG)


# ------------------------------------------------------------------- browser origins, CORS


def test_a_foreign_origin_is_refused_even_with_a_key(srv: Served) -> None:
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
        resp = _post(srv, CHAT, {"messages": HI}, {**AUTH, "Origin": origin})
        assert resp.status_code == 403 and _error(resp)["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in resp.headers
    refused = asyncio.run(_ws_status(srv.ws_url, origin="http://evil.example", additional_headers=AUTH))
    assert refused == 403
    preflight = httpx.options(
        srv.url + CHAT,
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers


def test_an_allowed_origin_gets_cors_headers_and_a_preflight(srv: Served) -> None:
    preflight = httpx.options(
        srv.url + CHAT,
        headers={
            "Origin": ALLOWED,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    resp = _post(srv, CHAT, {"messages": HI, "max_tokens": 1}, {**AUTH, "Origin": ALLOWED})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ALLOWED
    assert "X-Request-Id" in resp.headers["access-control-expose-headers"]
    # An error still carries CORS headers, so the page can read why.
    assert _post(srv, CHAT, {"messages": HI}, {"Origin": ALLOWED}).headers["access-control-allow-origin"]
    got, code = asyncio.run(_ws_speak(srv.ws_url, origin=ALLOWED, additional_headers=AUTH))
    assert code == 1000 and got


def test_the_servers_own_host_is_allowed_without_cors(srv: Served) -> None:
    own = f"http://127.0.0.1:{srv.server.port}"
    resp = _post(srv, CHAT, {"messages": HI, "max_tokens": 1}, {**AUTH, "Origin": own})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    got, code = asyncio.run(_ws_speak(srv.ws_url, origin=own, additional_headers=AUTH))
    assert code == 1000 and got


def _raw_status(srv: Served, request: bytes) -> int:
    """The status line's code of one raw HTTP/1.1 exchange (any Host header we like)."""
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


def test_dns_rebinding_a_foreign_host_header_is_refused(srv: Served) -> None:
    # A page on evil.example whose name now resolves to 127.0.0.1: its Origin matches its Host.
    port = srv.server.port
    evil = f"evil.example:{port}"
    resp = _post(srv, CHAT, {"messages": HI}, {**AUTH, "Host": evil, "Origin": f"http://{evil}"})
    assert resp.status_code == 400 and _error(resp)["code"] == "invalid_host"
    assert "evil.example" in _error(resp)["message"]
    assert httpx.get(srv.url + "/health", headers={"Host": evil}).status_code == 400
    handshake = (
        f"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: {evil}\r\nOrigin: http://{evil}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: Bearer {KEYS[0]}\r\n\r\n"
    ).encode()
    assert _raw_status(srv, handshake) == 400
    assert _raw_status(srv, b"GET /health HTTP/1.0\r\n\r\n") == 400  # no Host at all
    for good in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert httpx.get(srv.url + "/health", headers={"Host": good}).status_code == 200, good


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("localhost:8000", "localhost"),
        ("Example.COM.", "example.com"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("127.0.0.1", "127.0.0.1"),
        ("bad host", None),
        ("a:b:c", None),
        ("[::1", None),
        ("*", None),
        ("x" * 300, None),
    ],
)
def test_host_header_parsing(header: str, host: str | None) -> None:
    assert host_of_header(header) == host


def test_serve_answers_loopback_names_on_a_loopback_address_and_any_host_elsewhere() -> None:
    def limits(host: str, allowed: list[str] | None = None) -> Any:
        args = SimpleNamespace(
            host=host,
            api_key=["k"],
            allowed_origins=None,
            allowed_hosts=allowed,
            protect_health=False,
            protect_metrics=False,
        )
        return security_limits(args, {})["allowed_hosts"]  # type: ignore[arg-type]

    assert limits("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert limits("127.0.0.2") == ("localhost", "127.0.0.1", "::1", "127.0.0.2")
    assert limits("0.0.0.0") == ("*",)
    assert limits("0.0.0.0", ["api.example.com,10.0.0.5", "::1"]) == ("api.example.com", "10.0.0.5", "::1")
    with pytest.raises(ConfigError, match="not a host name"):
        ServerConfig(allowed_hosts=("http://x",))


# ------------------------------------------------------------------- bad bodies


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_json_routes_take_only_application_json(srv: Served, content_type: str | None) -> None:
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    for path, body in ((CHAT, {"messages": HI}), (SPEECH, {"input": "Hi"})):
        resp = httpx.post(srv.url + path, content=json.dumps(body).encode(), headers=headers)
        assert resp.status_code == 415 and _error(resp)["code"] == "unsupported_media_type"
        assert "application/json" in _error(resp)["message"]
    ok = _post(
        srv,
        CHAT,
        {"messages": HI, "max_tokens": 1},
        {**AUTH, "Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert ok.status_code == 200


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 5_000, 30_000])
def test_deep_json_is_a_400_and_the_server_stays_up(srv: Served, depth: int) -> None:
    body = f'{{"messages": {json.dumps(HI)}, "x": {_nested(depth)}}}'.encode()  # one level more
    for path in (CHAT, SPEECH):
        resp = _post(srv, path, body, AUTH)
        assert resp.status_code == 400, resp.text
        assert f"more than {MAX_JSON_DEPTH} levels deep" in _error(resp)["message"]
    at_limit = f'{{"messages": {json.dumps(HI)}, "max_tokens": 1, "x": {_nested(MAX_JSON_DEPTH - 1)}}}'
    assert _post(srv, CHAT, at_limit.encode(), AUTH).status_code == 200
    assert httpx.get(srv.url + "/health").json()["status"] == "healthy"


def test_a_lone_surrogate_escape_is_a_400_not_a_crash(srv: Served) -> None:
    for path, body in (
        (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
        (SPEECH, '{"input": "\\udfff b"}'),
    ):
        resp = _post(srv, path, body.encode(), AUTH)
        assert resp.status_code == 400 and "unpaired UTF-16 surrogate" in _error(resp)["message"]
    paired = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    assert _post(srv, CHAT, paired.encode(), AUTH).status_code == 200


def test_an_oversize_body_is_413_whether_declared_or_streamed(srv: Served) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    resp = _post(srv, CHAT, big, AUTH)
    assert resp.status_code == 413 and _error(resp)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    streamed = httpx.post(srv.url + CHAT, content=chunks(), headers={**JSON, **AUTH})
    assert streamed.status_code == 413 and "limit is 65536 bytes" in _error(streamed)["message"]


def test_router_errors_have_string_codes(srv: Served) -> None:
    missing = httpx.get(srv.url + "/nope")
    assert missing.status_code == 404 and _error(missing)["code"] == "not_found"
    wrong = httpx.get(srv.url + CHAT, headers=AUTH)
    assert wrong.status_code == 405 and _error(wrong)["code"] == "method_not_allowed"


# ------------------------------------------------------------------- WebSocket malformed frames

MALFORMED: list[tuple[str, list[str | bytes]]] = [
    ("binary first", [b"\x00\x01\x02"]),
    ("binary later", [json.dumps({"type": "session.config"}), b"audio?"]),
    ("not json", ["{nope"]),
    ("not json later", [json.dumps({"type": "session.config"}), "{nope"]),
    ("array", ["[1, 2]"]),
    ("string", ['"session.config"']),
    ("deep", ['{"type": "session.config", "x": ' + _nested(5_000) + "}"]),
    ("no type", ["{}"]),
    ("type not a string", ['{"type": 5}']),
    ("unknown type", [json.dumps({"type": "session.config"}), json.dumps({"type": "no.such"})]),
    (
        "text not a string",
        [json.dumps({"type": "session.config"}), json.dumps({"type": "input.text", "text": 5})],
    ),
    ("voice not a string", [json.dumps({"type": "session.config", "voice": ["ethan"]})]),
    ("oversize", [json.dumps({"type": "session.config", "pad": "x" * 70_000})]),
    (
        "lone surrogate",
        [json.dumps({"type": "session.config"}), '{"type": "input.text", "text": "a\\ud800"}'],
    ),
]


async def _ws_until_closed(url: str, frames: list[str | bytes]) -> tuple[list[Any], int | None]:
    async with websockets.connect(url, additional_headers=AUTH) as ws:
        for frame in frames:
            await ws.send(frame)
        got: list[Any] = []
        try:
            async for m in ws:
                got.append(m)
        except websockets.ConnectionClosedError:
            pass
        return got, ws.close_code


@pytest.mark.parametrize("frames", [f for _, f in MALFORMED], ids=[n for n, _ in MALFORMED])
def test_a_malformed_ws_message_gets_an_error_frame_and_1008(srv: Served, frames: list[str | bytes]) -> None:
    got, code = asyncio.run(_ws_until_closed(srv.ws_url, frames))
    assert code == 1008
    errors = [json.loads(m) for m in got if isinstance(m, str)]
    assert len(errors) == 1 and errors[0]["type"] == "error" and isinstance(errors[0]["code"], str)


# ------------------------------------------------------------------- OpenAI parity


def test_models_retrieve_unknown_is_model_not_found(srv: Served) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        srv_client(srv).models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"
    assert srv_client(srv).models.retrieve(srv.model).owned_by == "omnirelay"


def srv_client(srv: Served) -> openai.OpenAI:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=30)
    srv.clients.append(client)
    return client


def test_chat_without_modalities_answers_in_text_only(srv: Served) -> None:
    r = srv_client(srv).chat.completions.create(model=srv.model, messages=HI, max_tokens=3)
    assert r.choices[0].message.content == "jkl" and r.choices[0].message.audio is None
    with_audio = srv_client(srv).chat.completions.create(
        model=srv.model, messages=HI, max_tokens=3, modalities=["text", "audio"]
    )
    assert with_audio.choices[0].message.audio is not None


REFUSED = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("tool_choice", {"tool_choice": "auto"}, "tool_choice"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    ("function_call", {"function_call": {"name": "f"}}, "function_call"),
    ("n", {"n": 2}, "n"),
    ("json mode", {"response_format": {"type": "json_object"}}, "response_format"),
    ("json schema", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("logprobs", {"logprobs": True}, "logprobs"),
    ("top_logprobs", {"top_logprobs": 2}, "logprobs"),
    ("logit_bias", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("presence_penalty", {"presence_penalty": 0.5}, "presence_penalty"),
    ("frequency_penalty", {"frequency_penalty": -1}, "frequency_penalty"),
    ("null user content", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("missing user content", {"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
    (
        "audio part",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content",
    ),
    (
        "tool calls in history",
        {"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
        "messages[1].tool_calls",
    ),
    ("tool role", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role"),
]


@pytest.mark.parametrize(("extra", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_unsupported_chat_features_are_refused_not_ignored(
    srv: Served, extra: dict[str, Any], param: str
) -> None:
    resp = _post(srv, CHAT, {"messages": HI, "max_tokens": 1, **extra}, AUTH)
    assert resp.status_code == 400, resp.text
    error = _error(resp)
    assert error["param"] == param and error["type"] == "invalid_request_error"


ACCEPTED = [
    ("tool_choice none", {"tool_choice": "none"}),
    ("text format", {"response_format": {"type": "text"}}),
    ("zero penalties", {"presence_penalty": 0, "frequency_penalty": 0.0}),
    ("logprobs false", {"logprobs": False}),
    ("empty tools", {"tools": []}),
    ("null assistant turn", {"messages": [*HI, {"role": "assistant", "content": None}, *HI]}),
    ("text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    ("unknown field", {"user": "u-1", "store": False, "metadata": {"a": "b"}}),
]


@pytest.mark.parametrize("extra", [a[1] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_what_means_nothing_unsupported_is_still_served(srv: Served, extra: dict[str, Any]) -> None:
    resp = _post(srv, CHAT, {"messages": HI, "max_tokens": 1, **extra}, AUTH)
    assert resp.status_code == 200, resp.text


def test_a_pipeline_file_may_default_chat_to_audio() -> None:
    from omnirelay.pipeline import load_pipeline

    base = load_pipeline("toy-3stage")

    def frontend(default: tuple[str, ...]) -> Frontend:
        import msgspec

        config = msgspec.structs.replace(base, default_modalities=default)
        return Frontend(SimpleNamespace(config=config), ServerConfig(), ByteCodec())  # type: ignore[arg-type]

    assert frontend(()).chat_modalities(None) == ("text",)
    assert frontend(("text", "audio")).chat_modalities(None) == ("text", "audio")
    assert frontend(()).chat_modalities(["audio"]) == ("audio",)


# ------------------------------------------------------------------- over capacity


def test_over_capacity_is_429_with_retry_after_everywhere(srv: Served) -> None:
    adm = srv.frontend.admission
    held = [adm.acquire() for _ in range(adm.max_concurrency)]
    try:
        for path, body in (
            (CHAT, {"messages": HI}),
            (CHAT, {"messages": HI, "stream": True}),
            (SPEECH, {"input": "Hi"}),
            (SPEECH, {"input": "Hi", "stream_format": "sse"}),
        ):
            resp = _post(srv, path, body, AUTH)
            assert resp.status_code == 429 and resp.headers["retry-after"] == "3", (path, body)
            assert _error(resp)["code"] == "server_busy"
        got, code = asyncio.run(_ws_speak(srv.ws_url, additional_headers=AUTH))
    finally:
        for slot in held:
            slot.release()
    assert code == 1000
    events = [json.loads(m) for m in got if isinstance(m, str)]
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "server_busy" and error["status"] == 429 and error["retry_after_s"] == 3
    done = next(e for e in events if e["type"] == "audio.done")
    assert done["total_bytes"] == 0 and "concurrent requests" in done["error"]


# ------------------------------------------------------------------- the serve command's flags


def _serve_args(*argv: str) -> Any:
    import argparse

    from omnirelay.cli import serve as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_and_environment_give_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from omnirelay.cli.serve import security_limits

    env = {"OMNIRELAY_API_KEY": " sk-a, sk-b ,"}
    limits = security_limits(_serve_args(), env)
    assert limits["api_keys"] == ("sk-a", "sk-b") and not limits["protect_health"]
    flags = _serve_args(
        "--api-key",
        "sk-c",
        "--api-key",
        "sk-d",
        "--allowed-origins",
        "https://a.example,http://b:8080",
        "--protect-metrics",
    )
    limits = security_limits(flags, env)  # the flags win over the environment
    assert limits["api_keys"] == ("sk-c", "sk-d") and limits["protect_metrics"]
    assert limits["allowed_origins"] == ("https://a.example", "http://b:8080")
    ServerConfig(**limits)  # valid as given
    assert capsys.readouterr().err == ""  # loopback: no warning


def test_serve_warns_on_a_public_address_without_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    from omnirelay.cli.serve import security_limits

    security_limits(_serve_args("--host", "0.0.0.0"), {})
    err = capsys.readouterr().err
    assert "WARNING" in err and "0.0.0.0" in err and "--api-key" in err
    security_limits(_serve_args("--host", "0.0.0.0"), {"OMNIRELAY_API_KEY": "sk-a"})
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("api_keys", ("has space",), "printable ASCII"),
        ("api_keys", ("",), "printable ASCII"),
        ("api_keys", ("a,b",), "comma"),
        ("allowed_origins", ("app.example",), "scheme://host"),
        ("allowed_origins", ("https://app.example/path",), "scheme://host"),
        ("allowed_origins", ("null",), "scheme://host"),
    ],
)
def test_bad_security_settings_are_refused_without_echoing_keys(field: str, value: Any, needle: str) -> None:
    from omnirelay.errors import ConfigError

    with pytest.raises(ConfigError, match=needle) as info:
        ServerConfig(**{field: value})
    if field == "api_keys":
        assert all(v not in str(info.value) for v in value if v)


def test_default_modalities_in_a_pipeline_file_are_validated() -> None:
    from importlib.resources import files

    import yaml

    from omnirelay.errors import ConfigError
    from omnirelay.pipeline import parse_pipeline

    data = yaml.safe_load((files("omnirelay") / "pipelines" / "toy-3stage.yaml").read_text())
    assert parse_pipeline({**data, "default_modalities": ["text", "audio"]}).default_modalities == (
        "text",
        "audio",
    )
    for bad, needle in (
        (["video"], "not an output"),
        (["timestamps"], "not an output"),
        (["text", "text"], "twice"),
        ("text", "list of strings"),
    ):
        with pytest.raises(ConfigError, match=needle):
            parse_pipeline({**data, "default_modalities": bad})
