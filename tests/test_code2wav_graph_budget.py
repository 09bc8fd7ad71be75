"""Code2Wav's CUDA graphs bounded by an activation budget (docs/design.md §12): the bucket
grid from the budget (a pure function), a step split into launches no larger than the
largest captured bucket, the capture's out-of-memory error as one line naming the knob,
and the device's KV sizing counting Code2Wav's pools captured before it."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner import code2wav as code2wav_module
from omnirelay.models.runner import vocoder as vocoder_module
from omnirelay.models.runner.code2wav import (
    DEFAULT_DECODE_BATCHES,
    DEFAULT_DECODE_FRAMES,
    GRAPH_MEMORY_ENV,
    GraphedCode2Wav,
    decoder_widths,
    graph_budget_bytes,
)
from omnirelay.models.runner.graphs import GraphSet, capture_order, graph_memory_errors
from omnirelay.models.runner.memory import (
    ACTIVATION_COPIES,
    DeviceBudget,
    activate,
    bucket_grid,
    peak_activation_bytes,
    provision,
)
from omnirelay.models.runner.vocoder import (
    DEFAULT_STREAM_BATCHES,
    DEFAULT_STREAM_FRAMES,
    StreamingVocoder,
    StreamRow,
)
from tests.memory_fakes import GIB, FakeMemory
from tests.test_models_support import single_thread, tiny_dir

#: The shipped Qwen3-Omni Code2Wav's up-sampling outputs (hidden 1024, decoder 1536,
#: ratios 2 x 2, rates 8, 5, 4, 3) as ``decoder_widths`` lists them.
SHIPPED_WIDTHS = [(1024, 2), (1024, 4), (1536, 4), (768, 32), (384, 160), (192, 640), (96, 1920)]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


def test_the_widest_layer_decides_a_row_frames_bytes() -> None:
    assert peak_activation_bytes(SHIPPED_WIDTHS, 4) == 96 * 1920 * ACTIVATION_COPIES * 4
    assert peak_activation_bytes([(8, 3), (2, 20)], 2) == 40 * ACTIVATION_COPIES * 2


def test_the_grid_keeps_the_buckets_whose_step_fits_the_budget() -> None:
    per = 10
    grid = bucket_grid((1, 2, 4, 8), (1, 4, 16), budget_bytes=40 * per, bytes_per_row_frame=per)
    assert grid == ((1, 1), (2, 1), (4, 1), (8, 1), (1, 4), (2, 4), (4, 4), (8, 4), (1, 16), (2, 16))
    assert all(b * t * per <= 40 * per for b, t in grid)


def test_every_frame_bucket_keeps_its_one_row_bucket_whatever_the_budget() -> None:
    grid = bucket_grid((1, 2, 4), (1, 8, 32), budget_bytes=0, bytes_per_row_frame=1)
    assert grid == ((1, 1), (1, 8), (1, 32))
    with pytest.raises(ModelError, match="bytes_per_row_frame >= 1"):
        bucket_grid((1,), (1,), budget_bytes=GIB, bytes_per_row_frame=0)


def test_the_shipped_decoder_in_float32_captures_at_most_a_gib_of_activations_by_default() -> None:
    per = peak_activation_bytes(SHIPPED_WIDTHS, 4)
    budget = graph_budget_bytes()
    streams = bucket_grid(
        DEFAULT_STREAM_BATCHES, DEFAULT_STREAM_FRAMES, budget_bytes=budget, bytes_per_row_frame=per
    )
    windows = bucket_grid(
        DEFAULT_DECODE_BATCHES, DEFAULT_DECODE_FRAMES, budget_bytes=budget, bytes_per_row_frame=per
    )
    assert budget == GIB
    assert max(b * t * per for b, t in streams + windows) <= GIB
    largest = {t: max(b for b, f in streams if f == t) for t in DEFAULT_STREAM_FRAMES}
    assert largest == {1: 64, 2: 64, 4: 32, 8: 16, 16: 8, 32: 4}
    # The grid before the budget: 64 rows x 32 frames, 14 GiB of activations estimated.
    assert 64 * 32 * per > 14 * GIB


def test_the_budget_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GRAPH_MEMORY_ENV, "0.5")
    assert graph_budget_bytes() == GIB // 2
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(GRAPH_MEMORY_ENV, bad)
        with pytest.raises(ModelError, match=GRAPH_MEMORY_ENV):
            graph_budget_bytes()


def test_the_tiny_decoders_widths_end_at_its_total_upsampling() -> None:
    model = Checkpoint.open(tiny_dir()).load_code2wav()
    widths = decoder_widths(model)
    assert widths[-1][1] == int(model.total_upsample)
    assert all(c > 0 for c, _ in widths)


class _LiveBytes(TorchDispatchMode):
    """A fake allocator: the bytes of the tensors the ops inside create, counted while
    they are alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key and key not in self.live:
                    self.live.add(key)
                    self.current += size
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(t, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live.discard(key)
        self.current -= size


@pytest.mark.parametrize("family", ["qwen3-omni", "qwen3-tts"])
def test_the_estimate_covers_a_measured_steps_activations(family: str) -> None:
    if family == "qwen3-omni":
        model = Checkpoint.open(tiny_dir()).load_code2wav()
    else:
        model = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()
    per = peak_activation_bytes(decoder_widths(model), next(model.parameters()).element_size())
    vocoder = StreamingVocoder(model, max_streams=4, cuda_graphs=False)
    gen = torch.Generator().manual_seed(0)
    size, q = int(model.config.codebook_size), int(model.config.num_quantizers)
    rows = [StreamRow(f"s{i}", torch.randint(0, size, (q, 8), generator=gen)) for i in range(4)]
    with torch.inference_mode():
        vocoder.decode(rows)  # the second chunk: every state in use
        with _LiveBytes() as stream:
            vocoder.decode(rows)
        with _LiveBytes() as window:
            model(torch.stack([r.codes for r in rows]))
    for measured in (stream.peak, window.peak):
        assert 0 < measured <= 4 * 8 * per
        assert measured >= 4 * 8 * per // 4  # the estimate is a margin, not a blind guess


def test_a_step_past_the_largest_captured_bucket_is_split_and_decodes_the_same() -> None:
    model = Checkpoint.open(tiny_dir()).load_code2wav()
    grid = bucket_grid((1, 2, 4, 8), (1, 2, 4), budget_bytes=8, bytes_per_row_frame=1)
    bounded = StreamingVocoder(model, max_streams=8, cuda_graphs=False, frames=(1, 2, 4), buckets=grid)
    free = StreamingVocoder(model, max_streams=8, cuda_graphs=False, frames=(1, 2, 4))
    assert [bounded.max_rows(t) for t in (1, 2, 4)] == [8, 4, 2]
    assert free.max_rows(4) == 8
    launches: list[int] = []
    decode_group = bounded._decode_group

    def counted(rows: list[StreamRow]) -> list[torch.Tensor]:
        launches.append(len(rows))
        return decode_group(rows)

    bounded._decode_group = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    size, q = int(model.config.codebook_size), int(model.config.num_quantizers)
    for n in (3, 1):  # a first chunk of 3 frames (bucket 4), then 1 frame each
        rows = [StreamRow(f"s{i}", torch.randint(0, size, (q, n), generator=gen)) for i in range(5)]
        with torch.inference_mode():
            got, want = bounded.decode(rows), free.decode(rows)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert launches == [2, 2, 1, 5]  # 5 rows of bucket 4 in launches of 2; 5 one-frame rows at once
    for i in range(5):
        bounded.release(f"s{i}")
        free.release(f"s{i}")
    assert len(bounded.slots) == 0 and len(free.slots) == 0


def test_a_capture_out_of_memory_is_one_line_naming_the_bucket_and_the_knob() -> None:
    graphs = GraphSet("code2wav-stream", torch.device("cpu"), enabled=False)
    graphs.capturing = (8, 32)
    with pytest.raises(ModelError) as info, graph_memory_errors(graphs, "lower THE_KNOB"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
    message = str(info.value)
    assert "\n" not in message
    assert "code2wav-stream" in message and "(8, 32)" in message and message.endswith("lower THE_KNOB")
    with pytest.raises(ValueError, match="other"), graph_memory_errors(graphs, "lower THE_KNOB"):
        raise ValueError("other")


def _sized_group(code2wav_pool_gib: float) -> dict[str, int]:
    """The Thinker and the Talker deferred to the budget, then Code2Wav built and its
    graphs captured at once (as a group builds its stages in order), then the sizing."""
    memory = FakeMemory(in_use_gib=65)  # the group's weights
    budget = DeviceBudget("cuda:0", 0.95, memory=memory)
    with activate(budget):
        for name, slot_gib in (("thinker", 0.1875), ("talker", 0.0625)):
            budget.stage = (name, 64)
            provision(
                device="cuda:0",
                max_len=2048,
                given=None,
                default=64,
                slot_bytes=int(slot_gib * GIB),
                fixed_bytes=GIB // 2,
                weights_bytes=GIB,
                build=lambda n, g=slot_gib: setattr(
                    memory, "allocated_bytes", memory.allocated_bytes + int(n * g * GIB)
                ),
                capture=lambda: None,
            )
        memory.pools += int(code2wav_pool_gib * GIB)  # Code2Wav: not sized, captured now
    return budget.finish(lambda line: None)


def test_code2wavs_pools_captured_before_the_sizing_leave_the_kv_less() -> None:
    # 0.95 x 80 = 76 GiB; 65 in use; 2 x 0.5 fixed; 0.25 GiB a slot in both stages.
    assert _sized_group(0.0) == {"thinker": 40, "talker": 40}
    assert _sized_group(1.0) == {"thinker": 36, "talker": 36}
    with pytest.raises(ModelError, match="not even one KV slot fits"):
        _sized_group(14.0)  # the grid before the budget


def test_the_graphs_are_captured_largest_step_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # The graphs of a set share one pool: captured largest first, each smaller step fits
    # in the blocks the larger captures freed instead of adding segments of its own.
    only = {(1, 1), (4, 1), (1, 4), (2, 2), (8, 1), (1, 16)}
    assert capture_order((1, 2, 4, 8), (1, 2, 4, 16), only) == [
        (1, 16),
        (8, 1),
        (1, 4),  # equal steps: the longer chunk first
        (2, 2),
        (4, 1),
        (1, 1),
    ]
    model = Checkpoint.open(tiny_dir()).load_code2wav()
    grid = bucket_grid((1, 2, 4), (1, 2, 4), budget_bytes=4, bytes_per_row_frame=1)
    monkeypatch.setattr(vocoder_module, "reserved_bytes", lambda device: 0)
    monkeypatch.setattr(code2wav_module, "reserved_bytes", lambda device: 0)
    stream = StreamingVocoder(model, max_streams=4, cuda_graphs=False, frames=(1, 2, 4), buckets=grid)
    window = GraphedCode2Wav(model, cuda_graphs=False, batch_sizes=(1, 2, 4), frames=(1, 2, 4), buckets=grid)
    monkeypatch.setattr(window, "_check_padding", lambda: None)
    for graphs, capture in ((stream.graphs, stream.capture_graphs), (window.graphs, window.capture_graphs)):
        captured: list[tuple[int, int]] = []
        graphs.enabled = True
        monkeypatch.setattr(graphs, "capture", lambda key, step, seen=captured: seen.append(key))
        capture()
        assert captured == capture_order((1, 2, 4), (1, 2, 4), set(grid))
        assert captured[0] == (1, 4) and captured[-1] == (1, 1)
