"""The shm connector on a GPU-direct edge, over the fake device (tests/device_fakes.py):
device tensors stay in the producer's device pool and the slot carries their references;
exactly once, no partial object, a stale or forged reference FAILED with its reason, the
block released when the object is consumed, cleaned up, reaped after a dead reader, or
the connector closes; a full pool or a failing device sends by the host path. Every test
ends with the leak audit: nothing of its namespace in /dev/shm (conftest), no pending
keys, no device block, the arena freed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from omnirelay.connectors import GetStatus, create_connector
from omnirelay.connectors.device.paths import gpu_direct_options
from omnirelay.connectors.device.refs import decode_ref, encode_ref
from omnirelay.connectors.shm import names, slot
from omnirelay.connectors.shm.connector import ShmConnector
from omnirelay.payload import codec
from omnirelay.pipeline import load_pipeline
from tests.device_fakes import MEMORY, FakeBackend

POOL = 1 << 20


class Edge:
    """A producer (stage 1) and a consumer (stage 2) on a GPU-direct edge."""

    def __init__(self, namespace: str, **producer_options: Any) -> None:
        self.backend = FakeBackend()
        options = {"device_min_bytes": 0, "device_pool_bytes": POOL, **producer_options}
        self.prod = ShmConnector(namespace, 1, device_backend=self.backend, gpu_direct_to=(2,), **options)
        self.cons = ShmConnector(namespace, 2, device_backend=self.backend, gpu_direct_in=True)

    def device(self, t: torch.Tensor) -> torch.Tensor:
        return self.backend.on_device(t)

    def slot_device_keys(self) -> list[str]:
        return [k for sl in self.prod._producer._pending.values() for k in sl.device_keys or ()]

    def audit(self) -> None:
        self.prod.reap_consumed()
        health = self.prod.health()
        assert self.prod.pending_keys() == [] and self.cons.pending_keys() == []
        assert (health.device_blocks, health.device_pool_bytes) == (0, 0)
        self.prod.close()
        self.cons.close()
        assert all(a.name not in MEMORY for a in self.backend.arenas)  # the arena is freed


@pytest.fixture
def edge(namespace: str) -> Iterator[Edge]:
    e = Edge(namespace)
    yield e
    e.audit()


def _chunk(e: Edge) -> dict[str, Any]:
    return {
        "hidden": e.device(torch.randn(1, 2048).to(torch.bfloat16)),
        "codes": e.device(torch.randint(0, 2048, (16, 50))),
        "on_host": torch.arange(6),
        "meta": {"step": 3, "final": False},
    }


def test_device_tensors_travel_by_reference_and_arrive_whole_once(edge: Edge) -> None:
    obj = _chunk(edge)
    res = edge.prod.put(1, 2, "r_1_0", obj)
    assert res.ok and res.nbytes < 2048  # references, not the 10 KB of tensor bytes
    health = edge.prod.health()
    assert (health.num_device_puts, health.device_blocks, health.num_device_fallbacks) == (2, 2, 0)
    assert health.device_bytes_put == 2 * 2048 + 16 * 50 * 8
    assert list(edge.cons.wait_arrivals(2, timeout=10)) == ["r_1_0"]
    got = edge.cons.get(1, 2, "r_1_0")
    assert got.is_ready
    for name in ("hidden", "codes", "on_host"):
        assert got.obj[name].dtype == obj[name].dtype and torch.equal(got.obj[name], obj[name])
    assert got.obj["meta"] == obj["meta"]
    assert edge.cons.get(1, 2, "r_1_0").status is GetStatus.NOT_YET  # exactly once
    assert edge.cons.health().num_device_gets == 2
    assert edge.prod.reap_consumed() == 1  # consumed: the slot and its blocks go
    assert edge.prod.health().device_blocks == 0


def test_a_stream_reuses_the_pool_and_small_tensors_cross_by_the_host(namespace: str) -> None:
    e = Edge(namespace, device_min_bytes=4096)
    for step in range(20):
        obj = {"hidden": e.device(torch.full((1, 2048), float(step)).to(torch.bfloat16))}
        obj["tiny"] = e.device(torch.full((4,), step))  # 32 bytes: below the threshold
        assert e.prod.put(1, 2, f"s_1_{step}", obj).ok
        got = e.cons.get(1, 2, f"s_1_{step}")
        assert got.is_ready and torch.equal(got.obj["hidden"], obj["hidden"])
        assert torch.equal(got.obj["tiny"], obj["tiny"])
    health = e.prod.health()
    assert (health.num_device_puts, health.num_device_fallbacks) == (20, 0)
    assert len(e.backend.arenas) == 1  # one pool, blocks reused as objects are reaped
    e.audit()


def test_a_host_edge_and_host_tensors_keep_the_host_bytes(namespace: str) -> None:
    plain = create_connector("shm", namespace=namespace, stage_id=1)
    assert plain._producer._device is None and plain._reader._device is None  # nothing loaded
    e = Edge(namespace)
    obj = {"t": torch.arange(64).view(8, 8).t(), "b": torch.ones(3, dtype=torch.bfloat16), "s": "x"}
    assert codec.plan_encode(obj, lambda t: None).nbytes == len(codec.encode(obj))
    out = bytearray(len(codec.encode(obj)))
    codec.plan_encode(obj, e.prod._device_sender.placer([])).write_into(out)  # CPU tensors
    assert bytes(out) == codec.encode(obj)
    assert e.prod.put(1, 3, "h_1_0", {"d": e.device(torch.ones(8))}).ok  # stage 3: a host edge
    assert e.prod.health().num_device_puts == 0
    assert e.prod.cleanup("h_1_0")
    plain.close()
    e.audit()


def test_abort_cleanup_and_close_release_every_block(edge: Edge) -> None:
    for rid in ("a", "b"):
        for i in range(3):
            assert edge.prod.put(1, 2, f"{rid}_1_{i}", _chunk(edge)).ok
    assert edge.prod.health().device_blocks == 12
    hinted = edge.cons.wait_arrivals(2, timeout=10)
    assert edge.prod.cleanup("a_1_0")  # abort before any read: retracted with its blocks
    assert edge.prod.cleanup_prefix("b_1_") == 3  # a released request id
    assert edge.prod.health().device_blocks == 4
    assert "a_1_0" in hinted and edge.cons.get(1, 2, "a_1_0").status is GetStatus.NOT_YET
    assert edge.cons.get(1, 2, "a_1_1").is_ready
    edge.prod.reap_consumed()
    assert edge.prod.health().device_blocks == 2
    assert edge.prod.cleanup("a_1_2")
    assert edge.prod.health().device_blocks == 0


def test_close_with_unread_objects_frees_the_pool(namespace: str) -> None:
    e = Edge(namespace)
    for i in range(3):
        assert e.prod.put(1, 2, f"c_1_{i}", _chunk(e)).ok
    arena = e.backend.arenas[0]
    e.prod.close()
    assert arena.name not in MEMORY and e.prod.health().device_blocks == 0
    assert e.cons.get(1, 2, "c_1_0").status is GetStatus.NOT_YET  # withdrawn, names gone
    assert not e.prod.put(1, 2, "c_1_9", _chunk(e)).ok  # closed
    e.audit()


def test_a_dead_readers_claim_returns_the_slot_and_its_blocks(edge: Edge) -> None:
    assert edge.prod.put(1, 2, "z_1_0", _chunk(edge)).ok
    (ref_key,) = edge.slot_device_keys()[:1]
    path = os.path.join("/dev/shm", names.key_name(edge.prod.namespace, "z_1_0"))
    with open(path, "r+b") as f:  # a reader claimed it, then died before its copy
        buf = bytearray(f.read(slot.HEADER_SIZE))
        slot.write_claim(buf, os.getpid(), 1)  # our pid, another start time: a dead process
        f.seek(0)
        f.write(buf)
    assert edge.prod.health().device_blocks == 2
    assert edge.prod.reap_consumed() == 1
    assert edge.prod.pending_keys() == [] and edge.prod.health().device_blocks == 0
    assert edge.prod._device_sender is not None
    assert ref_key not in (
        edge.prod._device_sender._producer.keys() if edge.prod._device_sender._producer else []
    )


def _put_with_ref(e: Edge, key: str, forge: Any) -> None:
    """Put one device tensor whose reference ``forge(ref)`` alters on its way into the slot."""
    sender = e.prod._device_sender
    assert sender is not None
    real = sender.place

    def place(tensor: torch.Tensor, placed: list[str]) -> bytes | None:
        data = real(tensor, placed)
        return None if data is None else forge(decode_ref(data), placed)

    sender.place = place  # type: ignore[method-assign]
    try:
        assert e.prod.put(1, 2, key, {"t": e.device(torch.ones(64))}).ok
    finally:
        sender.place = real  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda ref, _: encode_ref(msgspec.structs.replace(ref, generation=ref.generation + 1)), "stale"),
        (lambda ref, _: encode_ref(msgspec.structs.replace(ref, offset=POOL)), "outside the"),
        (
            lambda ref, _: encode_ref(msgspec.structs.replace(ref, shape=(8, 8), nbytes=256)),
            "names a float32",
        ),
        (lambda ref, _: b"\x93forged", "malformed device reference"),
        (
            lambda ref, _: encode_ref(
                msgspec.structs.replace(ref, arena=msgspec.structs.replace(ref.arena, handle=b"gone"))
            ),
            "cannot copy the GPU-direct tensor",
        ),
    ],
    ids=["stale-generation", "out-of-arena", "wrong-shape", "malformed", "unknown-arena"],
)
def test_a_forged_reference_is_failed_with_its_reason(edge: Edge, forge: Any, reason: str) -> None:
    _put_with_ref(edge, "f_1_0", forge)
    got = edge.cons.get(1, 2, "f_1_0")
    assert got.status is GetStatus.FAILED and reason in (got.error or "")
    assert edge.cons.get(1, 2, "f_1_0").status is GetStatus.NOT_YET  # consumed: never retried
    assert edge.cons.health().num_get_failures == 1


def test_a_block_released_during_the_copy_fails_the_get(edge: Edge) -> None:
    assert edge.prod.put(1, 2, "m_1_0", {"t": edge.device(torch.ones(64))}).ok
    sender = edge.prod._device_sender
    assert sender is not None
    edge.backend.opener_made.on_read = lambda: sender.release(edge.slot_device_keys())
    got = edge.cons.get(1, 2, "m_1_0")
    assert got.status is GetStatus.FAILED and "released while it was read" in (got.error or "")


def test_a_receiver_without_a_gpu_direct_edge_refuses_a_reference(edge: Edge, namespace: str) -> None:
    host = ShmConnector(namespace, 3)
    assert edge.prod.put(1, 3, "x_1_0", {"t": torch.ones(2)}).ok  # host edge: plain bytes
    assert host.get(1, 3, "x_1_0").is_ready
    _put_with_ref(edge, "x_1_1", lambda ref, _: encode_ref(ref))
    got = host.get(1, 2, "x_1_1")
    assert got.status is GetStatus.FAILED and "takes no GPU-direct edge" in (got.error or "")
    host.close()


def test_a_full_pool_or_a_failing_device_sends_by_the_host(namespace: str) -> None:
    e = Edge(namespace, device_pool_bytes=8192)
    first = {"t": e.device(torch.ones(1024))}  # 4 KB: fits
    second = {"t": e.device(torch.full((1024,), 2.0))}  # the pool holds no second one
    assert e.prod.put(1, 2, "p_1_0", first).ok and e.prod.put(1, 2, "p_1_1", second).ok
    health = e.prod.health()
    assert (health.num_device_puts, health.num_device_fallbacks) == (1, 1)
    assert "device pool full" in (health.last_device_fallback or "")
    for key, obj in (("p_1_0", first), ("p_1_1", second)):
        got = e.cons.get(1, 2, key)
        assert got.is_ready and torch.equal(got.obj["t"], obj["t"])
    e.audit()

    failing = Edge(namespace)
    failing.backend.fail_arena = "cudaIpcGetMemHandle failed"
    assert failing.prod.put(1, 2, "q_1_0", {"t": failing.device(torch.ones(8))}).ok
    health = failing.prod.health()
    assert health.num_device_fallbacks == 1 and "cudaIpcGetMemHandle" in (health.last_device_fallback or "")
    assert torch.equal(failing.cons.get(1, 2, "q_1_0").obj["t"], torch.ones(8))
    failing.audit()


def test_a_put_that_fails_after_placing_releases_its_blocks(edge: Edge) -> None:
    obj = {"t": edge.device(torch.ones(64)), "bad": object()}  # placed, then the walk fails
    res = edge.prod.put(1, 2, "e_1_0", obj)
    assert not res.ok and "unsupported type" in (res.error or "")
    assert edge.prod.health().device_blocks == 0
    assert edge.prod.put(1, 2, "e_1_1", {"t": edge.device(torch.ones(64))}).ok
    assert not edge.prod.put(1, 2, "e_1_1", {"t": edge.device(torch.ones(64))}).ok  # unread: refused
    assert edge.prod.health().device_blocks == 1
    assert edge.cons.get(1, 2, "e_1_1").is_ready


def test_the_pipeline_sets_the_gpu_direct_options_of_each_stage() -> None:
    cfg = load_pipeline("qwen3-omni")
    apart = cfg.with_device_groups("off")  # a process per stage: both edges cross processes
    options = [gpu_direct_options(apart, s) for s in apart.stages]
    assert options == [
        {"gpu_direct_to": (1,), "gpu_direct_in": False, "device": "cuda:0"},
        {"gpu_direct_to": (2,), "gpu_direct_in": True, "device": "cuda:1"},
        {"gpu_direct_to": (), "gpu_direct_in": True, "device": "cuda:1"},
    ]
    # Grouped (the default), the Talker and Code2Wav share cuda:1, so a process: their edge is in it.
    assert [gpu_direct_options(cfg, s) for s in cfg.stages] == [
        options[0],
        {"gpu_direct_to": (), "gpu_direct_in": True, "device": "cuda:1"},
        {},
    ]
    tiny = load_pipeline("qwen3-omni-tiny")
    assert all(gpu_direct_options(tiny, s) == {} for s in tiny.stages)
