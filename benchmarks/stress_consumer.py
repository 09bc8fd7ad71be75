"""The consumer process of ``omnirelay bench stress``: stage 2, a receiving adapter over shm.

It plays the stage-2 scheduler: at most ``consumer_window`` requests run at once (the
others wait in arrival order, their chunks piling up unread, like a downstream stage with
fewer slots than its upstream), ``load_async`` for a running request's next chunk, drain ready
chunks, check each one (request, generation and index, in order, exactly once), and
release requests — ``finish_requests`` after the terminal, ``cleanup_receiver`` then
``finish_requests`` on an early stop or an abort. The main thread is the only one that
touches the adapter's scheduler surface; two helper threads feed its inbox:

* the control reader: decoded :class:`Start` / :class:`Cancel` / :class:`Done`;
* the event pump: blocks in ``wait_events`` and posts a wake-up, then waits until the main
  thread has drained (so it does not spin while events sit undrained).

Because only the main thread drains ``poll_events``, ``cleanup_receiver`` is a clean
barrier: no chunk of a released request can surface afterwards.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from benchmarks.stress_plan import (
    Audit,
    Cancel,
    ChunkFactory,
    ConsumerReport,
    Done,
    Finished,
    Message,
    Released,
    RequestPlan,
    Settings,
    Start,
    Stopped,
    check_chunk,
    consumer_iid,
    encode_message,
    jsonable,
)
from benchmarks.stress_producer import StressTimeout, run_control_reader
from omnirelay.connectors import create_connector
from omnirelay.transfer import ChunkInput, TransferAdapter, TransferConfig

__all__ = ["consumer_main"]

STAGE, PREV_STAGE = 2, 1
_WAKE = "wake"


class _Track:
    """The consumer's books on one generation of one request."""

    __slots__ = ("gen", "iid", "is_open", "is_running", "num_received", "plan")

    def __init__(self, plan: RequestPlan, gen: int) -> None:
        self.plan = plan
        self.gen = gen
        self.iid = consumer_iid(plan.rid, gen)
        self.num_received = 0
        self.is_open = True
        self.is_running = False


class Consumer:
    def __init__(self, settings: Settings, plans: list[RequestPlan], ctrl: Connection, stop: Any) -> None:
        self.s = settings
        self.plans = plans
        self.ctrl = ctrl
        self.stop = stop
        self.report = ConsumerReport()
        self.factory = ChunkFactory()
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.drained = threading.Event()
        self.conn = create_connector("shm", namespace=settings.namespace, stage_id=STAGE)
        self.adapter = TransferAdapter(
            self.conn, TransferConfig(stage_id=STAGE, receive_from_stage=PREV_STAGE)
        )
        self.tracks: dict[str, _Track] = {}  # by internal id; kept after release (the bench's books)
        self.waiting: deque[_Track] = deque()  # started, not yet running
        self.num_open = 0
        self.num_running = 0
        self.is_producer_done = False

    def pump(self, stop: threading.Event) -> None:
        """Event pump thread: one wake-up per batch of events, then wait until drained."""
        while not stop.is_set():
            if self.adapter.wait_events(0.2):
                self.drained.clear()
                self.inbox.put(_WAKE)
                while not self.drained.wait(0.2) and not stop.is_set():
                    pass

    def run(self) -> None:
        while not (self.is_producer_done and self.num_open == 0):
            item = self._next_item()
            if item == _WAKE:
                self._drain()
                self.drained.set()
            elif isinstance(item, Start):
                self._start(item)
            elif isinstance(item, Cancel):
                self._cancel(item)
            elif isinstance(item, Done):
                self.is_producer_done = True
            else:
                self.report.problems.append(f"unexpected message {item!r}")

    def _next_item(self) -> Any:
        while True:
            left = self.s.deadline - time.monotonic()
            if left <= 0 or self.stop.is_set():
                raise StressTimeout(
                    f"the consumer hit the deadline with {self.num_open} requests open "
                    f"({self.num_running} running)" + ("" if self.is_producer_done else ", producer not done")
                )
            try:
                return self.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue

    def _start(self, msg: Start) -> None:
        track = _Track(self.plans[msg.rid], msg.gen)
        if track.iid in self.tracks:
            self.report.problems.append(f"{track.iid} started twice")
            return
        self.tracks[track.iid] = track
        self.num_open += 1
        self.waiting.append(track)
        self._schedule()

    def _schedule(self) -> None:
        while self.waiting and self.num_running < self.s.consumer_window:
            track = self.waiting.popleft()
            track.is_running = True
            self.num_running += 1
            self._load(track)

    def _load(self, track: _Track) -> None:
        if not self.adapter.load_async(track.iid, track.plan.ext):
            self.report.problems.append(f"{track.iid}: load_async was a no-op at chunk {track.num_received}")

    def _drain(self) -> None:
        events = self.adapter.poll_events()
        for f in (*events.failed, *events.timed_out):
            self.report.failures.append(f"{f.kind.value} {f.external_id}/{f.internal_id}: {f.reason}")
        for chunk in events.ready:
            self._on_chunk(chunk)

    def _on_chunk(self, chunk: ChunkInput) -> None:
        track = self.tracks.get(chunk.internal_id)
        if track is None or not track.is_open:
            self.report.problems.append(f"chunk {chunk.chunk_id} of {chunk.internal_id} after its release")
            return
        plan, idx = track.plan, track.num_received
        problem = check_chunk(self.factory, plan, track.gen, idx, chunk.payload)
        if problem is None and chunk.chunk_id != idx:
            problem = f"adapter chunk id {chunk.chunk_id}"
        if problem is not None:
            self.report.problems.append(f"{track.iid} chunk {idx}: {problem}")
        track.num_received += 1
        is_big = idx in plan.big[track.gen]
        self.report.num_delivered += 1
        self.report.num_big_delivered += int(is_big)
        self.report.bytes_delivered += _tensor_bytes(chunk.payload)
        last = idx == self.s.num_chunks - 1
        if chunk.is_finished != last:
            self.report.problems.append(f"{track.iid} chunk {idx}: is_finished={chunk.is_finished}")
        if last:
            self._close(track)
            self.adapter.finish_requests([track.iid])
            self.report.num_completed += 1
            self.report.num_completed_reused += int(track.gen == 1)
            self.report.num_completed_then_cancelled += int(track.gen == 0 and plan.cancel_phase is not None)
            self._send(Finished(plan.rid, track.gen, track.num_received))
        elif plan.stop_after is not None and track.gen == 0 and track.num_received == plan.stop_after:
            self._close(track)
            self.adapter.cleanup_receiver(track.iid)  # stop reading midway
            self.adapter.finish_requests([track.iid])
            self.report.num_stopped += 1
            self._send(Stopped(plan.rid, track.gen, track.num_received))
        else:
            self._load(track)

    def _cancel(self, msg: Cancel) -> None:
        iid = consumer_iid(msg.rid, msg.gen)
        track = self.tracks.get(iid)
        if track is None:
            self.report.problems.append(f"cancel of {iid}, which never started")
            return
        if track.is_open:
            self._close(track)
            self.adapter.cleanup_receiver(iid)
            self.adapter.finish_requests([iid])
        # No get of the old registration may still be in flight when the producer is told:
        # it could otherwise claim a reused id's new chunk under the same key (docs/protocol.md §10.3).
        if not self.adapter.flush(self.s.flush_timeout_s):
            raise StressTimeout(f"the receive queues did not drain within {self.s.flush_timeout_s} s")
        self.report.num_released += 1
        self._send(Released(msg.rid, msg.gen, track.num_received))

    def _close(self, track: _Track) -> None:
        track.is_open = False
        self.num_open -= 1
        if track.is_running:
            track.is_running = False
            self.num_running -= 1
        else:
            self.waiting.remove(track)
        self._schedule()

    def _send(self, msg: Message) -> None:
        self.ctrl.send_bytes(encode_message(msg))

    def audit(self) -> None:
        a = Audit()
        a.is_flushed = self.adapter.flush(self.s.flush_timeout_s)
        self._drain()
        keys = self.conn.pending_keys()
        a.num_pending_keys, a.pending_keys = len(keys), keys[:20]
        a.leak_state = jsonable(self.adapter.leak_state())
        health = self.adapter.health()
        a.live_bytes = health["connector"]["live_bytes"]
        a.num_adapter_errors, a.last_adapter_error = health["num_errors"], health["last_error"]
        self.report.receiver_stats = jsonable(health["receiver"])
        self.report.audit = a

    def finalize(self) -> None:
        h = self.conn.health()
        r = self.report
        r.num_gets, r.bytes_got, r.num_get_failures = h.num_gets, h.bytes_got, h.num_get_failures
        r.open_requests = [
            f"{t.iid} ({t.plan.ext}): read {t.num_received}" for t in self.tracks.values() if t.is_open
        ][:20]


def _tensor_bytes(payload: Any) -> int:
    total = 0
    for part in payload.values():
        if isinstance(part, dict):
            total += sum(int(v.numel() * v.element_size()) for v in part.values() if hasattr(v, "numel"))
    return total


def consumer_main(
    settings_bytes: bytes,
    plans_bytes: bytes,
    ctrl: Connection,
    out: Connection,
    consumer_ready: Any,
    stop: Any,
) -> None:
    """Process entry point (spawn): bind, signal ready, run, audit, report on ``out``."""
    import torch

    torch.set_num_threads(1)
    settings = msgspec.msgpack.decode(settings_bytes, type=Settings)
    plans = msgspec.msgpack.decode(plans_bytes, type=list[RequestPlan])
    consumer: Consumer | None = None
    error: str | None = None
    helpers_stop = threading.Event()
    try:
        consumer = Consumer(settings, plans, ctrl, stop)
        for target, args in (
            (run_control_reader, (ctrl, consumer.inbox, helpers_stop)),
            (consumer.pump, (helpers_stop,)),
        ):
            threading.Thread(target=target, args=args, daemon=True).start()
        consumer_ready.set()  # its arrival socket is bound: the producer may put
        consumer.run()
        consumer.audit()
    except StressTimeout as exc:
        error = f"timed out: {exc}"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    helpers_stop.set()
    report = consumer.report if consumer is not None else ConsumerReport()
    if consumer is not None:
        consumer.finalize()
        if error is not None:
            report.audit.leak_state = jsonable(consumer.adapter.leak_state())
        consumer.adapter.shutdown()
    report.error = error
    out.send_bytes(msgspec.msgpack.encode(report))
