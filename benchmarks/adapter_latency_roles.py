"""The two processes of ``omnirelay bench adapter``: a sending stage 1 and a receiving stage 2.

Both run the same :func:`schedule` of trials, one chunk in flight. Per trial the receiver
arms itself (a raw ``get`` that finds nothing, or a ``load_async`` whose first poll has
come back empty — seen through :class:`~benchmarks.tracing.TracingConnector`, so
its waiting request is idle before the chunk leaves), then says :class:`Ready`; the
sender waits a random gap, takes ``t0 = perf_counter_ns()`` and either ``put``s on a raw
connector or ``save_async``s on its adapter; the receiver takes ``t1`` when the object
came out of ``get``, or when ``poll_events`` handed the chunk over after ``wait_events``,
and answers :class:`Got`. ``perf_counter_ns`` is CLOCK_MONOTONIC, system-wide on Linux.

A third kind of trial, interleaved with those two, measures the floor: the sender sends one
datagram of a notice's size to a socket the receiver blocks on in ``poll`` (the way the
shm connector's ``wait_arrivals`` does), and ``t1`` is taken when ``recv`` returned it. It
carries no object; it is what waking a process through any notice costs on this machine.

In the ``hol_with`` phase a second request streams 64 MB payloads meanwhile: a pacer
thread on the sender admits the next one as soon as the previous put finished; the
processor builds each (a 64 MB copy) on a send worker; the receiver consumes each and
re-registers at once. Build, put and get intervals of the stream are recorded so the
report can say how many codec chunks really overlapped it.

Placement: with pinning (the default) each process runs on one CPU of its own during the
latency series (a), as in ``bench transfer``. Both processes are unpinned for the
head-of-line series (b): a 64 MB copy and a codec chunk's send in one process need two
CPUs between them (as a stage process with a GPU has); pinned to one, the series would
measure how the kernel time-slices that CPU, not whether the adapter keeps the chunk
from queueing behind the copy.
"""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Literal

import msgspec
import torch

from benchmarks.tracing import TracingConnector
from benchmarks.transfer import pin_to, unpin_process
from omnirelay.connectors import GetStatus, create_connector
from omnirelay.payload import Codes, Meta, OmniPayload
from omnirelay.transfer import BuildRequest, StatelessProcessor, TransferAdapter, TransferConfig

__all__ = [
    "BIG_EXT",
    "Got",
    "Ready",
    "RoleReport",
    "Trial",
    "raw_namespace",
    "receiver_main",
    "schedule",
    "sender_main",
]

Kind = Literal["raw", "adapter", "wake"]
#: The latency series' kinds, interleaved in this order.
LATENCY_KINDS: tuple[Kind, ...] = ("raw", "adapter", "wake")
#: The floor's datagram: as long as a codec chunk's arrival notice.
_WAKE_DATAGRAM = b"w" * 96
#: Adapter stages 1 → 2; raw connector stages 3 → 4, in a namespace of their own so that
#: the two pairs' objects and arrival notices never mix.
SEND_STAGE, RECV_STAGE, RAW_SEND, RAW_RECV = 1, 2, 3, 4
BIG_EXT = "hol_big"
_BIG_PREFIX = BIG_EXT + "_"  # the hooks below run on the measured path: nothing built there
_BIG_SHAPE = (4096, 4096)  # f32: 64 MiB


class Trial(msgspec.Struct, frozen=True):
    phase: str
    index: int
    kind: Kind
    ext: str
    is_last: bool  # the request's terminal chunk (adapter trials)


class Ready(msgspec.Struct, tag=True, frozen=True):
    seq: int


class Got(msgspec.Struct, tag=True, frozen=True):
    seq: int
    t1_ns: int


class StreamDone(msgspec.Struct, tag=True, frozen=True):
    """Sender → receiver: the 64 MB stream's terminal is queued after ``num_chunks`` chunks."""

    num_chunks: int


class RoleReport(msgspec.Struct):
    error: str | None = None
    #: perf_counter_ns per trial (t0 on the sender, t1 on the receiver), schedule order.
    times_ns: list[int] = msgspec.field(default_factory=list)
    #: Per trial on the receiver: when its chunk was published ready (the receive worker's
    #: commit, told to the adapter's ``on_chunk_ready``), perf_counter_ns.
    #: For raw trials, ``times_ns``.
    published_ns: list[int] = msgspec.field(default_factory=list)
    #: Per trial, the codec chunk's connector put (sender) or get (receiver) as (start, end).
    spans_ns: list[tuple[int, int]] = msgspec.field(default_factory=list)
    #: 64 MB stream activity as (start_ns, end_ns): build and put (sender), get (receiver).
    big_build: list[tuple[int, int]] = msgspec.field(default_factory=list)
    big_put: list[tuple[int, int]] = msgspec.field(default_factory=list)
    big_get: list[tuple[int, int]] = msgspec.field(default_factory=list)
    num_big: int = 0
    leak_state: dict[str, Any] = msgspec.field(default_factory=dict)
    num_pending_keys: int = -1
    num_adapter_errors: int = -1
    failures: list[str] = msgspec.field(default_factory=list)


_MSG = msgspec.msgpack.Decoder(Ready | Got | StreamDone)
_ENC = msgspec.msgpack.Encoder()


def schedule(n_latency: int, n_hol: int, warmup: int) -> list[Trial]:
    """Interleaved raw/adapter/wake trials, then the codec request without and with the
    stream."""
    out: list[Trial] = []
    m = n_latency + warmup
    for i in range(m):
        for kind in LATENCY_KINDS:
            out.append(Trial("latency", i, kind, "lat", kind == "adapter" and i == m - 1))
    for phase in ("hol_without", "hol_with"):
        m = n_hol + warmup
        out += [Trial(phase, i, "adapter", f"codec_{phase}", i == m - 1) for i in range(m)]
    return out


def raw_namespace(namespace: str) -> str:
    return namespace + "raw"


def wake_address(namespace: str) -> bytes:
    """The floor series' socket (abstract: nothing on disk)."""
    return f"\0omnirelay-bench-{namespace}-wake".encode()


#: 50 frames of 16 codebooks, flat and codebook-major, as the Talker's processor sends them.
_CODES = torch.randint(0, 2048, (16 * 50,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)


def codec_chunk(seq: int) -> OmniPayload:
    """A steady-state Talker → Code2Wav chunk: 25 new frames + 25 of left context, 16
    codebooks. Its header is the same from chunk to chunk, as the real processor's is
    (same shape, same meta); the trial's number travels in the codes themselves, so the
    receiver still checks it got the right chunk."""
    audio = _CODES.clone()
    audio[0] = seq
    return OmniPayload(codes=Codes(audio=audio), meta=Meta(left_context_size=25))


def chunk_seq(payload: OmniPayload) -> int:
    assert payload.codes is not None and payload.codes.audio is not None
    return int(payload.codes.audio[0])


def _busy_wait_ns(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _send(ctrl: Connection, msg: Any) -> None:
    ctrl.send_bytes(_ENC.encode(msg))


def _recv(ctrl: Connection, timeout: float) -> Any:
    # One C call that releases the GIL at once. ``Connection.poll`` runs tens of µs of
    # Python (a selector) first, and on the sender that Python holds the GIL the send
    # worker needs for the chunk just enqueued: harness cost inside the measured interval.
    ready, _, _ = select.select((ctrl.fileno(),), (), (), timeout)
    if not ready:
        raise TimeoutError(f"no message from the peer within {timeout:g} s")
    return _MSG.decode(ctrl.recv_bytes())


# ---------------------------------------------------------------------- sender


class _Sender:
    def __init__(
        self,
        namespace: str,
        trials: list[Trial],
        ctrl: Connection,
        seed: int,
        wait_s: float,
        all_cpus: set[int],
    ):
        self.all_cpus = all_cpus
        self.unpinned = False
        self.trials = trials
        self.ctrl = ctrl
        self.wait_s = wait_s
        self.rng = random.Random(seed)
        self.report = RoleReport()
        self.raw = create_connector("shm", namespace=raw_namespace(namespace), stage_id=RAW_SEND)
        self.conn = TracingConnector(
            create_connector("shm", namespace=namespace, stage_id=SEND_STAGE), on_put=self._on_put
        )
        self.adapter = TransferAdapter(
            self.conn,
            TransferConfig(stage_id=SEND_STAGE, send_to_stage=RECV_STAGE),
            processor=StatelessProcessor(self._build),
        )
        self.wake_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.wake_addr = wake_address(namespace)
        self.big_base = torch.randn(_BIG_SHAPE, generator=torch.Generator().manual_seed(1))
        self.big_put_done = threading.Event()
        self.codec_put = (0, 0)
        self.stop_stream = threading.Event()

    def _build(self, request: BuildRequest) -> Any:
        """The processor: a stream chunk is built here (a 64 MB copy, on a send worker)."""
        out = request.output
        if request.external_id == BIG_EXT and not request.is_finished:
            t0 = time.perf_counter_ns()
            x = self.big_base.clone()
            self.report.big_build.append((t0, time.perf_counter_ns()))
            return {"x": x, "meta": {"seq": out}}
        return out

    def _on_put(self, key: str, ok: bool, t0: int, t1: int) -> None:
        if not key.startswith(_BIG_PREFIX):
            self.codec_put = (t0, t1)  # one codec chunk in flight: no ambiguity
        else:
            if ok:
                self.report.big_put.append((t0, t1))
            self.big_put_done.set()

    def _stream(self) -> None:
        """Pacer thread: keep one 64 MB payload in flight until told to stop."""
        n = 0
        while not self.stop_stream.is_set():
            self.big_put_done.clear()
            self.adapter.save_async("s-big", BIG_EXT, n)
            n += 1
            if not self.big_put_done.wait(self.wait_s):
                self.report.failures.append("a 64 MB put did not finish in time")
                break
        self.report.num_big = n

    def run(self) -> None:
        pacer: threading.Thread | None = None
        for seq, trial in enumerate(self.trials):
            if trial.phase != "latency" and not self.unpinned:
                unpin_process(self.all_cpus)  # (b) needs more than one CPU: see the module docstring
                self.unpinned = True
            if trial.phase == "hol_with" and pacer is None:
                pacer = threading.Thread(target=self._stream, name="hol-stream", daemon=True)
                pacer.start()
            payload = codec_chunk(seq)
            key = f"{trial.ext}_{RAW_SEND}_{trial.index}"
            ready = _recv(self.ctrl, self.wait_s)
            assert isinstance(ready, Ready) and ready.seq == seq, ready
            _busy_wait_ns(self.rng.randint(20_000, 200_000))  # the receiver goes back to sleep
            t0 = time.perf_counter_ns()
            if trial.kind == "raw":
                result = self.raw.put(RAW_SEND, RAW_RECV, key, payload)
                self.codec_put = (t0, time.perf_counter_ns())
                if not result.ok:
                    raise RuntimeError(f"raw put of {key} failed: {result.error}")
            elif trial.kind == "wake":
                self.wake_sock.sendto(_WAKE_DATAGRAM, self.wake_addr)
                self.codec_put = (t0, time.perf_counter_ns())
            else:
                self.adapter.save_async(f"s-{trial.ext}", trial.ext, payload, is_finished=trial.is_last)
            self.report.times_ns.append(t0)
            got = _recv(self.ctrl, self.wait_s)
            assert isinstance(got, Got) and got.seq == seq, got
            self.report.spans_ns.append(self.codec_put)
            if trial.kind == "raw":
                self.raw.reap_consumed()
        if pacer is not None:
            self.stop_stream.set()
            pacer.join(self.wait_s)
            self.adapter.save_async("s-big", BIG_EXT, None, is_finished=True)
            _send(self.ctrl, StreamDone(self.report.num_big))
        self._drain_failures()

    def _drain_failures(self) -> None:
        ev = self.adapter.poll_events()
        self.report.failures += [f"{f.kind.value} {f.external_id}: {f.reason}" for f in ev.failed]

    def audit(self) -> None:
        self.adapter.flush(self.wait_s)
        _recv(self.ctrl, self.wait_s)  # the receiver consumed everything
        while self.conn.reap_consumed() or self.raw.reap_consumed():
            pass
        self.adapter.flush(self.wait_s)
        self._drain_failures()
        self.report.leak_state = msgspec.json.decode(
            msgspec.json.encode(self.adapter.leak_state(), enc_hook=repr)
        )
        self.report.num_pending_keys = len(self.conn.pending_keys()) + len(self.raw.pending_keys())
        self.report.num_adapter_errors = self.adapter.health()["num_errors"]

    def close(self) -> None:
        self.adapter.shutdown()
        self.raw.close()
        self.wake_sock.close()


def sender_main(
    namespace: str,
    trials_bytes: bytes,
    seed: int,
    wait_s: float,
    ctrl: Connection,
    out: Connection,
    ready: Any,
    cpu: int | None = None,
) -> None:
    all_cpus = os.sched_getaffinity(0)
    pin_to(cpu)
    torch.set_num_threads(1)
    trials = msgspec.msgpack.decode(trials_bytes, type=list[Trial])
    sender: _Sender | None = None
    report = RoleReport()
    try:
        if not ready.wait(wait_s):
            raise TimeoutError("the receiver never became ready")
        sender = _Sender(namespace, trials, ctrl, seed, wait_s, all_cpus)
        report = sender.report
        sender.run()
        sender.audit()
    except BaseException as exc:
        report.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        if sender is not None:
            sender.close()
    out.send_bytes(msgspec.msgpack.encode(report))


# ---------------------------------------------------------------------- receiver


class _Receiver:
    def __init__(
        self, namespace: str, trials: list[Trial], ctrl: Connection, wait_s: float, all_cpus: set[int]
    ):
        self.all_cpus = all_cpus
        self.unpinned = False
        self.trials = trials
        self.ctrl = ctrl
        self.wait_s = wait_s
        self.report = RoleReport()
        self.raw = create_connector("shm", namespace=raw_namespace(namespace), stage_id=RAW_RECV)
        self.conn = TracingConnector(
            create_connector("shm", namespace=namespace, stage_id=RECV_STAGE), on_get=self._on_get
        )
        self.adapter = TransferAdapter(
            self.conn,
            TransferConfig(stage_id=RECV_STAGE, receive_from_stage=SEND_STAGE),
            on_chunk_ready=self._on_ready,
        )
        self.wake_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.wake_sock.bind(wake_address(namespace))
        self.wake_sock.setblocking(False)
        self.wake_poller = select.poll()
        self.wake_poller.register(self.wake_sock, select.POLLIN)
        self.watch_key: str | None = None
        self.codec_get = (0, 0)
        self.published = 0  # ns: the last adapter trial's chunk published ready
        self.first_poll = threading.Event()
        self.big_open = False
        self.num_big = 0

    def _on_ready(self, internal_id: str, is_waited: bool) -> None:
        if internal_id != "r-big":  # the codec chunk of the trial in flight
            self.published = time.perf_counter_ns()

    def _on_get(self, key: str, status: GetStatus, t0: int, t1: int) -> None:
        if key == self.watch_key:
            if status is GetStatus.READY:
                self.codec_get = (t0, t1)
            if not self.first_poll.is_set():  # once: Event.set costs µs on the measured path
                self.first_poll.set()
        elif status is GetStatus.READY and key.startswith(_BIG_PREFIX):
            self.report.big_get.append((t0, t1))

    def run(self) -> None:
        received: dict[str, int] = {}
        for seq, trial in enumerate(self.trials):
            if trial.phase != "latency" and not self.unpinned:
                unpin_process(self.all_cpus)
                self.unpinned = True
            if trial.phase == "hol_with" and not self.big_open:
                self.big_open = True
                self.adapter.load_async("r-big", BIG_EXT)
            if trial.kind == "raw":
                t1 = self._raw_trial(seq, trial)
            elif trial.kind == "wake":
                t1 = self._wake_trial(seq)
            else:
                n = received.get(trial.ext, 0)
                t1 = self._adapter_trial(seq, trial, n)
                received[trial.ext] = n + 1
            self.report.times_ns.append(t1)
            self.report.published_ns.append(self.published if trial.kind == "adapter" else t1)
            self.report.spans_ns.append(self.codec_get)
            _send(self.ctrl, Got(seq, t1))
        if self.big_open:
            done = _recv(self.ctrl, self.wait_s)
            assert isinstance(done, StreamDone), done
            while self.big_open:  # consume the rest of the stream, its terminal included
                self._wait_ready(None)
        self.report.num_big = self.num_big
        _send(self.ctrl, Ready(-1))  # everything consumed: the sender may audit

    def _raw_trial(self, seq: int, trial: Trial) -> int:
        key = f"{trial.ext}_{RAW_SEND}_{trial.index}"
        got = self.raw.get(RAW_SEND, RAW_RECV, key)
        assert got.status is GetStatus.NOT_YET, got
        _send(self.ctrl, Ready(seq))
        deadline = time.monotonic() + self.wait_s
        while True:
            self.raw.wait_arrivals(RAW_RECV, 1.0)
            t_get = time.perf_counter_ns()
            got = self.raw.get(RAW_SEND, RAW_RECV, key)
            if got.status is GetStatus.READY:
                t1 = time.perf_counter_ns()
                self.codec_get = (t_get, t1)
                assert chunk_seq(got.obj) == seq
                return t1
            if got.status is GetStatus.FAILED or time.monotonic() > deadline:
                raise RuntimeError(f"raw get of {key}: {got.status} {got.error}")

    def _wake_trial(self, seq: int) -> int:
        """The floor: block in poll until the sender's datagram wakes us; t1 after recv."""
        _send(self.ctrl, Ready(seq))
        if not self.wake_poller.poll(self.wait_s * 1000.0):
            raise TimeoutError(f"no wake-up datagram within {self.wait_s:g} s")
        t_recv = time.perf_counter_ns()
        data = self.wake_sock.recv(4096)
        t1 = time.perf_counter_ns()
        self.codec_get = (t_recv, t1)
        assert data == _WAKE_DATAGRAM, data
        return t1

    def _adapter_trial(self, seq: int, trial: Trial, chunk_id: int) -> int:
        iid = f"r-{trial.ext}"
        self.watch_key = f"{trial.ext}_{SEND_STAGE}_{chunk_id}"
        self.first_poll.clear()
        if not self.adapter.load_async(iid, trial.ext):
            raise RuntimeError(f"load_async({iid}) was a no-op")
        if not self.first_poll.wait(self.wait_s):  # the waiting request is idle now
            raise TimeoutError(f"the first poll of {self.watch_key} never ran")
        _send(self.ctrl, Ready(seq))
        return self._wait_ready(iid, seq=seq, is_last=trial.is_last)

    def _wait_ready(self, iid: str | None, *, seq: int = -1, is_last: bool = False) -> int:
        """Drain events until ``iid``'s chunk is handed over (None: until the stream ends)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            if not self.adapter.wait_events(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no chunk for {iid or BIG_EXT} within {self.wait_s:g} s")
            ev = self.adapter.poll_events()
            t1 = time.perf_counter_ns()
            if ev.failed or ev.timed_out:
                raise RuntimeError(f"transfer failures: {[*ev.failed, *ev.timed_out]}")
            hit = False
            for c in ev.ready:
                if c.internal_id == "r-big":
                    self._on_big(c.is_finished)
                elif c.internal_id == iid:
                    assert chunk_seq(c.payload) == seq, (chunk_seq(c.payload), seq)
                    assert c.is_finished == is_last
                    if is_last:
                        self.adapter.finish_requests([iid])
                    hit = True
            if hit or (iid is None and not self.big_open):
                return t1

    def _on_big(self, is_finished: bool) -> None:
        if is_finished:
            self.adapter.finish_requests(["r-big"])
            self.big_open = False
        else:
            self.num_big += 1
            self.adapter.load_async("r-big", BIG_EXT)

    def audit(self) -> None:
        self.adapter.flush(self.wait_s)
        self.report.leak_state = msgspec.json.decode(
            msgspec.json.encode(self.adapter.leak_state(), enc_hook=repr)
        )
        self.report.num_pending_keys = len(self.conn.pending_keys())
        self.report.num_adapter_errors = self.adapter.health()["num_errors"]

    def close(self) -> None:
        self.adapter.shutdown()
        self.raw.close()
        self.wake_sock.close()


def receiver_main(
    namespace: str,
    trials_bytes: bytes,
    wait_s: float,
    ctrl: Connection,
    out: Connection,
    ready: Any,
    cpu: int | None = None,
) -> None:
    all_cpus = os.sched_getaffinity(0)
    pin_to(cpu)
    torch.set_num_threads(1)
    trials = msgspec.msgpack.decode(trials_bytes, type=list[Trial])
    receiver: _Receiver | None = None
    report = RoleReport()
    try:
        receiver = _Receiver(namespace, trials, ctrl, wait_s, all_cpus)
        report = receiver.report
        ready.set()  # both arrival sockets are bound
        receiver.run()
        receiver.audit()
    except BaseException as exc:
        report.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        if receiver is not None:
            receiver.close()
    out.send_bytes(msgspec.msgpack.encode(report))
