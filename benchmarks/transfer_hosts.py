"""``omnirelay bench transfer --backend nixl``: the cross-host connector beside shm and TCP.

In one run, for a codec chunk, a 4 MB prefill and a 64 MB tensor, one-way latency p50/p99
(method of benchmarks/transfer.py: producer and consumer processes, one object in flight)
through:

* ``nixl``: the nixl connector with UCX forced onto TCP (``UCX_TLS=tcp``), notice and claim
  endpoints on the loopback — the path two hosts take, minus the wire;
* ``shm``: the default connector (one host), for scale;
* ``zmq_tcp``: the baseline a simple multi-host implementation uses — pickle the object,
  send it over a ZeroMQ PUSH/PULL TCP socket, unpickle.

Ratios are against the TCP baseline (nixl/zmq_tcp < 1: nixl is faster).
"""

from __future__ import annotations

import os
import pickle
import uuid
from typing import Any

from benchmarks.transfer import PAYLOADS, ConnectorTransport, measure

__all__ = ["HOST_PAYLOADS", "HOST_TRANSPORTS", "render_hosts_table", "run_hosts_bench"]

HOST_PAYLOADS = ["codec_chunk", "prefill_4mb", "tensor_64mb"]
_KINDS = ["nixl", "shm", "zmq_tcp"]


class _Nixl(ConnectorTransport):
    def __init__(self, role: str, namespace: str, address: str | None = None) -> None:
        os.environ["UCX_TLS"] = "tcp"
        from omnirelay.connectors import create_connector

        if role == "consumer":
            self.conn = create_connector(
                "nixl", namespace=namespace, stage_id=2, endpoints={2: "tcp://127.0.0.1:0"}
            )
            self.address = self.conn.listening_at
        else:
            assert address is not None
            self.conn = create_connector(
                "nixl", namespace=namespace, stage_id=1, endpoints={1: "tcp://127.0.0.1:0", 2: address}
            )


class _ZmqTcp:
    """Baseline: pickle (protocol 5) over a ZeroMQ PUSH/PULL TCP socket on the loopback."""

    def __init__(self, role: str, namespace: str, address: str | None = None) -> None:
        import zmq

        self.ctx = zmq.Context()
        if role == "consumer":
            self.sock = self.ctx.socket(zmq.PULL)
            self.sock.bind("tcp://127.0.0.1:0")
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock = self.ctx.socket(zmq.PUSH)
            self.sock.connect(str(address))

    def put(self, key: str, obj: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        self.sock.send_multipart([key.encode(), head, *(b.raw() for b in buffers)], copy=False)

    def get(self, key: str) -> Any:
        frames = self.sock.recv_multipart()
        if frames[0] != key.encode():
            raise RuntimeError(f"expected {key}, got {frames[0]!r}")
        # copies out of the frames, as the connectors do, so the object owns its memory
        return pickle.loads(frames[1], buffers=[bytearray(f) for f in frames[2:]])

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


HOST_TRANSPORTS: dict[str, Any] = {"nixl": _Nixl, "shm": None, "zmq_tcp": _ZmqTcp}


def run_hosts_bench(
    payloads: list[str] | None = None, *, scale: float = 1.0, pin: bool = True
) -> dict[str, Any]:
    from benchmarks.transfer import _Ours

    HOST_TRANSPORTS["shm"] = _Ours
    run_tag = f"bench{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {"payloads": {}}
    for name in payloads or HOST_PAYLOADS:
        if name not in PAYLOADS:
            raise ValueError(f"unknown payload {name!r}; choose from {', '.join(PAYLOADS)}")
        desc, n_lat, n_tp = PAYLOADS[name]
        n_lat, n_tp = max(20, int(n_lat * scale)), max(5, int(n_tp * scale))
        entry: dict[str, Any] = {"description": desc}
        for kind in _KINDS:
            print(f"[bench transfer --backend nixl] {name}: {kind} ({n_lat} one-way trials)", flush=True)
            entry[kind] = measure(
                "ours" if kind == "shm" else kind, name, n_lat, n_tp, pin=pin, run_tag=run_tag
            ).to_dict()
        entry["nbytes"] = entry["nixl"]["nbytes"]
        results["payloads"][name] = entry
    results["leaks"] = [n for n in os.listdir("/dev/shm") if n.startswith(f"omnirelay-{run_tag}")]
    return results


def render_hosts_table(results: dict[str, Any]) -> str:
    lines = [
        "| payload | bytes | nixl p50 | nixl p99 | zmq+pickle TCP p50 | zmq+pickle TCP p99 | nixl/TCP p50 "
        "| nixl/TCP p99 | shm p50 | shm p99 | nixl/shm p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in results["payloads"].items():
        n, z, s = e["nixl"], e["zmq_tcp"], e["shm"]
        lines.append(
            f"| {name} ({e['description']}) | {e['nbytes']:,} | {_fmt(n['p50_us'])} | {_fmt(n['p99_us'])} "
            f"| {_fmt(z['p50_us'])} | {_fmt(z['p99_us'])} | {n['p50_us'] / z['p50_us']:.2f}x "
            f"| {n['p99_us'] / z['p99_us']:.2f}x | {_fmt(s['p50_us'])} | {_fmt(s['p99_us'])} "
            f"| {n['p50_us'] / s['p50_us']:.1f}x |"
        )
    lines.append("")
    lines.append("nixl: UCX_TLS=tcp over the loopback; one-way latency, one object in flight")
    lines.append(f"leak audit: {len(results['leaks'])} objects of this run left in /dev/shm")
    return "\n".join(lines)


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"
