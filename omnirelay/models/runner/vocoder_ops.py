"""The stream step's element-wise pieces in few launches (:mod:`omnirelay.models.runner.vocoder`).

A replayed stream step costs about one kernel launch per operation, whatever its batch
(docs/performance.md), so what the decoder's modules compute in chains of small
operations is computed here in fewer, from values fixed at startup:

* :func:`snake` — a SnakeBeta activation ``x + sin²(x·e^α) / (e^β + ε)`` as four
  launches instead of eight: ``e^α`` and ``e^β + ε`` (or its inverse, as the module
  writes it) are the parameters' and computed once; on CUDA with ``triton``, one
  launch (:mod:`~omnirelay.models.runner.vocoder_kernels`; ``OMNIRELAY_FUSED_SNAKE=0``
  keeps the four);
* :func:`fused_qkv` — an attention's query, key and value projections as one matrix
  (a copy of their weights, made at startup): one product instead of three;
* :func:`rotary` — rotary position embedding as three launches for the queries, keys and
  values at once instead of five for each of the queries and the keys:
  ``rotate_half(x) · sin`` is ``roll(x, D/2) · (sin with its first half negated)``, and
  the values' heads rotate by ``cos = 1, sin = 0`` (exactly themselves), the tables made
  once per step (:func:`head_tables`);
* :func:`window_bias` — the sliding window's attention mask made additive once per step,
  so that no attention call converts it again;
* :func:`rms_norm` — the transformer's RMS norms through ``F.rms_norm``: one fused
  kernel on CUDA instead of six (on the CPU it decomposes into the same six);
* :func:`scaled_residual` — ``h + scale · y`` (the codec transformer's layer scales,
  the ConvNeXt's ``gamma``) as one ``addcmul``.

In float32 each equals its module's computation up to the rounding of a fused
multiply-add or a reordered reduction (about 1e-7 relative; :func:`snake` of Qwen3-TTS's
own SnakeBeta divides as the module does and is exact). In bfloat16 a fused operation
rounds its result once where the module rounds each of its steps to bfloat16, so the
two differ by about one bfloat16 rounding (3e-3 relative) per fused piece.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "fused_qkv",
    "head_tables",
    "rms_norm",
    "rotary",
    "rotary_sign",
    "scaled_residual",
    "snake",
    "snake_kernel_enabled",
    "window_bias",
]

#: ``0`` runs the SnakeBeta activations as ``torch`` operations, not one Triton kernel each
FUSED_SNAKE_ENV = "OMNIRELAY_FUSED_SNAKE"

Activation = Callable[[torch.Tensor], torch.Tensor]


def snake_kernel_enabled(device: torch.device) -> bool:
    """Whether :func:`snake` on ``device`` launches the one Triton kernel: CUDA,
    ``triton`` importable, ``OMNIRELAY_FUSED_SNAKE`` not ``0``."""
    if os.environ.get(FUSED_SNAKE_ENV) == "0":
        return False
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def snake(module: torch.nn.Module, *, kernel: bool = False) -> Activation:
    """``module``'s SnakeBeta with its parameters' exponentials made once (the weights
    must be loaded before): the transformers module's (``no_div_by_zero``: it multiplies by
    ``1 / (e^β + ε)``) or Qwen3-TTS's (``eps``: it divides by ``e^β + ε``), each computed
    as its module does; any other activation is returned as it is. ``kernel``: as one
    Triton launch in float32 (:func:`snake_kernel_enabled` says where it can run)."""
    alpha = getattr(module, "alpha", None)
    beta = getattr(module, "beta", None)
    multiplies, divides = getattr(module, "no_div_by_zero", None), getattr(module, "eps", None)
    if not isinstance(alpha, torch.Tensor) or not isinstance(beta, torch.Tensor):
        return module
    if isinstance(multiplies, float):
        divide, offset = False, multiplies
    elif isinstance(divides, float):
        divide, offset = True, divides
    else:
        return module
    with torch.no_grad():  # the kernel computes in float32, its tables too
        a, b = (alpha.detach().float(), beta.detach().float()) if kernel else (alpha.detach(), beta.detach())
        freq = a.exp().view(1, -1, 1)
        denom = b.exp().view(1, -1, 1) + offset
        scale = denom if divide else 1.0 / denom
    if kernel:
        return _snake_kernel(freq.flatten(), scale.flatten(), divide)
    if divide:

        def divided(x: torch.Tensor) -> torch.Tensor:
            return torch.addcdiv(x, torch.sin(x * freq).pow(2), scale)

        return divided

    def multiplied(x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x, scale, torch.sin(x * freq).pow(2))

    return multiplied


def _snake_kernel(freq: torch.Tensor, scale: torch.Tensor, divide: bool) -> Activation:
    kernels = importlib.import_module("omnirelay.models.runner.vocoder_kernels")

    def fused(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = kernels.snake(x, freq, scale, divide=divide)
        return out

    return fused


def rotary_sign(head_dim: int) -> torch.Tensor:
    """``head_dim`` signs for :func:`head_tables`: −1 for the first half, +1 for the second."""
    half = head_dim // 2
    return torch.cat([torch.full((half,), -1.0), torch.ones(head_dim - half)])


def head_tables(
    cos: torch.Tensor, sin: torch.Tensor, sign: torch.Tensor, rotated: int, plain: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [B, T, D]`` as tables ``[B, T, rotated + plain, D]`` for :func:`rotary`:
    the first ``rotated`` heads with ``sin``'s first half negated (``sign``:
    :func:`rotary_sign`), the other ``plain`` heads left as they are (1 and 0)."""
    b, t, d = cos.shape
    ones, zeros = cos.new_ones((1, 1, 1, 1)), cos.new_zeros((1, 1, 1, 1))
    cos = torch.cat([cos.unsqueeze(2).expand(b, t, rotated, d), ones.expand(b, t, plain, d)], dim=2)
    sin = torch.cat([(sin * sign).unsqueeze(2).expand(b, t, rotated, d), zeros.expand(b, t, plain, d)], dim=2)
    return cos, sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated: ``x · cos + rotate_half(x) · sin`` with the tables of
    :func:`head_tables`. ``x`` as a projection's output is laid out so (on CUDA ``roll``
    copies a non-contiguous input first)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def scaled_residual(h: torch.Tensor, scale: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``h + scale(y)`` where ``scale`` multiplies by its ``scale`` vector (else applied as it is)."""
    vector = getattr(scale, "scale", None)
    if isinstance(vector, torch.Tensor):
        return torch.addcmul(h, vector, y)
    out: torch.Tensor = h + scale(y)
    return out


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an RMS norm (a ``*RMSNorm`` with a ``weight`` and an ``eps`` or
    ``variance_epsilon``) as one fused ``F.rms_norm``; any other module is applied as it is."""
    if "RMSNorm" not in type(module).__name__:
        out: torch.Tensor = module(x)
        return out
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        out = module(x)
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_qkv(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) of ``attn``'s ``q_proj``, ``k_proj`` and ``v_proj`` stacked:
    ``F.linear`` with them gives ``[queries, keys, values]`` along the last dimension."""
    projections = [getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")]
    with torch.no_grad():
        weight = torch.cat([p.weight.detach() for p in projections])
        biases = [p.bias for p in projections]
        bias = None if any(b is None for b in biases) else torch.cat([b.detach() for b in biases])
    return weight, bias


def window_bias(
    steps: torch.Tensor, positions: torch.Tensor, past: int, window: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask ``[B, 1, T, past + T]`` (0 or −inf) of ``T`` new frames (``steps``:
    ``0 .. T−1``) of streams at ``positions`` over their ``past`` cached frames and
    themselves: a cached frame is seen if the stream had it, a new one if it is not later
    than the query, each within ``window`` frames of it."""
    b, t = positions.shape[0], steps.shape[0]
    query = steps.view(1, t, 1)
    key = torch.arange(past + t, device=steps.device).view(1, 1, past + t)
    in_cache = key < past
    seen = key >= past - positions.view(b, 1, 1)  # cache rows before the stream began are empty
    new = key - past
    mask = (in_cache & seen & (key >= query)) | (~in_cache & (new <= query) & (query - new < window))
    # Rows padded to a multiple of 16: CUDA's memory-efficient attention takes an aligned
    # bias as it is, and would pad (copy) an unaligned one in every layer's call.
    padded = -(-(past + t) // 16) * 16
    bias = torch.full((b, t, padded), float("-inf"), dtype=dtype, device=mask.device)[..., : past + t]
    return bias.masked_fill_(mask, 0).unsqueeze(1)
