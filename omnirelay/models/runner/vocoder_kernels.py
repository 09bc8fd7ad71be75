"""The stream step's SnakeBeta activation as one Triton kernel (:func:`snake`).

Imported only where ``triton`` is (the CUDA machines; the tests under the Triton
interpreter). Composed of ``torch`` operations, a SnakeBeta ``x + sin²(x·f) · s`` (or
``/ s``) is four launches that each read and write the whole activation; late in the
decoder that activation is the audio's length times the channels, so those launches are
memory-bound and most of the step's element-wise time. Here each element is read once
and written once, in float32 whatever the activation's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["snake"]

#: samples per program (a row shorter than this gets one program)
_BLOCK = 1024


@triton.jit
def _snake_rows(
    x_ptr, out_ptr, freq_ptr, scale_ptr, channels, width, DIVIDE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)  # batch × channels rows of ``width`` samples
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < width
    channel = row % channels
    freq = tl.load(freq_ptr + channel)
    scale = tl.load(scale_ptr + channel)
    base = row.to(tl.int64) * width
    x = tl.load(x_ptr + base + offs, mask=live, other=0.0).to(tl.float32)
    wave = tl.sin(x * freq)
    if DIVIDE:
        y = x + wave * wave / scale
    else:
        y = x + wave * wave * scale
    tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=live)


def snake(x: torch.Tensor, freq: torch.Tensor, scale: torch.Tensor, *, divide: bool) -> torch.Tensor:
    """``x [B, C, T]`` through ``x + sin²(x · freq) · scale`` (``/ scale`` when ``divide``),
    ``freq`` and ``scale`` float32 vectors of ``C``; a new tensor of ``x``'s dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    b, c, t = x.shape
    block = min(_BLOCK, max(16, triton.next_power_of_2(t)))
    _snake_rows[(b * c, triton.cdiv(t, block))](x, out, freq, scale, c, t, DIVIDE=divide, BLOCK=block)
    return out
