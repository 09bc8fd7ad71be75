"""``omnirelay bench transfer --gpu cuda:0[,cuda:1]``: GPU → GPU rows beside the host path.

For each payload, a producer process holding its tensors on the first device and a
consumer process that needs them on the second (the same device when one is named) move
them through the shm connector two ways:

* ``host`` — a host edge: the connector carries the tensors' bytes (device → host into
  the slot, the consumer's copy out of the slot, host → device);
* ``gpu-direct`` — the connector of a GPU-direct edge (``gpu_direct_to`` /
  ``gpu_direct_in``, as the pipeline sets them where both stages are on CUDA devices):
  the put places each tensor in the producer's device pool and the slot carries its
  reference, the get copies it device to device through CUDA IPC (a peer copy across
  GPUs), the producer's reap releases the block. Every tensor of the payload takes it
  (``device_min_bytes=0``): the rows show what the size threshold of the default
  (``MIN_BYTES``) is chosen from.

Latency is one way, ``perf_counter_ns`` right before the producer's put and right after
the consumer's tensors are complete on its device; one object in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import uuid
from typing import Any

import torch

__all__ = ["GPU_PAYLOADS", "render_gpu_table", "run_gpu_transfer_bench"]

#: name -> (description, trials)
GPU_PAYLOADS: dict[str, tuple[str, int]] = {
    "thinker_step": ("bf16 1x2048 hidden state + 1x2048 embedding (one Thinker step, 8 KB)", 400),
    "codec_frame": ("int64 16 codes (one Talker frame, 128 B)", 400),
    "hidden_step": ("bf16 1x2048 hidden step (4 KB)", 400),
    "codec_chunk": ("int64 16x50 codes (6.4 KB)", 400),
    "prefill_4mb": ("f32 512x2048 prefill (4 MB)", 100),
    "tensor_64mb": ("f32 4096x4096 (64 MB)", 20),
}
PATHS = ("host", "gpu-direct")


def _make(name: str, device: str) -> dict[str, torch.Tensor]:
    if name == "thinker_step":
        return {
            "hidden": torch.randn(1, 2048, device=device).to(torch.bfloat16),
            "embed": torch.randn(1, 2048, device=device).to(torch.bfloat16),
        }
    if name == "codec_frame":
        return {"codes": torch.randint(0, 2048, (16,), device=device)}
    if name == "hidden_step":
        return {"t": torch.randn(1, 2048, device=device).to(torch.bfloat16)}
    if name == "codec_chunk":
        return {"t": torch.randint(0, 2048, (16, 50), device=device)}
    if name == "prefill_4mb":
        return {"t": torch.randn(512, 2048, device=device)}
    return {"t": torch.randn(4096, 4096, device=device)}


def _connector(namespace: str, stage: int, path: str, device: str, pool: int = 0) -> Any:
    from omnirelay.connectors import create_connector

    options: dict[str, Any] = {}
    if path == "gpu-direct" and stage == 1:
        options = {"gpu_direct_to": (2,), "device": device, "device_min_bytes": 0, "device_pool_bytes": pool}
    elif path == "gpu-direct":
        options = {"gpu_direct_in": True, "device": device}
    return create_connector("shm", namespace=namespace, stage_id=stage, **options)


def _consumer(path: str, n: int, device: str, namespace: str, conn: Any) -> None:
    torch.cuda.set_device(device)
    shm = _connector(namespace, 2, path, device)
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
                out = {k: t.to(device, non_blocking=False) for k, t in got.obj.items()}
                torch.cuda.current_stream(device).synchronize()
            else:
                out = got.obj  # on this device already, the copies complete
                assert all(t.device == torch.device(device) for t in out.values())
            done.append(time.perf_counter_ns())
            del out
            conn.send(i)
        conn.send(done)
    finally:
        shm.close()


def _producer(path: str, n: int, payload: str, device: str, namespace: str, conn: Any) -> None:
    torch.cuda.set_device(device)
    obj = _make(payload, device)
    pool = max(1 << 20, 4 * sum(t.numel() * t.element_size() for t in obj.values()))
    shm = _connector(namespace, 1, path, device, pool)
    torch.cuda.synchronize()
    conn.recv()  # the consumer is ready
    sent: list[int] = []
    try:
        for i in range(n):
            t0 = time.perf_counter_ns()
            res = shm.put(1, 2, f"L{i}_1_0", obj)
            if not res.ok:
                raise RuntimeError(res.error)
            sent.append(t0)
            conn.recv()  # the consumer has it
            shm.reap_consumed()  # consumed: the slot (and its device blocks) go back
        health = shm.health()
        if path == "gpu-direct" and (health.num_device_puts != n * len(obj) or health.num_device_fallbacks):
            raise RuntimeError(f"not every tensor went GPU-direct: {health}")
        conn.send(sent)
    finally:
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
    warm = min(5, n // 10)  # the first transfers open the pool and map it: warm-up, in time order
    lat = sorted((d - s) / 1000 for s, d in list(zip(sent, done))[warm:])
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
