"""What ``omnirelay bench stress`` does, and what its two processes say to each other.

* :class:`RequestPlan` / :func:`make_plan` — the seeded fate of every request: which of
  its chunks are 4 MB, whether and where it is cancelled (and through which entry point),
  whether its id is reused afterwards, whether its consumer stops early.
* Control messages (tagged ``msgspec`` structs, one encoder/decoder pair):
  producer → consumer :class:`Start`, :class:`Cancel`, :class:`Done`;
  consumer → producer :class:`Finished`, :class:`Stopped`, :class:`Released`.
* :class:`ProducerReport` / :class:`ConsumerReport` (with its leak :class:`Audit`) — what
  each process hands back.
* :class:`ChunkFactory`, :func:`make_chunk` / :func:`check_chunk` — every chunk carries (request id, generation,
  chunk index) in its meta *and* in its tensor, so the consumer can prove order and
  exactly-once delivery and that no chunk of one generation reached another.
* :func:`external_id` — ids that are prefixes of each other's keys (``task_1`` vs
  ``task_1_1``: docs/protocol.md §8 item 3), so every exact-key and prefix cleanup is also a test
  that no sibling is touched.
"""

from __future__ import annotations

import math
import random
from typing import Any, Literal

import msgspec
import torch

__all__ = [
    "BIG_SHAPE",
    "CODEC_SHAPE",
    "Audit",
    "Cancel",
    "ChunkFactory",
    "ConsumerReport",
    "Done",
    "Finished",
    "Message",
    "ProducerReport",
    "Released",
    "RequestPlan",
    "Settings",
    "Start",
    "Stopped",
    "check_chunk",
    "consumer_iid",
    "decode_message",
    "encode_message",
    "external_id",
    "make_chunk",
    "make_plan",
    "producer_iid",
]

#: A codec chunk: int64 codes 16x50 (6.4 KB) plus meta.
CODEC_SHAPE = (16, 50)
#: A big chunk: f32 512x2048 (4 MB), the size of a prefill embedding.
BIG_SHAPE = (512, 2048)
#: Tags at the start of every chunk's tensor: request id, generation, chunk index.
_NUM_TAGS = 3

CancelPhase = Literal["before", "during", "after"]
CancelVia = Literal["cleanup", "cleanup_sender"]
CANCEL_PHASES: tuple[CancelPhase, ...] = ("before", "during", "after")


class Settings(msgspec.Struct, frozen=True):
    """Run parameters both processes need."""

    namespace: str
    num_chunks: int
    #: Requests open at once on the producer / running at once on the consumer.
    window: int
    consumer_window: int
    seed: int
    #: Absolute ``time.monotonic()`` deadline (CLOCK_MONOTONIC is system-wide).
    deadline: float
    #: How long one ``flush`` may take before the run is declared stuck.
    flush_timeout_s: float = 30.0


class RequestPlan(msgspec.Struct, frozen=True):
    """The fate of one request (generation 0, and generation 1 when its id is reused)."""

    rid: int
    #: Chunk indexes that are 4 MB, per generation (index 0 and 1).
    big: tuple[tuple[int, ...], tuple[int, ...]]
    #: Cancelled (generation 0 only): where, and through which sender entry point.
    cancel_phase: CancelPhase | None = None
    #: Chunks admitted before the cancel ("before": 0 or 1, "during": 1..n-1, "after": n).
    cancel_after: int = 0
    cancel_via: CancelVia = "cleanup"
    #: "during" only: cancel when the put of the last admitted chunk starts (the scheduler's
    #: abort races a put in progress), not right after its admission.
    cancel_at_put_start: bool = False
    #: After the cancelled generation drained, start the id again as generation 1.
    reuse: bool = False
    #: The consumer stops after reading this many chunks (never for a cancelled request).
    stop_after: int | None = None

    @property
    def ext(self) -> str:
        return external_id(self.rid)

    @property
    def num_generations(self) -> int:
        return 2 if self.reuse else 1


def external_id(rid: int) -> str:
    """``task_<d>_<d>…``: the digits of ``rid`` joined by ``_`` (1 → task_1, 11 → task_1_1)."""
    return "task_" + "_".join(str(rid))


def producer_iid(rid: int, gen: int) -> str:
    return f"p{rid}.{gen}"


def consumer_iid(rid: int, gen: int) -> str:
    return f"c{rid}.{gen}"


def make_plan(
    *,
    num_requests: int,
    num_chunks: int,
    cancel_fraction: float,
    seed: int,
    big_fraction: float,
    early_stop_fraction: float,
    reuse_fraction: float,
) -> list[RequestPlan]:
    """The seeded plan. Cancelled requests take the three phases in turn (then shuffled)."""
    rng = random.Random(seed)
    rids = list(range(num_requests))
    num_cancel = min(num_requests, math.ceil(cancel_fraction * num_requests - 1e-9))
    cancelled = rng.sample(rids, num_cancel)
    rest = sorted(set(rids) - set(cancelled))
    num_stop = min(len(rest), round(early_stop_fraction * num_requests))
    stopped = set(rng.sample(rest, num_stop))
    phase_of = {rid: CANCEL_PHASES[i % len(CANCEL_PHASES)] for i, rid in enumerate(cancelled)}
    plans = []
    for rid in rids:
        big = tuple(tuple(i for i in range(num_chunks) if rng.random() < big_fraction) for _ in range(2))
        phase = phase_of.get(rid)
        if phase is None:
            stop = rng.randint(1, num_chunks - 1) if rid in stopped else None
            plans.append(RequestPlan(rid, (big[0], big[1]), stop_after=stop))
            continue
        if phase == "before":
            after = rng.randint(0, 1)
        elif phase == "during":
            after = rng.randint(1, num_chunks - 1)
        else:
            after = num_chunks
        via: CancelVia = "cleanup" if rng.random() < 0.5 else "cleanup_sender"
        at_put_start = phase == "during" and rng.random() < 0.5
        plans.append(
            RequestPlan(
                rid,
                (big[0], big[1]),
                cancel_phase=phase,
                cancel_after=after,
                cancel_via=via,
                cancel_at_put_start=at_put_start,
                reuse=rng.random() < reuse_fraction,
            )
        )
    return plans


# ---------------------------------------------------------------------- chunks


class ChunkFactory:
    """Builds and checks chunk payloads; both processes make the same base tensors."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.codes = torch.randint(0, 2048, CODEC_SHAPE, generator=g, dtype=torch.int64)
        self.big = torch.randn(BIG_SHAPE, generator=g)

    def make(self, rid: int, gen: int, idx: int, *, is_big: bool) -> dict[str, Any]:
        tags = (rid, gen, idx)
        meta = {"rid": rid, "gen": gen, "idx": idx}
        if is_big:
            t = self.big.clone()
            t.view(-1)[:_NUM_TAGS] = torch.tensor(tags, dtype=t.dtype)
            return {"embed": {"prefill": t}, "meta": meta}
        c = self.codes.clone()
        c.view(-1)[:_NUM_TAGS] = torch.tensor(tags, dtype=c.dtype)
        return {"codes": {"audio": c}, "meta": {**meta, "left_context_size": 25}}

    def check(self, payload: Any, rid: int, gen: int, idx: int, *, is_big: bool) -> str | None:
        """None if ``payload`` is exactly chunk ``idx`` of ``(rid, gen)``, else what differs."""
        try:
            meta = payload["meta"]
            got = (meta["rid"], meta["gen"], meta["idx"])
            t = payload["embed"]["prefill"] if is_big else payload["codes"]["audio"]
        except (KeyError, TypeError) as exc:
            return f"malformed chunk ({type(exc).__name__}: {exc})"
        want = (rid, gen, idx)
        if got != want:
            return f"meta says (rid, gen, idx) = {got}, expected {want}"
        base = self.big if is_big else self.codes
        if not isinstance(t, torch.Tensor) or t.dtype != base.dtype or t.shape != base.shape:
            return f"tensor is {type(t).__name__} {getattr(t, 'dtype', '?')} {tuple(getattr(t, 'shape', ()))}"
        flat = t.reshape(-1)
        tags = tuple(int(x) for x in flat[:_NUM_TAGS].tolist())
        if tags != want:
            return f"tensor tags are {tags}, expected {want}"
        if not torch.equal(flat[_NUM_TAGS:], base.reshape(-1)[_NUM_TAGS:]):
            return "tensor contents differ from what was sent"
        return None


def make_chunk(factory: ChunkFactory, plan: RequestPlan, gen: int, idx: int) -> dict[str, Any]:
    return factory.make(plan.rid, gen, idx, is_big=idx in plan.big[gen])


def check_chunk(factory: ChunkFactory, plan: RequestPlan, gen: int, idx: int, payload: Any) -> str | None:
    return factory.check(payload, plan.rid, gen, idx, is_big=idx in plan.big[gen])


# ---------------------------------------------------------------------- control messages


class Start(msgspec.Struct, tag=True, frozen=True):
    """Producer → consumer: start reading generation ``gen`` of request ``rid``."""

    rid: int
    gen: int


class Cancel(msgspec.Struct, tag=True, frozen=True):
    """Producer → consumer: the request was aborted; release it and answer :class:`Released`."""

    rid: int
    gen: int


class Done(msgspec.Struct, tag=True, frozen=True):
    """Producer → consumer: every request is resolved; audit and report."""


class Finished(msgspec.Struct, tag=True, frozen=True):
    """Consumer → producer: every chunk arrived (the terminal included)."""

    rid: int
    gen: int
    num_received: int


class Stopped(msgspec.Struct, tag=True, frozen=True):
    """Consumer → producer: stopped reading early and released the request."""

    rid: int
    gen: int
    num_received: int


class Released(msgspec.Struct, tag=True, frozen=True):
    """Consumer → producer: the cancelled request is released, no get is in flight for it."""

    rid: int
    gen: int
    num_received: int


Message = Start | Cancel | Done | Finished | Stopped | Released

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode_message(data: bytes) -> Message:
    return _DECODER.decode(data)


# ---------------------------------------------------------------------- reports


class Audit(msgspec.Struct):
    """The leak audit of one process, taken after its last request was resolved."""

    is_flushed: bool = False
    num_pending_keys: int = -1
    pending_keys: list[str] = msgspec.field(default_factory=list)
    leak_state: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Published objects or claims of the namespace still in /dev/shm (producer only).
    live_objects: list[str] = msgspec.field(default_factory=list)
    live_bytes: int = -1
    num_adapter_errors: int = -1
    last_adapter_error: str | None = None


class ProducerReport(msgspec.Struct):
    error: str | None = None
    open_requests: list[str] = msgspec.field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0
    num_requests_started: int = 0
    num_resolved: int = 0
    num_admitted: int = 0
    num_puts: int = 0
    num_big_puts: int = 0
    num_put_failures: int = 0
    bytes_put: int = 0
    #: Cancels by the phase planned / the phase observed at the cancel / the entry point.
    cancels_planned: dict[str, int] = msgspec.field(default_factory=dict)
    cancels_observed: dict[str, int] = msgspec.field(default_factory=dict)
    cancels_via: dict[str, int] = msgspec.field(default_factory=dict)
    num_reused: int = 0
    num_removed_exact: int = 0
    num_cleanup_calls: int = 0
    num_removed_prefix_cancel: int = 0
    num_removed_prefix_stop: int = 0
    sender_stats: dict[str, Any] = msgspec.field(default_factory=dict)
    failures: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)
    audit: Audit = msgspec.field(default_factory=Audit)


class ConsumerReport(msgspec.Struct):
    error: str | None = None
    open_requests: list[str] = msgspec.field(default_factory=list)
    num_delivered: int = 0
    num_big_delivered: int = 0
    bytes_delivered: int = 0
    #: Generations that delivered every chunk: never cancelled, reused (generation 1), or
    #: cancelled only after the consumer had read the terminal (a cancel "after").
    num_completed: int = 0
    num_completed_reused: int = 0
    num_completed_then_cancelled: int = 0
    num_stopped: int = 0
    num_released: int = 0
    num_gets: int = 0
    bytes_got: int = 0
    num_get_failures: int = 0
    receiver_stats: dict[str, Any] = msgspec.field(default_factory=dict)
    failures: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)
    audit: Audit = msgspec.field(default_factory=Audit)


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data (anything msgspec cannot encode becomes its repr), for
    the processes' reports."""
    return msgspec.json.decode(msgspec.json.encode(obj, enc_hook=repr))
