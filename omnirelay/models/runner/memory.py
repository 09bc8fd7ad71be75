"""KV slots sized from the device memory a process's stages leave (docs/design.md §12).

A runner's KV cache holds a fixed number of *slots* (one per request at once), each
``max_model_len`` positions long. Where the stages of a process share one CUDA device
(a device group, or a stage alone on its device), the slot counts are not fixed numbers
but what fits:

1. every stage builds its weights (its runner waits: :func:`provision` hands it to the
   process's :class:`DeviceBudget` instead of building it);
2. :meth:`DeviceBudget.finish` measures the memory in use, and :func:`plan_slots` gives
   each stage its slots: the memory the pipeline may use (``gpu_memory_utilization`` of
   the device's total) minus what is in use, minus each stage's estimate of its graph
   pools and activations, divided by the bytes one slot costs in *every* stage that sizes
   from memory — a request holds a slot in each stage it passes, so they all get the same
   count — capped by the smallest ``max_num_seqs`` among them;
3. each runner allocates its KV for that count, then each captures its graphs (after all
   KV, so no graph pool is counted twice or missed by the sizing).

A stage whose ``executor_args.max_num_seqs`` is given keeps that count (its memory is
taken first, whether or not it fits the share; its allocation checks the free memory). One startup line per stage: weights,
KV slots × positions, graph pools. When not even one slot fits, one line names the
shortfall and the settings that change it.

:func:`plan_slots` is pure (tested on the CPU with made-up figures); the rest touches the
device only in :meth:`DeviceBudget.finish`.

A stage that captures its graphs in its build (Code2Wav) is measured as in use by the
sizing, so its graphs are bounded before: :func:`bucket_grid` keeps the (rows, frames)
buckets whose step's activations (:func:`peak_activation_bytes` per row and frame) fit a
budget (docs/design.md §12).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnirelay.errors import ModelError

__all__ = [
    "CudaMemory",
    "DeviceBudget",
    "DeviceMemory",
    "SlotNeed",
    "activate",
    "active_budget",
    "bucket_grid",
    "decoder_reserve_bytes",
    "decoder_slot_bytes",
    "module_bytes",
    "peak_activation_bytes",
    "plan_slots",
    "provision",
]

_GIB = 2**30
_KNOBS = (
    "raise gpu_memory_utilization (the pipeline file's), lower executor_args.max_model_len, "
    "or place a stage on another device"
)


@dataclass(frozen=True, slots=True)
class SlotNeed:
    """What one stage's KV asks of the device."""

    stage: str
    #: bytes one slot costs (keys and values of every layer, per-slot state)
    slot_bytes: int
    #: bytes that do not depend on the count: the scratch row, and the estimate of the
    #: stage's graph pools and activations
    fixed_bytes: int
    #: the stage's ``max_num_seqs`` (the count never exceeds it)
    cap: int
    #: a count given explicitly (``executor_args.max_num_seqs``): kept, not sized
    given: int | None = None


def plan_slots(
    needs: list[SlotNeed], *, free_bytes: int, total_bytes: int, fraction: float
) -> dict[str, int]:
    """Slots per stage (see the module docstring); raises :class:`ModelError` (one line)
    when not even one sized slot fits. A given count is kept as it is (its allocation
    checks the device's free memory, as without sizing) and leaves the rest less."""
    if not 0.0 < fraction <= 1.0:
        raise ModelError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    in_use = total_bytes - free_bytes
    budget = int(fraction * total_bytes) - in_use
    where = (
        f"{fraction:g} of {total_bytes / _GIB:.1f} GiB with {in_use / _GIB:.1f} GiB already in use "
        f"leaves {max(budget, 0) / _GIB:.2f} GiB"
    )
    plan: dict[str, int] = {}
    left = budget
    for need in needs:
        if need.given is not None:  # kept as given (the allocation checks the free memory)
            left -= need.fixed_bytes + need.given * need.slot_bytes
            plan[need.stage] = need.given
    sized = [n for n in needs if n.given is None]
    if not sized:
        return plan
    left -= sum(n.fixed_bytes for n in sized)
    per_slot = sum(n.slot_bytes for n in sized)
    count = min(min(n.cap for n in sized), max(left, 0) // max(per_slot, 1))
    if count < 1:
        short = per_slot - left
        parts = ", ".join(
            f"{n.stage} {n.slot_bytes / _GIB:.3f} GiB a slot + {n.fixed_bytes / _GIB:.2f} GiB" for n in sized
        )
        given = ", ".join(f"{n.stage} {n.given}" for n in needs if n.given is not None)
        after = f" after the slots executor_args.max_num_seqs gives ({given})" if given else ""
        knobs = f"lower executor_args.max_num_seqs, {_KNOBS}" if given else _KNOBS
        raise ModelError(
            f"not even one KV slot fits{after}: {short / _GIB:.2f} GiB short ({parts}; {where}); {knobs}"
        )
    for need in sized:
        plan[need.stage] = int(count)
    return plan


class DeviceMemory(Protocol):
    """Reads of one device's memory (bytes)."""

    def free_and_total(self) -> tuple[int, int]:
        """Free and total memory of the device, with the allocator's unused cache freed."""
        ...

    def allocated(self) -> int: ...

    def reserved(self) -> int: ...


class CudaMemory:
    """:class:`DeviceMemory` of a CUDA device, through torch's caching allocator."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)

    def free_and_total(self) -> tuple[int, int]:
        self._torch.cuda.empty_cache()  # what the builds freed is not in use
        free, total = self._torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        return int(self._torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(self._torch.cuda.memory_reserved(self.device))


@dataclass(slots=True)
class _Deferred:
    need: SlotNeed
    device: Any
    max_len: int
    weights_bytes: int
    build: Callable[[int], None]
    capture: Callable[[], None]
    slots: int = 0
    kv_bytes: int = 0
    graph_bytes: int = 0


@dataclass
class DeviceBudget:
    """The KV sizing of one process's stages on one CUDA device (see the module docstring).

    The process sets :attr:`stage` (name, ``max_num_seqs``) before it builds each stage;
    the stages' runners come in through :func:`provision`; :meth:`finish` sizes, builds
    and captures them, and :attr:`slots` tells each stage's count afterwards."""

    device: str
    #: the pipeline's ``gpu_memory_utilization``
    fraction: float
    stage: tuple[str, int] = ("stage", 1)
    slots: dict[str, int] = field(default_factory=dict)
    #: how the device's memory is read (default: the CUDA caching allocator's; tests fake it)
    memory: DeviceMemory | None = None
    _deferred: list[_Deferred] = field(default_factory=list)

    def defer(self, item: _Deferred) -> None:
        self._deferred.append(item)

    @property
    def is_pending(self) -> bool:
        return bool(self._deferred)

    def finish(self, log: Callable[[str], None] | None = None) -> dict[str, int]:
        """Size, build and capture every deferred runner; returns the slots per stage."""
        if not self._deferred:
            return self.slots
        say = log if log is not None else _stderr
        memory = self.memory if self.memory is not None else CudaMemory(self.device)
        free, total = memory.free_and_total()
        plan = plan_slots(
            [d.need for d in self._deferred], free_bytes=free, total_bytes=total, fraction=self.fraction
        )
        for item in self._deferred:  # every stage's KV before any graph
            before = memory.allocated()
            item.slots = plan[item.need.stage]
            item.build(item.slots)
            item.kv_bytes = memory.allocated() - before
        for item in self._deferred:
            before = memory.reserved()
            item.capture()
            item.graph_bytes = memory.reserved() - before
        for item in self._deferred:
            say(
                f"omnirelay: {item.need.stage} on {self.device}: weights {item.weights_bytes / _GIB:.2f} GiB, "
                f"KV {item.slots} slots x {item.max_len} positions ({item.kv_bytes / _GIB:.2f} GiB, "
                f"{'given' if item.need.given is not None else 'sized from memory'}), "
                f"graph pools {item.graph_bytes / _GIB:.2f} GiB"
            )
        self.slots.update(plan)
        self._deferred.clear()
        return self.slots


def decoder_slot_bytes(config: Any, max_len: int, itemsize: int) -> int:
    """Bytes of one slot of a decoder's KV cache (keys and values of every layer)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (
        2
        * int(config.num_hidden_layers)
        * int(config.num_key_value_heads)
        * int(head_dim)
        * max_len
        * itemsize
    )


def decoder_reserve_bytes(config: Any, *, max_tokens: int, max_batch: int, itemsize: int) -> int:
    """An estimate of a decoder runner's graph pools and activations: its largest launch
    (``max_tokens`` tokens) through one layer — hidden states, the MLP's or the routed
    experts' intermediates — and the float32 logits of ``max_batch`` rows, with a margin
    of a quarter for the graphs' kept outputs."""
    hidden = int(config.hidden_size)
    experts = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if experts:
        inner = experts * int(config.moe_intermediate_size)
        inner += int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    else:
        inner = int(config.intermediate_size)
    per_token = (8 * hidden + 3 * inner) * itemsize
    logits = 3 * max_batch * int(config.vocab_size) * 4
    return (max_tokens * per_token + logits) * 5 // 4


#: Tensors of a decoder layer's full width alive at once in a captured step (its input
#: kept for the residual, the activation's temporaries, the history concatenated to it,
#: the convolution's output), a margin included.
ACTIVATION_COPIES = 10


def peak_activation_bytes(widths: Iterable[tuple[int, int]], itemsize: int) -> int:
    """Bytes a convolutional decoder's step holds at its peak per row and frame: its
    widest layer (``channels × samples per frame``, from ``widths``) times
    :data:`ACTIVATION_COPIES`, in ``itemsize`` bytes."""
    widest = max((channels * samples for channels, samples in widths), default=1)
    return widest * ACTIVATION_COPIES * itemsize


def bucket_grid(
    batches: Sequence[int], frames: Sequence[int], *, budget_bytes: int, bytes_per_row_frame: int
) -> tuple[tuple[int, int], ...]:
    """The (rows, frames) buckets whose step fits ``budget_bytes`` of activations
    (``rows × frames × bytes_per_row_frame``), frames first; every frame bucket keeps
    its one-row bucket whatever the budget (a chunk is never split across steps)."""
    if budget_bytes < 0 or bytes_per_row_frame < 1:
        raise ModelError(
            f"a graph budget needs budget_bytes >= 0 and bytes_per_row_frame >= 1, "
            f"got {budget_bytes} and {bytes_per_row_frame}"
        )
    return tuple(
        (b, t)
        for t in frames
        for b in batches
        if b == min(batches) or b * t * bytes_per_row_frame <= budget_bytes
    )


def module_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_ACTIVE: DeviceBudget | None = None


def active_budget() -> DeviceBudget | None:
    """The process's budget while its stages are built (None: runners build at once)."""
    return _ACTIVE


@contextmanager
def activate(budget: DeviceBudget | None) -> Iterator[DeviceBudget | None]:
    """Runners built inside go to ``budget`` (None: nothing changes)."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, budget
    try:
        yield budget
    finally:
        _ACTIVE = saved


def provision(
    *,
    device: Any,
    max_len: int,
    given: int | None,
    default: int,
    slot_bytes: int,
    fixed_bytes: int,
    weights_bytes: int,
    build: Callable[[int], None],
    capture: Callable[[], None],
) -> None:
    """Build a runner for its slots and capture its graphs: now, with ``given`` slots
    (else ``default``) when no budget of this device is active; else at the budget's
    :meth:`~DeviceBudget.finish`. ``build(n)`` allocates the runner for ``n`` slots."""
    budget = _ACTIVE
    if budget is None or str(device) != budget.device:
        build(given if given is not None else default)
        capture()
        return
    name, cap = budget.stage
    need = SlotNeed(name, slot_bytes, fixed_bytes, cap=cap, given=given)
    budget.defer(_Deferred(need, device, max_len, weights_bytes, build, capture))


def provision_decoder(
    *,
    device: Any,
    static: Any,
    sized: bool,
    config: Any,
    itemsize: int,
    model: Any,
    build: Callable[[int], None],
    capture: Callable[[], None],
    extra_slot_bytes: int = 0,
) -> None:
    """:func:`provision` for a static decoder runner of ``config`` with ``static``'s
    buckets (:class:`~omnirelay.models.runner.Buckets`): a slot is its KV for
    ``max_model_len`` positions plus ``extra_slot_bytes`` (per-slot state of the
    executor's own), the fixed share one slot and the step's activations; ``sized``: the
    slot count comes from the device's budget, else ``static.max_num_seqs``."""
    slot = decoder_slot_bytes(config, static.max_model_len, itemsize) + extra_slot_bytes
    reserve = decoder_reserve_bytes(
        config, max_tokens=static.max_prefill_tokens, max_batch=static.max_batch, itemsize=itemsize
    )
    provision(
        device=device,
        max_len=static.max_model_len,
        given=None if sized else static.max_num_seqs,
        default=static.max_num_seqs,
        slot_bytes=slot,
        fixed_bytes=slot + reserve,
        weights_bytes=module_bytes(model),
        build=build,
        capture=capture,
    )
