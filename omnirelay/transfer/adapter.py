"""The chunk transfer adapter of one stage process: the facade that owns the threads.

Scheduler surface (all non-blocking, no I/O; docs/design.md §7 — the scheduler stays a pure state
machine that feeds commands in and drains plain data out):

* ``save_async(internal_id, external_id, output, ...) -> SaveResult`` — enqueue one chunk.
* ``load_async(internal_id, external_id) -> bool`` (alias ``request_chunk``) — wait for the
  request's next chunk; False when it is a no-op (already waiting, chunk ready, exhausted).
* ``poll_events() -> TransferEvents`` — ready chunks (ownership handed over), failures,
  stall timeouts, and the external ids whose sender generation retired with its keys
  reclaimed. ``wait_events(timeout)`` blocks until there is something to drain.
* ``is_upstream_exhausted(id)``, ``is_segment_finished(id)``, ``is_waiting_for_chunk(id)``,
  ``has_active_sender(external_id)``, ``is_draining(external_id)``,
  ``sender_owner(external_id)`` — queries.
* ``finish_requests(ids)`` / ``cleanup(internal_id, external_id=None)`` /
  ``cleanup_receiver(internal_id)`` / ``cleanup_sender(external_id)`` — release.

Orchestrator surface: ``take_external_failures() -> {external_id: [TransferFailure]}``.
Operations: ``health()``, ``leak_state()``, ``flush(timeout)``, ``kick()``, ``housekeep(blocking)``,
``shutdown()``.

Threads: a pool of send workers (:class:`LaneExecutor`, one lane per external id; worker 0
also runs the idle reap pass) and a pool of receive workers (one lane per internal id)
whose current leader blocks in ``connector.wait_arrivals`` and dispatches polls of the
announced entries (plus a slow fallback pass over all of them). The leader polls the first
announced *small* chunk itself (``Arrivals.small``: a codec chunk, a hidden-state step)
before it listens again, so that chunk costs no thread hand-off at all; a large one goes
to a worker while another listens. See ``sender.py`` for how cleanup stays ordered before
a reused id's puts.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from omnirelay.connectors.base import Arrivals, Connector
from omnirelay.errors import TransferError
from omnirelay.transfer.budget import ByteBudget
from omnirelay.transfer.events import EventBox, SaveResult, TransferEvents, TransferFailure
from omnirelay.transfer.keys import IdMap
from omnirelay.transfer.lanes import LaneExecutor
from omnirelay.transfer.processor import ChunkProcessor
from omnirelay.transfer.receiver import LoadEntry, ReceiveSide
from omnirelay.transfer.sender import SendSide
from omnirelay.transfer.transfer_config import TransferConfig
from omnirelay.transfer.wakeup import Parker

__all__ = ["TransferAdapter"]


class TransferAdapter:
    """Per-request chunk streams over one connector; see the module docstring."""

    def __init__(
        self,
        connector: Connector,
        config: TransferConfig,
        *,
        processor: ChunkProcessor | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_chunk_ready: Callable[[str, bool], None] | None = None,
    ) -> None:
        """``processor``: builds each chunk's body and keeps per-id state
        (:class:`~omnirelay.transfer.processor.ChunkProcessor`; None: the output given to
        ``save_async`` is the body). ``on_chunk_ready(internal_id, is_waited)``: told of
        each ready chunk at its commit, on a receive worker (see
        :class:`~omnirelay.transfer.receiver.ReceiveSide`)."""
        self.config = config
        self._connector = connector
        self._clock = clock
        self._stop = threading.Event()
        self._close_lock = threading.Lock()
        self._is_closed = False
        self._errors_lock = threading.Lock()
        self._num_errors = 0
        self._last_error: str | None = None
        self._box = EventBox(config.max_undrained_failures)
        self._ids = IdMap()
        self._budget = ByteBudget(config.edge_budget_bytes)
        # Serializes the reap routine only (no state behind it); held across the reap I/O
        # so that flush() can run one complete pass after the queues are idle.
        self._housekeeping_mutex = threading.Lock()
        self._send_lanes: LaneExecutor | None = None
        self._sender: SendSide | None = None
        if config.is_sender:
            self._send_lanes = LaneExecutor(
                f"omnirelay-send-s{config.stage_id}",
                config.num_send_workers,
                on_error=self._note_error,
                after_task=lambda: self.housekeep(False),
                on_idle=lambda: self.housekeep(False),
                idle_interval_s=config.reap_interval_s,
            )
            self._sender = SendSide(
                connector=connector,
                config=config,
                lanes=self._send_lanes,
                budget=self._budget,
                box=self._box,
                clock=clock,
                processor=processor,
                owner=self,
            )
        self._receiver: ReceiveSide | None = None
        self._recv_lanes: LaneExecutor | None = None
        self._next_fallback = clock() + config.fallback_poll_s  # read and written by the leader only
        if config.is_receiver:
            self._receiver = ReceiveSide(
                connector=connector, config=config, box=self._box, clock=clock, on_chunk_ready=on_chunk_ready
            )
            self._recv_lanes = LaneExecutor(
                f"omnirelay-recv-s{config.stage_id}",
                config.num_recv_workers,
                on_error=self._note_error,
                source=self._arrival_pass,
            )
        # Every map the threads read exists by now (docs/protocol.md §4.2).
        for lanes in (self._send_lanes, self._recv_lanes):
            if lanes is not None:
                lanes.start()

    # ----------------------------------------------------------------- send side

    def _require_sender(self) -> SendSide:
        if self._sender is None:
            raise TransferError(f"stage {self.config.stage_id} has no send edge (send_to_stage is not set)")
        if self._is_closed:
            raise TransferError("the transfer adapter is closed")
        return self._sender

    def save_async(
        self,
        internal_id: str,
        external_id: str,
        output: Any,
        *,
        context: Any = None,
        is_finished: bool = False,
        is_segment_finished: bool = False,
        num_confirmed_tokens: int | None = None,
        segment_generation: int | None = None,
        to_replica: int = 0,
        wakes: list[Parker] | None = None,
    ) -> SaveResult:
        """Enqueue one chunk of ``external_id`` (scheduler thread; never blocks on I/O).

        ``is_finished`` marks the request's terminal chunk (end of stream downstream);
        ``is_segment_finished`` a segment end of a streaming session. ``context`` is the
        caller's snapshot of the request, passed to the processor. ``num_confirmed_tokens``
        (committed tokens) drops a preempted request's recomputed chunks; a
        ``segment_generation`` older than the current one is dropped. ``to_replica``: the
        next stage's replica the request is bound to (docs/design.md §11). A rejection
        records a failure for ``internal_id`` (drained by ``poll_events``). ``wakes``: a
        caller saving a step's chunks collects the send workers to wake there and wakes
        them once, after the last (:func:`~omnirelay.transfer.wakeup.wake_all`), instead
        of handing its thread to a worker per chunk.
        """
        sender = self._sender
        if sender is None or self._is_closed:
            sender = self._require_sender()  # raises, saying why
        self._ids.ensure(internal_id, external_id)  # before the task can finish and clean it up
        return sender.admit(
            internal_id,
            external_id,
            output,
            context=context,
            is_finished=is_finished,
            is_segment_finished=is_segment_finished,
            num_confirmed_tokens=num_confirmed_tokens,
            segment_generation=segment_generation,
            to_replica=to_replica,
            wakes=wakes,
        )

    def has_active_sender(self, external_id: str) -> bool:
        return self._sender is not None and self._sender.has_active_sender(external_id)

    def is_draining(self, external_id: str) -> bool:
        """True while a cancelled generation of ``external_id`` drains (reuse is refused)."""
        return self._sender is not None and self._sender.is_draining(external_id)

    def cleanup_sender(self, external_id: str, internal_id: str | None = None) -> None:
        """Cancel the sender generation of ``external_id`` (docs/protocol.md §4.5); returns at once."""
        if self._sender is not None:
            self._sender.cleanup_sender(external_id, internal_id)

    def sender_owner(self, external_id: str) -> str | None:
        """The internal id whose sender generation holds ``external_id`` (None: no
        generation; its retirement, if any, is reported by ``poll_events``)."""
        return None if self._sender is None else self._sender.owner(external_id)

    def sender_generation(self, external_id: str) -> dict[str, Any] | None:
        """The generation's fields, for tests and debugging."""
        return None if self._sender is None else self._sender.generation(external_id)

    # ----------------------------------------------------------------- receive side

    def load_async(self, internal_id: str, external_id: str, *, wakes: list[Parker] | None = None) -> bool:
        """Wait for the next chunk of ``internal_id`` (scheduler thread; enqueue only).
        ``wakes``: as in :meth:`save_async`, for a caller registering several loads."""
        if self._receiver is None or self._is_closed:
            return False
        self._ids.ensure(internal_id, external_id)
        entry = self._receiver.register(internal_id, external_id)
        if entry is None:
            return False
        self._dispatch(entry, wakes)
        return True

    request_chunk = load_async

    def is_waiting_for_chunk(self, internal_id: str) -> bool:
        return self._receiver is not None and self._receiver.is_registered(internal_id)

    def is_upstream_exhausted(self, internal_id: str) -> bool:
        return self._receiver is not None and self._receiver.is_upstream_exhausted(internal_id)

    def is_segment_finished(self, internal_id: str) -> bool:
        return self._receiver is not None and self._receiver.is_segment_finished(internal_id)

    def cleanup_receiver(self, internal_id: str) -> None:
        """Drop the request's receiver state and (docs/protocol.md §4.6) its id mapping — unless its
        sender generation still needs the mapping to report failures by internal id."""
        if self._receiver is not None:
            self._receiver.cleanup_receiver(internal_id)
        ext = self._ids.get(internal_id)
        if ext is not None and not (self._sender is not None and self._sender.has_active_sender(ext)):
            self._ids.pop(internal_id)

    def _dispatch(self, entry: LoadEntry, wakes: list[Parker] | None = None) -> None:
        """Queue a poll of ``entry`` on its request's lane (never runs it on the caller)."""
        assert self._recv_lanes is not None
        self._recv_lanes.submit(entry.internal_id, functools.partial(self._poll, entry), wakes=wakes)

    def _poll(self, entry: LoadEntry) -> None:
        assert self._receiver is not None
        self._receiver.poll(entry)

    def _arrival_pass(self) -> None:
        """One wait for arrival notices, by the receive pool's current leader.

        Polls only the entries whose key was announced; every ``fallback_poll_s`` all of
        them (covers lost notices). An idle waiting request costs nothing in between. The
        first announced entry whose get the connector says is small (``Arrivals.small``:
        a codec chunk, a hidden-state step) is polled by the leader itself, before it
        listens again, without waking another worker; every other poll goes to the pool.
        """
        receiver = self._receiver
        assert receiver is not None
        try:
            keys = self._connector.wait_arrivals(self.config.stage_id, self.config.arrival_wait_s)
        except Exception as exc:
            if self._stop.is_set():
                return
            self._note_error(exc)
            keys = Arrivals()
            self._stop.wait(self.config.arrival_wait_s)  # don't spin on a broken connector
        now = self._clock()
        # A lost notice (the connector says its queue overflowed) means: poll everything now.
        is_fallback = now >= self._next_fallback or keys.overflowed
        if is_fallback:
            self._next_fallback = now + self.config.fallback_poll_s
        if keys or is_fallback:
            small = keys.small
            if not is_fallback and len(keys) == 1 and keys[0] in small:
                # The common arrival (one codec chunk or hidden-state step): no lists.
                entry = receiver.take_announced(keys[0])
                if entry is not None:
                    assert self._recv_lanes is not None
                    self._recv_lanes.run_now(entry.internal_id, self._poll, entry)
                return
            mine: LoadEntry | None = None
            for entry in receiver.entries_to_poll(keys, include_all=is_fallback):
                if mine is None and entry.key in small:
                    mine = entry
                else:
                    self._dispatch(entry)
            if mine is not None:  # after the others went to the pool: on this thread, now
                assert self._recv_lanes is not None
                self._recv_lanes.run_now(mine.internal_id, self._poll, mine)

    # ----------------------------------------------------------------- scheduler

    def poll_events(self) -> TransferEvents:
        """Drain what happened since the last tick (scheduler thread, once per tick)."""
        ready, failed, retired = self._box.drain()
        timed_out: tuple[TransferFailure, ...] = ()
        if self._receiver is not None:
            timeouts = self._receiver.collect_timeouts()
            for f in timeouts:
                self._box.record_external(f)
            timed_out = tuple(timeouts)
        return TransferEvents(ready=ready, failed=failed, timed_out=timed_out, retired_senders=retired)

    def wait_events(self, timeout: float | None, wake_if: Callable[[], bool] | None = None) -> bool:
        """Block until a ready chunk, a failure or a retired sender is there to drain;
        False on timeout.

        ``wake_if`` (optional) also ends the wait when it returns True; it is re-checked
        whenever :meth:`kick` is called, so a stage engine can wait for chunk events and
        its own commands on one condition. It runs under the event lock: cheap, lock-free.
        """
        return self._box.wait(timeout, wake_if)

    def take_external_failures(self) -> dict[str, list[TransferFailure]]:
        """Failures keyed by external id, for the orchestrator (drains them)."""
        return self._box.take_external()

    def cleanup(self, internal_id: str, external_id: str | None = None) -> None:
        """Release everything of one request: receiver state, then its sender generation.

        Undrained events of the request go too: the scheduler no longer tracks it.
        """
        mapped = self._ids.pop(internal_id)
        ext = external_id if external_id is not None else (mapped if mapped is not None else internal_id)
        self.cleanup_receiver(internal_id)
        self._box.discard_request(internal_id)
        self.cleanup_sender(ext, internal_id)

    def finish_requests(self, internal_ids: Iterable[str]) -> None:
        """The scheduler finished (or aborted) these requests: release each of them."""
        for iid in internal_ids:
            self.cleanup(iid)

    # ----------------------------------------------------------------- housekeeping

    @property
    def is_stopping(self) -> bool:
        """Shutting down (:meth:`shutdown` was called)."""
        return self._stop.is_set()

    def housekeep(self, blocking: bool) -> None:
        """One reap pass and budget reconciliation (docs/protocol.md §3.5: also when the loop is idle)."""
        if not self._housekeeping_mutex.acquire(blocking=blocking):
            return  # another worker is doing it right now
        try:
            snapshot = self._budget.snapshot()  # before pending_keys(): see budget.py
            self._connector.reap_consumed()
            if snapshot:
                self._budget.release_absent(snapshot, set(self._connector.pending_keys()))
        except Exception as exc:
            self._note_error(exc)
        finally:
            self._housekeeping_mutex.release()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until no send or receive task is queued or running, then run one reap pass.

        Returns False on timeout. Waits on conditions, never sleeps.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for lanes in (self._send_lanes, self._recv_lanes):
            if lanes is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not lanes.wait_idle(left):
                return False
        if self._sender is not None and not self._is_closed:
            self.housekeep(True)
        return True

    def set_event_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` whenever :meth:`wait_events` waiters are woken (a ready
        chunk, a failure, a retired sender, :meth:`kick`), under no lock of the adapter."""
        self._box.set_listener(listener)

    def kick(self) -> None:
        """Wake every waiter to re-check its clock (after advancing an injected clock)."""
        self._budget.notify()
        self._box.notify()

    def _note_error(self, exc: BaseException) -> None:
        with self._errors_lock:
            self._num_errors += 1
            self._last_error = f"{type(exc).__name__}: {exc}"

    # ----------------------------------------------------------------- observability

    def health(self) -> dict[str, Any]:
        with self._errors_lock:
            errors = {"num_errors": self._num_errors, "last_error": self._last_error}
        try:
            connector = self._connector.health().to_dict()
        except Exception as exc:
            connector = {"status": "unhealthy", "last_error": f"{type(exc).__name__}: {exc}"}
        return {
            "status": "closed" if self._is_closed else "healthy",
            "stage_id": self.config.stage_id,
            "send_to_stage": self.config.send_to_stage,
            "receive_from_stage": self.config.receive_from_stage,
            "send_queue": None if self._send_lanes is None else self._send_lanes.stats(),
            "recv_queue": None if self._recv_lanes is None else self._recv_lanes.stats(),
            "sender": None if self._sender is None else self._sender.stats(),
            "receiver": None if self._receiver is None else self._receiver.stats(),
            "budget": self._budget.stats(),
            "events": self._box.stats(),
            "num_id_mappings": len(self._ids),
            **errors,
            "connector": connector,
        }

    def leak_state(self) -> dict[str, Any]:
        """Every non-empty per-request map; ``{}`` when the adapter holds no request state."""
        out: dict[str, Any] = {}
        if self._sender is not None:
            out.update(self._sender.leak_state())
        if self._receiver is not None:
            out.update(self._receiver.leak_state())
        for name, lanes in (("send_lanes", self._send_lanes), ("recv_lanes", self._recv_lanes)):
            if lanes is not None and (busy := lanes.lanes()):
                out[name] = busy
        ids = self._ids.snapshot()
        if ids:
            out["id_mapping"] = ids
        out.update(self._budget.leak_state())
        out.update(self._box.leak_state())
        if not self._is_closed:
            # Objects this stage still holds that no budget record accounts for: a key
            # its cleanup task released while a reader was consuming it. Its name lingers
            # until the next reap pass (at most reap_interval_s), so reap before judging.
            untracked = set(self._connector.pending_keys()) - {k for k, _ in self._budget.snapshot()}
            if untracked:
                self.housekeep(blocking=True)
                untracked &= set(self._connector.pending_keys())
            if untracked:
                out["connector_untracked_keys"] = sorted(untracked)[:16]
            # A backend's own per-object books (nixl: objects awaiting an ack, notices not got).
            books = getattr(self._connector, "leak_state", None)
            if callable(books) and (held := books()):
                out["connector"] = held
        return out

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the threads (join), drop queued work, close the connector. Idempotent."""
        with self._close_lock:
            if self._is_closed:
                return
            self._is_closed = True
        self._stop.set()
        self._budget.notify()
        alive: list[str] = []
        for lanes in (self._send_lanes, self._recv_lanes):
            if lanes is not None:
                alive += lanes.stop(self.config.shutdown_join_s)
        if alive:
            self._note_error(TransferError(f"threads still running after shutdown: {', '.join(alive)}"))
        try:
            self._connector.close()  # releases every object this stage still owns
        except Exception as exc:
            self._note_error(exc)
        if self._sender is not None:
            self._sender.clear()
        if self._receiver is not None:
            self._receiver.clear()
        self._budget.clear()
        self._ids.clear()
        self._box.clear()

    close = shutdown

    def __enter__(self) -> TransferAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
