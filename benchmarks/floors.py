"""A step's floor: the bytes it must read, divided by the card's memory bandwidth.

A decode step reads every weight of the layers it runs once (for a mixture of experts:
the experts its batch routes to), and the cached keys and values of each row up to the
row's length; at batch sizes where the step is bandwidth-bound nothing can run faster
than ``bytes ÷ bandwidth``. The benchmarks report, per step, those bytes, the floor, the
measured time over the floor (the ratio) and the kernels the step launches.

* :func:`copy_bandwidth` — the card's bandwidth, measured at the start of a run: a
  1 GiB device→device copy (on the CPU a smaller memcpy), counting read and write;
* :func:`param_bytes`, :func:`kv_bytes_per_position` — what a step reads;
* :class:`RoutedExperts` — the distinct experts a forward pass routes to, per layer
  (from each router's top-k), and the bytes of those experts;
* :func:`talker_tail_bytes` — what a Talker frame's code-predictor tail reads;
* :func:`count_kernels` — kernels per step from ``torch.profiler`` (on the CPU: the
  ``aten`` operators, the launches' counterpart there);
* :func:`floor` — bytes, bandwidth and a measured time as the reported figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "RoutedExperts",
    "copy_bandwidth",
    "count_kernels",
    "floor",
    "is_experts",
    "kernel_census",
    "kv_bytes_per_position",
    "param_bytes",
    "profiled",
    "talker_tail_bytes",
]

#: Bytes copied to measure a GPU's bandwidth (as docs/performance.md's figures).
GPU_COPY_BYTES = 1 << 30
#: Bytes copied on the CPU: enough to leave the caches, small enough for a test.
CPU_COPY_BYTES = 64 << 20


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes per second a device→device copy of ``nbytes`` moves, counting the read and
    the write (median of ``reps`` after one uncounted copy)."""
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dst.copy_(src)
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the 2 GiB back: the KV cache sizes itself from the free memory
    return 2.0 * nbytes / max(statistics.median(times), 1e-9)


def is_experts(module: torch.nn.Module) -> bool:
    """A mixture-of-experts weight bank (``transformers``' ``*Experts`` modules)."""
    return type(module).__name__.endswith("Experts")


def param_bytes(modules: Iterable[torch.nn.Module | None], *, skip_experts: bool = True) -> int:
    """Bytes of the parameters of ``modules`` (each counted once; expert banks left out
    when ``skip_experts``: a step reads only the experts it routes to)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        skipped = {id(p) for m in module.modules() if skip_experts and is_experts(m) for p in m.parameters()}
        for p in module.parameters():
            if id(p) in seen or id(p) in skipped:
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Keys and values of one cached position across all layers."""
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * int(config.num_hidden_layers) * int(config.num_key_value_heads) * head_dim * dtype.itemsize


class RoutedExperts:
    """Records, while active (``with``), which experts each router under ``model`` picks;
    :attr:`distinct` per layer and :meth:`nbytes` of those experts. Hooks run only in an
    eager pass (a CUDA graph replay runs no Python): run the step once with its graphs
    bypassed inside the block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers: list[torch.nn.Module] = []
        self._banks: list[torch.nn.Module] = []
        for module in model.modules():
            gate = getattr(module, "gate", None)
            experts = getattr(module, "experts", None)
            if gate is not None and experts is not None and is_experts(experts):
                self._routers.append(gate)
                self._banks.append(experts)
        self.chosen: list[set[int]] = [set() for _ in self._routers]
        self._handles: list[Any] = []

    def __len__(self) -> int:
        return len(self._routers)

    def __enter__(self) -> RoutedExperts:
        self.chosen = [set() for _ in self._routers]
        for i, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            indices = output[-1] if isinstance(output, tuple) else output
            self.chosen[i].update(int(e) for e in indices.reshape(-1).unique().tolist())

        return hook

    @property
    def distinct(self) -> list[int]:
        """Distinct experts routed to, per MoE layer."""
        return [len(c) for c in self.chosen]

    def nbytes(self) -> int:
        """Bytes of the experts routed to (each expert's share of its layer's bank)."""
        total = 0
        for bank, chosen in zip(self._banks, self.chosen):
            num = int(getattr(bank, "num_experts", 0) or next(iter(bank.parameters())).shape[0])
            total += param_bytes([bank], skip_experts=False) * len(chosen) // max(num, 1)
        return total


def count_kernels(
    fn: Callable[[], Any], sync: Callable[[], None], device: torch.device, steps: int = 3
) -> float:
    """Kernels per call of ``fn`` (the mean of ``steps`` profiled calls after one
    unprofiled): CUDA kernels on a GPU, ``aten`` operators on the CPU."""
    on_device = device.type == "cuda"
    count = 0
    for event in _profile(fn, sync, device, steps).events():
        if on_device:
            count += int(event.device_type.name == "CUDA")
        else:  # an operator that calls no other (``aten::linear`` is its ``addmm``)
            count += int(
                event.name.startswith("aten::")
                and not any(c.name.startswith("aten::") for c in event.cpu_children)
            )
    return count / steps


def profiled(fn: Callable[[], Any], sync: Callable[[], None], device: torch.device, steps: int) -> Any:
    """``key_averages()`` of ``steps`` calls of ``fn`` under ``torch.profiler`` (after one
    unprofiled call)."""
    return _profile(fn, sync, device, steps).key_averages()


def _profile(fn: Callable[[], Any], sync: Callable[[], None], device: torch.device, steps: int) -> Any:
    """The profiler that saw ``steps`` calls of ``fn`` (after one unprofiled call): the
    host's operators, and on a GPU its kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync()
    return prof


def kernel_census(
    fn: Callable[[], Any], sync: Callable[[], None], device: torch.device, steps: int = 3
) -> dict[str, dict[str, float]]:
    """Kernels and device ms per call of ``fn`` by family (:func:`benchmarks.kernels.census`)."""
    from benchmarks.kernels import census, kernel_rows

    return census(kernel_rows(profiled(fn, sync, device, steps), device.type == "cuda"), steps)


def talker_tail_bytes(runner: Any) -> int:
    """Bytes a Talker frame's tail reads (:class:`~omnirelay.models.runner.predictor.CodePredictor`):
    the codec head, the code predictor's layers once per pass (``Q`` passes), and the
    ``Q − 1`` codebook heads."""
    predictor = runner.predictor
    per_pass = param_bytes([*predictor.layers, predictor.model.norm, predictor.projection])
    heads = list(runner.talker.code_predictor.lm_head)[: runner.q - 1]
    return runner.q * per_pass + param_bytes([runner.talker.codec_head, *heads])


def floor(nbytes: int, bandwidth: float, measured_ms: float) -> dict[str, float]:
    """``bytes``, ``floor_ms`` (bytes ÷ bandwidth) and ``ratio`` (measured ÷ floor)."""
    floor_ms = 1000.0 * nbytes / bandwidth if bandwidth > 0 else 0.0
    return {
        "bytes": float(nbytes),
        "floor_ms": floor_ms,
        "ratio": measured_ms / floor_ms if floor_ms > 0 else 0.0,
    }
