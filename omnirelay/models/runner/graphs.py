"""CUDA graphs of fixed-shape steps, captured once at startup and replayed per step.

:class:`GraphSet` holds one graph per key (a bucket shape). :meth:`GraphSet.capture`
runs the step once eagerly on a side stream (lazy initialisation: kernels, workspaces),
then records it; :meth:`GraphSet.run` replays the graph if one was captured for the key,
else runs the step eagerly — the same function, so eager and graph results are the same
computation. Every graph of a set shares one memory pool: the runner replays one graph at
a time and copies what it needs out of a graph's outputs before the next replay (a later
graph may reuse the memory of an earlier one's intermediates).

Inputs and outputs: the step reads only the tensors it is given (views of buffers the
runner allocated once, so replays see the values copied into them) and returns a dict of
tensors that live in the pool.

Streams (docs/design.md §12). Each set warms up and captures on a stream of its own
(:func:`own_stream`), never on torch's one default capture stream: PyTorch keeps a cuBLAS
workspace per (handle, stream), and a graph replays with the workspace its capture stream
had — so graphs of several sets captured on one stream share one workspace, which two
stages of a device group, replaying on two streams at once, would both write. Warmed up
on its capture stream, a set's workspace is allocated there, outside the graph pool.
A graph's kernels also keep the capture stream's priority (torch instantiates graphs
with per-node priorities), so a set captures at the priority it replays at.

Sets of one stage that replay in turn on its one stream may share a pool
(:class:`GraphPool`), and then share its capture stream too: the caching allocator gives
an allocation only a block freed on the allocation's own stream, so a set capturing on a
stream of its own would find none of the blocks the other set's captures freed, and the
pool would grow to the sum of the sets' peaks instead of the larger.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.errors import ModelError

__all__ = [
    "CaptureReport",
    "GraphPool",
    "GraphSet",
    "Step",
    "StreamOwners",
    "capture_order",
    "graph_memory_errors",
    "own_stream",
    "reserved_bytes",
    "to_device",
    "upload",
    "uploaded",
    "used_here",
]

Step = Callable[[], dict[str, torch.Tensor]]


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the host tensor ``src`` into the device buffer ``dst`` without blocking the
    host: from pinned memory, ordered on the stream before the next replay, so the host
    prepares a step while the device still runs the last one (the caching host allocator
    keeps ``src``'s pinned block until the copy has run). Off CUDA: a plain copy."""
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def uploaded(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on ``device`` holding ``host``, copied as :func:`upload` does."""
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    upload(out, host)
    return out


def used_here(x: torch.Tensor) -> torch.Tensor:
    """``x``, marked as read by the current CUDA stream when it lives on a CUDA device
    (``record_stream``): a tensor another stream made (another stage's output, handed by
    reference) keeps its memory until this stream's work on it ran, whenever its last
    reference goes. Elsewhere ``x`` as it is."""
    if x.is_cuda:
        x.record_stream(torch.cuda.current_stream(x.device))
    return x


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied as :func:`upload` does."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


class StreamOwners:
    """Streams handed to one owner each. torch hands its streams out of a small pool in
    turn (32 per priority), so two callers of ``torch.cuda.Stream()`` may get the same
    stream; :meth:`take` asks again until the stream is one nobody holds. A stream is
    held while the object :meth:`take` returned lives (its owner keeps it: a graph set
    with its graphs, a stage's executor)."""

    def __init__(self, max_tries: int = 64) -> None:
        self.max_tries = max_tries
        self._held: set[tuple[int, int]] = set()

    def take(self, make: Callable[[], Any]) -> Any:
        """A stream from ``make()`` (a ``torch.cuda.Stream`` factory) that no live
        :meth:`take` result is; :class:`ModelError` when the pool has none left."""
        for _ in range(self.max_tries):
            stream = make()
            key = (int(stream.device_index), int(stream.cuda_stream))
            if key not in self._held:
                self._held.add(key)
                try:
                    # Not at interpreter exit: nothing is left to hand out then.
                    weakref.finalize(stream, self._held.discard, key).atexit = False
                except TypeError:  # a stream type without weak references: held for good
                    pass
                return stream
        raise ModelError(
            f"no CUDA stream is left that another stage of this process does not already hold "
            f"({len(self._held)} held)"
        )

    def __len__(self) -> int:
        return len(self._held)


_OWNERS = StreamOwners()


def capture_order(
    batch_sizes: Iterable[int], frames: Iterable[int], only: Collection[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """The ``(rows, frames)`` buckets of ``batch_sizes × frames`` (those in ``only``, when
    given) in capture order: the largest step (rows × frames) first. The graphs of a set
    share one pool, and the caching allocator gives a capture a block freed by an earlier
    capture only when the block is large enough: captured smallest first, each larger
    step takes new segments and the smaller ones stay, so the pool grows to about the sum
    of the steps' peaks; captured largest first, the smaller steps fit in the blocks the
    largest freed."""
    grid = [(b, t) for t in frames for b in batch_sizes if only is None or (b, t) in only]
    return sorted(grid, key=lambda bucket: (-bucket[0] * bucket[1], -bucket[1], -bucket[0]))


def own_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A CUDA stream on ``device`` that no other caller holds: a graph set's capture
    stream, a stage's launch stream (see the module docstring)."""
    stream: torch.cuda.Stream = _OWNERS.take(lambda: torch.cuda.Stream(device=device, priority=priority))
    return stream


def reserved_bytes(device: torch.device) -> int:
    """What the caching allocator holds on ``device`` once its unused cache is freed
    (graph pools stay held): measured before and after a capture, the graphs' pools."""
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    is_cuda_error = accelerator_error is not None and isinstance(exc, accelerator_error)
    return (is_cuda_error or isinstance(exc, RuntimeError)) and "out of memory" in str(exc)


@contextmanager
def graph_memory_errors(graphs: GraphSet, knob: str) -> Iterator[None]:
    """A CUDA out-of-memory error inside (a set's capture) becomes one line: the set,
    the bucket it was capturing, the device's free memory, and ``knob`` (what to change)."""
    try:
        yield
    except Exception as exc:
        if not _is_out_of_memory(exc):
            raise
        try:
            free, total = torch.cuda.mem_get_info(graphs.device)
            where = f"{free / 2**30:.2f} GiB of {total / 2**30:.1f} GiB free"
        except Exception:  # the device may refuse calls after a failed capture
            where = "device memory unknown"
        raise ModelError(
            f"{graphs.name}: the CUDA graph of bucket {graphs.capturing} ran out of device memory "
            f"({graphs.report.num_graphs} captured before it; {where}): {knob}"
        ) from None


@dataclass
class CaptureReport:
    """What a set's capture took (logged at startup, kept for the stage's health)."""

    name: str
    num_graphs: int = 0
    seconds: float = 0.0
    keys: list[Any] = field(default_factory=list)
    #: device memory the capture kept (the pool's growth; None: not measured)
    pool_bytes: int | None = None

    def __str__(self) -> str:
        pool = "" if self.pool_bytes is None else f", graph pool +{self.pool_bytes / 2**30:.2f} GiB"
        return f"{self.name}: {self.num_graphs} CUDA graphs captured in {self.seconds:.1f} s{pool}"


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    outputs: dict[str, torch.Tensor]


class GraphPool:
    """One memory pool and the one stream its sets capture on (see the module docstring):
    for the graph sets of one stage, replayed in turn on one stream."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._stream: torch.cuda.Stream | None = None

    def stream(self, device: torch.device, priority: int) -> torch.cuda.Stream:
        """The pool's capture stream (:func:`own_stream`, made by the first set to capture)."""
        if self._stream is None:
            self._stream = own_stream(device, priority)
        return self._stream


class GraphSet:
    """Graphs by key on one CUDA device (or none: ``enabled=False`` runs everything eagerly)."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        *,
        enabled: bool,
        pool: GraphPool | None = None,
        priority: int = 0,
    ) -> None:
        """``pool``: a memory pool and capture stream shared with other sets whose graphs
        replay in turn with these, at the same priority (None: a pool and stream of its own);
        ``priority``: the priority of the stream the graphs are captured on (that of the
        stream they replay on)."""
        self.name = name
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Hashable, _Graph] = {}
        #: the pool and capture stream (a shared one, or the set's own; None when disabled)
        self._pool = (pool if pool is not None else GraphPool()) if self.enabled else None
        self.report = CaptureReport(name)
        self.num_replays = 0
        self.num_eager = 0
        #: the key being captured (None: none; named when a capture fails)
        self.capturing: Hashable | None = None
        #: run every step eagerly even where a graph exists (to time or check the eager path)
        self.bypass = False
        self.priority = priority
        #: the stream this set warms up and captures on (:func:`own_stream`; made at the first capture)
        self.stream: torch.cuda.Stream | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph: from now on every step runs eagerly."""
        self._graphs.clear()
        self.enabled = False

    def capture(self, key: Hashable, step: Step) -> None:
        """Warm ``step`` up once, then record it under ``key`` (no-op when disabled)."""
        pool = self._pool
        if not self.enabled or pool is None or key in self._graphs:
            return
        start = time.monotonic()
        self.capturing = key
        if self.stream is None:
            self.stream = pool.stream(self.device, self.priority)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()  # on the capture stream: its cuBLAS workspace is allocated now, outside the pool
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # The warm-up's activations are cached outside the pool: free them for the capture.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the stage process (transfers) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=pool.handle, stream=stream, capture_error_mode="thread_local"):
            outputs = step()
        self._graphs[key] = _Graph(graph, outputs)
        self.capturing = None
        self.report.num_graphs += 1
        self.report.seconds += time.monotonic() - start
        self.report.keys.append(key)

    def run(self, key: Hashable, step: Step) -> dict[str, torch.Tensor]:
        """The graph's outputs after a replay, or ``step()``'s when no graph has ``key``."""
        captured = None if self.bypass else self._graphs.get(key)
        if captured is None:
            self.num_eager += 1
            return step()
        captured.graph.replay()
        self.num_replays += 1
        return captured.outputs
