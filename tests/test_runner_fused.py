"""Fused projections (``omnirelay.models.runner.fused``): one matmul for a layer's QKV
and one for its gate/up give what the separate projections give (float32 on the CPU:
to the last bits), and the modules' own weights become views of the fused ones (no
second copy of the weights)."""

from __future__ import annotations

import torch

from omnirelay.models.qwen3_tts.layers import MLP
from omnirelay.models.runner.fused import fuse_projections, project_qkv, run_mlp


class _Attention(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 16, bias=bias)
        self.k_proj = torch.nn.Linear(8, 4, bias=bias)
        self.v_proj = torch.nn.Linear(8, 4, bias=bias)


class _HFMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 12, bias=False)
        self.up_proj = torch.nn.Linear(8, 12, bias=False)
        self.down_proj = torch.nn.Linear(12, 8, bias=False)
        self.act_fn = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Layer(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, bias: bool = False) -> None:
        super().__init__()
        self.self_attn = _Attention(bias)
        self.mlp = mlp


class _Unknown(torch.nn.Module):  # an MLP this module does not know: left as it is
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 12, bias=False)
        self.up_proj = torch.nn.Linear(8, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.gate_proj(x) + self.up_proj(x)
        return out


def test_fused_projections_equal_the_separate_ones_and_share_their_weights() -> None:
    torch.manual_seed(0)
    layers = [_Layer(_HFMLP(), bias=True), _Layer(MLP(8, 12)), _Layer(_Unknown())]
    x = torch.randn(3, 5, 8)
    with torch.inference_mode():
        want = [
            ((lay.self_attn.q_proj(x), lay.self_attn.k_proj(x), lay.self_attn.v_proj(x)), lay.mlp(x))
            for lay in layers
        ]
    fuse_projections(layers)
    fuse_projections(layers)  # idempotent
    with torch.inference_mode():
        for lay, (qkv, mlp_out) in zip(layers, want):
            for got, ref in zip(project_qkv(lay.self_attn, x), qkv, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(run_mlp(lay.mlp, x), mlp_out, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(lay.mlp(x), mlp_out, rtol=0, atol=0)  # the module itself unchanged
    attn = layers[0].self_attn
    fused = attn.omnirelay_qkv_weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused[16:].data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.omnirelay_qkv_bias[20:].data_ptr()
    assert layers[1].mlp.up_proj.weight.data_ptr() == layers[1].mlp.omnirelay_gate_up_weight[12:].data_ptr()
    assert not hasattr(layers[2].mlp, "omnirelay_gate_up_weight")
    # Not saved with the model: the checkpoint's names stay the model's own.
    assert not any("omnirelay" in name for name in layers[0].state_dict())


def test_rms_norms_run_as_one_op_with_the_modules_results() -> None:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    from omnirelay.models.qwen3_tts.layers import RMSNorm
    from omnirelay.models.runner.fused import run_norm

    torch.manual_seed(1)
    x = torch.randn(3, 5, 64)
    norms = [hf.Qwen3OmniMoeThinkerTextRMSNorm(64, eps=1e-6), RMSNorm(64, 1e-6)]
    with torch.inference_mode():
        for norm in norms:
            norm.weight.normal_()
            torch.testing.assert_close(run_norm(norm, x), norm(x), rtol=0, atol=0)  # float32: exact
            # bfloat16: one rounding instead of two, so within one step of bfloat16 (2^-7 relative).
            half, xb = norm.to(torch.bfloat16), x.to(torch.bfloat16)
            torch.testing.assert_close(run_norm(half, xb).float(), half(xb).float(), rtol=2**-7, atol=1e-2)
        layer_norm = torch.nn.LayerNorm(64)  # not an RMS norm: run as it is
        torch.testing.assert_close(run_norm(layer_norm, x), layer_norm(x), rtol=0, atol=0)


def test_queries_and_keys_normed_and_rotated_together_equal_the_layers_own() -> None:
    import copy

    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
    from omnirelay.models.runner.decoder import _rotary_fn
    from omnirelay.models.runner.fused import attention_inputs

    model = open_checkpoint(ModelArgs(tiny=True, device="cpu")).load_thinker()
    text = getattr(model.model, "language_model", model.model)
    layer = text.layers[0]
    plain = copy.deepcopy(layer)
    fuse_projections([layer])
    assert hasattr(layer.self_attn, "omnirelay_qk_norm")
    torch.manual_seed(2)
    x = torch.randn(2, 3, text.config.hidden_size)
    positions = torch.arange(3).view(1, 1, 3).expand(3, 2, 3)
    with torch.inference_mode():
        cos, sin = text.rotary_emb(x, positions)
        got = attention_inputs(layer.self_attn, x, cos, sin, _rotary_fn())
        want = attention_inputs(plain.self_attn, x, cos, sin, _rotary_fn())  # unfused: the modules
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def runner_vs_model_logits(device: str, dtype: str, steps: int = 8) -> float:
    """The largest relative difference, over a prefill and ``steps`` greedy decodes of
    one prompt, between the static runner's last-token logits (fused projections, norms
    and rotary; CUDA graphs where the device has them) and the tiny Thinker's own
    ``transformers`` forward over the whole sequence."""
    from omnirelay.engine.interfaces import SamplingParams
    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
    from omnirelay.models.runner import Buckets, Row, ThinkerRunner

    model = open_checkpoint(ModelArgs(tiny=True, device=device, dtype=dtype)).load_thinker()
    text = getattr(model.model, "language_model", model.model)
    buckets = Buckets(max_num_seqs=2, max_model_len=64, batch_sizes=(1, 2), prefill_tokens=(16,))
    runner = ThinkerRunner(
        text, model.lm_head, capture_layers=(0,), num_text_ids=200, buckets=buckets, cuda_graphs=True
    )
    runner.capture_graphs()
    ids = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    runner.slots.acquire("x")
    worst = 0.0
    with torch.inference_mode():
        row = Row("x", 0, ids, SamplingParams(), torch.Generator())
        for step in range(steps + 1):
            (out,) = runner.run([row], decode=step > 0, keep_logits=True)
            assert out.logits is not None and out.token is not None
            hidden = text(input_ids=torch.tensor([ids], device=runner.device)).last_hidden_state
            want = model.lm_head(hidden[0, -1]).float()[:200]
            got = out.logits[:200]
            worst = max(worst, float((got - want).norm() / want.norm()))
            ids.append(out.token)
            row = Row("x", len(ids) - 1, [out.token], SamplingParams(), torch.Generator())
    runner.slots.release("x")
    return worst


def test_runner_logits_match_the_models_own_forward_in_float32() -> None:
    # float32 on the CPU: the fused path sums what the model's modules sum.
    assert runner_vs_model_logits("cpu", "float32") < 1e-5
