"""Code2Wav window decodes replayed from CUDA graphs, one per (batch, frames) bucket.

A streaming Code2Wav step decodes a few window shapes over and over (4 frames first,
then 25 new frames with up to 25 of context; the last window shorter), each ~2,000
kernel launches eagerly. :class:`GraphedCode2Wav` pads a ``[B, Q, T]`` window up to a
bucket (code 0 in the padding) and replays that bucket's graph. The decoder is causal —
its attention looks back only and its convolutions are left-padded — so samples of the
real frames do not depend on frames after them: the padded decode, cut to the real
window's length (``T·U − holdback`` samples), is the unpadded decode (checked at startup
against an eager decode, and in the tests). Windows larger than every bucket run eagerly.

``buckets`` limits the graphs to the (batch, frames) pairs a memory budget allows
(:func:`~omnirelay.models.runner.memory.bucket_grid` over :func:`decoder_widths`); a batch
with more rows than its frame bucket's largest captured batch is decoded in several
replays of that bucket.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection
from typing import Any

import torch

from omnirelay.errors import ModelError
from omnirelay.models.runner.buckets import bucket
from omnirelay.models.runner.graphs import (
    GraphPool,
    GraphSet,
    Step,
    capture_order,
    graph_memory_errors,
    reserved_bytes,
    upload,
)

__all__ = [
    "CODE2WAV_PRIORITY",
    "DEFAULT_DECODE_BATCHES",
    "DEFAULT_DECODE_FRAMES",
    "GRAPH_MEMORY_ENV",
    "GRAPH_MEMORY_KNOB",
    "GraphedCode2Wav",
    "decoder_widths",
    "graph_budget_bytes",
]

DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16)
#: Environment variable: GiB of activations the largest captured Code2Wav step may take
#: (window and stream graphs alike; they share one pool), default :data:`DEFAULT_GRAPH_GIB`.
GRAPH_MEMORY_ENV = "OMNIRELAY_CODE2WAV_GRAPH_GIB"
DEFAULT_GRAPH_GIB = 1.0
GRAPH_MEMORY_KNOB = (
    f"lower {GRAPH_MEMORY_ENV} (GiB of activations the largest captured Code2Wav step may take, "
    f"default {DEFAULT_GRAPH_GIB:g}), set executor_args.cuda_graphs: false, or free device memory "
    "(gpu_memory_utilization, another device)"
)
#: The CUDA stream priority of Code2Wav's work, captured and launched (lower is sooner:
#: in a device group the stage nearest the client goes first, docs/design.md §12).
CODE2WAV_PRIORITY = -1
#: Largest relative error (‖graph − eager‖ / ‖eager‖) a padded window may show.
PADDING_TOLERANCE = 1e-2
#: 4: a stream's first window; 29 (4 + 25) → 32; 50: 25 new frames + 25 of context.
DEFAULT_DECODE_FRAMES = (4, 8, 16, 32, 50, 64)


def graph_budget_bytes() -> int:
    """The activation budget of the largest captured Code2Wav step (:data:`GRAPH_MEMORY_ENV`)."""
    value = os.environ.get(GRAPH_MEMORY_ENV, "").strip()
    try:
        gib = float(value) if value else DEFAULT_GRAPH_GIB
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ModelError(f"{GRAPH_MEMORY_ENV} must be a number of GiB >= 0, got {value!r}")
    return int(gib * 2**30)


def decoder_widths(model: Any) -> list[tuple[int, int]]:
    """Each up-sampling layer's output of a Code2Wav decoder as ``(channels, samples per
    frame)``: what its step's activations grow with (the widest one decides the peak)."""
    factor, widths = 1, []
    for up, _ in model.upsample:
        factor *= int(up.conv.stride[0])
        widths.append((int(up.conv.out_channels), factor))
    blocks = list(model.decoder)
    widths.append((int(blocks[0].conv.out_channels), factor))
    for block in blocks[1:-2]:
        trans = block.block[1]
        factor *= int(trans.conv.stride[0])
        widths.append((int(trans.conv.out_channels), factor))
    return widths


class GraphedCode2Wav:
    """``__call__(codes [B, Q, T]) -> [B, 1, samples]``, like the model itself."""

    def __init__(
        self,
        model: Any,
        *,
        cuda_graphs: bool,
        batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCHES,
        frames: tuple[int, ...] = DEFAULT_DECODE_FRAMES,
        buckets: Collection[tuple[int, int]] | None = None,
        pool: GraphPool | None = None,
    ) -> None:
        """``buckets``: the (batch, frames) pairs to capture (None: all); ``pool``: the
        graphs' memory pool, shared with the stage's other graphs (None: their own)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.config = model.config
        self.upsample = int(model.total_upsample)
        self.batch_sizes = batch_sizes
        self.frames = frames
        self.graphs = GraphSet(
            "code2wav", self.device, enabled=cuda_graphs, pool=pool, priority=CODE2WAV_PRIORITY
        )
        self._buckets = None if buckets is None else frozenset(buckets)
        q = int(model.config.num_quantizers)
        self._codes = torch.zeros((batch_sizes[-1], q, frames[-1]), dtype=torch.long, device=self.device)
        #: relative error of a padded graph decode against the eager one (startup check)
        self.padding_error = float("inf")

    def capture_graphs(self) -> None:
        if not self.graphs.enabled:
            return
        start = time.monotonic()
        before = reserved_bytes(self.device)
        with torch.inference_mode(), graph_memory_errors(self.graphs, GRAPH_MEMORY_KNOB):
            for b, t in capture_order(self.batch_sizes, self.frames, self._buckets):
                self.graphs.capture((b, t), self._step(b, t))
            self._check_padding()
        self.graphs.report.seconds = time.monotonic() - start
        self.graphs.report.pool_bytes = reserved_bytes(self.device) - before
        print(
            f"omnirelay: {self.graphs.report} (padded window vs eager: relative error {self.padding_error:.1e})",
            file=sys.stderr,
            flush=True,
        )

    def _step(self, b: int, t: int) -> Step:
        def step() -> dict[str, torch.Tensor]:
            return {"wav": self.model(self._codes[:b, :, :t])}

        return step

    def _check_padding(self) -> None:
        """A padded graph decode must equal the eager decode of the real window; if it
        does not (a decoder that looks ahead), the graphs are dropped, with a warning.
        Equal means within :data:`PADDING_TOLERANCE` relative error: other shapes pick
        other convolution algorithms, and TF32 ones differ in the last bits."""
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, int(self.config.codebook_size), (2, self._codes.shape[1], 5), generator=gen)
        eager = self.model(codes.to(self.device))
        graphed = self(codes)
        if graphed.shape == eager.shape:
            self.padding_error = float((graphed - eager).norm() / eager.norm().clamp_min(1e-12))
        if self.padding_error > PADDING_TOLERANCE:
            self.graphs.clear()
            print(
                f"omnirelay: warning: a right-padded Code2Wav window decodes differently from the window "
                f"itself (relative error {self.padding_error:.2g}: the decoder is not causal); Code2Wav runs "
                "without CUDA graphs",
                file=sys.stderr,
                flush=True,
            )

    def max_rows(self, frames: int) -> int:
        """The largest batch captured for the frame bucket (0: none)."""
        return max((b for b in self.batch_sizes if (b, frames) in self.graphs), default=0)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        n, q, t = codes.shape
        frames = bucket(t, self.frames)
        rows = 0 if frames is None else self.max_rows(frames)
        if 0 < rows < n:  # more rows than a captured batch: several replays
            # Each piece copied: the next replay writes the same graph's output.
            return torch.cat([self(codes[k : k + rows]).clone() for k in range(0, n, rows)])
        b = bucket(n, self.batch_sizes)
        if b is None or frames is None or (b, frames) not in self.graphs:
            wav: torch.Tensor = self.model(codes.to(self.device))
            return wav
        block = torch.zeros((b, q, frames), dtype=torch.long)
        block[:n, :, :t] = codes
        upload(self._codes[:b, :, :frames], block)  # a pageable copy would wait for the stream
        out = self.graphs.run((b, frames), self._step(b, frames))["wav"]
        holdback = frames * self.upsample - out.shape[-1]
        return out[:n, :, : t * self.upsample - holdback]
