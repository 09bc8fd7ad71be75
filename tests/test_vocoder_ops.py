"""The stream step's fused pieces compute what the decoders' own modules compute (float32:
exact or within 1e-6; bfloat16: within a bfloat16 rounding, 1e-2 relative), and the step
launches a fixed set of operations: its rows' histories read in one gather, none per row."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

from benchmarks.code2wav_ops import count_step, family
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_tts.codec import SnakeBeta
from omnirelay.models.qwen3_tts.layers import Attention, RMSNorm, apply_rotary
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner import vocoder_ops as ops
from omnirelay.models.runner.vocoder import StreamingVocoder, StreamRow
from tests.test_models_support import single_thread, tiny_dir

BF16 = {"rtol": 1e-2, "atol": 1e-2}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


def _randomized(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_is_the_modules_activation(dtype: torch.dtype) -> None:
    x = torch.randn(3, 8, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    tts = _randomized(SnakeBeta(8), dtype)
    theirs = _randomized(omni.Qwen3OmniMoeSnakeBeta(8), dtype)
    with torch.no_grad():
        if dtype == torch.float32:
            assert torch.equal(ops.snake(tts)(x), tts(x))  # divided as the module divides
            torch.testing.assert_close(ops.snake(theirs)(x), theirs(x), rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(ops.snake(tts)(x), tts(x), **BF16)
            torch.testing.assert_close(ops.snake(theirs)(x), theirs(x), **BF16)
    other = torch.nn.GELU()
    assert ops.snake(other) is other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_projection_and_one_rotation_give_the_attentions_queries_keys_and_values(
    dtype: torch.dtype,
) -> None:
    heads, kv_heads, d, b, t = 4, 2, 8, 2, 5
    attn = _randomized(Attention(16, heads, kv_heads, d, eps=1e-6, qk_norm=False, bias=True), dtype)
    x = torch.randn(b, t, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    freqs = torch.rand(b, t, d // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos, sin = torch.cat([freqs, freqs], -1).cos().to(dtype), torch.cat([freqs, freqs], -1).sin().to(dtype)
    with torch.no_grad():
        q, k, v = (p(x).view(b, t, -1, d).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        want_q, want_k = apply_rotary(q, k, cos, sin)
        weight, bias = ops.fused_qkv(attn)
        tables = ops.head_tables(cos, sin, ops.rotary_sign(d).to(dtype), heads + kv_heads, kv_heads)
        got = ops.rotary(F.linear(x, weight, bias).view(b, t, -1, d), *tables).transpose(1, 2)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else BF16
    torch.testing.assert_close(got[:, :heads], want_q, **tol)
    torch.testing.assert_close(got[:, heads : heads + kv_heads], want_k, **tol)
    torch.testing.assert_close(got[:, heads + kv_heads :], v, **tol)  # cos 1, sin 0: itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_modules_norm_and_other_norms_pass_through(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else BF16
    for norm in (RMSNorm(16, 1e-5), omni.Qwen3OmniMoeCode2WavRMSNorm(16, 1e-5)):
        norm = _randomized(norm, dtype)
        with torch.no_grad():
            torch.testing.assert_close(ops.rms_norm(norm, x), norm(x), **tol)
    layer = _randomized(torch.nn.LayerNorm(16), dtype)
    with torch.no_grad():
        assert torch.equal(ops.rms_norm(layer, x), layer(x))


def test_the_window_bias_lets_a_frame_see_what_the_stream_had_within_the_window() -> None:
    past, window, t = 3, 4, 2
    bias = ops.window_bias(torch.arange(t), torch.tensor([0, 1, 9]), past, window, torch.float32)
    seen = bias[:, 0] == 0  # [B, T, past + T]; keys: 3 cached frames (oldest first), then 2 new
    assert bias.dtype == torch.float32 and set(bias.unique().tolist()) == {0.0, float("-inf")}
    assert seen[0].tolist() == [[False, False, False, True, False], [False, False, False, True, True]]
    assert seen[1].tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    assert seen[2].tolist() == [[True, True, True, True, False], [False, True, True, True, True]]


def test_the_tts_front_with_its_tables_made_once_is_the_quantizers_decode() -> None:
    codec = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()
    codes = torch.randint(0, codec.config.codebook_size, (3, codec.config.num_quantizers, 7))
    with torch.no_grad():
        assert torch.equal(codec.stream_front()(codes), codec.embed_codes(codes))


@pytest.mark.parametrize("decoder", ["omni", "tts"])
def test_a_step_launches_the_same_operations_for_any_batch_and_reads_its_histories_at_once(
    decoder: str,
) -> None:
    if decoder == "omni":
        model = Checkpoint.open(tiny_dir()).load_code2wav()
    else:
        model = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()
    voc = StreamingVocoder(model, max_streams=4, cuda_graphs=False)
    counts = [count_step(voc, b, t)[0] for b, t in ((1, 1), (4, 2))]
    kernels = [sum(n for k, n in c.items() if family(k) != "view") for c in counts]
    # the CPU's matrix products decompose by shape (addmm, or mm and add, or a copy and
    # bmm): a launch or two apart; every other family is the same operations
    assert abs(kernels[0] - kernels[1]) <= 2
    for name in ("convolution", "cat", "index_select", "gather", "index_copy_", "addcmul", "sin"):
        assert counts[0][name] == counts[1][name], name
    ops_ = counts[0]
    # the rows' histories read in one gather and written in one scatter, each layer's keys
    # and values in one of each; each new state gathered from its input once
    layers = len(model.pre_transformer.layers)
    assert ops_["index_select"] == ops_["index_copy_"] == 1 + layers
    assert ops_["gather"] == len(voc._state.shapes) + layers
    if decoder == "tts":
        assert ops_["masked_fill"] == 0  # a first chunk reads the zero row; nothing to mask


@pytest.mark.parametrize("decoder", ["omni", "tts"])
def test_a_bfloat16_stream_decodes_the_whole_utterance_within_bfloat16_rounding(decoder: str) -> None:
    """The fused step in bfloat16 (as the GPU runs Qwen3-TTS's decoder): chunk by chunk
    it stays within bfloat16 rounding of the whole-utterance decode (the unfused step was
    6e-3 relative on this decoder, the fused one 7e-3)."""
    if decoder == "omni":
        model = Checkpoint.open(tiny_dir()).load_code2wav().to(torch.bfloat16)
    else:
        model = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec().to(torch.bfloat16)
    codes = torch.randint(0, 2048, (16, 20), generator=torch.Generator().manual_seed(0))
    voc = StreamingVocoder(model, max_streams=2, cuda_graphs=False)
    with torch.inference_mode():
        whole = model(codes.unsqueeze(0))[0, 0].float()
        pieces = [
            voc.decode([StreamRow("x", codes[:, a:b])])[0] for a, b in ((0, 3), (3, 4), (4, 12), (12, 20))
        ]
    got = torch.cat(pieces).float()
    assert got.shape == whole.shape
    assert float((got - whole).norm() / whole.norm().clamp_min(1e-12)) < 2e-2
