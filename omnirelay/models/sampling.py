"""Token sampling shared by the AR executors: greedy, temperature, top-k, top-p.

* :func:`make_generator` — one ``torch.Generator`` per request: seeded from
  ``SamplingParams.seed`` (reproducible), else from the OS.
* :func:`sample_rows` — one token per row of ``logits [B, V]``, each row with its own
  parameters and generator. The filtering runs on the whole batch at once; each row
  then draws one uniform number from its own generator and inverts its CDF (in
  vocabulary order), so a request samples the same tokens whether it runs alone or
  batched with others. Top-k and top-p keep every token tied with their threshold.
* :func:`suppress` — mask token ids that must never be sampled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from omnirelay.engine.interfaces import SamplingParams

__all__ = ["make_generator", "sample_rows", "suppress"]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request (its uniform draws; sampling math stays on device)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def suppress(logits: torch.Tensor, start: int, stop: int, keep: Sequence[int] = ()) -> torch.Tensor:
    """``logits`` with ids ``[start, stop)`` set to −inf except ``keep`` (in place; returned)."""
    if start < stop:
        kept = {k: logits[..., k].clone() for k in keep if start <= k < stop}
        logits[..., start:stop] = float("-inf")
        for k, value in kept.items():
            logits[..., k] = value
    return logits


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float | None = None,
) -> list[int]:
    """Sample one id per row of ``logits [B, V]``.

    ``top_k``/``top_p``/``temperature`` override every row's own (the Talker's code
    predictor uses fixed ones); a row whose request is greedy (temperature 0) stays greedy.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), logits.shape
    greedy = logits.argmax(dim=-1)
    temps = [p.temperature if temperature is None or p.temperature <= 0 else temperature for p in params]
    sampled_rows = [b for b, t in enumerate(temps) if t > 0]
    out = greedy.tolist()
    if not sampled_rows:
        return [int(t) for t in out]
    rows = torch.tensor(sampled_rows, device=logits.device)
    scores = logits.index_select(0, rows).float()
    scores = scores / torch.tensor([temps[b] for b in sampled_rows], device=scores.device).unsqueeze(1)
    ks = [params[b].top_k if top_k is None else top_k for b in sampled_rows]
    ps = [params[b].top_p if top_p is None else top_p for b in sampled_rows]
    vocab = scores.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    needs_top_p = any(0.0 < p < 1.0 for p in ps)
    if min(ks) < vocab or needs_top_p:
        # Thresholds come from *values* only (the k-th best score, the least score inside
        # the top-p mass), never from an order of tied tokens: a row's kept set is the same
        # whatever else is in the batch. A full sort only when a row wants top-p over all.
        kmax = max(ks)
        values = (
            torch.topk(scores, kmax, dim=-1).values
            if kmax < vocab
            else scores.sort(dim=-1, descending=True).values
        )
        k_index = torch.tensor([k - 1 for k in ks], device=scores.device).unsqueeze(1)
        threshold = values.gather(1, k_index)
        if needs_top_p:
            candidates = values.masked_fill(values < threshold, float("-inf"))
            probs = torch.softmax(candidates, dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            limits = [p if 0.0 < p < 1.0 else 2.0 for p in ps]
            p_limit = torch.tensor(limits, device=scores.device).unsqueeze(1)
            outside = (mass_before >= p_limit) | torch.isinf(candidates)
            kept = candidates.masked_fill(outside, float("inf"))
            threshold = torch.maximum(threshold, kept.min(dim=-1, keepdim=True).values)
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    # Inverse CDF in vocabulary order with one uniform draw from the row's own generator.
    cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1)
    uniform = torch.cat([torch.rand(1, generator=generators[b]) for b in sampled_rows]).to(cdf.device)
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True)
    tokens = position.clamp_max(vocab - 1).squeeze(1).tolist()
    for b, token in zip(sampled_rows, tokens):
        out[b] = token
    return [int(t) for t in out]
