"""Fused projections: one matmul for a layer's queries, keys and values, one for its MLP's
gate and up projections.

A decoder layer of the Qwen3 families projects its input three times for attention
(``q_proj``, ``k_proj``, ``v_proj``) and twice for a dense MLP (``gate_proj``,
``up_proj``): five launches, each reading the same input. :func:`fuse_projections`
concatenates each group's weights once, when the runner is built, and makes the
modules' own weights views of the concatenation (no second copy of the weights: the
model's modules keep working, and read the same memory). :func:`project_qkv` and
:func:`run_mlp` then run one matmul per group and split its output — views, no copy.

Each output element is the same dot product as before; only how the GEMM blocks its
columns may differ, so in float32 the results equal the separate projections' up to
the last bits, and in bfloat16 up to its rounding of the same sums. A layer without the
expected modules (an MoE block's experts: ``transformers`` already keeps their gate
and up projections in one tensor) runs as it is.

:func:`run_norm` runs an RMS norm of these families (``x · rsqrt(mean(x²) + ε) · w``,
computed in float32) as one ``F.rms_norm`` — a single fused kernel on a GPU instead of
the module's six (cast, square, mean, add, rsqrt, two products); it rounds to the input's
dtype once, after the weight, where the module rounds before it.

:func:`attention_inputs` goes one step further for a layer with fused QKV whose query
and key norms share their epsilon: the queries' and keys' columns of the fused output
are one ``[B, T, Hq + Hk, D]`` view, normed by one ``F.rms_norm`` (no weight) and one
product with the two norms' weights laid out per head, then rotated by one rotary pass
(the ``transformers`` formula ``x·cos + rotate_half(x)·sin``, element by element the
same) — four launches fewer per layer than norming and rotating queries and keys apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from omnirelay.models.runner.moe import fused_moe_block

__all__ = ["attention_inputs", "fuse_projections", "project_qkv", "run_mlp", "run_norm"]

_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def _fuse(module: torch.nn.Module, names: tuple[str, ...], prefix: str) -> None:
    """Concatenate the weights (and biases) of ``module``'s linear children ``names``
    into the non-persistent buffers ``{prefix}_weight`` / ``{prefix}_bias``; the
    children's parameters become views of them."""
    linears = [getattr(module, name, None) for name in names]
    if any(not isinstance(m, torch.nn.Linear) for m in linears) or hasattr(module, f"{prefix}_weight"):
        return
    parts: list[torch.nn.Linear] = linears  # type: ignore[assignment]
    has_bias = [m.bias is not None for m in parts]
    if any(has_bias) and not all(has_bias):
        return
    with torch.no_grad():
        weight = torch.cat([m.weight for m in parts])
        bias = torch.cat([m.bias for m in parts]) if all(has_bias) else None
        offset = 0
        for m in parts:
            n = m.out_features
            m.weight = torch.nn.Parameter(weight[offset : offset + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[offset : offset + n], requires_grad=False)
            offset += n
    module.register_buffer(f"{prefix}_weight", weight, persistent=False)
    module.register_buffer(f"{prefix}_bias", bias, persistent=False)
    setattr(module, f"{prefix}_sizes", tuple(m.out_features for m in parts))


def _activation(mlp: Any) -> Any:
    """The activation a dense MLP applies to its gate: ``transformers``' ``act_fn``, or
    SiLU for Qwen3-TTS's own MLP (its forward is ``down(silu(gate) · up)``); None: an
    MLP this module does not know (left unfused)."""
    act = getattr(mlp, "act_fn", None)
    if act is not None:
        return act
    if type(mlp).__module__ == "omnirelay.models.qwen3_tts.layers" and type(mlp).__name__ == "MLP":
        return F.silu
    return None


def _fuse_qk_norms(attn: Any) -> None:
    """The query and key norms' weights per head ``[Hq + Hk, D]`` (a buffer), when both
    are RMS norms with one epsilon over fused QKV."""
    sizes = getattr(attn, "omnirelay_qkv_sizes", None)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    eps_q, eps_k = _rms_eps(q_norm), _rms_eps(k_norm)
    if sizes is None or eps_q is None or eps_q != eps_k or hasattr(attn, "omnirelay_qk_norm"):
        return
    d = int(attn.head_dim)
    hq, hk = sizes[0] // d, sizes[1] // d
    with torch.no_grad():
        weight = torch.cat([q_norm.weight.expand(hq, d), k_norm.weight.expand(hk, d)])  # type: ignore[union-attr]
    attn.register_buffer("omnirelay_qk_norm", weight, persistent=False)
    attn.omnirelay_qk_eps = eps_q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(
    attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[B, Hq, T, D]``, keys and values ``[B, Hk, T, D]`` of ``x [B, T, H]``:
    projected, the queries and keys normed and rotated (``cos``/``sin [B, T, D]``).
    ``rotate``: the family's ``apply_rotary_pos_emb``, for a layer run unfused."""
    b, t, _ = x.shape
    d = attn.head_dim
    weight = getattr(attn, "omnirelay_qk_norm", None)
    if weight is None:
        q_, k_, v_ = project_qkv(attn, x)
        q = run_norm(attn.q_norm, q_.view(b, t, -1, d)).transpose(1, 2)
        k = run_norm(attn.k_norm, k_.view(b, t, -1, d)).transpose(1, 2)
        q, k = rotate(q, k, cos, sin)
        return q, k, v_.view(b, t, -1, d).transpose(1, 2)
    nq, nk, _nv = attn.omnirelay_qkv_sizes
    qkv = F.linear(x, attn.omnirelay_qkv_weight, attn.omnirelay_qkv_bias)
    qk = qkv[..., : nq + nk].view(b, t, -1, d)
    qk = (F.rms_norm(qk, (d,), None, attn.omnirelay_qk_eps) * weight).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    qk = qk * c + _rotate_half(qk) * s
    hq = nq // d
    return qk[:, :hq], qk[:, hq:], qkv[..., nq + nk :].view(b, t, -1, d).transpose(1, 2)


def fuse_projections(layers: Iterable[Any]) -> None:
    """Fuse each decoder layer's QKV projections and, for a dense MLP, its gate and up
    projections (idempotent; see the module docstring)."""
    for layer in layers:
        _fuse(layer.self_attn, _QKV, "omnirelay_qkv")
        _fuse_qk_norms(layer.self_attn)
        act = _activation(layer.mlp)
        if act is not None:
            _fuse(layer.mlp, _GATE_UP, "omnirelay_gate_up")
            layer.mlp.omnirelay_act = act


def project_qkv(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values of ``x [B, T, H]`` (each ``[B, T, heads·D]``)."""
    weight = getattr(attn, "omnirelay_qkv_weight", None)
    if weight is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k, v = F.linear(x, weight, attn.omnirelay_qkv_bias).split(attn.omnirelay_qkv_sizes, dim=-1)
    return q, k, v


def run_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)``: a fused dense MLP as ``down(act(gate) · up)``, an MoE block through
    :func:`~omnirelay.models.runner.moe.fused_moe_block` where that applies, anything
    else as is."""
    weight = getattr(mlp, "omnirelay_gate_up_weight", None)
    if weight is None:
        fused = fused_moe_block(mlp, x)  # an MoE block while its experts run fused
        out: torch.Tensor = mlp(x) if fused is None else fused
        return out
    gate, up = F.linear(x, weight, mlp.omnirelay_gate_up_bias).split(mlp.omnirelay_gate_up_sizes, dim=-1)
    out = mlp.down_proj(mlp.omnirelay_act(gate) * up)
    return out


def _rms_eps(norm: Any) -> float | None:
    """The epsilon of an RMS norm this module knows (``transformers``' Qwen3 norms:
    ``variance_epsilon``; Qwen3-TTS's own: ``eps``), None for any other module."""
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(
        getattr(norm, "weight", None), torch.Tensor
    ):
        return None
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if isinstance(eps, float):
            return eps
    return None


def run_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for an RMS norm over the last dimension, as one ``F.rms_norm``."""
    eps = _rms_eps(norm)
    if eps is None:
        out: torch.Tensor = norm(x)
        return out
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
