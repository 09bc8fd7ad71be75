"""Token sampling on the device with per-row parameters as tensors (graph-capturable).

:func:`sample` computes exactly what :func:`omnirelay.models.sampling.sample_rows` does —
greedy for temperature 0; else temperature, top-k and top-p thresholds taken from
*values* (ties with a threshold are kept), then the inverse CDF in vocabulary order at a
uniform number the caller drew from the request's own generator — but with static
shapes and no host synchronization, so it runs inside a CUDA graph. Rows that ask for no
top-k (0) or no top-p (1.0) get neutral thresholds. Inputs are ``[B]`` tensors.

:func:`sample_top_k` draws the same for rows that share one small top-k (the code
predictor's residual codebooks: 50 of 2,048 ids) without :func:`sample`'s sort of the
whole vocabulary, one radix sort per codebook on a GPU. It works on the ``k + TIE_ROOM``
best scores that one ``torch.topk`` returns: the k-th best is the top-k threshold, top-p
runs over those values in descending order as before, and the inverse CDF in vocabulary
order is a masked sum over the window (an entry's CDF is the mass of the kept ids at or
before its id) instead of a cumulative sum over every id. The same uniform number picks
the same id; only float sums in another order round differently, and more than
``TIE_ROOM`` ids tying with the k-th best score would keep fewer ids than :func:`sample`
keeps (it keeps every tie).
"""

from __future__ import annotations

import torch

__all__ = ["TIE_ROOM", "sample", "sample_top_k"]

#: ids beyond the k-th best that :func:`sample_top_k` looks at, so that ties with the
#: k-th best score are kept as :func:`sample` keeps them
TIE_ROOM = 14


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


def sample_top_k(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: int,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """:func:`sample` with every row's top-k ``top_k`` (a Python int, 0: none), without a
    sort of the whole vocabulary; see the module docstring."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    is_sampled = temperature > 0
    scores = logits / torch.where(is_sampled, temperature, 1.0).unsqueeze(1)
    k = top_k if 0 < top_k < vocab else vocab
    values, ids = scores.topk(min(vocab, k + TIE_ROOM), dim=-1)  # descending
    threshold = values[:, k - 1 : k]
    candidates = values.masked_fill(values < threshold, float("-inf"))
    probs = torch.softmax(candidates, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    limit = torch.where((top_p > 0) & (top_p < 1), top_p, 2.0).unsqueeze(1)
    outside = (mass_before >= limit) | torch.isinf(candidates)
    kept = candidates.masked_fill(outside, float("inf"))
    threshold = torch.maximum(threshold, kept.min(dim=-1, keepdim=True).values)
    weights = torch.softmax(values.masked_fill(values < threshold, float("-inf")), dim=-1)
    # cdf[b, i]: the kept mass at or before id ids[b, i] in vocabulary order
    at_or_before = ids.unsqueeze(1) <= ids.unsqueeze(2)
    cdf = (weights.unsqueeze(1) * at_or_before).sum(dim=-1)
    target = uniform.unsqueeze(1) * cdf.max(dim=-1, keepdim=True).values
    # the least id whose CDF passes the target (searchsorted, right=True)
    drawn = torch.where(cdf > target, ids, vocab).min(dim=-1).values.clamp_max(vocab - 1)
    return torch.where(is_sampled, drawn, greedy)
