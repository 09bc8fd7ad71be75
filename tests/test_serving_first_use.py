"""Errors a new client meets first speak of what it sent: ``max_completion_tokens`` over the
limit is named as such (not ``max_tokens``), and an upload that is not audio is a 400 that
says it "could not decode audio" and why in words, without FFmpeg's error number or
``'<none>'``.

Both are refused before anything is submitted, so the app runs over the pipeline file
alone (no stage process).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from omnirelay.cli.serve import server_config
from omnirelay.pipeline import load_pipeline
from omnirelay.serving import create_app
from omnirelay.serving.text import ByteCodec

MODEL = "voice-cpu"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    pipe = SimpleNamespace(config=load_pipeline(MODEL))  # refused before a submit: no stage runs
    app = create_app(pipe, server_config(pipe.config, max_tokens_limit=16), prompts=ByteCodec())  # type: ignore[arg-type]
    with TestClient(app) as http:
        yield http


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_the_token_limit_error_names_the_field_sent(client: TestClient, field: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: 17}
    got = client.post("/v1/chat/completions", json=body)
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["param"] == field and error["message"] == f"{field} is 17; the limit is 16"


@pytest.mark.parametrize("name", ["question.wav", "question.mp3", "question.webm"])
def test_an_upload_that_is_not_audio_is_a_clear_400(client: TestClient, name: str) -> None:
    pdf = b"%PDF-1.4 a document, not audio\n" * 40
    got = client.post("/v1/audio/transcriptions", data={"model": MODEL}, files={"file": (name, pdf)})
    assert got.status_code == 400
    error = got.json()["error"]
    fmt = name.rpartition(".")[2]
    assert error["param"] == "file"
    assert error["message"].startswith(f"file.data is not a readable {fmt} file (could not decode audio: "), (
        error
    )
    assert "Errno" not in error["message"] and "<none>" not in error["message"]
