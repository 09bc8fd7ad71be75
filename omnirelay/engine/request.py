"""One request inside one stage engine: its lifecycle enum and its mutable record.

* :class:`RequestStatus` — the lifecycle. :data:`ALLOWED_TRANSITIONS` is the whole table;
  a status changes only through the named methods of :class:`Request`, each of which
  checks the table and raises :class:`IllegalTransitionError` (an ``AssertionError``:
  an illegal transition is a scheduler bug, never a user error) otherwise.
* :class:`Request` — ids, tokens, sampling, runtime info committed from upstream chunks,
  the full input forwarded by the orchestrator, and timestamps.

Lifecycle::

                 ┌──────────── park_for_chunk ────────────┐
                 ▼                                        │
    WAITING ─start_running─► RUNNING ─park_for_chunk─► WAITING_FOR_CHUNK
       ▲  ▲                   │   ▲                       │ unpark (back to where it parked)
       │  └── unpark ─────────┼───┴───────────────────────┘
       │                      ▼
       └─ (readmission) ─ PREEMPTED          any non-finished ─finish─► FINISHED_*

A parked request remembers where it parked (:attr:`Request.parked_from`) and
:meth:`Request.unpark` returns it there: a RUNNING request keeps its batch slot (its
executor state) while it waits; a WAITING or PREEMPTED one holds none.

The internal id is the external id plus a stage-local suffix (``"{ext}@s{stage}.{n}"``),
so two lifetimes of one external id in one stage never share scheduler or receiver state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from omnirelay.engine.interfaces import SamplingParams

__all__ = [
    "ALLOWED_TRANSITIONS",
    "FINISHED_STATUSES",
    "IllegalTransitionError",
    "Request",
    "RequestSnapshot",
    "RequestStatus",
    "make_internal_id",
]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the stage, not yet holding a batch slot
    WAITING_FOR_CHUNK = "waiting_for_chunk"  # parked until the adapter commits its next chunk
    RUNNING = "running"  # holds a batch slot; scheduled every tick it is runnable
    PREEMPTED = "preempted"  # lost its slot and executor state; recomputes when readmitted
    FINISHED_STOPPED = "finished_stopped"  # stop token, executor said done, input exhausted
    FINISHED_LENGTH = "finished_length"  # max_tokens reached
    FINISHED_ABORTED = "finished_aborted"  # abort (or release) from the orchestrator
    FINISHED_ERROR = "finished_error"  # transfer failure, timeout, executor error

    # Members are singletons compared by identity: hashed by identity too, in C. Enum's
    # own hash (of the name, in Python) ran several times per row and step in the sets
    # and maps below.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        """The client-visible reason (``StageOutput.finish_reason``); None while live."""
        return _FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_S = RequestStatus
#: Every allowed ``from -> to``. Finished statuses are terminal.
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.WAITING_FOR_CHUNK, *FINISHED_STATUSES}),
    _S.RUNNING: frozenset({_S.WAITING_FOR_CHUNK, _S.PREEMPTED, *FINISHED_STATUSES}),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.WAITING_FOR_CHUNK, *FINISHED_STATUSES}),
    # Back to where it parked; finished by abort, failure, timeout, or an input that
    # turned out to be empty. Never RUNNING from a WAITING park (that needs admission).
    _S.WAITING_FOR_CHUNK: frozenset({_S.WAITING, _S.RUNNING, _S.PREEMPTED, *FINISHED_STATUSES}),
    **{s: frozenset() for s in FINISHED_STATUSES},
}


class IllegalTransitionError(AssertionError):
    """A status change the table does not allow (a scheduler bug)."""


def make_internal_id(external_id: str, stage_id: int, seq: int) -> str:
    """``"{external_id}@s{stage_id}.{seq}"``: unique per stage engine lifetime."""
    return f"{external_id}@s{stage_id}.{seq}"


class RequestSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What a chunk processor sees of the request (``BuildRequest.context``).

    Taken on the engine thread at ``save_async``; immutable, so the processor (on a send
    worker) never sees a later mutation (docs/protocol.md §4.3 step 5). A frozen struct:
    one is made per row and step, and a frozen dataclass's ``__init__`` cost several
    times as much.
    """

    internal_id: str
    external_id: str
    stage_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    #: Tokens sampled by the step this chunk comes from.
    new_token_ids: tuple[int, ...]
    num_computed_tokens: int
    sampling: SamplingParams
    is_placeholder: bool
    final_stage_id: int
    is_finished: bool
    finish_reason: str | None
    #: The client's per-request extras (e.g. ``voice``), as the orchestrator sent them.
    extras: Mapping[str, Any] = {}

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids


class Request:
    """The stage-local record of one request. Mutated only by its scheduler (engine thread)."""

    __slots__ = (
        "_status",
        "additional_information",
        "arrival_time",
        "error",
        "external_id",
        "extras",
        "final_stage_id",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "has_ready_chunk",
        "inputs",
        "internal_id",
        "is_chunk_requested",
        "is_placeholder",
        "is_recompute",
        "is_upstream_exhausted",
        "num_chunks_received",
        "num_computed_tokens",
        "num_prefill_pieces",
        "num_steps",
        "output_seconds",
        "output_token_ids",
        "parked_from",
        "prompt_token_ids",
        "runtime_info",
        "sampling",
        "send_to_replica",
        "stage_id",
        "stream",
    )

    def __init__(
        self,
        *,
        internal_id: str,
        external_id: str,
        stage_id: int,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float,
        is_placeholder: bool = False,
        inputs: Any = None,
        final_stage_id: int = 0,
        stream: bool = True,
        extras: Mapping[str, Any] | None = None,
        send_to_replica: int = 0,
    ) -> None:
        self.internal_id = internal_id
        #: The next stage's replica this request is bound to (its chunks are announced there).
        self.send_to_replica = send_to_replica
        self.extras: Mapping[str, Any] = MappingProxyType(dict(extras or {}))
        self.external_id = external_id
        self.stage_id = stage_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        #: The audio this stage's outputs carried so far (seconds; a generation stage's).
        self.output_seconds = 0.0
        #: Tokens of ``prompt + output`` the executor has computed (its KV covers them).
        self.num_computed_tokens = 0
        self.sampling = sampling
        #: What the upstream chunks committed for the next step, consumed by it (docs/protocol.md §4.9
        #: postprocess): the chunk's payload (AR), or the runtime info (generation).
        self.additional_information: Any = None
        #: Generation receivers: what the committed chunks left for the next one to build on
        #: (the stage's chunk reader's runtime info); kept across steps.
        self.runtime_info: Any = None
        #: A full input forwarded by the orchestrator (non-chunk edge); passed every step.
        self.inputs = inputs
        self.is_placeholder = is_placeholder
        #: The highest stage this request needs: this stage sends chunks only below it.
        self.final_stage_id = final_stage_id
        self.stream = stream
        self._status = RequestStatus.WAITING
        self.parked_from: RequestStatus | None = None
        #: A committed chunk is attached and not yet computed.
        self.has_ready_chunk = False
        #: The upstream's terminal chunk was committed: no chunk will come any more.
        self.is_upstream_exhausted = False
        #: The adapter was asked for this request's next chunk (``load_async``) and it has
        #: not been applied yet: asking again would be a no-op.
        self.is_chunk_requested = False
        #: The next step recomputes tokens already computed before a preemption.
        self.is_recompute = False
        self.num_chunks_received = 0
        #: Steps that completed a prefill or a decode (a piece of a split prompt is not one).
        self.num_steps = 0
        #: Steps that computed a piece of a prompt split across steps, not its last.
        self.num_prefill_pieces = 0
        self.error: str | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __repr__(self) -> str:
        return (
            f"Request({self.internal_id!r}, {self._status.name}, prompt={len(self.prompt_token_ids)}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )

    # ----------------------------------------------------------------- queries

    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def is_finished(self) -> bool:
        return self._status in FINISHED_STATUSES  # the status's own property, inlined (hot)

    @property
    def holds_slot(self) -> bool:
        """Holds a batch slot: RUNNING, or parked from RUNNING."""
        return self._status is RequestStatus.RUNNING or (
            self._status is RequestStatus.WAITING_FOR_CHUNK and self.parked_from is RequestStatus.RUNNING
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def snapshot(self, new_token_ids: tuple[int, ...] = ()) -> RequestSnapshot:
        return RequestSnapshot(
            internal_id=self.internal_id,
            external_id=self.external_id,
            stage_id=self.stage_id,
            prompt_token_ids=tuple(self.prompt_token_ids),
            output_token_ids=tuple(self.output_token_ids),
            new_token_ids=tuple(new_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            sampling=self.sampling,
            is_placeholder=self.is_placeholder,
            final_stage_id=self.final_stage_id,
            is_finished=self.is_finished,
            finish_reason=self._status.finish_reason,
            extras=self.extras,
        )

    # ----------------------------------------------------------------- transitions

    def _move(self, to: RequestStatus, event: str) -> None:
        frm = self._status
        if to not in ALLOWED_TRANSITIONS[frm]:
            allowed = ", ".join(sorted(s.name for s in ALLOWED_TRANSITIONS[frm])) or "none (terminal)"
            raise IllegalTransitionError(
                f"request {self.internal_id!r}: {event} would move {frm.name} -> {to.name}, "
                f"which is not allowed (from {frm.name}: {allowed})"
            )
        self._status = to

    def _require(self, names: tuple[str, ...], event: str) -> None:
        """Preconditions narrower than the table (admission is not an unpark)."""
        if self._status.name not in names:
            raise IllegalTransitionError(
                f"request {self.internal_id!r}: {event} needs status {' or '.join(names)}, "
                f"got {self._status.name}"
            )

    def start_running(self, now: float) -> None:
        """Admission: WAITING or PREEMPTED -> RUNNING (takes a batch slot)."""
        self._require(("WAITING", "PREEMPTED"), "start_running")
        self._move(RequestStatus.RUNNING, "start_running")
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def park_for_chunk(self) -> None:
        """WAITING / RUNNING / PREEMPTED -> WAITING_FOR_CHUNK, remembering where from."""
        frm = self._status
        if self.has_ready_chunk:
            raise IllegalTransitionError(f"request {self.internal_id!r}: parked with a ready chunk")
        self._move(RequestStatus.WAITING_FOR_CHUNK, "park_for_chunk")
        self.parked_from = frm

    def unpark(self) -> None:
        """WAITING_FOR_CHUNK -> the status it parked from (its chunk was committed)."""
        if self._status is not RequestStatus.WAITING_FOR_CHUNK or self.parked_from is None:
            raise IllegalTransitionError(
                f"request {self.internal_id!r}: unpark while {self._status.name} (not WAITING_FOR_CHUNK)"
            )
        to, self.parked_from = self.parked_from, None
        self._move(to, "unpark")

    def preempt(self) -> None:
        """RUNNING -> PREEMPTED: executor state dropped; everything is recomputed later."""
        self._require(("RUNNING",), "preempt")
        self._move(RequestStatus.PREEMPTED, "preempt")
        self.num_computed_tokens = 0
        self.is_recompute = self.num_steps > 0

    def finish(self, status: RequestStatus, now: float, error: str | None = None) -> None:
        """Any live status -> ``status`` (one of the FINISHED_* statuses)."""
        if not status.is_finished:
            raise IllegalTransitionError(
                f"request {self.internal_id!r}: finish() needs a FINISHED_* status, got {status.name}"
            )
        self._move(status, "finish")
        self.parked_from = None
        self.finished_time = now
        if error is not None:
            self.error = error

    # ----------------------------------------------------------------- chunk input

    def attach_ar_chunk(self, payload: Any, *, is_finished: bool) -> None:
        """AR receiver: the chunk's payload, as it came, is the input of the next step."""
        self.additional_information = payload
        self.has_ready_chunk = True
        self.num_chunks_received += 1
        if is_finished:
            self.is_upstream_exhausted = True

    def attach_generation_chunk(self, prompt_token_ids: list[int], info: Any, *, is_finished: bool) -> None:
        """Generation receiver: a fresh one-shot prefill over the chunk's ids (docs/protocol.md §4.8);
        ``info`` is the runtime info the stage's chunk reader made of it."""
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.runtime_info = info
        self.additional_information = info
        self.has_ready_chunk = True
        self.num_chunks_received += 1
        if is_finished:
            self.is_upstream_exhausted = True
