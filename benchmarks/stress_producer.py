"""The producer process of ``omnirelay bench stress``: stage 1, a sending adapter over shm.

It plays the stage-1 scheduler (``save_async`` one chunk per request per step, cancels)
and the orchestrator (release by id, docs/protocol.md §2.8; id reuse only once both stages let go
of the old generation). Everything it waits for arrives on one inbox queue:

* ``("put", key)`` — from :class:`~benchmarks.tracing.TracingConnector`, after a
  put succeeded: that request may admit its next chunk (one chunk in flight per request,
  like a model step producing one chunk per request);
* ``("put_start", key)`` — a put of an *armed* key began; the send worker blocks in the
  hook until this loop has cancelled the request, so the abort races a put in progress;
* ``("retired", ext)`` — from the adapter's release hook: ``ext``'s sender generation is
  gone (its terminal went out, or its cancel drained);
* consumer messages (:class:`Finished`, :class:`Stopped`, :class:`Released`), read from
  the control pipe by a reader thread.

A request's life here: start → admit chunks → (cancel: wait for both the consumer's
:class:`Released` and the sender's drain → maybe release by prefix → maybe start
generation 1) or (wait for the terminal's retire and the consumer's answer → after an
early stop, release by prefix) → resolved. At most ``window`` requests are open at once.
"""

from __future__ import annotations

import enum
import queue
import random
import threading
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from benchmarks.stress_plan import (
    Audit,
    Cancel,
    ChunkFactory,
    Done,
    Finished,
    Message,
    ProducerReport,
    Released,
    RequestPlan,
    Settings,
    Start,
    Stopped,
    decode_message,
    encode_message,
    jsonable,
    make_chunk,
    producer_iid,
)
from benchmarks.tracing import TracingConnector
from omnirelay.connectors import create_connector
from omnirelay.connectors.shm import sweep
from omnirelay.transfer import (
    BuildRequest,
    ReleaseScope,
    SaveResult,
    TransferAdapter,
    TransferConfig,
    key_prefix,
    make_key,
)

__all__ = ["StressTimeout", "producer_main", "run_control_reader"]

STAGE, NEXT_STAGE = 1, 2
_Item = tuple[str, str] | Message


class StressTimeout(Exception):
    """The run's deadline passed (or the parent asked to stop) before the work was done."""


class Phase(enum.Enum):
    SENDING = "sending"  # admitting chunks
    CANCELLING = "cancelling"  # waiting for Released and the sender's drain
    ENDING = "ending"  # terminal admitted: waiting for its retire and the consumer's answer


class _Request:
    """The producer's books on one request (one generation at a time)."""

    def __init__(self, plan: RequestPlan, gen: int) -> None:
        self.plan = plan
        self.gen = gen
        self.iid = producer_iid(plan.rid, gen)
        self.phase = Phase.SENDING
        self.num_admitted = 0
        self.num_puts = 0
        self.is_put_pending = False  # an admitted chunk whose put has not been reported
        self.is_start_sent = False
        self.is_sender_gone = False  # the generation retired (terminal out, or cancel drained)
        self.answer: Finished | Stopped | Released | None = None  # the consumer's answer

    def describe(self) -> str:
        return (
            f"{self.plan.ext} gen {self.gen} ({self.phase.value}): admitted {self.num_admitted}, "
            f"put {self.num_puts}, put pending {self.is_put_pending}, sender gone {self.is_sender_gone}, "
            f"consumer answer {type(self.answer).__name__ if self.answer else None}"
        )


def run_control_reader(ctrl: Connection, inbox: queue.SimpleQueue[Any], stop: threading.Event) -> None:
    """Forward decoded control messages from ``ctrl`` into ``inbox`` until EOF or ``stop``."""
    while not stop.is_set():
        try:
            if not ctrl.poll(0.2):
                continue
            inbox.put(decode_message(ctrl.recv_bytes()))
        except (EOFError, OSError):
            return


class Producer:
    def __init__(self, settings: Settings, plans: list[RequestPlan], ctrl: Connection, stop: Any) -> None:
        self.s = settings
        self.plans = plans
        self.ctrl = ctrl
        self.stop = stop
        self.report = ProducerReport()
        self.inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.factory = ChunkFactory()
        self.rng = random.Random(settings.seed + 1)
        self.conn = TracingConnector(
            create_connector("shm", namespace=settings.namespace, stage_id=STAGE),
            on_put_start=self._on_put_start,
            on_put=self._on_put,
        )
        #: Keys whose put, once started, waits for the main thread to cancel its request:
        #: the abort then provably races a put in progress (docs/protocol.md §8 item 1, across processes).
        self.armed: dict[str, threading.Event] = {}
        self.adapter = TransferAdapter(
            self.conn,
            TransferConfig(stage_id=STAGE, send_to_stage=NEXT_STAGE),
            processor=self,  # its chunk bodies are the outputs; it watches the releases
        )
        self.open: dict[str, _Request] = {}  # by external id
        self.eligible: set[str] = set()  # external ids that may admit their next chunk now
        self.next_plan = 0
        self.cancels_planned: Counter[str] = Counter()
        self.cancels_observed: Counter[str] = Counter()
        self.cancels_via: Counter[str] = Counter()

    # ------------------------------------------------------------------ hooks (worker threads)

    def _on_put_start(self, key: str) -> None:
        gate = self.armed.get(key)  # dict reads and writes are atomic: no lock needed
        if gate is not None:
            self.inbox.put(("put_start", key))
            if not gate.wait(max(0.0, self.s.deadline - time.monotonic())):
                self.inbox.put(("gate_timeout", key))

    def _on_put(self, key: str, ok: bool, t0: int, t1: int) -> None:
        if ok:
            self.inbox.put(("put", key))

    def build(self, request: BuildRequest) -> Any:
        return request.output

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        if scope is ReleaseScope.REQUEST:
            self.inbox.put(("retired", external_id))

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        self.report.t_start = time.monotonic()
        while True:
            self._fill_window()
            self._admit_eligible()
            if not self.open and self.next_plan == len(self.plans):
                break
            self._handle(self._next_item())
        self.report.t_end = time.monotonic()
        self._send(Done())

    def _next_item(self) -> _Item:
        while True:
            self._drain_failures()
            left = self.s.deadline - time.monotonic()
            if left <= 0 or self.stop.is_set():
                raise StressTimeout(
                    f"the producer hit the deadline with {len(self.open)} requests open and "
                    f"{len(self.plans) - self.next_plan} not started"
                )
            try:
                return self.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue

    def _fill_window(self) -> None:
        while len(self.open) < self.s.window and self.next_plan < len(self.plans):
            plan = self.plans[self.next_plan]
            self.next_plan += 1
            self.report.num_requests_started += 1
            self._start(_Request(plan, 0))

    def _start(self, req: _Request) -> None:
        self.open[req.plan.ext] = req
        if req.gen == 0:
            self._send(Start(req.plan.rid, 0))
            req.is_start_sent = True
            if req.plan.cancel_phase == "before" and req.plan.cancel_after == 0:
                self._cancel(req)
                return
        # A reused id's consumer starts once generation 1's first chunk is out: by then the
        # old generation's exact-key cleanup, queued ahead of it on the id's lane, has run.
        self.eligible.add(req.plan.ext)

    def _admit_eligible(self) -> None:
        ready = sorted(self.eligible)
        self.rng.shuffle(ready)
        for ext in ready:
            req = self.open[ext]
            if req.phase is Phase.SENDING and not req.is_put_pending:
                self._admit(req)
        self.eligible.clear()

    def _admit(self, req: _Request) -> None:
        n, last = req.num_admitted, req.num_admitted == self.s.num_chunks - 1
        payload = make_chunk(self.factory, req.plan, req.gen, n)
        is_cancel_point = (
            req.gen == 0 and req.plan.cancel_phase in ("before", "during") and n + 1 == req.plan.cancel_after
        )
        armed = make_key(req.plan.ext, STAGE, n) if is_cancel_point and req.plan.cancel_at_put_start else None
        if armed is not None:
            # Before the chunk is enqueued: a send worker may start its put before
            # save_async returns here.
            self.armed[armed] = threading.Event()
        admission = self.adapter.save_async(req.iid, req.plan.ext, payload, is_finished=last)
        if admission is not SaveResult.ENQUEUED:
            if armed is not None:
                del self.armed[armed]
            self.report.problems.append(f"{req.plan.ext} gen {req.gen} chunk {n}: save_async {admission}")
            return
        req.num_admitted += 1
        req.is_put_pending = True
        self.report.num_admitted += 1
        self.report.num_big_puts += int(n in req.plan.big[req.gen])
        if last:
            req.phase = Phase.ENDING
        if is_cancel_point and armed is None:
            self._cancel(req)

    # ------------------------------------------------------------------ events

    def _handle(self, item: _Item) -> None:
        if isinstance(item, tuple):
            kind, name = item
            if kind == "put":
                self._on_put_done(name.rsplit("_", 2)[0])
            elif kind == "put_start":
                req = self.open.get(name.rsplit("_", 2)[0])
                if req is not None and req.phase is Phase.SENDING:
                    self._cancel(req)  # returns at once: it never waits for the blocked put
                self.armed.pop(name).set()  # now let the put go on
            elif kind == "gate_timeout":
                self.report.problems.append(f"the put of {name} waited for its cancel until the deadline")
            else:
                self._on_retired(name)
            return
        if isinstance(item, Finished | Stopped | Released):
            req = self.open.get(self.plans[item.rid].ext)
            if req is None or req.gen != item.gen:
                self.report.problems.append(f"unexpected {item!r}")
                return
            if (req.phase is Phase.CANCELLING) != isinstance(item, Released):
                if isinstance(item, Finished):
                    return  # it finished before the cancel reached it; Released follows
                self.report.problems.append(f"{item!r} for {req.describe()}")
                return
            req.answer = item
            if isinstance(item, Finished) and item.num_received != self.s.num_chunks:
                self.report.problems.append(f"{req.plan.ext} finished with {item.num_received} chunks")
            self._progress(req)
            return
        self.report.problems.append(f"unexpected message {item!r}")

    def _on_put_done(self, ext: str) -> None:
        req = self.open.get(ext)
        if req is None:
            self.report.problems.append(f"a put of {ext} was reported after the request was resolved")
            return
        req.num_puts += 1
        req.is_put_pending = False
        if req.gen == 1 and not req.is_start_sent:
            self._send(Start(req.plan.rid, 1))
            req.is_start_sent = True
        if req.phase is Phase.SENDING:
            self.eligible.add(ext)

    def _on_retired(self, ext: str) -> None:
        req = self.open.get(ext)
        if req is None or self.adapter.sender_generation(ext) is not None:
            return  # a late notice, or a no-op cleanup of a resolved request
        if req.phase is Phase.SENDING:
            return  # not retired: nothing was admitted yet (the hook of a no-token cleanup)
        req.is_sender_gone = True
        if req.phase is Phase.ENDING and req.gen == 0 and req.plan.cancel_phase == "after":
            self._cancel(req)  # every chunk is out, the terminal included
            return
        self._progress(req)

    def _cancel(self, req: _Request) -> None:
        ext = req.plan.ext
        gen = self.adapter.sender_generation(ext)
        if gen is None:  # nothing admitted yet, or the terminal went out and retired it
            observed = "after_terminal" if req.num_admitted == self.s.num_chunks else "before_first_put"
        elif gen["in_flight"]:
            observed = "task_in_flight"  # a chunk is being built or put right now: the WAIT path
        else:
            observed = "before_first_put" if gen["num_puts"] == 0 else "between_puts"
        assert req.plan.cancel_phase is not None
        self.cancels_planned[req.plan.cancel_phase] += 1
        self.cancels_observed[observed] += 1
        self.cancels_via[req.plan.cancel_via] += 1
        req.phase = Phase.CANCELLING
        req.is_sender_gone = False
        req.answer = None  # only the consumer's Released counts now (a Finished may have come first)
        self.eligible.discard(ext)
        if req.plan.cancel_via == "cleanup":
            self.adapter.cleanup(req.iid, ext)
        else:
            self.adapter.cleanup_sender(ext, req.iid)
        self._send(Cancel(req.plan.rid, req.gen))

    def _progress(self, req: _Request) -> None:
        """Act once both sides of a request are done with its current generation."""
        if not req.is_sender_gone or req.answer is None:
            return
        ext, n = req.plan.ext, self.s.num_chunks
        got = req.answer.num_received
        if req.phase is Phase.CANCELLING:
            if req.plan.cancel_via == "cleanup_sender":
                self.adapter.finish_requests([req.iid])  # the scheduler drops the request
            if req.plan.cancel_phase == "after":
                # The terminal went out, so the sender cleaned nothing: the orchestrator
                # releases what the consumer did not read (one get may have raced the cancel).
                released = self.conn.release_prefix(key_prefix(ext, STAGE))
                self.report.num_removed_prefix_cancel += released
                if not n - got - 1 <= released <= n - got:
                    self.report.problems.append(
                        f"{ext}: released {released} chunks after cancel, consumer read {got} of {n}"
                    )
            if req.plan.reuse and req.gen == 0:
                self.report.num_reused += 1
                del self.open[ext]
                self._start(_Request(req.plan, 1))
                return
        elif isinstance(req.answer, Stopped):
            released = self.conn.release_prefix(key_prefix(ext, STAGE))
            self.report.num_removed_prefix_stop += released
            if released != req.num_puts - got:
                self.report.problems.append(
                    f"{ext}: released {released} chunks after an early stop at {got} of {req.num_puts}"
                )
        del self.open[ext]
        self.report.num_resolved += 1

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg: Message) -> None:
        self.ctrl.send_bytes(encode_message(msg))

    def _drain_failures(self) -> None:
        events = self.adapter.poll_events()
        for f in (*events.failed, *events.timed_out):
            self.report.failures.append(f"{f.kind.value} {f.external_id}/{f.internal_id}: {f.reason}")
        for lst in self.adapter.take_external_failures().values():
            for f in lst:
                if not any(f.reason in x for x in self.report.failures):
                    self.report.failures.append(f"{f.kind.value} {f.external_id}: {f.reason}")

    def audit(self) -> None:
        """Leak audit once every request is resolved: queues idle, consumed keys reaped."""
        a = Audit()
        a.is_flushed = self.adapter.flush(self.s.flush_timeout_s)
        while self.conn.reap_consumed():
            pass
        a.is_flushed &= self.adapter.flush(self.s.flush_timeout_s)  # its pass also settles the budget
        self._drain_failures()
        keys = self.conn.pending_keys()
        a.num_pending_keys, a.pending_keys = len(keys), keys[:20]
        a.leak_state = jsonable(self.adapter.leak_state())
        a.live_objects = [
            f"{o.kind}:{o.key or o.name}"
            for o in sweep(self.s.namespace).objects
            if o.kind in ("object", "claim", "unknown")
        ]
        health = self.adapter.health()
        a.live_bytes = health["connector"]["live_bytes"]
        a.num_adapter_errors, a.last_adapter_error = health["num_errors"], health["last_error"]
        self.report.sender_stats = jsonable(health["sender"])
        self.report.audit = a

    def finalize(self) -> None:
        r = self.report
        r.t_end = r.t_end or time.monotonic()
        r.num_puts, r.num_put_failures, r.bytes_put = (
            self.conn.num_puts_ok,
            self.conn.num_put_failures,
            self.conn.bytes_put,
        )
        r.num_removed_exact, r.num_cleanup_calls = self.conn.num_removed_exact, self.conn.num_cleanup_calls
        r.cancels_planned, r.cancels_observed = dict(self.cancels_planned), dict(self.cancels_observed)
        r.cancels_via = dict(self.cancels_via)
        r.open_requests = [req.describe() for req in self.open.values()][:20]


def producer_main(
    settings_bytes: bytes,
    plans_bytes: bytes,
    ctrl: Connection,
    out: Connection,
    consumer_ready: Any,
    stop: Any,
) -> None:
    """Process entry point (spawn): run, audit, report on ``out``, shut down."""
    import torch

    torch.set_num_threads(1)
    settings = msgspec.msgpack.decode(settings_bytes, type=Settings)
    plans = msgspec.msgpack.decode(plans_bytes, type=list[RequestPlan])
    producer: Producer | None = None
    error: str | None = None
    try:
        if not consumer_ready.wait(max(0.0, settings.deadline - time.monotonic())):
            raise StressTimeout("the consumer never became ready")
        producer = Producer(settings, plans, ctrl, stop)
        reader_stop = threading.Event()
        threading.Thread(
            target=run_control_reader, args=(ctrl, producer.inbox, reader_stop), daemon=True
        ).start()
        producer.run()
        producer.audit()
        reader_stop.set()
    except StressTimeout as exc:
        error = f"timed out: {exc}"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    report = producer.report if producer is not None else ProducerReport()
    if producer is not None:
        producer.finalize()
        if error is not None:
            report.audit.leak_state = jsonable(producer.adapter.leak_state())
        producer.adapter.shutdown()
    report.error = error
    out.send_bytes(msgspec.msgpack.encode(report))
