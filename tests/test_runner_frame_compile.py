"""The Talker frame's decoder step compiled (``OMNIRELAY_FRAME_COMPILE=1``): the same
codes as the uncompiled step, frame after frame, while requests join and leave (the
frame's rows in place and gathered, several batch sizes and attention lengths), for the
tiny Qwen3-TTS and Qwen3-Omni Talkers; and inductor keeps the step's key/value writes in
the cache itself (CPU; tests/test_runner_frame_compile_cuda.py runs them on a GPU)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_omni.talker import TalkerExecutor, TalkerSpec
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner import Buckets, TalkerRow, TalkerRunner
from omnirelay.models.runner.talker import FRAME_COMPILE_ENV
from tests.test_models_talker import checkpoint, frames, make_talker, payloads, talk

__all__ = ["checkpoint", "payloads"]  # the Qwen3-Omni fixtures, shared with its Talker's tests

FRAMES = 14


@pytest.fixture(scope="module")
def tts() -> Any:
    return TTSCheckpoint.open(TTSModelArgs(load_format="tiny", device="cpu"))


@pytest.fixture(scope="module")
def tts_talker(tts: Any) -> Any:
    return tts.load_talker()


def _runner(talker: Any, config: Any, compile: str | None = None, cuda_graphs: bool = False) -> TalkerRunner:
    tc = config.talker_config
    buckets = Buckets(
        max_num_seqs=4, max_model_len=64, batch_sizes=(1, 2, 4), prefill_tokens=(16,), lengths=(16, 32, 64)
    )
    projection = talker.code_predictor.small_to_mtp_projection
    return TalkerRunner(
        talker,
        codebook_size=tc.codebook_size,
        codec_eos=tc.codec_eos_token_id,
        num_code_groups=tc.num_code_groups,
        buckets=buckets,
        cuda_graphs=cuda_graphs,
        compile=compile,
        row_controls=True,
        projection=None if isinstance(projection, torch.nn.Identity) else projection,
    )


def _row(runner: TalkerRunner, rid: str, n: int, seed: int) -> TalkerRow:
    embeds = torch.randn(n, runner.hidden, generator=torch.Generator().manual_seed(seed)) * 0.5
    embeds = embeds.to(runner.device, runner.dtype)
    return TalkerRow(rid, embeds, SamplingParams(), torch.Generator(), 1.05, True)


def _talk(runner: TalkerRunner) -> Iterator[torch.Tensor]:
    """Greedy codes of each step: one request alone, then two more (batch buckets 1, 2,
    4); one frame of the last holder alone (its slot above the launch's rows: the frame
    gathers its keys); the second leaving (the last holder's slot packed into its place)
    and a fourth joining; positions past 16 (attention lengths 16 and 32)."""
    runner.slots.acquire("r0")
    yield runner.prefill([_row(runner, "r0", 6, 0)])
    live = ["r0"]
    for frame in range(FRAMES):
        if frame in (1, 2):
            rid = f"r{frame}"
            runner.slots.acquire(rid)
            yield runner.prefill([_row(runner, rid, 4 + frame, frame)])
            live.append(rid)
        if frame == 4:
            yield runner.decode([_row(runner, "r2", 1, 1000)])  # a subset: gathered
        if frame == 6:
            runner.slots.release("r1")
            live.remove("r1")
            runner.slots.acquire("r3")
            yield runner.prefill([_row(runner, "r3", 9, 3)])
            live.append("r3")
        yield runner.decode([_row(runner, rid, 1, 100 * frame + k) for k, rid in enumerate(live)])
    for rid in live:
        runner.slots.release(rid)


def test_the_switch_compiles_the_frame_only_with_a_compiled_tail(
    tts_talker: Any, tts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FRAME_COMPILE_ENV, "1")
    assert _runner(tts_talker, tts.config).decoder.decode_backend is None  # no tail compile: eager
    compiled = _runner(tts_talker, tts.config, compile="aot_eager")
    assert compiled.decoder.decode_backend == "aot_eager"
    assert "the frame's decoder step with aot_eager" in compiled._compile_plan()
    monkeypatch.setenv(FRAME_COMPILE_ENV, "0")
    assert _runner(tts_talker, tts.config, compile="aot_eager").decoder.decode_backend is None


def test_a_compiled_frame_decodes_the_codes_of_the_uncompiled_one(tts_talker: Any, tts: Any) -> None:
    from torch._dynamo.utils import counters

    with torch.inference_mode():
        want = list(_talk(_runner(tts_talker, tts.config)))
        runner = _runner(tts_talker, tts.config)
        runner.decoder.compile_decode("aot_eager")  # functionalized as inductor sees it
        counters.clear()
        got = list(_talk(runner))
    assert len(got) == len(want) == FRAMES + 5
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not counters["graph_break"], dict(counters["graph_break"])  # one graph per shape


_BUFFER = re.compile(r"empty_strided_\w+\(\(([^)]*)\)")


def buffer_sizes(code: list[str]) -> list[int]:
    """Elements of each buffer inductor's generated ``code`` allocates with a fixed shape
    (a symbolic one, a batch or attention length, is a step's own intermediate)."""
    sizes = []
    for text in code:
        for dims in _BUFFER.findall(text):
            parts = [d.strip() for d in dims.split(",") if d.strip()]
            if all(p.isdigit() for p in parts):
                sizes.append(math.prod(int(p) for p in parts))
    return sizes


@contextmanager
def generated_code() -> Iterator[list[str]]:
    """The code inductor generates while the block runs (every graph compiled in it)."""
    from torch._inductor.graph import GraphLowering

    code: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", code.append):
        yield code


def compiled_pass_matches(runner: TalkerRunner, shapes: list[tuple[int, int]], atol: float) -> list[str]:
    """Compile the runner's decode pass with inductor and run it at each ``(rows,
    attention length)`` of ``shapes`` (rows in place, in slots 0..rows-1), each against the
    uncompiled pass from the same cache: the last hidden states and the whole cache
    within ``atol``, the cache's own storage written. Returns the generated code."""
    decoder, kv, dev = runner.decoder, runner.kv, runner.device
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    decoder.compile_decode("inductor")
    with torch.inference_mode(), generated_code() as code:
        for b, length in shapes:
            embeds = (torch.randn(b, 1, runner.hidden, generator=gen) * 0.5).to(dev, runner.dtype)
            slots = torch.arange(b, device=dev)
            starts = torch.randint(0, length - 1, (b,), generator=gen).to(dev)
            counts = torch.ones(b, dtype=torch.long, device=dev)
            kv.cache.copy_(torch.randn(kv.cache.shape, generator=gen).to(dev, kv.cache.dtype))
            before = kv.cache.clone()
            want, _ = decoder.forward(embeds, slots, starts, counts, attn_len=length, in_place=True)
            want_cache = kv.cache.clone()
            kv.cache.copy_(before)
            storage = kv.cache.data_ptr()
            got, _ = decoder.decode_forward(embeds, slots, starts, counts, attn_len=length, in_place=True)
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
            assert kv.cache.data_ptr() == storage
            torch.testing.assert_close(kv.cache.float(), want_cache.float(), rtol=0, atol=atol)
            assert not torch.equal(kv.cache, before)  # the pass wrote its keys and values
    return code


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_writes_keys_and_values_in_the_cache_and_matches_eager(tts_talker: Any, tts: Any) -> None:
    """Inductor itself (a C++ kernel per fused group on the CPU), a first shape compiled
    static and a second one dynamic (batch and attention length symbolic): the last hidden
    states and the cache within float32 rounding (1e-4) of the uncompiled pass, and no
    buffer in the generated code as large as one layer's keys (a copy of the cache, which
    an out-of-place write would need)."""
    runner = _runner(tts_talker, tts.config)
    code = compiled_pass_matches(runner, [(2, 16), (3, 32), (4, 48)], atol=1e-4)
    assert len(code) == 2  # the first shape's graph, then one for every later shape
    sizes = buffer_sizes(code)
    assert sizes and max(sizes) < runner.kv.keys[0].numel()


def test_the_omni_talker_with_its_frame_compiled_speaks_the_same_frames(
    checkpoint: Checkpoint, payloads: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-Omni's Talker (an MoE decoder) through the same switch: one graph per shape
    (no break), the frames of the uncompiled static runner."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    _dynamo.reset()
    counters.clear()
    monkeypatch.setenv(FRAME_COMPILE_ENV, "1")
    spec = TalkerSpec.from_config(checkpoint.config)
    buckets = Buckets(max_num_seqs=8, max_model_len=256)
    compiled = TalkerExecutor(
        checkpoint.load_talker(), spec, static=buckets, cuda_graphs=False, compile="aot_eager"
    )
    assert compiled.runner is not None and compiled.runner.decoder.decode_backend == "aot_eager"
    got = talk(compiled, payloads, 14)
    want = talk(make_talker(checkpoint, "static"), payloads, 14)
    for rid in payloads:
        assert torch.equal(frames(got[rid]), frames(want[rid])), rid
    assert not counters["graph_break"], dict(counters["graph_break"])
    _dynamo.reset()
