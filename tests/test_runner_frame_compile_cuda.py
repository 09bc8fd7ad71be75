"""On a GPU: the Talker frame's decoder step compiled with inductor
(``OMNIRELAY_FRAME_COMPILE=1``) and captured in the frame's CUDA graphs computes what the
uncompiled step computes, for Qwen3-TTS and Qwen3-Omni alike.

* tiny Qwen3-TTS in float32, frame graphs: the greedy codes of the uncompiled frame
  while requests join and leave (the first frame exactly, ≥ 95 % of all codes: fused
  sums may break a rare tie the other way);
* tiny Qwen3-TTS in bfloat16, three shapes (a static graph, then a dynamic one; torch
  2.11 on CUDA keeps the attention length, an ``int``, fixed in the dynamic graph, so
  the third shape may compile a third): the
  compiled pass's normed hidden states within 0.05 of
  the uncompiled pass's (values of order 1: a few bfloat16 steps, fused kernels round
  elsewhere), its keys and values written in the cache (no buffer of a layer's keys'
  size in the generated code), and a CUDA graph of it replays the same;
* tiny Qwen3-Omni Talker, tail and frame compiled: the eager frames up to the rare tie
  that fused float math breaks the other way (as the compiled tail's own test).
* tiny Qwen3-Omni Thinker in bfloat16 (the fused Triton MoE path), its decode launches
  compiled with inductor (``OMNIRELAY_THINKER_COMPILE=1``) inside its graphs, fed the
  uncompiled runner's ids while requests join and leave (rows in place and gathered):
  logits within 3 % relative of the uncompiled graphs' (bf16 rounding where inductor
  fuses; a wrong slot or cache write is off by far more), ≥ 95 % of the greedy ids equal;
  and the stage built with the switch on compiles its decode and keeps its first ids.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner.talker import FRAME_COMPILE_ENV
from tests.test_runner_frame_compile import _runner, _talk, buffer_sizes, compiled_pass_matches

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # inductor's own warnings (a torch.jit API torch deprecates; TF32 left off for float32)
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]


def _tts(dtype: str) -> Any:
    return TTSCheckpoint.open(TTSModelArgs(load_format="tiny", device="cuda:0", dtype=dtype))


def test_tts_frame_graphs_compiled_speak_the_uncompiled_codes() -> None:
    checkpoint = _tts("float32")
    talker = checkpoint.load_talker()
    results = {}
    for compiled in (False, True):
        runner = _runner(talker, checkpoint.config, cuda_graphs=True)
        if compiled:
            runner.decoder.compile_decode("inductor")
        runner.capture_graphs()
        assert len(runner.graphs) > 0
        with torch.inference_mode():
            results[compiled] = list(_talk(runner))
        assert runner.graphs.num_replays > 0
    got, want = torch.cat(results[True]), torch.cat(results[False])
    assert got.shape == want.shape
    assert torch.equal(results[True][1], results[False][1])  # the first compiled frame
    # fused float32 sums may break a rare tie the other way (later frames then follow it)
    assert float((got == want).float().mean()) >= 0.95


def test_tts_compiled_pass_in_bf16_writes_in_place_and_replays_in_a_graph() -> None:
    checkpoint = _tts("bfloat16")
    runner = _runner(checkpoint.load_talker(), checkpoint.config)
    kv, dev = runner.kv, runner.device
    code = compiled_pass_matches(runner, [(4, 32), (2, 16), (3, 48)], atol=0.05)
    assert len(code) in (2, 3)  # the second graph's attention length: symbolic, or fixed (torch 2.11)
    sizes = buffer_sizes(code)
    assert sizes and max(sizes) < kv.keys[0].numel()
    # captured in a CUDA graph: a replay writes the cache and returns what the call did
    b, length = 3, 32
    embeds = torch.randn(b, 1, runner.hidden, device=dev, dtype=runner.dtype)
    slots, counts = torch.arange(b, device=dev), torch.ones(b, dtype=torch.long, device=dev)
    starts = torch.tensor([4, 9, 20], device=dev)
    with torch.inference_mode():
        before = kv.cache.clone()
        want, _ = runner.decoder.decode_forward(embeds, slots, starts, counts, attn_len=length, in_place=True)
        want_cache = kv.cache.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = runner.decoder.decode_forward(
                embeds, slots, starts, counts, attn_len=length, in_place=True
            )
        kv.cache.copy_(before)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=0.05)
    torch.testing.assert_close(kv.cache.float(), want_cache.float(), rtol=0, atol=0.05)


def test_omni_talker_with_the_frame_compiled_speaks_the_eager_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_runner_cuda import compiled_talker_speaks_the_eager_frames

    compiled_talker_speaks_the_eager_frames(
        lambda talker: talker.runner.decoder.decode_backend,
        lambda compiled: monkeypatch.setenv(FRAME_COMPILE_ENV, "1" if compiled else "0"),
    )


def _thinker_bf16() -> Any:
    from omnirelay.models.qwen3_omni import Checkpoint
    from tests.test_models_support import tiny_dir

    return Checkpoint.open(tiny_dir(), device="cuda:0", dtype="bfloat16")


def test_thinker_decode_compiled_in_graphs_keeps_the_logits_and_greedy_ids() -> None:
    from omnirelay.models.runner import moe
    from tests.test_runner_thinker_compile import lockstep, make_runner

    model = _thinker_bf16().load_thinker()
    plain = make_runner(model, cuda_graphs=True)
    compiled = make_runner(model, compile="inductor", cuda_graphs=True)
    before = moe.CALLS.copy()
    plain.capture_graphs()
    compiled.capture_graphs()
    with torch.inference_mode():
        (want, got), (want_logits, got_logits) = lockstep([plain, compiled])
    ran = moe.CALLS - before
    assert ran["fallback"] == 0 and ran["block"] > 0, dict(ran)  # the fused MoE path, whole blocks
    assert compiled.graphs.num_replays > 0  # the decodes replayed the compiled graphs
    finite = torch.isfinite(want_logits)
    assert torch.equal(finite, torch.isfinite(got_logits))  # the same ids masked
    diff = (got_logits[finite] - want_logits[finite]).norm() / want_logits[finite].norm()
    ids = [(a, b) for r in want for a, b in zip(want[r], got[r], strict=True)]
    agree = sum(a == b for a, b in ids) / len(ids)
    print(f"tiny Thinker, compiled decode vs uncompiled, bf16: relative error {diff:.2e}, ids {agree:.1%}")
    assert diff < 3e-2
    assert agree >= 0.95


def test_thinker_stage_with_the_switch_compiles_its_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnirelay.models.qwen3_omni import encode_chat_prompt
    from omnirelay.models.qwen3_omni.loader import ModelArgs
    from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
    from omnirelay.models.runner.thinker import THINKER_COMPILE_ENV
    from tests.test_models_support import run_thinker

    results = {}
    for on in (True, False):
        monkeypatch.setenv(THINKER_COMPILE_ENV, "1" if on else "0")
        args = ModelArgs(device="cuda:0", runner="static", max_num_seqs=8, max_model_len=256)
        thinker = ThinkerExecutor.from_checkpoint(_thinker_bf16(), args)
        assert thinker.runner is not None
        assert thinker.runner.decoder.decode_backend == ("inductor" if on else None)
        tok = thinker.tokenizer
        prompts = {
            "a": encode_chat_prompt(tok, "Hello there, how are you today?"),
            "b": encode_chat_prompt(tok, "Tell me a story."),
        }
        results[on] = run_thinker(thinker, prompts, 8)
    for rid in ("a", "b"):
        # the prefill's id and the first compiled decode's: a tie broken the other way
        # later changes every id after it, so later ids are the lockstep test's
        assert results[True][rid].tokens[:2] == results[False][rid].tokens[:2], rid
