"""Per-request KV caches of one decoder, stacked into a left-padded batch for decode steps.

* :class:`KVPool` — owns every live request's keys/values, keyed by internal id.
  :meth:`~KVPool.prefill_cache` hands out one request's batch-1 cache (a prefill, a
  chunked prefill, or an unbatched step) and :meth:`~KVPool.store` takes it back;
  :meth:`~KVPool.decode_batch` returns one cache for several requests, left-padded to a
  common length, with its attention mask and each row's next position;
  :meth:`~KVPool.commit_decode` records that every row grew by one token;
  :meth:`~KVPool.drop` frees a request.

Why a group: stacking per-request caches copies all of their keys and values. A decode
batch of the same requests in the same order as the last one (the steady state of a
batch that is not changing) reuses the stacked cache as it is, so a step costs no copy.
Any other batch dissolves the group back into per-request caches (padding stripped) and
stacks the new one. Left padding keeps each row's real tokens contiguous at the right
edge; the mask hides the padding, and positions count real tokens only, so a padded row
computes what it would compute alone (up to floating-point summation order).

Invariant: a request's KV lives in exactly one place — its own entry, the group, or (between
``prefill_cache`` and ``store``) the caller's hands, when the pool forgets its length.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

__all__ = ["KVPool", "cache_keyword"]

_LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, heads, length, head_dim]


@dataclass(slots=True)
class _Group:
    ids: tuple[str, ...]
    cache: DynamicCache
    #: [B, L]: 1 for real positions, 0 for left padding.
    mask: torch.Tensor


def cache_keyword(module: torch.nn.Module) -> str:
    """The KV-cache keyword of a ``transformers`` decoder's ``forward``: ``cache`` in newer
    releases, ``past_key_values`` before (passing the old name to a new release warns)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _cache_from(layers: list[_LayerKV]) -> DynamicCache:
    cache = DynamicCache()
    for idx, (keys, values) in enumerate(layers):
        cache.update(keys, values, idx)
    return cache


def _layers_of(cache: DynamicCache) -> list[_LayerKV]:
    layers: list[Any] = list(cache.layers)  # DynamicLayer: .keys / .values [B, heads, L, dim]
    out = []
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4:  # an untouched layer holds no 4-D tensor yet
            out.append((keys, layer.values))
    return out


class KVPool:
    """KV caches by request id; see the module docstring. Used by one thread."""

    def __init__(self) -> None:
        self._single: dict[str, list[_LayerKV]] = {}
        self._lengths: dict[str, int] = {}
        self._group: _Group | None = None

    def __contains__(self, internal_id: object) -> bool:
        return internal_id in self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def length(self, internal_id: str) -> int:
        """Tokens cached for the request (0 if unknown)."""
        return self._lengths.get(internal_id, 0)

    @property
    def num_grouped(self) -> int:
        return 0 if self._group is None else len(self._group.ids)

    # ---- batch-1 use

    def prefill_cache(self, internal_id: str) -> DynamicCache:
        """The request's cache as a batch of one (empty for a new request). Pair with
        :meth:`store` after the forward pass."""
        if self._group is not None and internal_id in self._group.ids:
            self._dissolve()
        # Taken out until stored back: if the forward pass fails, the request has no KV.
        self._lengths.pop(internal_id, None)
        return _cache_from(self._single.pop(internal_id, []))

    def store(self, internal_id: str, cache: DynamicCache) -> None:
        """Take back a batch-1 cache (after a forward pass extended it)."""
        layers = _layers_of(cache)
        self._single[internal_id] = layers
        self._lengths[internal_id] = layers[0][0].shape[-2] if layers else 0

    def truncate(self, internal_id: str, length: int) -> None:
        """Keep the first ``length`` cached tokens (a recompute from an earlier point)."""
        if internal_id not in self._lengths or length >= self._lengths[internal_id]:
            return
        if self._group is not None and internal_id in self._group.ids:
            self._dissolve()
        layers = self._single[internal_id]
        self._single[internal_id] = [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in layers]
        self._lengths[internal_id] = length

    # ---- batched decode

    def decode_batch(self, internal_ids: list[str]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """One cache for ``internal_ids`` (in this order), the attention mask for one new
        token per row ``[B, L + 1]``, and each row's position ``[B, 1]``. Every id must
        have been prefilled. Pair with :meth:`commit_decode` after the forward pass."""
        ids = tuple(internal_ids)
        if self._group is None or self._group.ids != ids:
            self._dissolve()
            self._group = self._stack(ids)
        group = self._group
        ones = group.mask.new_ones((len(ids), 1))
        mask = torch.cat([group.mask, ones], dim=1)
        positions = torch.tensor([[self._lengths[i]] for i in ids], dtype=torch.long, device=mask.device)
        return group.cache, mask, positions

    def commit_decode(self, internal_ids: list[str]) -> None:
        """Every row of the current group cached one more token."""
        group = self._group
        assert group is not None and group.ids == tuple(internal_ids), "commit_decode without decode_batch"
        group.mask = torch.cat([group.mask, group.mask.new_ones((len(group.ids), 1))], dim=1)
        for i in group.ids:
            self._lengths[i] += 1
        # Invariant: the stacked cache is exactly as long as the mask.
        assert group.cache.get_seq_length() == group.mask.shape[1], (
            group.cache.get_seq_length(),
            group.mask.shape,
        )

    def drop(self, internal_id: str) -> None:
        """Free the request's KV (idempotent)."""
        if self._group is not None and internal_id in self._group.ids:
            self._dissolve()
        self._single.pop(internal_id, None)
        self._lengths.pop(internal_id, None)

    # ---- stacking

    def _stack(self, ids: tuple[str, ...]) -> _Group:
        rows = [self._single.pop(i) for i in ids]
        lengths = [self._lengths[i] for i in ids]
        width = max(lengths)
        num_layers = len(rows[0])
        cache = DynamicCache()
        for layer in range(num_layers):
            keys, values = [], []
            for row, n in zip(rows, lengths):
                k, v = row[layer]
                pad = width - n
                if pad:
                    k = torch.cat([k.new_zeros((*k.shape[:2], pad, k.shape[3])), k], dim=2)
                    v = torch.cat([v.new_zeros((*v.shape[:2], pad, v.shape[3])), v], dim=2)
                keys.append(k)
                values.append(v)
            cache.update(torch.cat(keys, dim=0), torch.cat(values, dim=0), layer)
        device = rows[0][0][0].device
        mask = torch.zeros((len(ids), width), dtype=torch.long, device=device)
        for b, n in enumerate(lengths):
            mask[b, width - n :] = 1
        return _Group(ids=ids, cache=cache, mask=mask)

    def _dissolve(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        layers = _layers_of(group.cache)
        width = group.mask.shape[1]
        for b, i in enumerate(group.ids):
            start = width - self._lengths[i]
            self._single[i] = [
                (k[b : b + 1, :, start:].clone(), v[b : b + 1, :, start:].clone()) for k, v in layers
            ]
