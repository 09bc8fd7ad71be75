"""On a GPU: the shipped-size Code2Wav decoders of Qwen3-Omni and Qwen3-TTS (random
weights) capture their graphs within the activation budget (one pool for window and
stream graphs), a step of more streams than the largest captured bucket is split and
decodes what the uncompiled eager step decodes, and a capture that runs out of memory is
one line naming the knob. Each check prints the pool it measured (the figure
docs/performance.md quotes).

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.code2wav import Code2WavExecutor
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner.code2wav import GRAPH_MEMORY_ENV, decoder_widths, graph_budget_bytes
from omnirelay.models.runner.memory import peak_activation_bytes
from omnirelay.models.runner.vocoder import StreamingVocoder, StreamRow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GIB = 2**30


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _check(model: Any, name: str, capfd: pytest.CaptureFixture[str]) -> None:
    executor = Code2WavExecutor(model, cuda_graphs=True, max_streams=64)
    startup = capfd.readouterr().err
    print(startup)
    assert f"code2wav on {next(model.parameters()).device}: weights" in startup and "graph pools" in startup
    vocoder = executor.vocoder
    assert vocoder is not None
    per = peak_activation_bytes(decoder_widths(model), next(model.parameters()).element_size())
    budget = graph_budget_bytes()
    keys = vocoder.graphs.report.keys + executor._decoder.graphs.report.keys
    assert max(b * t * per for b, t in keys if b > 1) <= budget
    pools = (vocoder.graphs.report.pool_bytes or 0) + (executor._decoder.graphs.report.pool_bytes or 0)
    print(f"{name}: {len(keys)} graphs, graph pools {pools / GIB:.2f} GiB (budget {budget / GIB:g} GiB)")
    assert pools <= budget * 3 // 2
    # 24 streams with a first chunk of 25 frames: more rows than bucket 32's largest batch.
    gen = torch.Generator().manual_seed(0)
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    rows = [StreamRow(f"s{i}", torch.randint(0, size, (q, 25), generator=gen)) for i in range(24)]
    assert vocoder.max_rows(32) < len(rows)
    with torch.inference_mode():
        graphed = [p.float().cpu() for p in vocoder.decode(rows)]
        for row in rows:
            vocoder.release(row.rid)
        vocoder.graphs.bypass = True
        eager = [p.float().cpu() for p in vocoder.decode(rows)]
    worst = max(_relative(g, e) for g, e in zip(graphed, eager, strict=True))
    print(f"{name}: split step vs eager, largest relative error {worst:.2e}")
    assert worst < 2e-2
    assert vocoder.graphs.num_replays >= 24 // vocoder.max_rows(32)
    # The window decoder: 20 windows of 25 frames, more than bucket 32's largest batch.
    windows = torch.randint(0, size, (20, q, 25), generator=gen)
    assert 0 < executor._decoder.max_rows(32) < 20
    with torch.inference_mode():
        replayed = executor.decode(windows).float().cpu()
        direct = model(windows.to(next(model.parameters()).device)).float().cpu()
    error = _relative(replayed, direct[..., : replayed.shape[-1]])
    print(f"{name}: split windows vs eager, relative error {error:.2e}")
    assert replayed.shape[0] == 20 and error < 2e-2


def test_full_size_omni_code2wav_captures_within_the_budget(capfd: pytest.CaptureFixture[str]) -> None:
    model = open_checkpoint(ModelArgs(load_format="dummy", device="cuda:0")).load_code2wav()
    _check(model, "qwen3-omni", capfd)


def test_full_size_tts_decoder_captures_within_the_budget(capfd: pytest.CaptureFixture[str]) -> None:
    _check(
        TTSCheckpoint.open(TTSModelArgs(load_format="dummy", device="cuda:0")).load_codec(),
        "qwen3-tts",
        capfd,
    )


def test_a_capture_out_of_memory_is_one_line_naming_the_knob() -> None:
    model = open_checkpoint(ModelArgs(load_format="dummy", device="cuda:0")).load_code2wav()
    vocoder = StreamingVocoder(model, max_streams=64, cuda_graphs=True)  # every bucket, up to 64 x 32
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(free - GIB, 0), dtype=torch.uint8, device="cuda:0")
    try:
        with pytest.raises(ModelError) as info:
            vocoder.capture_graphs()
    finally:
        del hog
        torch.cuda.empty_cache()
    message = str(info.value)
    print(message)
    assert "\n" not in message and GRAPH_MEMORY_ENV in message and "code2wav-stream" in message
