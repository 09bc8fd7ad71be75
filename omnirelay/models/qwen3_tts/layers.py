"""The transformer pieces Qwen3-TTS is made of (plain ``torch``).

Module and parameter names are the checkpoint's (``self_attn.q_proj``, ``input_layernorm``,
``mlp.gate_proj`` …), which is also what the shared GPU runner reads
(:func:`omnirelay.models.runner.decoder.decoder_layer` runs one of these layers over its
slot KV cache; :class:`~omnirelay.models.runner.predictor.CodePredictor` and
:class:`~omnirelay.models.runner.vocoder.StreamingVocoder` walk them the same way).

* :class:`RMSNorm`, :class:`RotaryEmbedding` (``rotate_half`` layout; positions ``[B, T]``,
  or the multimodal ``[3, B, T]`` of the Talker, whose rows are equal for speech — which
  is plain rotary positions, so row 0 is used), :class:`MLP` (SwiGLU).
* :class:`Attention` — grouped-query attention with optional per-head q/k RMS norms (the
  Talker and the code predictor have them, the codec decoder not) and an optional sliding
  window (the codec decoder's: a query sees itself and the ``window − 1`` positions before).
* :class:`DecoderLayer` — pre-norm attention and MLP, with the codec decoder's optional
  layer scales on both residual branches.
* :func:`apply_rotary` and :func:`causal_forward` — the full-sequence forward the tests
  and the non-streaming paths use (no cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "LayerScale",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "causal_mask",
]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """``forward(x, positions) -> (cos, sin)``, each ``[B, T, head_dim]`` in ``x``'s dtype."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (float(theta) ** exponent), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 3:  # [3, B, T]: equal rows for speech (see the module docstring)
            positions = positions[0]
        freqs = positions.to(device=x.device, dtype=torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [B, heads, T, D]`` rotated by ``cos, sin [B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def causal_mask(t: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[T, T]`` True where query ``i`` may attend key ``j``: ``j <= i`` (and ``i − j < window``)."""
    i = torch.arange(t, device=device).view(t, 1)
    j = torch.arange(t, device=device).view(1, t)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        bias: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = heads
        self.num_key_value_heads = kv_heads
        self.scaling = head_dim**-0.5
        self.window = window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Full-sequence causal attention over ``x [B, T, H]`` (no cache)."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        mask = causal_mask(t, x.device, self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class LayerScale(nn.Module):
    def __init__(self, size: int, initial: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((size,), float(initial)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; ``layer_scale``: the codec decoder's scaled residuals."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        bias: bool = False,
        window: int | None = None,
        layer_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(
            hidden, heads, kv_heads, head_dim, eps=eps, qk_norm=qk_norm, bias=bias, window=window
        )
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn_layer_scale: nn.Module = nn.Identity()
        self.mlp_layer_scale: nn.Module = nn.Identity()
        if layer_scale is not None:
            self.self_attn_layer_scale = LayerScale(hidden, layer_scale)
            self.mlp_layer_scale = LayerScale(hidden, layer_scale)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), cos, sin))
        out: torch.Tensor = h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))
        return out
