"""``omnirelay bench transfer --gpu cuda:0[,cuda:1]``: GPU → GPU rows beside the host path.

For each payload, a producer process holding the tensor on the first device and a
consumer process that needs it on the second (the same device when one is named) move it
through the shm connector two ways:

* ``host`` — the connector carries the tensor's bytes: device → host into the slot
  (the encoder), the consumer's copy out of the slot, host → device;
* ``gpu-direct`` — the producer places the tensor in its device pool
  (:class:`~omnirelay.connectors.device.DeviceProducer`), the connector carries only the
  :class:`~omnirelay.connectors.device.DeviceRef`, and the consumer copies device to
  device through CUDA IPC (a peer copy across GPUs); the block is released when the
  consumer has it, as the producer's reap does.

Latency is one way, ``perf_counter_ns`` right before the producer's first step and right
after the consumer's tensor is complete on its device; one object in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
import uuid
from typing import Any

import torch

__all__ = ["GPU_PAYLOADS", "render_gpu_table", "run_gpu_transfer_bench"]

#: name -> (description, trials)
GPU_PAYLOADS: dict[str, tuple[str, int]] = {
    "hidden_step": ("bf16 1x2048 hidden step (4 KB)", 400),
    "codec_chunk": ("int64 16x50 codes (6.4 KB)", 400),
    "prefill_4mb": ("f32 512x2048 prefill (4 MB)", 100),
    "tensor_64mb": ("f32 4096x4096 (64 MB)", 20),
}
PATHS = ("host", "gpu-direct")


def _make(name: str, device: str) -> torch.Tensor:
    if name == "hidden_step":
        return torch.randn(1, 2048, device=device).to(torch.bfloat16)
    if name == "codec_chunk":
        return torch.randint(0, 2048, (16, 50), device=device)
    if name == "prefill_4mb":
        return torch.randn(512, 2048, device=device)
    return torch.randn(4096, 4096, device=device)


def _connector(namespace: str, stage: int) -> Any:
    from omnirelay.connectors import create_connector

    return create_connector("shm", namespace=namespace, stage_id=stage)


def _consumer(path: str, n: int, device: str, namespace: str, conn: Any) -> None:
    from omnirelay.connectors.device import DeviceImporter, decode_ref
    from omnirelay.connectors.device.cuda import CudaOpener

    torch.cuda.set_device(device)
    shm = _connector(namespace, 2)
    importer = DeviceImporter(CudaOpener(), torch.device(device))
    done: list[int] = []
    conn.send("ready")
    try:
        for i in range(n):
            key = f"L{i}_1_0"
            while not (got := shm.get(1, 2, key)).is_ready:
                if got.error:
                    raise RuntimeError(got.error)
                shm.wait_arrivals(2, timeout=1.0)
            if path == "host":
                t = got.obj["t"].to(device, non_blocking=False)
                torch.cuda.current_stream(device).synchronize()
            else:
                t = importer.take(decode_ref(got.obj["ref"]))
            done.append(time.perf_counter_ns())
            del t
            conn.send(i)
        conn.send(done)
    finally:
        importer.close()
        shm.close()


def _producer(path: str, n: int, payload: str, device: str, namespace: str, conn: Any) -> None:
    from omnirelay.connectors.device import DeviceProducer, encode_ref
    from omnirelay.connectors.device.cuda import CudaArena

    torch.cuda.set_device(device)
    shm = _connector(namespace, 1)
    tensor = _make(payload, device)
    dp = DeviceProducer(
        CudaArena(max(1 << 20, 2 * tensor.numel() * tensor.element_size()), device),
        producer=f"{os.getpid()}-bench",
        min_bytes=0,
    )
    torch.cuda.synchronize()
    conn.recv()  # the consumer is ready
    sent: list[int] = []
    try:
        for i in range(n):
            key = f"L{i}_1_0"
            t0 = time.perf_counter_ns()
            if path == "host":
                res = shm.put(1, 2, key, {"t": tensor})
            else:
                ref = dp.put(key, tensor)
                assert ref is not None
                res = shm.put(1, 2, key, {"ref": encode_ref(ref)})
            if not res.ok:
                raise RuntimeError(res.error)
            sent.append(t0)
            conn.recv()  # the consumer has it
            dp.release(key)  # what the reap of the consumed key does
            shm.reap_consumed()
        conn.send(sent)
    finally:
        dp.close()
        shm.close()


def _measure_pair(path: str, payload: str, src: str, dst: str, n: int) -> dict[str, Any]:
    """Run one producer/consumer pair; the test process relays acks between them."""
    ctx = mp.get_context("spawn")
    namespace = f"gb{uuid.uuid4().hex[:8]}"
    to_cons, cons_end = ctx.Pipe()
    to_prod, prod_end = ctx.Pipe()
    cons = ctx.Process(target=_consumer, args=(path, n, dst, namespace, cons_end), daemon=True)
    prod = ctx.Process(target=_producer, args=(path, n, payload, src, namespace, prod_end), daemon=True)
    cons.start()
    prod.start()
    try:
        to_prod.send(to_cons.recv())  # "ready"
        for _ in range(n):
            to_prod.send(to_cons.recv())  # each ack
        done, sent = to_cons.recv(), to_prod.recv()
    finally:
        for proc in (prod, cons):
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    lat = sorted((d - s) / 1000 for s, d in zip(sent, done))[min(5, n // 10) :]  # first ones warm up
    return {
        "path": path,
        "src": src,
        "dst": dst,
        "p50_us": statistics.median(lat),
        "p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "n": len(lat),
    }


def run_gpu_transfer_bench(
    devices: list[str], payloads: list[str] | None = None, scale: float = 1.0
) -> dict[str, Any]:
    """Rows for the same GPU (``devices[0]`` to itself) and, with two devices, the peer pair."""
    pairs = [(devices[0], devices[0])] + ([(devices[0], devices[1])] if len(devices) > 1 else [])
    rows = []
    for payload in payloads or list(GPU_PAYLOADS):
        desc, trials = GPU_PAYLOADS[payload]
        n = max(10, int(trials * scale))
        for src, dst in pairs:
            for path in PATHS:
                row = _measure_pair(path, payload, src, dst, n)
                rows.append({"payload": payload, "description": desc, **row})
    return {"device": torch.cuda.get_device_name(0), "rows": rows}


def render_gpu_table(results: dict[str, Any]) -> str:
    lines = [
        f"GPU -> GPU transfers on {results['device']} (one way, one object in flight)",
        "| payload | src -> dst | host path p50 / p99 | gpu-direct p50 / p99 | host / gpu-direct |",
        "|---|---|---:|---:|---:|",
    ]
    by_key: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in results["rows"]:
        by_key.setdefault((row["payload"], row["src"], row["dst"]), {})[row["path"]] = row
    for (payload, src, dst), paths in by_key.items():
        host, direct = paths.get("host"), paths.get("gpu-direct")
        if host is None or direct is None:
            continue
        lines.append(
            f"| {payload} | {src} -> {dst} | {host['p50_us']:,.0f} / {host['p99_us']:,.0f} µs | "
            f"{direct['p50_us']:,.0f} / {direct['p99_us']:,.0f} µs | {host['p50_us'] / direct['p50_us']:.1f}× |"
        )
    return "\n".join(lines)
