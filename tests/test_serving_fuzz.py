"""A reduced run of ``benchmarks/fuzz_serve.py`` against a live server over the toy
pipeline, with an API key: Schemathesis cases (positive and negative) for every ``/v1``
operation of the server's own OpenAPI schema → never a 5xx, never a hang, every error an
OpenAI error body; malformed WebSocket frames of every kind → one ``error`` frame and a
1008 close each; then the server is healthy and the pipeline holds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.fuzz_serve import API_KEY, check_healthy, fuzz_http, fuzz_ws
from omnirelay.serving import ServerConfig
from tests.serving_support import Served, serve

CONFIG = ServerConfig(
    api_keys=(API_KEY,),
    max_tokens_limit=64,
    max_body_bytes=256 * 1024,
    ws_max_config_bytes=64 * 1024,
    ws_max_text_bytes=16 * 1024,
)
EXAMPLES = 10
WS_FRAMES = 48  # four of each kind


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    yield from serve("toy-3stage", CONFIG)


def test_the_schema_describes_every_v1_body(srv: Served) -> None:
    paths = httpx.get(srv.url + "/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/audio/speech", "/v1/models", "/v1/models/{model_id}"} <= set(paths)
    for path in ("/v1/chat/completions", "/v1/audio/speech"):
        op = paths[path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["required"] and "$ref" not in str(schema)
        assert {"400", "401", "415", "429"} <= set(op["responses"])


def test_http_fuzz_finds_no_server_error(srv: Served) -> None:
    report = fuzz_http(srv.url, examples=EXAMPLES)
    assert report.ok, report.failures
    assert len(report.operations) == 4 and report.requests >= 4 * EXAMPLES
    assert set(report.statuses) <= {"200", "400", "404", "409", "413", "415", "429"}, report.statuses
    srv.audit()


def test_ws_fuzz_gets_an_error_frame_and_1008_each(srv: Served) -> None:
    report = asyncio.run(fuzz_ws(srv.ws_url, frames=WS_FRAMES, max_bytes=CONFIG.ws_max_config_bytes))
    assert report.ok, report.failures
    assert report.error_then_1008 == WS_FRAMES and len(report.kinds) == 12
    assert check_healthy(srv.url, srv.model) is None
    srv.audit()
