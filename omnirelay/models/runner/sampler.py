"""Token sampling on the device with per-row parameters as tensors (graph-capturable).

:func:`sample` computes exactly what :func:`omnirelay.models.sampling.sample_rows` does —
greedy for temperature 0; else temperature, top-k and top-p thresholds taken from
*values* (ties with a threshold are kept), then the inverse CDF in vocabulary order at a
uniform number the caller drew from the request's own generator — but with static
shapes and no host synchronization, so it runs inside a CUDA graph. Rows that ask for no
top-k (0) or no top-p (1.0) get neutral thresholds. Inputs are ``[B]`` tensors.
"""

from __future__ import annotations

import torch

__all__ = ["sample"]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """One id per row of ``logits [B, V]`` (int64 ``[B]``)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    is_sampled = temperature > 0
    scores = logits / torch.where(is_sampled, temperature, 1.0).unsqueeze(1)
    values = scores.sort(dim=-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    threshold = values.gather(1, (k - 1).unsqueeze(1))
    candidates = values.masked_fill(values < threshold, float("-inf"))
    probs = torch.softmax(candidates, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    limit = torch.where((top_p > 0) & (top_p < 1), top_p, 2.0).unsqueeze(1)
    outside = (mass_before >= limit) | torch.isinf(candidates)
    kept = candidates.masked_fill(outside, float("inf"))
    threshold = torch.maximum(threshold, kept.min(dim=-1, keepdim=True).values)
    scores = scores.masked_fill(scores < threshold, float("-inf"))
    cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1)
    drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1).contiguous(), right=True)
    drawn = drawn.clamp_max(vocab - 1).squeeze(1)
    return torch.where(is_sampled, drawn, greedy)
