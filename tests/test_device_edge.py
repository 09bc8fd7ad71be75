"""GPU-direct edges, the parts the CPU can test: which path an edge takes, the producer's
device pool, device references as untrusted input, and the put / take / release
lifecycle over a fake device — exactly once per block generation, no partial object,
release on consume / cleanup / dead reader, a dead producer forgotten, nothing left after
abort or close."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omnirelay.connectors.device import (
    DeviceImporter,
    DevicePool,
    DeviceProducer,
    DeviceRef,
    EdgePath,
    StaleBlockError,
    cuda_index,
    decode_ref,
    edge_path,
    encode_ref,
)
from omnirelay.connectors.device.pool import ALIGN, STAMP_BYTES
from omnirelay.connectors.device.refs import DeviceRefError
from omnirelay.pipeline import load_pipeline, parse_pipeline
from tests.device_fakes import MEMORY, FakeArena, FakeOpener

# ------------------------------------------------------------------------- paths


def _paths(data: dict) -> list[EdgePath]:
    cfg = parse_pipeline(data)
    return [edge_path(cfg, e)[0] for e in cfg.edges()]


def _two(devices: tuple[str | None, str | None], **kw: object) -> dict:
    stages = [
        {
            "id": 0,
            "name": "a",
            "execution_type": "ar",
            "executor": "x.a",
            "chunk_processor": "p",
            "final_output": True,
            "final_output_type": "text",
        },
        {
            "id": 1,
            "name": "b",
            "execution_type": "ar",
            "executor": "x.b",
            "input_sources": [0],
            "final_output": True,
            "final_output_type": "audio",
        },
    ]
    for stage, device in zip(stages, devices):
        if device is not None:
            stage["devices"] = device
    return {"name": "two", "stages": stages, **kw}


def test_the_shipped_layout_is_gpu_direct_on_both_edges() -> None:
    cfg = load_pipeline("qwen3-omni")
    paths = [edge_path(cfg, e) for e in cfg.edges()]
    # One process per device by default: the Talker and Code2Wav share cuda:1, their edge
    # stays in that process; the Thinker's edge crosses to it by a peer copy.
    assert [p for p, _ in paths] == [EdgePath.GPU_PEER, EdgePath.IN_PROCESS]
    assert "cuda:0 -> cuda:1" in paths[0][1] and "peer copy" in paths[0][1]
    # A process per stage when asked: both edges cross processes on the device.
    apart = cfg.with_device_groups("off")
    assert [edge_path(apart, e)[0] for e in apart.edges()] == [EdgePath.GPU_PEER, EdgePath.GPU_SAME]


@pytest.mark.parametrize(
    ("devices", "path"),
    [
        (("cuda:0", "cuda:0"), EdgePath.GPU_SAME),
        (("cuda", "cuda:0"), EdgePath.GPU_SAME),
        (("cuda:0", "cuda:3"), EdgePath.GPU_PEER),
        (("cpu", "cuda:0"), EdgePath.HOST),
        (("cuda:0", None), EdgePath.HOST),
        ((None, None), EdgePath.HOST),
    ],
)
def test_gpu_direct_needs_both_stages_on_cuda(devices: tuple[str | None, str | None], path: EdgePath) -> None:
    assert _paths(_two(devices, device_groups="off")) == [path]  # a process per stage


def test_stages_on_one_device_share_a_process_unless_told_apart() -> None:
    assert _paths(_two(("cuda:0", "cuda"))) == [EdgePath.IN_PROCESS]  # auto by default
    assert _paths(_two(("cuda:0", "cuda"), device_groups="off")) == [EdgePath.GPU_SAME]
    alone = _two(("cuda:0", "cuda:0"), device_groups="auto")
    alone["stages"][1]["own_process"] = True
    assert _paths(alone) == [EdgePath.GPU_SAME]


def test_executor_device_wins_and_other_backends_keep_their_path() -> None:
    data = _two(("cuda:0", "cuda:0"), device_groups="off")
    data["stages"][1]["executor_args"] = {"device": "cpu"}
    assert _paths(data) == [EdgePath.HOST]
    inproc = _two(("cuda:0", "cuda:0"), connectors={"default": {"backend": "inproc"}})
    assert _paths(inproc) == [EdgePath.IN_PROCESS]
    assert [cuda_index(d) for d in ("cuda:2", "cuda", "cpu", "cuda:x", None)] == [2, 0, None, None, None]


# ------------------------------------------------------------------------- pool


def test_pool_places_first_fit_aligned_blocks_and_merges_freed_ranges() -> None:
    pool = DevicePool(4096 + 100)
    assert pool.capacity == 4096
    a = pool.place("a", 10)
    b = pool.place("b", 1000)
    assert a is not None and b is not None
    assert (a.offset, a.size, b.offset) == (0, ALIGN, ALIGN)
    assert b.size == 1280 and b.data_offset == ALIGN + STAMP_BYTES
    assert b.generation == a.generation + 1
    assert pool.place("c", 4096) is None  # full: the host path, not an error
    pool.free("a")
    pool.free("b")
    assert pool.free("b") is None  # idempotent
    assert pool.largest_free == 4096 and pool.used_bytes == 0 and pool.live_keys() == []
    c = pool.place("c", 4096 - STAMP_BYTES)
    assert c is not None and c.offset == 0 and c.generation > b.generation
    with pytest.raises(KeyError):
        pool.place("c", 1)
    with pytest.raises(ValueError):
        DevicePool(100)


# ------------------------------------------------------------------------- refs


def _ref(**kw: object) -> DeviceRef:
    arena = FakeArena(1 << 16)
    producer = DeviceProducer(arena, producer="p1", min_bytes=0)
    ref = producer.put("k", torch.arange(6, dtype=torch.int64).view(2, 3))
    assert ref is not None
    return msgspec.structs.replace(ref, **kw)


def test_refs_round_trip_and_bad_refs_are_clear_errors() -> None:
    ref = _ref()
    assert decode_ref(encode_ref(ref)) == ref
    cases = {
        "unknown dtype": _ref(dtype="object"),
        "do not hold": _ref(shape=(2, 4)),
        "outside the": _ref(offset=1 << 16),
        "not aligned": _ref(offset=ALIGN + 8),
        "unknown device backend": _ref(arena=msgspec.structs.replace(ref.arena, backend="opencl")),
    }
    for words, bad in cases.items():
        with pytest.raises(DeviceRefError, match=words):
            decode_ref(encode_ref(bad))
    with pytest.raises(DeviceRefError, match="malformed"):
        decode_ref(b"\x93not a ref")
    with pytest.raises(DeviceRefError, match="malformed"):
        decode_ref(encode_ref(ref)[:-3])
    with pytest.raises(DeviceRefError, match="malformed"):  # a forged handle far too long
        decode_ref(encode_ref(_ref(arena=msgspec.structs.replace(ref.arena, handle=b"x" * 4096))))


# ------------------------------------------------------------------------- lifecycle


@pytest.fixture
def edge() -> tuple[DeviceProducer, DeviceImporter, FakeArena, FakeOpener]:
    arena = FakeArena(1 << 16)
    opener = FakeOpener()
    yield DeviceProducer(arena, producer="1234-99", min_bytes=0), DeviceImporter(opener), arena, opener
    arena.close()


TENSORS = [
    torch.randn(1, 2048).to(torch.bfloat16),
    torch.randint(0, 2048, (16, 50)),
    torch.tensor([True, False, True]),
    torch.zeros(0, 4),
    torch.randn(8, 8).t(),  # not contiguous
]


def test_each_tensor_arrives_whole_and_once_released_is_gone(edge: tuple) -> None:
    producer, importer, _, _ = edge
    for i, t in enumerate(TENSORS):
        ref = producer.put(f"r_0_{i}", t)
        assert ref is not None and ref.dtype == str(t.dtype).removeprefix("torch.")
        got = importer.take(decode_ref(encode_ref(ref)))
        assert got.dtype == t.dtype and torch.equal(got, t)
        assert producer.release(f"r_0_{i}")  # the slot was consumed: the producer reaps
        with pytest.raises(StaleBlockError, match="no longer holds"):
            importer.take(ref)
    assert producer.keys() == [] and producer.pool.used_bytes == 0
    assert importer.producers() == ["1234-99"]  # the arena was opened once


def test_a_block_placed_again_never_serves_an_old_ref(edge: tuple) -> None:
    producer, importer, _, _ = edge
    old = producer.put("a_0_0", torch.ones(4))
    producer.release("a_0_0")
    new = producer.put("b_0_0", torch.full((4,), 7.0))
    assert old is not None and new is not None and new.offset == old.offset
    with pytest.raises(StaleBlockError):
        importer.take(old)
    assert torch.equal(importer.take(new), torch.full((4,), 7.0))


def test_a_release_during_the_copy_is_detected(edge: tuple) -> None:
    producer, importer, _, opener = edge
    ref = producer.put("a_0_0", torch.ones(4))
    opener.on_read = lambda: producer.release("a_0_0")  # an abort lands mid-copy
    with pytest.raises(StaleBlockError, match="released while it was read"):
        importer.take(ref)


def test_small_tensors_take_the_host_path() -> None:
    arena = FakeArena(4 << 20)
    producer = DeviceProducer(arena, producer="p")  # the default threshold
    assert producer.put("s_0_0", torch.zeros(1, 2048, dtype=torch.bfloat16)) is None  # 4 KB
    ref = producer.put("l_0_0", torch.zeros(512, 512))  # 1 MB
    assert ref is not None and producer.keys() == ["l_0_0"]
    producer.close()


def test_a_full_pool_sends_by_the_host_path_and_leaks_nothing() -> None:
    arena = FakeArena(4096)
    producer = DeviceProducer(arena, producer="p", min_bytes=0)
    assert producer.put("big_0_0", torch.zeros(4096, dtype=torch.uint8)) is None
    assert producer.keys() == []
    arena.close()


def test_abort_cleanup_and_close_leave_nothing(edge: tuple) -> None:
    producer, importer, arena, _ = edge
    for rid in ("x", "y"):
        for k in range(3):
            assert producer.put(f"{rid}_0_{k}", torch.ones(10)) is not None
    assert producer.put("x_0_extra", torch.ones(1)) is not None  # not "x_0_" + an integer
    assert producer.release_prefix("x_0_") == 3  # the request id was released (abort)
    assert sorted(producer.keys()) == ["x_0_extra", "y_0_0", "y_0_1", "y_0_2"]
    producer.close()
    producer.close()  # idempotent
    assert producer.keys() == [] and arena.name not in MEMORY
    assert producer.put("z_0_0", torch.ones(1)) is None  # closed: the host path
    importer.close()


def test_a_dead_reader_returns_its_block(edge: tuple) -> None:
    producer, importer, _, _ = edge
    ref = producer.put("r_0_0", torch.ones(10))
    assert ref is not None
    # The reader claimed the slot and died before copying: the sweep returns the slot to
    # its producer, whose reap releases the block. A zombie reading later gets nothing.
    assert producer.release("r_0_0")
    with pytest.raises(StaleBlockError):
        importer.take(ref)
    assert producer.keys() == []


def test_a_dead_producer_is_forgotten(edge: tuple) -> None:
    producer, importer, arena, opener = edge
    ref = producer.put("r_0_0", torch.ones(10))
    assert ref is not None
    importer.take(ref)
    arena.die()
    with pytest.raises(RuntimeError, match="gone"):
        importer.take(ref)
    assert importer.forget("1234-99") == 1
    assert opener.opened[0].is_closed and importer.producers() == []
    with pytest.raises(RuntimeError, match="producer is gone"):  # no reopening a dead arena
        importer.take(ref)


def test_a_new_arena_under_a_known_name_replaces_the_old_mapping() -> None:
    opener = FakeOpener()
    importer = DeviceImporter(opener)
    first, second = FakeArena(4096), FakeArena(4096)
    for arena in (first, second):  # a restarted producer with the same identity
        ref = DeviceProducer(arena, producer="p", min_bytes=0).put("k_0_0", torch.ones(2))
        assert ref is not None and torch.equal(importer.take(ref), torch.ones(2))
    assert [o.is_closed for o in opener.opened] == [True, False]
    importer.close()
    assert opener.opened[1].is_closed
    first.close()
    second.close()


def test_check_prints_each_edge_path() -> None:
    import io

    from omnirelay.cli.check import build_report, render_report

    report = build_report(load_pipeline("qwen3-omni").with_device_groups("auto"))
    assert [e["path"] for e in report["edges"]] == ["gpu-direct-peer", "in-process"]
    out = io.StringIO()
    render_report(report, out)
    text = out.getvalue()
    assert "tensors: gpu-direct-peer (cuda:0 -> cuda:1: CUDA IPC handle, peer copy" in text
    assert "tensors: in-process (inproc connector: one process)" in text
    assert "processes (device_groups: auto): 0 | 1+2" in text and report["processes"] == [[0], [1, 2]]
    apart = io.StringIO()
    render_report(build_report(load_pipeline("qwen3-omni").with_device_groups("off")), apart)
    text = apart.getvalue()
    assert "tensors: gpu-direct (cuda:1 -> cuda:1" in text and "under 256 KiB through the host" in text
    tiny = io.StringIO()
    render_report(build_report(load_pipeline("qwen3-omni-tiny")), tiny)
    assert "tensors: host (stage 0 (thinker) is on cpu)" in tiny.getvalue()


def test_gpu_transfer_rows_render_side_by_side() -> None:
    from benchmarks.transfer_gpu import render_gpu_table

    rows = [
        {
            "payload": "prefill_4mb",
            "src": "cuda:0",
            "dst": "cuda:0",
            "path": "host",
            "p50_us": 900.0,
            "p99_us": 1200.0,
        },
        {
            "payload": "prefill_4mb",
            "src": "cuda:0",
            "dst": "cuda:0",
            "path": "gpu-direct",
            "p50_us": 300.0,
            "p99_us": 400.0,
        },
    ]
    table = render_gpu_table({"device": "X", "rows": rows})
    assert "| prefill_4mb | cuda:0 -> cuda:0 | 900 / 1,200 µs | 300 / 400 µs | 3.0× |" in table
