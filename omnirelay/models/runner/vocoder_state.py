"""The streaming Code2Wav decoder's per-stream state in one buffer (:mod:`omnirelay.models.runner.vocoder`).

One row per slot holds all of a stream's state: each causal convolution's history
(``channels × width`` samples), then each transformer layer's cached keys and values side
by side (``2 × kv heads × (W − 1) × head_dim``). A step costs launches, not bytes
(docs/performance.md), so the row layout lets a step read its rows' histories in one
gather (:meth:`StreamState.read`) and write them back in one scatter
(:meth:`StreamState.write_histories`). The keys and values are most of the bytes (a row's
histories are a tenth of them): they are read and written layer by layer
(:meth:`StreamState.read_kv`, :meth:`StreamState.write_kv`), so that a step holds one
layer's copy at a time, as its activation budget assumes (docs/design.md §12). A stream
moving to another slot is one row copied (:meth:`StreamState.move`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["StreamState"]


class StreamState:
    """``rows`` rows of state: the histories of ``shapes`` (each ``(channels, width)``),
    then ``kv[0]`` layers of keys and values of shape ``kv[1:]``."""

    def __init__(
        self,
        rows: int,
        shapes: Sequence[tuple[int, int]],
        kv: tuple[int, ...],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = list(shapes)
        self.offsets: list[int] = []
        offset = 0
        for c, w in self.shapes:
            self.offsets.append(offset)
            offset += c * w
        self.history_size = offset
        per_layer = math.prod(kv[1:])
        self.kv_shape = tuple(kv[1:])
        self.spans = [(offset + li * per_layer, offset + (li + 1) * per_layer) for li in range(kv[0])]
        self.buffer = torch.zeros((rows, offset + kv[0] * per_layer), dtype=dtype, device=device)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The histories of ``rows`` (slot indices), one gather: ``[B, histories' size]``."""
        return self.buffer[:, : self.history_size].index_select(0, rows)

    def read_kv(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s keys and values of ``rows``: ``[B, *kv shape]``."""
        return self._kv_view(layer).index_select(0, rows)

    def history(self, state: torch.Tensor, index: int) -> torch.Tensor:
        """History ``index`` of a :meth:`read` result: ``[B, channels, width]`` (a view)."""
        c, w = self.shapes[index]
        offset = self.offsets[index]
        return state[:, offset : offset + c * w].view(state.shape[0], c, w)

    def write_histories(self, slots: torch.Tensor, histories: Sequence[torch.Tensor]) -> None:
        """Every history's new state (in index order, each ``[B, channels, width]``) into
        the rows ``slots``, one scatter."""
        b = histories[0].shape[0]
        flat = torch.cat([h.reshape(b, -1) for h in histories], dim=1)
        self.buffer[:, : self.history_size].index_copy_(0, slots, flat)

    def write_kv(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Layer ``layer``'s new keys and values (``[B, *kv shape]``) into the rows ``slots``."""
        self._kv_view(layer).index_copy_(0, slots, kv)

    def _kv_view(self, layer: int) -> torch.Tensor:
        start, end = self.spans[layer]
        return self.buffer[:, start:end].view(self.buffer.shape[0], *self.kv_shape)

    def move(self, src: int, dst: int) -> None:
        self.buffer[dst].copy_(self.buffer[src])
