"""``omnirelay bench transfer``: connector latency and throughput across two processes.

For each payload, a producer process and a consumer process move objects through:

* ``ours``: the ``shm`` connector (consumer blocks in ``wait_arrivals``, then ``get``);
* ``baseline``: pickle over ``multiprocessing.shared_memory``, one segment per key,
  a readiness word written last, consumer polling by name (what a simple
  implementation does);

and the **physical limit** is measured in the same run: two ``memcpy`` of the same bytes
(into shared memory, out of it) between preallocated buffers.

Latency is one-way: ``perf_counter_ns`` (CLOCK_MONOTONIC, system-wide) in the producer
right before ``put`` and in the consumer right after the object is rebuilt; one object
in flight, a random gap before each put so the consumer really sleeps. Throughput:
``n`` back-to-back puts, objects/s = n / (last get − first put).

Every pair of processes (ours, baseline and the floor alike) is pinned to two CPUs,
producer on the first and consumer on the second (``pin=False`` / ``--no-pin`` to let
the scheduler place them), as ``transfer_anchor.py --pin`` does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "PAYLOADS",
    "BenchRow",
    "ConnectorTransport",
    "make_payload",
    "measure",
    "pin_cpus",
    "pin_to",
    "run_transfer_bench",
    "unpin_process",
]

#: name -> (description, trials for latency, objects for throughput)
PAYLOADS: dict[str, tuple[str, int, int]] = {
    "codec_chunk": ("int64 16x50 codes + meta (6.4 KB)", 2000, 2000),
    "hidden_step": ("bf16 1x2048 hidden step (4 KB)", 2000, 2000),
    "prefill_4mb": ("f32 512x2048 prefill (4 MB)", 200, 100),
    "tensor_64mb": ("f32 4096x4096 (64 MB)", 25, 10),
}


def make_payload(name: str) -> Any:
    g = torch.Generator().manual_seed(0)
    if name == "codec_chunk":
        return {
            "codes": {"audio": torch.randint(0, 2048, (16, 50), generator=g, dtype=torch.int64)},
            "meta": {"finished": False, "left_context_size": 25},
        }
    if name == "hidden_step":
        return {"hidden_states": {"output": torch.randn(1, 2048, generator=g).to(torch.bfloat16)}}
    if name == "prefill_4mb":
        return {"embed": {"prefill": torch.randn(512, 2048, generator=g)}}
    if name == "tensor_64mb":
        return {"x": torch.randn(4096, 4096, generator=g)}
    raise KeyError(name)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


# ---------------------------------------------------------------------- transports
class ConnectorTransport:
    """A connector as a transport: the producer puts as stage 1, the consumer gets as
    stage 2, waiting on arrival notices. Subclasses set ``self.conn``."""

    conn: Any

    def put(self, key: str, obj: Any) -> None:
        res = self.conn.put(1, 2, key, obj)
        if not res.ok:
            raise RuntimeError(res.error)
        self.conn.reap_consumed()

    def get(self, key: str) -> Any:
        while True:
            got = self.conn.get(1, 2, key)
            if got.is_ready:
                return got.obj
            if got.error:
                raise RuntimeError(got.error)
            self.conn.wait_arrivals(2, timeout=1.0)

    def close(self) -> None:
        self.conn.close()


class _Ours(ConnectorTransport):
    def __init__(self, role: str, namespace: str, address: str | None = None) -> None:
        from omnirelay.connectors import create_connector

        self.conn = create_connector("shm", namespace=namespace, stage_id=1 if role == "producer" else 2)
        self.role = role


class _PickleShm:
    """Baseline: pickle.dumps -> new SharedMemory per key -> consumer polls by name."""

    def __init__(self, role: str, namespace: str, address: str | None = None) -> None:
        from multiprocessing import resource_tracker, shared_memory

        self.shm_mod = shared_memory
        self.tracker = resource_tracker
        self.prefix = f"omnirelay-{namespace}-b-"

    def _untrack(self, shm: Any) -> None:
        try:
            self.tracker.unregister(shm._name, "shared_memory")
        except Exception:
            pass

    def put(self, key: str, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=5)
        # Producer and consumer share one resource tracker (children of one parent); the
        # consumer's unlink() unregisters the name, so the producer must not.
        shm = self.shm_mod.SharedMemory(name=self.prefix + key, create=True, size=8 + len(data))
        buf = shm.buf
        assert buf is not None
        buf[8 : 8 + len(data)] = data
        struct.pack_into("<Q", buf, 0, len(data))  # readiness word last
        del buf
        shm.close()

    def get(self, key: str) -> Any:
        while True:
            try:
                shm = self.shm_mod.SharedMemory(name=self.prefix + key)
            except (FileNotFoundError, ValueError):  # not there yet, or not sized yet
                time.sleep(0)
                continue
            buf = shm.buf
            assert buf is not None
            n = struct.unpack_from("<Q", buf, 0)[0]
            if n == 0:
                del buf
                shm.close()
                continue
            obj = pickle.loads(bytes(buf[8 : 8 + n]))
            del buf
            shm.close()
            shm.unlink()  # also unregisters it from the resource tracker
            return obj

    def close(self) -> None:
        pass


_TRANSPORTS: dict[str, Callable[[str, str, str | None], Any]] = {"ours": _Ours, "baseline": _PickleShm}


def _transport(kind: str) -> Callable[[str, str, str | None], Any]:
    """``kind``'s transport class; the cross-host ones (``nixl``, ``zmq_tcp``) live in
    benchmarks/transfer_hosts.py. A consumer's ``address`` (where it listens) reaches the
    producer's constructor."""
    if kind not in _TRANSPORTS:
        from benchmarks.transfer_hosts import HOST_TRANSPORTS

        _TRANSPORTS.update(HOST_TRANSPORTS)
    return _TRANSPORTS[kind]


# ---------------------------------------------------------------------- processes
def unpin_process(cpus: set[int]) -> None:
    """Let every thread of this process run on ``cpus`` again (affinity is per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):
            pass  # a thread that just exited, or not allowed


def pin_to(cpu: int | None) -> None:
    """Pin this process (all its threads) to ``cpu``; None, or not allowed here: unpinned."""
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            pass  # not allowed here: run unpinned


def pin_cpus(pin: bool) -> tuple[int | None, int | None]:
    """(producer CPU, consumer CPU): the first two CPUs this process may use, or
    (None, None) unpinned. Pinning keeps the scheduler from placing the woken consumer on
    the producer's CPU (where it waits for the producer to yield) or migrating either."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if pin and len(cpus) >= 2 else (None, None)


def _consumer_main(
    kind: str,
    namespace: str,
    payload: str,
    n_lat: int,
    n_tp: int,
    peer: Any,
    out: Any,
    cpu: int | None = None,
) -> None:
    pin_to(cpu)
    torch.set_num_threads(1)
    tr = _transport(kind)("consumer", namespace, None)
    peer.send(("ready", getattr(tr, "address", None)))
    try:
        got: list[int] = []
        for i in range(n_lat):
            tr.get(f"L{i}_1_0")
            got.append(time.perf_counter_ns())
            peer.send(i)  # ack: the producer may send the next one
        for i in range(n_tp):
            tr.get(f"T{i}_1_0")
        t_last = time.perf_counter_ns()
        peer.send("done")
        out.send((got, t_last))
    finally:
        tr.close()


def _producer_main(
    kind: str,
    namespace: str,
    payload: str,
    n_lat: int,
    n_tp: int,
    peer: Any,
    out: Any,
    cpu: int | None = None,
) -> None:
    pin_to(cpu)
    torch.set_num_threads(1)
    _, address = peer.recv()  # consumer ready (and where it listens)
    tr = _transport(kind)("producer", namespace, address)
    obj = make_payload(payload)
    rng = random.Random(1)
    try:
        sent: list[int] = []
        for i in range(n_lat):
            gap_end = time.perf_counter_ns() + rng.randint(0, 200_000)
            while time.perf_counter_ns() < gap_end:
                pass
            t0 = time.perf_counter_ns()
            tr.put(f"L{i}_1_0", obj)
            sent.append(t0)
            peer.recv()
        t_first = time.perf_counter_ns()
        for i in range(n_tp):
            tr.put(f"T{i}_1_0", obj)
        peer.recv()  # "done": the consumer has read everything
        out.send((sent, t_first))
    finally:
        tr.close()


@dataclass
class BenchRow:
    payload: str
    description: str
    nbytes: int
    transport: str
    p50_us: float
    p99_us: float
    mean_us: float
    objects_per_s: float
    gbytes_per_s: float
    n_latency: int
    n_throughput: int
    samples_us: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples_us")
        return d


def measure(
    kind: str, payload: str, n_lat: int, n_tp: int, *, pin: bool = True, run_tag: str = "bench"
) -> BenchRow:
    ctx = mp.get_context("spawn")
    p_cpu, c_cpu = pin_cpus(pin)
    namespace = f"{run_tag}{uuid.uuid4().hex[:6]}"
    prod_end, cons_end = ctx.Pipe()
    c_out_r, c_out_w = ctx.Pipe(duplex=False)
    p_out_r, p_out_w = ctx.Pipe(duplex=False)
    cons = ctx.Process(
        target=_consumer_main, args=(kind, namespace, payload, n_lat, n_tp, cons_end, c_out_w, c_cpu)
    )
    prod = ctx.Process(
        target=_producer_main, args=(kind, namespace, payload, n_lat, n_tp, prod_end, p_out_w, p_cpu)
    )
    cons.start()
    prod.start()
    try:
        if not c_out_r.poll(900) or not p_out_r.poll(60):
            raise RuntimeError(f"{kind}/{payload}: producer or consumer did not finish")
        got, t_last = c_out_r.recv()
        sent, t_first = p_out_r.recv()
    finally:
        for proc in (prod, cons):
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    from omnirelay.connectors.shm import sweep

    sweep(namespace, reclaim=True)  # nothing should be there; the leak audit reports it
    lat = [(g - s) / 1e3 for s, g in zip(sent, got)]
    lat = lat[min(len(lat) // 10, 20) :]  # warm-up: first pool fills, first mappings
    dt = max(1, t_last - t_first) / 1e9
    nbytes = _nbytes(make_payload(payload))
    return BenchRow(
        payload=payload,
        description=PAYLOADS[payload][0],
        nbytes=nbytes,
        transport=kind,
        p50_us=statistics.median(lat),
        p99_us=_percentile(lat, 99),
        mean_us=statistics.fmean(lat),
        objects_per_s=n_tp / dt,
        gbytes_per_s=n_tp * nbytes / dt / 1e9,
        n_latency=len(lat),
        n_throughput=n_tp,
        samples_us=lat,
    )


def _floor_consumer(ns: str, n: int, nbytes: int, peer: Any, out: Any, cpu: int | None = None) -> None:
    pin_to(cpu)
    import mmap
    import select
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(f"\0omnirelay-{ns}-floor".encode())
    s.setblocking(False)
    fd = os.open(f"/dev/shm/omnirelay-{ns}-floor", os.O_RDWR)
    src = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    peer.send("ready")
    got = []
    for i in range(n):
        select.select([s], [], [], 30)
        s.recv(64)
        np.copyto(dst, src)
        got.append(time.perf_counter_ns())
        peer.send(i)
    out.send(got)


def _floor_producer(ns: str, n: int, nbytes: int, peer: Any, out: Any, cpu: int | None = None) -> None:
    pin_to(cpu)
    import mmap
    import socket

    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    fd = os.open(f"/dev/shm/omnirelay-{ns}-floor", os.O_RDWR)
    dst = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    src = np.ones(nbytes, dtype=np.uint8)
    rng = random.Random(1)
    peer.recv()
    sent = []
    for _ in range(n):
        gap_end = time.perf_counter_ns() + rng.randint(0, 200_000)
        while time.perf_counter_ns() < gap_end:
            pass
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        c.sendto(b"k", f"\0omnirelay-{ns}-floor".encode())
        sent.append(t0)
        peer.recv()
    out.send(sent)


def floor_us(payload: str, n: int, *, pin: bool = True, run_tag: str = "bench") -> float:
    """One-way p50 of the bare minimum across two processes: copy the bytes into a mapped
    shared buffer, send a 1-byte datagram, wake the sleeping consumer, copy the bytes out."""
    nbytes = _nbytes(make_payload(payload))
    ns = f"{run_tag}{uuid.uuid4().hex[:6]}"
    path = f"/dev/shm/omnirelay-{ns}-floor"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        cr, cw = ctx.Pipe(duplex=False)
        pr, pw = ctx.Pipe(duplex=False)
        p_cpu, c_cpu = pin_cpus(pin)
        cons = ctx.Process(target=_floor_consumer, args=(ns, n, nbytes, a, cw, c_cpu))
        prod = ctx.Process(target=_floor_producer, args=(ns, n, nbytes, b, pw, p_cpu))
        cons.start()
        prod.start()
        got, sent = cr.recv(), pr.recv()
        cons.join(60)
        prod.join(60)
    finally:
        os.close(fd)
        os.unlink(path)
    lat = [(g - s) / 1e3 for s, g in zip(sent, got)][min(n // 10, 20) :]
    return statistics.median(lat)


def memcpy_limit_us(payload: str, repeats: int = 30) -> float:
    """Median time of two memcpy of the payload's bytes between preallocated buffers."""
    n = _nbytes(make_payload(payload))
    src = np.ones(n, dtype=np.uint8)
    mid = np.empty(n, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)
    np.copyto(mid, src)
    np.copyto(dst, mid)
    reps = max(5, min(repeats * 100, int(2e9 // max(n, 1))))
    xs = []
    for _ in range(min(reps, 2000)):
        t0 = time.perf_counter_ns()
        np.copyto(mid, src)
        np.copyto(dst, mid)
        xs.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(xs)


def run_transfer_bench(
    payloads: list[str] | None = None,
    *,
    scale: float = 1.0,
    baseline: bool = True,
    pin: bool = True,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    names = payloads or list(PAYLOADS)
    # Every namespace of this run starts with its tag, so the leak audit sees this run's
    # objects only, not those of another run on the machine.
    run_tag = f"bench{uuid.uuid4().hex[:6]}"
    p_cpu, c_cpu = pin_cpus(pin)
    results: dict[str, Any] = {
        "payloads": {},
        "leaks": [],
        "pinned": None if p_cpu is None else {"producer_cpu": p_cpu, "consumer_cpu": c_cpu},
    }
    for name in names:
        if name not in PAYLOADS:
            raise ValueError(f"unknown payload {name!r}; choose from {', '.join(PAYLOADS)}")
        desc, n_lat, n_tp = PAYLOADS[name]
        n_lat, n_tp = max(20, int(n_lat * scale)), max(5, int(n_tp * scale))
        entry: dict[str, Any] = {"description": desc, "nbytes": _nbytes(make_payload(name))}
        entry["limit_two_memcpy_us"] = memcpy_limit_us(name)
        entry["floor_wakeup_two_memcpy_us"] = floor_us(name, n_lat, pin=pin, run_tag=run_tag)
        kinds = ["ours", "baseline"] if baseline else ["ours"]
        for kind in kinds:
            log(f"[bench transfer] {name}: {kind} ({n_lat} one-way trials, {n_tp} streamed)")
            row = measure(kind, name, n_lat, n_tp, pin=pin, run_tag=run_tag)
            entry[kind] = row.to_dict()
        results["payloads"][name] = entry
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"omnirelay-{run_tag}")]
    results["leaks"] = leftovers
    return results


def render_table(results: dict[str, Any]) -> str:
    lines = [
        "| payload | bytes | ours p50 | ours p99 | limit: 2x memcpy | floor: 2x memcpy + wake-up "
        "| ours/limit | ours/floor | baseline p50 | baseline p99 | baseline/ours | ours obj/s | baseline obj/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in results["payloads"].items():
        o, lim = e["ours"], e["limit_two_memcpy_us"]
        b = e.get("baseline")
        lines.append(
            f"| {name} ({e['description']}) | {e['nbytes']:,} | {_fmt(o['p50_us'])} | {_fmt(o['p99_us'])} "
            f"| {_fmt(lim)} | {_fmt(e['floor_wakeup_two_memcpy_us'])} | {o['p50_us'] / lim:.1f}x "
            f"| {o['p50_us'] / e['floor_wakeup_two_memcpy_us']:.1f}x "
            + (
                f"| {_fmt(b['p50_us'])} | {_fmt(b['p99_us'])} | {b['p50_us'] / o['p50_us']:.1f}x "
                f"| {o['objects_per_s']:,.0f} | {b['objects_per_s']:,.0f} |"
                if b
                else f"| - | - | - | {o['objects_per_s']:,.0f} | - |"
            )
        )
    leaks = results.get("leaks") or []
    pinned = results.get("pinned")
    lines.append("")
    lines.append(
        f"processes pinned: producer on CPU {pinned['producer_cpu']}, consumer on CPU {pinned['consumer_cpu']}"
        if pinned
        else "processes not pinned (the scheduler places them)"
    )
    lines.append(
        f"leak audit: {len(leaks)} objects of this run left in /dev/shm" + (f": {leaks[:5]}" if leaks else "")
    )
    return "\n".join(lines)


def _fmt(us: float) -> str:
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.0f} µs"


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]
