"""``omnirelay run``: options, errors, the WAV writer, and Ctrl-C on a real run.

The happy path (a real run writing a WAV and a JSON timeline) is in
``test_e2e_qwen_tiny.py``; here are the ways it must fail cleanly, and the interrupt:
SIGINT once the answer streams aborts the request, shuts the stage processes down and
exits with 130, leaving no process and no /dev/shm object behind.
"""

from __future__ import annotations

import io
import os
import selectors
import signal
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.cli.main import main
from omnirelay.cli.run import WavWriter, _Answer
from omnirelay.cli.session import Progress, load_run_config, sampling_overrides
from omnirelay.connectors.shm import sweep
from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.qwen3_omni.tiny import CACHE_ENV
from omnirelay.orchestrator.requests import RequestOutput
from omnirelay.pipeline import load_pipeline
from omnirelay.timeline import StageTrace, drive_request
from tests.orchestrator_audit import fork_servers, pids_alive, processes
from tests.test_models_support import tiny_cache, tiny_dir

# --------------------------------------------------------------------------- errors


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--pipeline",
        "--model",
        "--prompt",
        "--out",
        "--json",
        "--modalities",
        "--max-tokens",
        "--seed",
        "--device",
        "--load-format",
        "--runner",
    ):
        assert option in out
    assert "qwen3-omni-tiny" in out and "critical path" in out and "Ctrl-C" in out


def test_missing_model_directory_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--prompt", "hi", "--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "omnirelay run: error:" in err and "does not exist" in err and "--model" in err


def test_a_directory_that_is_not_a_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--prompt", "hi", "--model", str(tmp_path)]) == 1
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["run", "--prompt", "hi", "--model", str(tmp_path)]) == 1
    assert "not Qwen3-Omni" in capsys.readouterr().err


def test_out_needs_audio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--prompt", "hi", "--modalities", "text", "--out", "x.wav"]) == 1
    assert "--out needs audio" in capsys.readouterr().err


def test_a_pipeline_without_a_thinker_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--prompt", "hi", "--pipeline", "toy-3stage"]) == 1
    assert "not a Qwen3-Omni Thinker" in capsys.readouterr().err


# --------------------------------------------------------------------------- configuration


def test_model_path_replaces_every_stage_source(monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_dir()
    cfg = load_run_config(model=str(path), device="cpu")
    assert cfg.name == "qwen3-omni"  # --model defaults to the real deploy file
    for stage in cfg.stages:
        assert stage.executor_args["model_dir"] == str(path.resolve())
        assert stage.executor_args["device"] == "cpu"
        assert "tiny" not in stage.executor_args
    tiny = load_run_config("qwen3-omni-tiny", model=str(path))
    assert all(s.executor_args == {"num_threads": 1, "model_dir": str(path.resolve())} for s in tiny.stages)
    with pytest.raises(ConfigError, match="no Qwen3-Omni stage"):
        load_run_config("toy-3stage", device="cpu")
    with pytest.raises(ModelError, match="does not exist"):
        load_run_config(model="/nonexistent/omnirelay-model")


def test_load_format_dummy_needs_no_checkpoint() -> None:
    cfg = load_run_config(load_format="dummy", device="cuda:0")
    assert cfg.name == "qwen3-omni"  # the full-size deploy file, without its model_dir
    for stage in cfg.stages:
        args = stage.executor_args
        assert args["load_format"] == "dummy" and args["device"] == "cuda:0" and "model_dir" not in args
    tiny = load_run_config("qwen3-omni-tiny", load_format="dummy", runner="static")
    assert all(s.executor_args["tiny"] and s.executor_args["runner"] == "static" for s in tiny.stages)
    with pytest.raises(ConfigError, match="--load-format"):
        load_run_config(load_format="npz")
    with pytest.raises(ConfigError, match="--runner"):
        load_run_config(runner="fast")


def test_sampling_overrides() -> None:
    cfg = load_pipeline("qwen3-omni-tiny")
    assert sampling_overrides(cfg) == {}
    out = sampling_overrides(cfg, max_tokens=5, seed=3)
    assert out[0].max_tokens == 5 and out[0].seed == 3 and out[0].temperature == 0.0
    assert out[1].seed == 3 and out[1].max_tokens == 64 and out[1].stop_token_ids == (2150,)
    assert 2 not in out  # Code2Wav samples nothing
    with pytest.raises(ConfigError):
        sampling_overrides(cfg, max_tokens=0)


def test_progress_without_a_terminal_prints_a_start_and_an_end_line() -> None:
    buf = io.StringIO()
    with Progress("building", buf, done="built"):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "building…" and lines[1].startswith("building: built in ")
    buf = io.StringIO()
    with pytest.raises(RuntimeError), Progress("starting", buf):
        raise RuntimeError("boom")
    assert buf.getvalue().splitlines()[-1] == "starting: failed"


# --------------------------------------------------------------------------- WAV


def test_wav_writer_streams_16_bit_pcm_and_appears_only_on_commit(tmp_path: Path) -> None:
    target = tmp_path / "out" / "a.wav"
    writer = WavWriter(target)
    writer.write(torch.tensor([0.0, 0.5, -0.5, 1.0]), 24000)
    writer.write(torch.zeros(0), 24000)
    writer.write(torch.tensor([2.0, -2.0]), 24000)  # clipped
    assert not target.exists()
    with pytest.raises(ModelError, match="sample rate changed"):
        writer.write(torch.tensor([0.1]), 16000)
    assert writer.commit()
    with wave.open(str(target), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 6)
        pcm = torch.frombuffer(bytearray(w.readframes(6)), dtype=torch.int16).tolist()
    assert pcm == [0, 16384, -16384, 32767, 32767, -32767]
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.wav"]


def test_wav_writer_discard_leaves_nothing(tmp_path: Path) -> None:
    writer = WavWriter(tmp_path / "b.wav")
    assert writer.commit() is False  # no audio: no file
    writer.write(torch.ones(10), 24000)
    writer.discard()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- Ctrl-C


@pytest.fixture
def run_env() -> Iterator[dict[str, str]]:
    tiny_dir()
    yield {**os.environ, CACHE_ENV: str(tiny_cache()), "PYTHONUNBUFFERED": "1"}


def _stage_workers(pid: int) -> list[int]:
    """The stage workers of the front ``pid``: the children of its fork server."""
    procs = processes()
    servers = set(fork_servers(pid, procs))
    return [p for p, (ppid, _) in procs.items() if ppid in servers]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_aborts_the_request_and_leaves_nothing(run_env: dict[str, str], tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "omnirelay.cli.main", "run", "--prompt", "Hello, who are you?"]
    cmd += ["--pipeline", "qwen3-omni-tiny", "--out", str(tmp_path / "a.wav")]
    # SIGINT at its default in the child, as in a terminal: a test run started as a
    # background job (`cmd &` in a script) inherits it ignored, and Python keeps it so.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=run_env,
        preexec_fn=_default_sigint,  # only a signal reset: safe after fork
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        # Wait for the answer to start streaming: the request is in flight in every stage.
        while True:
            assert sel.select(timeout=120), "no output within 120 s"
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                pytest.fail(f"omnirelay run exited before streaming: {proc.stderr.read().decode()}")
            if chunk.strip():
                break
        sel.close()
        workers = _stage_workers(proc.pid)
        assert len(pids_alive(list(workers))) == 3  # one process per stage
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode()
    assert proc.returncode == 130, text
    assert "omnirelay run: interrupted" in text
    assert pids_alive(list(workers)) == []
    assert [o.name for o in sweep().objects if o.namespace.startswith(f"p{proc.pid}x")] == []
    assert list(tmp_path.iterdir()) == []  # no WAV, no partial file


def test_a_restarted_run_writes_only_the_reruns_audio_and_words(tmp_path: Path) -> None:
    """Audio alone is buffered: a replica lost on the way runs it again, and what the WAV
    and the aligner's words had of the failed attempt goes."""
    target = tmp_path / "c.wav"
    out = io.StringIO()
    shown = _Answer(out, WavWriter(target))

    def audio(samples: list[float], **kw: Any) -> RequestOutput:
        return RequestOutput(request_id="r", stage_id=2, modality="audio", audio=torch.tensor(samples), **kw)

    shown(audio([0.5, 0.5, 0.5], sample_rate=16000), 0.1)
    shown(
        RequestOutput(request_id="r", stage_id=3, modality="timestamps", text="[]", stage_finished=True), 0.2
    )
    shown(RequestOutput(request_id="r", stage_id=2, modality="", restarted=True), 0.3)
    assert shown.stamps == [] and not list(tmp_path.iterdir())  # the part-file went too
    shown(audio([1.0], sample_rate=24000, finished=True), 0.4)
    assert shown.writer is not None and shown.writer.commit()
    with wave.open(str(target), "rb") as w:
        assert (w.getframerate(), w.getnframes()) == (24000, 1)
    assert out.getvalue() == ""


def test_drive_request_submits_buffered_when_asked_and_times_only_the_rerun() -> None:
    outputs = [
        RequestOutput(request_id="r", stage_id=0, modality="text", token_ids=[1], text="a"),
        RequestOutput(request_id="r", stage_id=0, modality="", restarted=True),
        RequestOutput(request_id="r", stage_id=0, modality="text", token_ids=[2], text="b"),
        RequestOutput(request_id="r", stage_id=0, modality="text", finished=True, finish_reason="stop"),
    ]
    submitted: list[dict[str, Any]] = []

    class OnePipe:
        config = load_pipeline("toy-3stage")

        def submit(self, prompt: list[int], **kw: Any) -> Iterator[RequestOutput]:
            submitted.append(kw)
            return iter(outputs)

    seen: list[RequestOutput] = []
    timeline = drive_request(
        OnePipe(),  # type: ignore[arg-type]
        StageTrace(),
        [1],
        request_id="r",
        on_output=lambda o, at: seen.append(o),
        buffered=True,
    )
    assert submitted[0]["buffered"] is True and seen == outputs  # the caller sees the restart
    assert timeline.text == "b" and len(timeline.arrivals) == 2 and timeline.finish_reason == "stop"
