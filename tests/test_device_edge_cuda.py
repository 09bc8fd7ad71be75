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
from tests.device_cuda_roles import consumer, digest, producer, shm_consumer

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


# ------------------------------------------------------------------ the wired shm connector


def test_the_shm_connector_on_a_gpu_direct_edge() -> None:
    """Two processes on cuda:0 (same-GPU GPU-direct) through the shm connector: the object
    arrives whole on the reader's device exactly once, abort releases its blocks, a reader
    killed inside its claim is reaped with its blocks, nothing is left after close."""
    from omnirelay.connectors.shm.connector import ShmConnector
    from tests.conftest import shm_entries

    namespace = f"gd{os.getpid()}"
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(0)
    prod = ShmConnector(
        namespace, 1, gpu_direct_to=(2,), device="cuda:0", device_pool_bytes=64 << 20, device_min_bytes=0
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=shm_consumer, args=(child, namespace, "cuda:0"), daemon=True)
    proc.start()
    try:
        obj = _tensors("cuda:0")
        del obj["tensor_64mb"]
        assert prod.put(1, 2, "a_1_0", obj).ok
        health = prod.health()
        assert (health.num_device_puts, health.device_blocks, health.num_device_fallbacks) == (4, 4, 0)
        parent.send(("get", "a_1_0"))
        status, error, got = parent.recv()
        assert status == "ready", error
        assert got == {k: (digest(t), "cuda:0") for k, t in obj.items()}  # whole, on its device
        parent.send(("get_once", "a_1_0"))
        assert parent.recv()[0] == "not_yet"  # exactly once
        assert prod.reap_consumed() == 1 and prod.health().device_blocks == 0

        assert prod.put(1, 2, "b_1_0", obj).ok  # aborted before it is read
        assert prod.cleanup_prefix("b_1_") == 1 and prod.health().device_blocks == 0
        parent.send(("get_once", "b_1_0"))
        assert parent.recv()[0] == "not_yet"

        assert prod.put(1, 2, "c_1_0", obj).ok
        parent.send(("die_in_copy", "c_1_0"))
        assert parent.recv() == "dying"
        proc.join(timeout=30)
        assert proc.exitcode == -9
        assert prod.reap_consumed() == 1  # the dead reader's claim ends; its blocks go
        assert prod.pending_keys() == [] and prod.health().device_blocks == 0
        assert prod.put(1, 2, "d_1_0", {"t": torch.zeros(32 << 20, dtype=torch.uint8, device="cuda:0")}).ok
        assert prod.health().num_device_fallbacks == 0  # every block reusable
        assert prod.cleanup("d_1_0")
        del obj  # the test's own tensors are no part of what must be freed
    finally:
        if proc.is_alive():
            parent.send("stop")
            proc.join(timeout=30)
        prod.close()
    assert shm_entries(namespace) == []
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) <= baseline + (64 << 20)  # at most the pool, pinned


def test_the_thinker_hands_its_rows_on_its_device_for_a_gpu_direct_edge() -> None:
    """On a GPU-direct edge the Thinker's rows for the Talker stay on its device (copies:
    the step's buffers are reused), equal to the host rows it hands otherwise."""
    from omnirelay.models.qwen3_omni import Checkpoint
    from omnirelay.models.qwen3_omni.loader import ModelArgs
    from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
    from tests.test_models_support import run_thinker, tiny_dir

    args = ModelArgs(device="cuda:0", runner="static", cuda_graphs=True, max_num_seqs=8, max_model_len=256)
    thinker = ThinkerExecutor.from_checkpoint(Checkpoint.open(tiny_dir(), device="cuda:0"), args)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9]}
    layer = thinker.accept_hidden_layer
    host = run_thinker(thinker, prompts, 3, accept_hidden_layer=layer)
    thinker.keep_outputs_on_device(True)
    device = run_thinker(thinker, prompts, 3, accept_hidden_layer=layer)
    for rid in prompts:
        for new in device[rid].results:
            out = new.next_stage_output
            assert all(t.device.type == "cuda" for t in out["hidden_layers"].values())
            assert out["tts_pad"].device.type == "cuda"
        a, b = host[rid].results[0].next_stage_output, device[rid].results[0].next_stage_output
        assert all(
            torch.equal(a["hidden_layers"][k], b["hidden_layers"][k].cpu()) for k in a["hidden_layers"]
        )
        assert all(
            p.hidden_states["output"].device.type == "cuda" for p in device[rid].payloads if p.hidden_states
        )
