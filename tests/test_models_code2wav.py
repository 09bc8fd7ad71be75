"""Code2Wav executor: a streamed request decodes to exactly the whole-utterance samples —
with its decoder state (the default: any chunk sizes, no left context needed), or window
by window when the left context covers the decoder's receptive field; complete inputs
use the chunked decode; bad codes fail."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import Executor
from omnirelay.errors import ModelError
from omnirelay.models.code2wav import (
    SAMPLE_RATE,
    Code2WavExecutor,
    frames_of_context_needed,
    measure_receptive_field,
)
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_omni.code2wav import open_code2wav
from omnirelay.payload import Codes, Meta, OmniPayload
from omnirelay.processors import TalkerToCode2WavConfig, TalkerToCode2WavProcessor
from tests.test_models_support import item, single_thread, tiny_dir

Q = 16
U = 1920
EOS = 2150
TOL = 1e-5
DEPLOY = TalkerToCode2WavConfig(
    initial_codec_chunk_frames=4,
    codec_chunk_frames=25,
    codec_left_context_frames=25,
    codec_chunk_adaptive=False,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module")
def code2wav() -> Code2WavExecutor:
    """The default executor: streams keep their decoder state between chunks."""
    return open_code2wav(Checkpoint.open(tiny_dir()))


@pytest.fixture(scope="module")
def windowed(code2wav: Code2WavExecutor) -> Code2WavExecutor:
    """Streams decoded window by window, each with its left context (``stateful: false``)."""
    return Code2WavExecutor(code2wav.model, stateful=False)


@pytest.fixture(params=["stateful", "windowed"])
def either(
    request: pytest.FixtureRequest, code2wav: Code2WavExecutor, windowed: Code2WavExecutor
) -> Code2WavExecutor:
    return code2wav if request.param == "stateful" else windowed


_STREAM_IDS = itertools.count()


def random_frames(num_frames: int, seed: int) -> torch.Tensor:
    """[T, Q] codec frames as the Talker emits them (one row per step)."""
    return torch.randint(0, 2048, (num_frames, Q), generator=torch.Generator().manual_seed(seed))


def chunk_payloads(
    frames: torch.Tensor, config: TalkerToCode2WavConfig, frame_times: list[float] | None = None
) -> list[OmniPayload]:
    """What the Talker → Code2Wav processor sends for these frames, one frame per Talker
    step (made at ``frame_times`` on a virtual clock, when given), and a last step that
    samples codec EOS (finished; its frame is no audio)."""
    now = [0.0]
    processor = TalkerToCode2WavProcessor(config, clock=lambda: now[0])
    state = processor.new_state()
    steps = [(frames[t : t + 1], False) for t in range(frames.shape[0])]
    steps.append((torch.tensor([[EOS] + [0] * (Q - 1)]), True))
    times = frame_times if frame_times is not None else [0.01 * t for t in range(len(steps))]
    out: list[OmniPayload] = []
    for (frame, finished), at in zip(steps, times + [times[-1]] * len(steps)):
        now[0] = at
        payload = processor.step(state, frame, chunk_id=len(out), finished=finished)
        if payload is not None:
            out.append(payload)
    return out


def chunk_item(rid: str, payload: OmniPayload) -> Any:
    """The generation scheduler's item for one committed chunk (docs/protocol.md §4.8: Code2Wav's
    chunk reader makes the 1-D codes the prompt and the rest the runtime info)."""
    ids, info = Code2WavExecutor.read_chunk(None, payload)
    return item(rid, input_ids=ids, info=info)


def stream(
    executor: Code2WavExecutor,
    frames: torch.Tensor,
    config: TalkerToCode2WavConfig,
    frame_times: list[float] | None = None,
) -> tuple[list[Any], Any]:
    payloads = chunk_payloads(frames, config, frame_times)
    schedule = [
        (p.codes.audio.numel() // Q if p.codes is not None else 0, p.meta.left_context_size) for p in payloads
    ]
    rid = f"r{next(_STREAM_IDS)}"
    pieces = [executor.step([chunk_item(rid, p)])[0].audio for p in payloads]
    executor.release(rid)  # as the engine does when the request ends
    assert executor.num_live_requests() == 0 and executor.leak_state() == {}
    return schedule, torch.cat(pieces)


def whole(executor: Code2WavExecutor, frames: torch.Tensor) -> torch.Tensor:
    return executor.decode(frames.T.unsqueeze(0))[0, 0]


def test_is_an_executor(code2wav: Code2WavExecutor) -> None:
    assert isinstance(code2wav, Executor)
    assert code2wav.execution_type == "generation" and code2wav.supports_batching
    assert (code2wav.num_codebooks, code2wav.upsample, code2wav.sample_rate) == (Q, U, SAMPLE_RATE)


def test_tiny_decoder_receptive_field_is_covered_by_the_first_chunk(code2wav: Code2WavExecutor) -> None:
    lookback, holdback = measure_receptive_field(code2wav.model)
    assert 0 < holdback < U  # the causal decoder holds samples back at a window's edge
    assert lookback > 0
    # The smallest left context that decodes exactly: less than the first chunk's 4 frames.
    assert frames_of_context_needed(lookback, holdback, U) == 2


def test_streaming_4_29_50_50_matches_the_whole_utterance(either: Code2WavExecutor) -> None:
    frames = random_frames(130, seed=1)
    schedule, streamed = stream(either, frames, DEPLOY)
    assert schedule == [(4, 0), (29, 4), (50, 25), (50, 25), (50, 25), (50, 25), (26, 25)]
    reference = whole(either, frames)
    assert reference.shape[0] == 130 * U - measure_receptive_field(either.model)[1]
    assert streamed.shape == reference.shape  # exactly the whole-utterance sample count
    assert float(reference.std()) > 0.05  # a real signal, not silence
    assert float((streamed - reference).abs().max()) < TOL  # nothing duplicated, nothing lost


@pytest.mark.parametrize("interval_s", [0.01, 0.03, 0.07])
def test_the_adaptive_schedule_matches_the_whole_utterance(
    either: Code2WavExecutor, interval_s: float
) -> None:
    frames = random_frames(130, seed=3)
    times = [0.1 + interval_s * t for t in range(131)]
    schedule, streamed = stream(either, frames, TalkerToCode2WavConfig(), times)
    assert len(schedule) > 3 and len({new - left for new, left in schedule}) > 2  # sizes vary
    sent = 0
    for total, left in schedule:  # every chunk re-sends min(sent so far, Lc) frames of context
        assert left == min(sent, 25)
        sent += total - left
    reference = whole(either, frames)
    assert streamed.shape == reference.shape
    assert float((streamed - reference).abs().max()) < TOL


def test_a_stateful_stream_needs_no_left_context(code2wav: Code2WavExecutor) -> None:
    """Chunks without context (codec_left_context_frames: 0), in sizes 1 to 25: the
    decoder state carries everything a window's context would have re-decoded."""
    frames = random_frames(90, seed=6)
    times = [0.1 + 0.03 * t for t in range(91)]
    config = TalkerToCode2WavConfig(codec_left_context_frames=0)
    schedule, streamed = stream(code2wav, frames, config, times)
    assert all(left == 0 for _, left in schedule) and schedule[0][0] <= 2
    assert float((streamed - whole(code2wav, frames)).abs().max()) < TOL


def test_too_little_context_is_approximate_but_never_shifts_samples(windowed: Code2WavExecutor) -> None:
    code2wav = windowed
    frames = random_frames(60, seed=2)
    short = TalkerToCode2WavConfig(
        initial_codec_chunk_frames=1,
        codec_chunk_frames=25,
        codec_left_context_frames=1,
        codec_chunk_adaptive=False,
    )
    schedule, streamed = stream(code2wav, frames, short)
    assert [left for _, left in schedule] == [0, 1, 1, 1]
    reference = whole(code2wav, frames)
    assert streamed.shape == reference.shape
    error = (streamed - reference).abs()
    assert float(error.max()) > 10 * TOL  # the comparison notices missing context …
    # … and only near chunk boundaries: away from them every sample is exact.
    starts = [0, 1 * U, 26 * U, 51 * U]
    near = torch.zeros_like(error, dtype=torch.bool)
    for s in starts:
        near[max(0, s - U) : s + 2 * U] = True
    assert float(error[~near].max()) < TOL


def test_stream_ending_on_a_boundary_gets_a_terminal_with_no_frames(either: Code2WavExecutor) -> None:
    frames = random_frames(29, seed=3)
    payloads = chunk_payloads(frames, DEPLOY)
    assert payloads[-1].codes is None  # the terminal: every frame went out before it
    (res,) = either.step([chunk_item("t", payloads[-1])])
    assert res.audio.shape == (0,) and res.sample_rate == SAMPLE_RATE
    assert either.num_live_requests() == 0  # a terminal without frames takes no state
    _, streamed = stream(either, frames, DEPLOY)
    assert float((streamed - whole(either, frames)).abs().max()) < TOL


def test_windows_of_several_streams_decode_in_one_batch(windowed: Code2WavExecutor) -> None:
    code2wav = windowed
    windows = [
        chunk_payloads(random_frames(n, seed=n), DEPLOY)[k] for n, k in ((60, 2), (30, 1), (3, 0), (54, 2))
    ]
    items = [chunk_item(f"r{i}", p) for i, p in enumerate(windows)]
    batched = Code2WavExecutor(code2wav.model, max_decode_batch=4, stateful=False).step(items)
    for it, res in zip(items, batched):
        (alone,) = code2wav.step([it])
        assert res.internal_id == it.internal_id
        assert res.audio.shape == alone.audio.shape
        assert float((res.audio - alone.audio).abs().max()) < TOL


def test_a_launched_step_gives_what_a_step_gives(windowed: Code2WavExecutor) -> None:
    """``launch`` (a device group's split step) on the CPU: done at once, the same audio."""
    windows = [chunk_payloads(random_frames(n, seed=n), DEPLOY)[k] for n, k in ((60, 2), (3, 0))]
    items = [chunk_item(f"r{i}", p) for i, p in enumerate(windows)]
    launched = windowed.launch(items)
    assert launched.is_done()
    for res, alone in zip(launched.result(), windowed.step(items)):
        assert res.internal_id == alone.internal_id and torch.equal(res.audio, alone.audio)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_launched_step_on_cuda_polls_its_event_and_gives_what_a_step_gives(
    windowed: Code2WavExecutor,
) -> None:
    import copy

    executor = Code2WavExecutor(copy.deepcopy(windowed.model).to("cuda:0"), stateful=False, cuda_graphs=True)
    windows = [chunk_payloads(random_frames(n, seed=n), DEPLOY)[k] for n, k in ((60, 2), (3, 0))]
    items = [chunk_item(f"r{i}", p) for i, p in enumerate(windows)]
    launched = executor.launch(items)
    while not launched.is_done():  # polled, as a device group's loop does
        pass
    for res, alone in zip(launched.result(), executor.step(items)):
        assert res.audio.device.type == "cpu" and res.audio.is_pinned()
        assert float((res.audio - alone.audio).abs().max()) < TOL


def test_complete_input_uses_the_chunked_decode(code2wav: Code2WavExecutor) -> None:
    frames = random_frames(130, seed=4)
    reference = whole(code2wav, frames)
    pieces = Code2WavExecutor(code2wav.model, chunk_frames=40, chunk_left_context=25)
    flat = frames.T.reshape(-1).tolist()
    for it in (
        item("flat", input_ids=flat),  # codebook-major ids as the prompt
        item(
            "info", input_ids=[0], info=OmniPayload(codes=Codes(audio=frames.T))
        ),  # [Q, T] in the runtime info
        item("fwd", input_ids=[0], inputs={"codes": frames.T.unsqueeze(0)}),  # forwarded [1, Q, T]
    ):
        (res,) = pieces.step([it])
        assert res.audio.shape == reference.shape, it.internal_id
        assert float((res.audio - reference).abs().max()) < TOL, it.internal_id
    # Two complete inputs of different lengths in one batch, each cropped to its frames.
    short = random_frames(50, seed=5)
    a, b = pieces.step([item("a", input_ids=flat), item("b", input_ids=short.T.reshape(-1).tolist())])
    assert float((a.audio - reference).abs().max()) < TOL
    assert float((b.audio - whole(code2wav, short)).abs().max()) < TOL


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": list(range(17))}, "not a multiple of Q=16"),
        ({"input_ids": [2150] * 16}, r"must lie in \[0, 2048\)"),
        (
            {"input_ids": [0], "info": OmniPayload(codes=Codes(audio=torch.zeros((5, Q), dtype=torch.long)))},
            "codebook-major",
        ),
        ({"input_ids": [1] * 32, "info": OmniPayload(meta=Meta(left_context_size=3))}, "left_context_size"),
        ({"input_ids": [1] * 16, "info": {"meta": {"left_context_size": 0}}}, "must be the OmniPayload"),
    ],
)
def test_bad_codes_are_errors(code2wav: Code2WavExecutor, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        code2wav.step([item("bad", **kwargs)])
