"""The CLI starts fast, and ``serve`` fails at once on a port it cannot have.

* ``--help`` of every command and ``check`` import no torch (nor FastAPI, uvicorn, PyAV or
  transformers for ``--help``): each runs in a fresh interpreter that then lists what it
  imported.
* ``serve`` binds its port before it loads anything: on a port the test holds it exits 1
  with a message that says why, without starting a stage.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omnirelay.errors import OmniRelayError
from omnirelay.serving.server import bind_socket

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "fastapi", "uvicorn", "av", "transformers")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

_PROBE = """
import contextlib, io, json, sys
from omnirelay.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print(json.dumps({"code": code, "heavy": heavy}))
""".replace("HEAVY", repr(HEAVY))


def _imports_after(argv: list[str]) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return int(result["code"] or 0), list(result["heavy"])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["serve", "--help"], ["run", "--help"], ["check", "--help"], ["doctor", "--help"]],
    ids=lambda a: " ".join(a),
)
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    code, heavy = _imports_after(argv)
    assert code == 0 and heavy == []


@pytest.mark.parametrize("pipeline", ["voice-cpu", "qwen3-omni", "qwen3-omni-tiny", "toy-3stage"])
def test_check_imports_no_torch(pipeline: str) -> None:
    code, heavy = _imports_after(["check", pipeline])
    assert code == 0 and "torch" not in heavy, heavy


def test_serve_on_a_held_port_fails_at_once_and_starts_nothing() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "omnirelay.cli.main",
                "serve",
                "--pipeline",
                "toy-3stage",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert (
        f"omnirelay serve: error: cannot listen on 127.0.0.1:{port}: the address is already in use"
        in done.stderr
    )
    assert "starting pipeline" not in done.stderr  # no stage was started


def test_bind_socket_says_why() -> None:
    with pytest.raises(
        OmniRelayError, match=r"cannot listen on 192\.0\.2\.1:8000: the address is not one of this host's"
    ):
        bind_socket("192.0.2.1", 8000)  # TEST-NET-1: never a local address
    with pytest.raises(OmniRelayError, match="the port must be 0-65535"):
        bind_socket("127.0.0.1", 70000)
    sock = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OmniRelayError, match="already in use"):
            sock.listen()
            bind_socket("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_serve_takes_a_checkpoint_directory_and_no_abbreviated_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from omnirelay.cli.main import main

    missing = tmp_path / "no-such-checkpoint"
    # --model is serve's own option (not a prefix of --model-name): a missing directory is an
    # error naming it before any port is bound or process started.
    assert main(["serve", "--pipeline", "qwen3-tts", "--model", str(missing), "--port", "0"]) == 1
    assert str(missing) in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model-n", "x"])
    assert info.value.code == 2
    assert "unrecognized arguments: --model-n" in capsys.readouterr().err


def test_serve_max_websockets_reaches_the_server_config() -> None:
    from omnirelay.cli.main import build_parser
    from omnirelay.cli.serve import _limits, security_limits, server_config
    from omnirelay.pipeline import load_pipeline
    from omnirelay.serving.server_config import ServerConfig

    for argv, want in ((["--max-websockets", "3"], 3), ([], None)):
        args = build_parser().parse_args(["serve", "--pipeline", "toy-3stage", *argv])
        door = ServerConfig(**security_limits(args, {}))
        config = server_config(load_pipeline("toy-3stage"), **_limits(args, door))
        assert config.max_websockets == want and config.max_concurrency == 64
