"""``omnirelay bench tts-talker``: the Talker step's parts by batch, reduced to the tiny
model on the CPU (the figures that matter are a GPU's; here: it runs whole, profiles,
renders and leaves no slot held)."""

from __future__ import annotations

import pytest

from benchmarks.tts_talker import render_tts_talker_bench, run_tts_talker_bench
from omnirelay.cli.main import main


def test_a_reduced_run_times_every_part_and_leaves_no_slot() -> None:
    report = run_tts_talker_bench(device="cpu", load_format="tiny", batches=(2,), reps=1, profile=2)
    assert set(report["batches"]) == {"2"}
    for figures in report["batches"].values():
        assert figures["frame_ms"] > 0 and figures["step_ms"] > 0 and figures["admit_ms"] > 0
        assert figures["tail_and_host_ms"] == pytest.approx(figures["step_ms"] - figures["frame_ms"])
        # The floor: the step's bytes over the measured bandwidth, and the step over that.
        assert figures["bytes"] > 0 and figures["kernels_per_step"] > 0
        want_floor = 1000.0 * figures["bytes"] / report["bandwidth_bytes_per_s"]
        assert figures["floor_ms"] == pytest.approx(want_floor)
        assert figures["ratio"] == pytest.approx(figures["step_ms"] / want_floor)
    prof = report["profile"]
    assert prof["batch"] == 2 and prof["kernels_per_step"] > 0 and prof["top"]
    # The census: the frame alone and the step less the frame add up to the step.
    parts = prof["census"]
    assert parts["step"]["total"]["kernels"] == pytest.approx(prof["kernels_per_step"])
    assert parts["frame"]["total"]["kernels"] > 0 and parts["tail_and_host"]["sampling"]["kernels"] > 0
    assert parts["frame"]["gemm"]["kernels"] + parts["tail_and_host"]["gemm"]["kernels"] == pytest.approx(
        parts["step"]["gemm"]["kernels"]
    )
    assert report["leak_state"] == {}
    assert report["tail_compile"] is None and report["frame_compile"] is None  # no graphs on the CPU
    text = render_tts_talker_bench(report)
    assert (
        "frame ms" in text
        and "floor ms" in text
        and "profile at batch 2" in text
        and "kernels per step by family" in text
        and "state left: none" in text
    )


def test_cli_wiring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tts-talker", "--help"])
    assert exc.value.code == 0
    assert "--batches" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="must be one of the batches"):
        main(
            [
                "bench",
                "tts-talker",
                "--device",
                "cpu",
                "--load-format",
                "tiny",
                "--batches",
                "1",
                "--profile",
                "4",
            ]
        )
    with pytest.raises(SystemExit, match="--batches must be integers like 1,8,64"):
        main(["bench", "tts-talker", "--batches", "one"])
    with pytest.raises(SystemExit, match="batches must be sizes >= 1"):
        main(["bench", "tts-talker", "--device", "cpu", "--load-format", "tiny", "--batches", "0"])
