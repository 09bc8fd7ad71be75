"""GPU-direct edges on a real GPU: a tensor put by one process arrives whole in another
through CUDA IPC (same GPU; peer GPU where there are two), released blocks are never
served, and a dead reader or a dead producer leaves nothing behind. Skipped without CUDA."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.connectors.device import (
    DeviceImporter,
    DeviceProducer,
    StaleBlockError,
    decode_ref,
    encode_ref,
)
from tests.device_cuda_roles import consumer, digest, producer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARENA = 256 << 20


def _tensors(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "hidden_step": torch.randn(1, 2048, device=device, generator=g).to(torch.bfloat16),
        "codec_chunk": torch.randint(0, 2048, (16, 50), device=device, generator=g),
        "prefill_4mb": torch.randn(512, 2048, device=device, generator=g),
        "tensor_64mb": torch.randn(4096, 4096, device=device, generator=g),
        "mask": torch.rand(3, 5, device=device, generator=g) > 0.5,
    }


@pytest.fixture
def reader() -> Iterator[Any]:
    def start(device: str) -> tuple[Any, Any]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=consumer, args=(child, device), daemon=True)
        proc.start()
        started.append((proc, parent))
        return proc, parent

    started: list[tuple[Any, Any]] = []
    yield start
    for proc, parent in started:
        if proc.is_alive():
            try:
                parent.send("stop")
            except OSError:  # it is exiting already (its failure is the test's)
                pass
        proc.join(timeout=30)
        assert not proc.is_alive()


def _producer(device: str) -> DeviceProducer:
    from omnirelay.connectors.device.cuda import CudaArena

    return DeviceProducer(CudaArena(ARENA, device), producer=f"{os.getpid()}-test", min_bytes=0)


def _send_each(dp: DeviceProducer, conn: Any, device: str) -> None:
    for name, t in _tensors(device).items():
        ref = dp.put(f"{name}_0_0", t)
        assert ref is not None, name
        conn.send(encode_ref(ref))
        assert conn.recv() == digest(t), name  # whole, bit for bit, in the other process
        assert dp.release(f"{name}_0_0")  # consumed: reaped
        conn.send(encode_ref(ref))  # a stale ref is refused, never another object's bytes
        assert conn.recv().startswith("error:StaleBlockError"), name


def _round_trip(device: str, reader_device: str, reader: Any) -> None:
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device)
    dp = _producer(device)
    proc, conn = reader(reader_device)
    _send_each(dp, conn, device)
    assert dp.keys() == []
    conn.send("stop")
    proc.join(timeout=30)
    assert proc.exitcode == 0
    dp.close()
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) == baseline


def test_same_gpu_two_processes(reader: Any) -> None:
    _round_trip("cuda:0", "cuda:0", reader)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_peer_gpu_two_processes(reader: Any) -> None:
    _round_trip("cuda:0", "cuda:1", reader)


def test_a_dead_reader_returns_every_block(reader: Any) -> None:
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(0)
    dp = _producer("cuda:0")
    proc, conn = reader("cuda:0")
    first = dp.put("a_0_0", torch.ones(1024, device="cuda:0"))
    assert first is not None
    conn.send(encode_ref(first))
    assert conn.recv() == digest(torch.ones(1024))  # the reader has the arena mapped
    assert dp.release("a_0_0")
    assert dp.put("b_0_0", torch.ones(1024, device="cuda:0")) is not None
    conn.send("die")  # claimed, then dead before its copy
    assert conn.recv() == "dying"
    proc.join(timeout=30)
    assert proc.exitcode == -9
    assert dp.release("b_0_0")  # the sweep returned the slot; the producer reaps its block
    assert dp.keys() == []
    whole = dp.put("c_0_0", torch.zeros(ARENA // 2 - 1024, dtype=torch.uint8, device="cuda:0"))
    assert whole is not None  # every block is reusable
    dp.close()
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    # torch's IPC reference counter of the arena is never released by a reader killed while
    # it maps it: the allocation stays with the producer process until it exits (the arena
    # at most; nothing per object).
    assert torch.cuda.memory_allocated(0) <= baseline + ARENA


def test_a_dead_producer_is_forgotten() -> None:
    from omnirelay.connectors.device.cuda import CudaOpener

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child, "cuda:0"), daemon=True)
    proc.start()
    data, want, name = parent.recv()
    importer = DeviceImporter(CudaOpener(), torch.device("cuda:0"))
    ref = decode_ref(data)
    assert digest(importer.take(ref)) == want
    proc.kill()
    proc.join(timeout=30)
    assert importer.forget(name) == 1 and importer.producers() == []
    with pytest.raises((RuntimeError, StaleBlockError)):  # a dead producer's memory is not served
        importer.take(ref)
    importer.close()
