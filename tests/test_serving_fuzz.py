"""A reduced run of ``benchmarks/fuzz_serve.py``: a live server over the toy pipeline,
with an API key; Schemathesis cases (positive and negative) for every ``/v1`` operation
of the server's own OpenAPI schema → never a 5xx, never a hang, every error an OpenAI
error body; malformed WebSocket frames of every kind → one ``error`` frame and a 1008
close each; then the server is healthy, no request state is left in any stage and no
object after shutdown.

The fuzz runs in a process of its own: Hypothesis refuses to generate floats in a
process whose floating-point state a native library loaded by another test changed
(flush-to-zero), and the script is what an operator runs anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from omnirelay.pipeline import load_pipeline
from omnirelay.serving import ServerConfig, create_app
from omnirelay.serving.text import ByteCodec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = 10
WS_FRAMES = 48  # four of each kind


def test_the_schema_describes_every_v1_body() -> None:
    pipe = SimpleNamespace(config=load_pipeline("toy-3stage"))  # the schema needs no running stage
    app = create_app(pipe, ServerConfig(), prompts=ByteCodec())  # type: ignore[arg-type]
    paths = app.openapi()["paths"]
    assert {
        "/v1/chat/completions",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/models",
        "/v1/models/{model_id}",
    } <= set(paths)
    form = paths["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["required"] == ["file"]
    for path in ("/v1/chat/completions", "/v1/audio/speech"):
        op = paths[path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["required"] and "$ref" not in str(schema)
        assert schema["properties"]["model"]["anyOf"][0] == {"enum": ["toy-3stage"]}
        assert {"400", "401", "403", "413", "415", "429"} <= set(op["responses"])


def test_fuzz_finds_no_server_error_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    argv = ["--examples", str(EXAMPLES), "--ws-frames", str(WS_FRAMES), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fuzz_serve", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    http, ws = report["http"], report["ws"]
    assert http["ok"] and http["server_errors"] == http["hangs"] == http["bad_error_bodies"] == 0
    assert len(http["operations"]) == 5 and http["requests"] >= 5 * EXAMPLES
    assert set(http["statuses"]) <= {"200", "400", "404", "409", "413", "415", "429"}, http["statuses"]
    assert ws["ok"] and ws["error_then_1008"] == WS_FRAMES and len(ws["kinds"]) == 12
    assert report["healthy_after"]
    assert report["leftover"] == {
        "server_in_flight": 0,
        "pipeline_in_flight": 0,
        "request_state": [],
        "objects_after_shutdown": 0,
    }
