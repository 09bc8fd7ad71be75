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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.errors import ModelError

__all__ = [
    "CaptureReport",
    "GraphSet",
    "Step",
    "graph_memory_errors",
    "reserved_bytes",
    "to_device",
    "upload",
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


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied as :func:`upload` does."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


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


class GraphSet:
    """Graphs by key on one CUDA device (or none: ``enabled=False`` runs everything eagerly)."""

    def __init__(self, name: str, device: torch.device, *, enabled: bool, pool: Any = None) -> None:
        """``pool``: a memory pool (``torch.cuda.graph_pool_handle()``) shared with other
        sets whose graphs replay in turn with these (None: a pool of its own)."""
        self.name = name
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool = (pool if pool is not None else torch.cuda.graph_pool_handle()) if self.enabled else None
        self.report = CaptureReport(name)
        self.num_replays = 0
        self.num_eager = 0
        #: the key being captured (None: none; named when a capture fails)
        self.capturing: Hashable | None = None
        #: run every step eagerly even where a graph exists (to time or check the eager path)
        self.bypass = False

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
        if not self.enabled or key in self._graphs:
            return
        start = time.monotonic()
        self.capturing = key
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # The warm-up's activations are cached outside the pool: free them for the capture.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the stage process (transfers) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
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
