"""The receive side: registrations, polls, commit and ready publication (docs/protocol.md §4.6–§4.8).

* :meth:`ReceiveSide.register` (scheduler thread, via ``load_async``) — create a
  :class:`LoadEntry` for the request's next chunk and index it by its key.
* :meth:`ReceiveSide.entries_to_poll` (arrival thread) — the entries whose key was
  announced, or all of them on the slow fallback pass; each is marked queued once.
* :meth:`ReceiveSide.poll` (a receive worker) — ``connector.get`` outside the lock, then
  under the lock: the identity check and the commit. A chunk is a
  :class:`~omnirelay.transfer.envelope.ChunkEnvelope`: its flags are read, its body is
  handed to the scheduler unread (what a chunk means is the consuming stage's business).
* :meth:`ReceiveSide.cleanup_receiver` — drop every per-request map entry. No tombstones:
  a late result is rejected because its entry is no longer *the* registered object. It
  returns only once no get of the request is in flight: a get that outlived its
  registration could otherwise consume the chunk of a *later* request under the same id
  (same key) after the stages reported the id released, and that request would wait for
  a chunk that is gone.

A registration lives until its chunk is committed (or the request is cleaned); a new one is
needed for the next chunk. Per request the receiver keeps: the registration, the get
counter, the exhausted and segment-finished marks — all removed by ``cleanup_receiver``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from omnirelay.connectors.base import Connector, GetResult, GetStatus
from omnirelay.ids import request_id_problem
from omnirelay.transfer.envelope import ChunkEnvelope, check_envelope
from omnirelay.transfer.events import ChunkInput, EventBox, FailureKind, TransferFailure
from omnirelay.transfer.keys import make_key
from omnirelay.transfer.transfer_config import TransferConfig

__all__ = ["LoadEntry", "ReceiveSide"]


class LoadEntry:
    """One registration: "request X waits for chunk N". Compared by identity only."""

    __slots__ = (
        "chunk_id",
        "external_id",
        "internal_id",
        "is_queued",
        "is_timeout_reported",
        "is_waited",
        "key",
        "since",
    )

    def __init__(self, internal_id: str, external_id: str, chunk_id: int, key: str, since: float) -> None:
        self.internal_id = internal_id
        self.external_id = external_id
        self.chunk_id = chunk_id
        self.key = key
        #: Start of the stall clock (registration, or the last arrival).
        self.since = since
        #: A poll of this entry is queued and not yet started (dedupes notices).
        self.is_queued = False
        self.is_timeout_reported = False
        #: A poll found nothing: the consumer asked before the chunk arrived (told to
        #: ``on_chunk_ready`` at the commit).
        self.is_waited = False

    def __repr__(self) -> str:
        return f"LoadEntry({self.internal_id!r}, key={self.key!r})"


class ReceiveSide:
    """Registrations of one adapter; see the module docstring."""

    def __init__(
        self,
        *,
        connector: Connector,
        config: TransferConfig,
        box: EventBox,
        clock: Callable[[], float],
        on_chunk_ready: Callable[[str, bool], None] | None = None,
    ) -> None:
        """``on_chunk_ready(internal_id, is_waited)``: called at each commit of a ready
        chunk, on the receive worker, under the receiver's lock and before the chunk is
        published (an engine's step tracer); it must be quick and take no lock of ours."""
        assert config.receive_from_stage is not None
        self._connector = connector
        self._stage = config.stage_id
        self._from_stage = config.receive_from_stage
        self._stall_timeout_s = config.stall_timeout_s
        self._box = box
        self._clock = clock
        self._on_chunk_ready = on_chunk_ready
        self._lock = threading.Lock()
        #: Notified when a request's last in-flight get ended (``cleanup_receiver`` waits).
        self._gets_ended = threading.Condition(self._lock)
        #: Gets running outside the lock, by internal id (a get is bounded: the connector
        #: contract says it never blocks beyond a short wait for a publish in progress).
        self._gets_in_flight: dict[str, int] = {}
        self._entries: dict[str, LoadEntry] = {}
        self._by_key: dict[str, LoadEntry] = {}
        self._num_received: dict[str, int] = {}  # the get counter, by internal id
        self._exhausted: set[str] = set()
        self._segment_finished: set[str] = set()
        self._counts: dict[str, int] = dict.fromkeys(
            ("num_registered", "num_polls", "num_committed", "num_stale_results", "num_failed",
             "num_timeouts"),
            0,
        )  # fmt: skip

    # ----------------------------------------------------------------- registration

    def register(self, internal_id: str, external_id: str) -> LoadEntry | None:
        """docs/protocol.md §4.7 ``load_async``; returns the new entry to poll once, or None (no-op).

        No-op when the request is already registered, has an undrained ready chunk, or its
        upstream is exhausted (no chunk will ever come).
        """
        problem = request_id_problem(external_id, "external request id")
        if problem is not None:
            self._record(internal_id, str(external_id), FailureKind.RECEIVE_FAILED, problem)
            return None
        with self._lock:
            if internal_id in self._entries or internal_id in self._exhausted:
                return None
            if self._box.has_ready(internal_id):
                return None
            chunk_id = self._num_received.get(internal_id, 0)
            key = make_key(external_id, self._from_stage, chunk_id)
            entry = LoadEntry(internal_id, external_id, chunk_id, key, self._clock())
            entry.is_queued = True  # the caller polls it once: a notice may predate the entry
            self._entries[internal_id] = entry
            self._by_key[key] = entry
            self._counts["num_registered"] += 1
            return entry

    def entries_to_poll(self, keys: Iterable[str], *, include_all: bool) -> list[LoadEntry]:
        """Entries to poll now: those whose key was announced (all on a fallback pass)."""
        out: list[LoadEntry] = []
        with self._lock:
            if include_all:
                candidates: Iterable[LoadEntry | None] = list(self._entries.values())
            else:
                by_key = self._by_key
                candidates = [by_key.get(k) for k in keys]
            for e in candidates:  # one loop (on the arrival leader's path to a chunk)
                if e is not None and not e.is_queued:
                    e.is_queued = True
                    out.append(e)
            return out

    def take_announced(self, key: str) -> LoadEntry | None:
        """``entries_to_poll([key], include_all=False)`` for one key, without the lists:
        the arrival leader's path to a single small chunk."""
        with self._lock:
            e = self._by_key.get(key)
            if e is None or e.is_queued:
                return None
            e.is_queued = True
            return e

    def is_registered(self, internal_id: str) -> bool:
        with self._lock:
            return internal_id in self._entries

    def is_upstream_exhausted(self, internal_id: str) -> bool:
        with self._lock:
            return internal_id in self._exhausted

    def is_segment_finished(self, internal_id: str) -> bool:
        with self._lock:
            return internal_id in self._segment_finished

    # ----------------------------------------------------------------- poll and commit

    def poll(self, entry: LoadEntry) -> None:
        """One get for ``entry``, on a receive worker. The get runs outside the lock."""
        iid = entry.internal_id
        with self._lock:
            if self._entries.get(iid) is not entry:
                return  # stale: cleaned (and maybe re-registered) meanwhile
            entry.is_queued = False
            key = entry.key
            self._counts["num_polls"] += 1
            self._gets_in_flight[iid] = self._gets_in_flight.get(iid, 0) + 1
        try:
            result = self._connector.get(self._from_stage, self._stage, key)
        except Exception as exc:  # the contract says get never raises: fail, don't spin
            result = GetResult(GetStatus.FAILED, error=f"connector.get raised {type(exc).__name__}: {exc}")
        except BaseException:
            with self._lock:
                self._end_get_locked(iid)
            raise
        with self._lock:
            self._end_get_locked(iid)
            if result.status is GetStatus.NOT_YET:
                entry.is_waited = True  # only this poll touches the entry (it was queued once)
                return  # its arrival notice (or the fallback pass) polls it again
            if self._entries.get(iid) is not entry:
                # Cleanup is a commit barrier: the consumed data is dropped, no state recreated.
                self._counts["num_stale_results"] += 1
                return
            reason = self._commit_or_reason_locked(entry, result)
            if reason is None:
                return
            self._unregister_locked(entry)
            self._counts["num_failed"] += 1
        self._record(iid, entry.external_id, FailureKind.RECEIVE_FAILED, reason)

    def _end_get_locked(self, internal_id: str) -> None:
        left = self._gets_in_flight[internal_id] - 1
        if left:
            self._gets_in_flight[internal_id] = left
            return
        del self._gets_in_flight[internal_id]
        self._gets_ended.notify_all()

    def _commit_or_reason_locked(self, entry: LoadEntry, result: GetResult) -> str | None:
        """Commit a READY result that keeps the transfer contract; else why the chunk failed."""
        if result.status is GetStatus.READY:
            problem = check_envelope(result.obj)
            if problem is None:
                self._commit_locked(entry, result.obj)
                return None
            return f"chunk {entry.key!r} violates the transfer contract: {problem}"
        return f"chunk {entry.key!r} could not be received: {result.error or 'no reason given'}"

    def _commit_locked(self, entry: LoadEntry, chunk: ChunkEnvelope) -> None:
        """docs/protocol.md §4.8, under the lock, after the identity check: the flags
        move the request's marks; the body goes to the scheduler as it came."""
        iid = entry.internal_id
        self._num_received[iid] = entry.chunk_id + 1  # consumed from the transport
        if chunk.is_finished:
            self._exhausted.add(iid)
        if chunk.is_segment_finished:
            self._segment_finished.add(iid)
        else:
            self._segment_finished.discard(iid)
        self._unregister_locked(entry)
        self._counts["num_committed"] += 1
        if self._on_chunk_ready is not None:
            self._on_chunk_ready(iid, entry.is_waited)
        self._box.publish_ready(
            ChunkInput(
                internal_id=iid,
                external_id=entry.external_id,
                chunk_id=entry.chunk_id,
                is_finished=chunk.is_finished,
                is_segment_finished=chunk.is_segment_finished,
                payload=chunk.body,
            )
        )

    def _unregister_locked(self, entry: LoadEntry) -> None:
        del self._entries[entry.internal_id]
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]

    # ----------------------------------------------------------------- timeouts, cleanup

    def collect_timeouts(self) -> list[TransferFailure]:
        """Registrations stalled past the timeout, each reported once (scheduler tick)."""
        if self._stall_timeout_s <= 0:
            return []
        now = self._clock()
        out: list[TransferFailure] = []
        with self._lock:
            for e in self._entries.values():
                if not e.is_timeout_reported and now - e.since >= self._stall_timeout_s:
                    e.is_timeout_reported = True
                    self._counts["num_timeouts"] += 1
                    out.append(
                        TransferFailure(
                            e.internal_id,
                            e.external_id,
                            FailureKind.TIMEOUT,
                            f"no chunk {e.key!r} arrived within the stall timeout of "
                            f"{self._stall_timeout_s:g} s",
                            self._stage,
                        )
                    )
        return out

    def cleanup_receiver(self, internal_id: str) -> None:
        """Drop every trace of the request (idempotent); any poll in flight loses identity,
        and this returns once its get ended (see the module docstring). Never call it on a
        receive worker."""
        with self._lock:
            entry = self._entries.get(internal_id)
            if entry is not None:
                self._unregister_locked(entry)
            self._num_received.pop(internal_id, None)
            self._exhausted.discard(internal_id)
            self._segment_finished.discard(internal_id)
            self._box.discard_request(internal_id)
            while internal_id in self._gets_in_flight:
                self._gets_ended.wait()

    def _record(self, internal_id: str, external_id: str, kind: FailureKind, reason: str) -> None:
        self._box.record(TransferFailure(internal_id, external_id, kind, reason, self._stage))

    # ----------------------------------------------------------------- introspection

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_registrations": len(self._entries),
                "num_exhausted": len(self._exhausted),
                **self._counts,
            }

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            maps: dict[str, Any] = {
                "registrations": sorted(self._entries),
                "registrations_by_key": sorted(self._by_key),
                "get_counters": dict(self._num_received),
                "upstream_exhausted": sorted(self._exhausted),
                "segment_finished": sorted(self._segment_finished),
                "gets_in_flight": dict(self._gets_in_flight),
            }
            return {k: v for k, v in maps.items() if v}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_key.clear()
            self._num_received.clear()
            self._exhausted.clear()
            self._segment_finished.clear()
