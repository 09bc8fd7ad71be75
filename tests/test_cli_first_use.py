"""What a new user meets first, said in one line instead of a traceback or a wrong word:

* ``run``/``serve`` of a pipeline whose models ask for CUDA, on a machine without it: the
  tiny models run on the CPU (a note says so); any other size stops at once, naming
  ``--device cpu``;
* ``check`` takes ``--device`` and ``--load-format`` and shows the file as ``run`` would
  start it (no ``cuda:0`` nor GPU-direct edge for ``--device cpu``);
* ``--device``'s help speaks of every pipeline, not Qwen3-Omni's alone;
* ``omnirelay --help`` lists every benchmark;
* ``bench transfer --backend nixl`` without NIXL stops at once with the install line;
* the timeline's verdict on gaps says what gap-free means (short gaps do not break it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from omnirelay.cli.main import build_parser, main
from omnirelay.cli.session import load_run_config
from omnirelay.errors import ConfigError


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_the_tiny_models_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    config = load_run_config("qwen3-tts", load_format="tiny")
    devices = {s.name: s.executor_args.get("device") for s in config.stages if "device" in s.executor_args}
    assert devices and set(devices.values()) == {"cpu"}, devices
    assert (
        capsys.readouterr().err
        == "note: no CUDA device here: the tiny models run on the CPU (--device cpu)\n"
    )
    # A device given is the user's: kept, and no note.
    config = load_run_config("qwen3-tts", load_format="tiny", device="cuda:1")
    assert {s.executor_args.get("device") for s in config.stages if "device" in s.executor_args} == {"cuda:1"}
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_a_full_size_model_stops_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        ConfigError, match=r"runs on cuda:0, and torch has no CUDA device here: add --device cpu$"
    ):
        load_run_config("qwen3-omni", load_format="dummy")
    rc = main(
        ["run", "--pipeline", "qwen3-tts", "--load-format", "dummy", "--prompt", "Hi", "--modalities", "text"]
    )
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("omnirelay run: error: stage 0 (talker) of pipeline 'qwen3-tts' runs on cuda:0"), (
        err
    )
    assert err.endswith("add --device cpu\n")


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


@pytest.mark.parametrize("command", ["run", "serve"])
def test_device_help_speaks_of_every_pipeline(command: str) -> None:
    device = next(a for a in _subcommand(command)._actions if "--device" in a.option_strings)
    assert device.help is not None and "every stage that loads a model" in device.help
    assert "Qwen3-Omni stage" not in device.help


def test_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.cli import build_parser as bench_parser

    sub = next(a for a in bench_parser()._actions if isinstance(a, argparse._SubParsersAction))
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name in sub.choices:
        assert f" {name}," in listed or f" {name} (" in listed, name


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--load-format", "tiny"]])
def test_check_shows_the_pipeline_as_run_would_start_it(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "check.json"
    assert main(["check", "qwen3-tts", *flags, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "cuda" not in out and "gpu-direct" not in out, out
    stages = json.loads(report.read_text())["stages"]
    assert {s["device"] for s in stages} == {"cpu"}
    # Without the flags, the file as it is: its CUDA devices (no error: check starts nothing).
    assert main(["check", "qwen3-tts"]) == 0
    assert "device cuda:0" in capsys.readouterr().out


def test_bench_transfer_over_nixl_without_nixl_stops_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.transfer_hosts
    import omnirelay.connectors.nixl

    why = "the nixl connector needs NIXL: pip install --no-deps 'nixl-cu12>=1.5,<2'"
    monkeypatch.setattr(omnirelay.connectors.nixl, "unavailable_reason", lambda: why)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a benchmark process started without NIXL")

    monkeypatch.setattr(benchmarks.transfer_hosts, "run_hosts_bench", never)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "transfer", "--backend", "nixl", "--scale", "0.01"])
    assert exc.value.code == f"omnirelay bench transfer: --backend nixl: {why}"


def _timeline(*chunks: tuple[float, int]) -> str:
    from omnirelay.cli.run import render_timeline
    from omnirelay.timeline.request import ClientArrival, RequestTimeline

    arrivals = [ClientArrival(at, 1, "audio", 0, n, False, None) for at, n in chunks]
    tl = RequestTimeline("r", 0.0, arrivals, [], "stop", "", 1000, None, None, None)
    return next(line for line in render_timeline(tl).splitlines() if "first playable audio" in line)


def test_the_timeline_says_what_gap_free_means() -> None:
    assert _timeline((0.0, 100), (0.05, 100)).endswith("   no gap")
    short = _timeline((0.0, 100), (0.13, 100), (0.26, 100))  # two 30 ms gaps
    assert short.endswith("2 gap(s), worst 30.0 ms, 60.0 ms of silence (gap-free: none over 50 ms)"), short
    long = _timeline((0.0, 100), (0.18, 100))
    assert long.endswith("1 gap(s), worst 80.0 ms, 80.0 ms of silence (NOT gap-free: one over 50 ms)"), long
