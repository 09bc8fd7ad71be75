"""On a GPU: the stream step compiled with inductor and captured in CUDA graphs decodes
what the uncompiled step decodes in its graphs — streams of several lengths joining and
leaving (a leaving stream's slot taken by the top holder, then by a new stream), chunks of
1 to 25 frames — for the tiny and the shipped-size decoders of Qwen3-Omni (float32) and
Qwen3-TTS (bfloat16), random weights; and the streams are still the whole-utterance
decode. Each check prints its largest relative error (the figure docs/performance.md
quotes).

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from omnirelay.models.qwen3_omni.code2wav import open_code2wav
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner.vocoder import COMPILE_ENV, StreamingVocoder, StreamRow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: The buckets of these checks: every kind of compiled graph (batch and frames of one and
#: above one) with few captures.
BATCHES = (1, 2, 4)
FRAMES = (1, 2, 4, 8, 32)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _vocoder(model: Any, compile: str | None) -> StreamingVocoder:
    voc = StreamingVocoder(
        model, max_streams=4, cuda_graphs=True, batch_sizes=BATCHES, frames=FRAMES, compile=compile
    )
    voc.capture_graphs()
    assert len(voc.graphs) == len(BATCHES) * len(FRAMES)
    assert voc.compile_backend == compile, f"the compiled step fell back: startup error {voc.compile_error}"
    return voc


def _compare(model: Any, compiled: StreamingVocoder, step_tol: float, whole_tol: float) -> None:
    """Both decoders through one schedule: per step, the compiled pieces within
    ``step_tol`` of the uncompiled ones; per stream, within ``whole_tol`` of its
    whole-utterance decode."""
    plain = _vocoder(model, None)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    lengths = {"a": 31, "b": 77, "c": 12, "d": 50, "e": 40}
    codes = {rid: torch.randint(0, size, (q, n), generator=gen) for rid, n in lengths.items()}
    sent = dict.fromkeys(lengths, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in lengths}
    worst = 0.0
    with torch.inference_mode():
        for step in range(200):
            live = [rid for rid in lengths if 0 < sent[rid] < lengths[rid]]
            waiting = [rid for rid in lengths if sent[rid] == 0]
            if waiting and len(live) < 4 and (step % 3 == 0 or not live):
                live.append(waiting[0])  # a stream joins
            if not live:
                break
            rows = []
            for rid in live:
                k = min(rng.choice([1, 1, 2, 3, 4, 8, 25]), lengths[rid] - sent[rid])
                rows.append(StreamRow(rid, codes[rid][:, sent[rid] : sent[rid] + k]))
                sent[rid] += k
            for row, want, got in zip(rows, plain.decode(rows), compiled.decode(rows)):
                assert got.shape == want.shape, (step, row.rid)
                worst = max(worst, _relative(got, want))
                pieces[row.rid].append(got)
            for row in rows:
                if sent[row.rid] == lengths[row.rid]:  # done: it leaves, the top holder moves down
                    plain.release(row.rid)
                    compiled.release(row.rid)
        assert all(sent[rid] == n for rid, n in lengths.items())
        errors = {}
        for rid, c in codes.items():
            whole = model(c.unsqueeze(0).to(compiled.device))[0, 0]
            got = torch.cat(pieces[rid])
            assert got.shape == whole.shape, rid
            errors[rid] = _relative(got, whole)
    print(
        f"compiled vs uncompiled step: largest relative error {worst:.2e} (startup probe "
        f"{compiled.compile_error}); vs whole: {errors}"
    )
    assert worst < step_tol
    assert max(errors.values()) < whole_tol
    assert compiled.graphs.num_replays > 0 and compiled.graphs.num_eager == 0
    assert len(compiled.slots) == 0 and len(plain.slots) == 0


def test_tiny_omni_stage_compiles_its_step_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_runner_cuda import _tiny

    monkeypatch.setenv(COMPILE_ENV, "1")
    executor = open_code2wav(_tiny(), ModelArgs(device="cuda:0"))
    compiled = executor.vocoder
    assert compiled is not None and compiled.compile_backend == "inductor" and len(compiled.graphs) > 0
    _compare(executor.model, compiled, 1e-2, 1e-2)


def test_tiny_tts_decoder_compiled_step_decodes_the_uncompiled_one() -> None:
    codec = TTSCheckpoint.open(TTSModelArgs(tiny=True, device="cuda:0")).load_codec()
    _compare(codec, _vocoder(codec, "inductor"), 1e-2, 1e-2)


def test_full_size_omni_code2wav_compiled_step_decodes_the_uncompiled_one() -> None:
    model = open_checkpoint(ModelArgs(load_format="dummy", device="cuda:0")).load_code2wav()
    _compare(model, _vocoder(model, "inductor"), 2e-2, 2e-2)


def test_full_size_tts_decoder_compiled_step_decodes_the_uncompiled_one() -> None:
    codec = TTSCheckpoint.open(TTSModelArgs(load_format="dummy", device="cuda:0")).load_codec()
    assert next(codec.parameters()).dtype == torch.bfloat16
    _compare(codec, _vocoder(codec, "inductor"), 5e-2, 5e-2)
