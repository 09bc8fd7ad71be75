"""``bench pipeline --mps``: the private MPS daemon's lifecycle, with a fake control program."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from benchmarks.mps import MpsError, mps_daemon

# Records each call; -d "starts" a daemon (its control pipe appears), "quit" on stdin stops it.
FAKE = """#!/bin/sh
echo "$@ pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then
  [ -n "{fail}" ] && {{ echo "cannot start" >&2; exit 3; }}
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read cmd; echo "stdin $cmd" >> "{log}"
[ -n "{hang}" ] && exec sleep 30
[ "$cmd" = "quit" ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def _fake(tmp_path: Path, *, fail: bool = False, hang: bool = False) -> tuple[str, Path]:
    log = tmp_path / "calls.log"
    exe = tmp_path / "fake-mps-control"
    exe.write_text(FAKE.format(log=log, fail="yes" if fail else "", hang="yes" if hang else ""))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe), log


def test_daemon_runs_inside_the_block_only(tmp_path: Path) -> None:
    exe, log = _fake(tmp_path)
    before = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    with mps_daemon(control=exe) as env:
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert (pipe / "control").exists()  # started, and private: its own pipe directory
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)  # children inherit it
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == env["CUDA_MPS_LOG_DIRECTORY"]
    assert not pipe.parent.exists()  # quit, and nothing left on disk
    assert {k: os.environ.get(k) for k in before} == before
    calls = log.read_text().splitlines()
    assert calls[0].startswith(f"-d pipe={pipe} ")
    assert calls[-1] == "stdin quit"


def test_daemon_quits_when_the_block_raises(tmp_path: Path) -> None:
    exe, log = _fake(tmp_path)
    with pytest.raises(KeyError), mps_daemon(control=exe) as env:
        root = Path(env["CUDA_MPS_PIPE_DIRECTORY"]).parent
        raise KeyError("a failed run")
    assert not root.exists()
    assert log.read_text().splitlines()[-1] == "stdin quit"


def test_a_daemon_kept_up_by_a_client_is_a_warning_not_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "quit" waits for the daemon's last client; a run's figures must not be lost to it.
    exe, log = _fake(tmp_path, hang=True)
    with mps_daemon(control=exe, quit_timeout_s=0.5) as env:
        root = Path(env["CUDA_MPS_PIPE_DIRECTORY"]).parent
    assert "did not stop within 0.5 s" in capsys.readouterr().err
    assert not root.exists()
    assert log.read_text().splitlines()[-1] == "stdin quit"


def test_a_daemon_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    exe, log = _fake(tmp_path, fail=True)
    before = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    with pytest.raises(MpsError, match="cannot start"), mps_daemon(control=exe):
        pass
    assert "stdin" not in log.read_text()  # nothing to stop
    assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY") == before
    pipe_dir = log.read_text().split("pipe=")[1].split()[0]
    assert not Path(pipe_dir).parent.exists()


def test_missing_control_program_is_a_clear_error() -> None:
    with pytest.raises(MpsError, match="not installed"), mps_daemon(control="no-such-mps-control-program"):
        pass


def test_sharing_variants_are_valid_pipelines_of_the_shipped_file() -> None:
    from benchmarks.sharing import VARIANTS, variant_pipeline
    from omnirelay.pipeline import parse_pipeline

    envs = {}
    for name, (_, settings, _) in VARIANTS.items():
        cfg = parse_pipeline(variant_pipeline("qwen3-omni", settings, 40))
        assert [s.name for s in cfg.stages] == ["thinker", "talker", "code2wav"]
        envs[name] = [s.process_env() for s in cfg.stages]
    assert envs["graphs"] == envs["mps"] == [{}, {}, {}]
    assert envs["mps-share-low"] == [
        {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "CUDA_MPS_CLIENT_PRIORITY": "1"},
        {},
        {},
    ]
