"""The runner bench's floors (``benchmarks.floors``): the bytes a step must read, the
bandwidth, the floor and the ratio, and the kernels per step — reduced to the tiny model
on the CPU (the figures that matter are a card's; here: the fields and the arithmetic)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.floors import RoutedExperts, copy_bandwidth, floor, kv_bytes_per_position, param_bytes
from benchmarks.runner import render_runner_bench, run_runner_bench


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 6, 3))  # 72 floats: 18 per expert
        self.down_proj = torch.nn.Parameter(torch.zeros(4, 3, 3))  # 36 floats: 9 per expert


class _Router(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x, x, x.long()  # "top-k indices": the input's values


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Router()
        self.experts = _Experts()
        self.norm = torch.nn.Linear(3, 2, bias=False)  # 6 floats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)[2]


def test_param_bytes_leave_out_the_experts_and_routing_counts_each_layers_distinct_experts() -> None:
    block = _Block()
    assert param_bytes([block]) == 6 * 4
    assert param_bytes([block, block.norm, None]) == 6 * 4  # each parameter once
    assert param_bytes([block], skip_experts=False) == (6 + 72 + 36) * 4
    with RoutedExperts(block) as routed:
        block(torch.tensor([[0.0, 2.0], [2.0, 3.0]]))
    assert routed.distinct == [3]  # experts 0, 2 and 3
    assert routed.nbytes() == 3 * (18 + 9) * 4
    block(torch.tensor([1.0]))  # hooks removed on exit
    assert routed.distinct == [3]


def test_floor_arithmetic_and_a_measured_bandwidth() -> None:
    figures = floor(3_000_000, 3.0e12, 2.0)
    assert figures == {"bytes": 3e6, "floor_ms": pytest.approx(1e-3), "ratio": pytest.approx(2000.0)}
    assert floor(0, 1e9, 1.0)["ratio"] == 0.0
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, reps=2) > 0


def test_a_reduced_runner_bench_reports_each_steps_floor() -> None:
    report = run_runner_bench(device="cpu", reps=1, stages=("thinker",), tiny=True, sizes=(2,))
    bandwidth = report["bandwidth_bytes_per_s"]
    assert bandwidth > 0
    thinker = report["thinker"]
    assert thinker["greedy_ids_equal"]
    for key in ("prefill_2x30", "decode_2"):
        figures = thinker[key]
        assert figures["bytes"] > 0 and figures["kernels_per_step"] > 0 and figures["experts_per_layer"] >= 1
        assert figures["floor_ms"] == pytest.approx(1000.0 * figures["bytes"] / bandwidth)
        assert figures["ratio"] == pytest.approx(figures["graph_ms"] / figures["floor_ms"])
    # A decode step reads the two rows' cached keys and values on top of the weights.
    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint

    text = open_checkpoint(ModelArgs(tiny=True, device="cpu")).config.thinker_config.text_config
    assert thinker["decode_2"]["bytes"] >= 2 * 31 * kv_bytes_per_position(text, torch.float32)
    text_out = render_runner_bench(report)
    assert "floor ms" in text_out and "decode_2" in text_out


def test_a_bench_that_started_cuda_ends_with_its_status_and_one_that_did_not_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import sys
    import types

    from benchmarks import cli

    ended: list[int] = []
    monkeypatch.setattr(os, "_exit", ended.append)
    cli.end_if_cuda(3)  # CUDA never started on this machine: nothing happens
    assert ended == []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    cli.end_if_cuda(3)
    assert ended == [3]


def test_the_runner_bench_can_leave_code2wavs_compiled_steps_out() -> None:
    from benchmarks.cli import build_parser
    from benchmarks.runner_code2wav import stream_backend

    assert build_parser().parse_args(["runner"]).code2wav_compiled is True
    assert build_parser().parse_args(["runner", "--no-compiled-code2wav"]).code2wav_compiled is False
    import types

    cuda_param = types.SimpleNamespace(device=torch.device("cuda", 0))
    on_cuda = types.SimpleNamespace(parameters=lambda: iter([cuda_param]))
    assert stream_backend(on_cuda) == "inductor"
    assert stream_backend(on_cuda, compiled=False) is None
    assert stream_backend(torch.nn.Linear(1, 1)) is None  # the CPU: never compiled


def test_the_code2wav_target_step_sums_its_kernels_by_family() -> None:
    from benchmarks.runner_code2wav import CENSUS_STEP, _stream_step, render_stateful
    from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
    from omnirelay.models.runner.vocoder import StreamingVocoder

    codec = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()
    vocoder = StreamingVocoder(codec, max_streams=16, cuda_graphs=False)
    q, size = int(codec.config.num_quantizers), int(codec.config.codebook_size)
    b, t = CENSUS_STEP
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        figures = _stream_step(
            vocoder, None, [torch.randint(0, size, (q, t), generator=gen)] * b, 1, lambda: None
        )
        one = _stream_step(vocoder, None, [torch.randint(0, size, (q, 1), generator=gen)], 1, lambda: None)
    census = figures["census"]
    assert census["conv"]["kernels"] > 0  # the decoder's convolutions have a family of their own
    assert census["total"]["kernels"] == pytest.approx(
        sum(census[f]["kernels"] for f in census if f != "total")
    )
    assert "census" not in one  # one shape is summed, the others only counted
    stateful = {"capture_s": 0.0, "num_graphs": 0, "stream_relative_error": 0.0, f"step_{b}x{t}": figures}
    assert f"the {b} x {t} step's kernels by family" in render_stateful("tts-code2wav", stateful)
