"""Talker → Code2Wav processor: valid-frame filter, emission schedule, layout (docs/protocol.md §5.2, §5.3)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import omnirelay.processors as processors
from omnirelay.errors import ConfigError, PayloadEncodeError
from omnirelay.payload import Codes, Meta, OmniPayload
from omnirelay.processors import (
    CodecStreamState,
    TalkerToCode2WavConfig,
    TalkerToCode2WavProcessor,
    flatten_codebook_major,
    merge_runtime_info,
    parse_codec_chunk_ramp,
    read_codec_chunk,
    unflatten_codebook_major,
)

Q = 16


def fixed(**kwargs: Any) -> TalkerToCode2WavConfig:
    """The fixed schedule of docs/protocol.md §5.2 (the adaptive one is the default)."""
    return TalkerToCode2WavConfig(codec_chunk_adaptive=False, **kwargs)


def frame(index: int) -> torch.Tensor:
    """A distinct, valid codec frame [1, Q] for global frame ``index`` (codebook 0 never a stop id)."""
    return (torch.arange(Q) * 100 + index % 97 + 1).reshape(1, Q)


class Stream:
    """Drives one request through the processor the way the transfer adapter does."""

    def __init__(self, processor: TalkerToCode2WavProcessor, state: CodecStreamState | None = None) -> None:
        self.processor = processor
        self.state = state if state is not None else processor.new_state()
        self.payloads: list[OmniPayload] = []
        #: The finish flag the adapter's envelope carried with each payload.
        self.finished: list[bool] = []

    def step(self, codes: torch.Tensor | None, *, finished: bool = False, **kw: Any) -> OmniPayload | None:
        out = self.processor.step(self.state, codes, chunk_id=len(self.payloads), finished=finished, **kw)
        if out is not None:
            assert type(out) is OmniPayload
            self.payloads.append(out)  # the put succeeded: the adapter's counter moves
            self.finished.append(finished)
        return out


def summary(
    payloads: Sequence[OmniPayload], finished: Sequence[bool] | None = None
) -> list[tuple[int, int, bool]]:
    """(frames sent, left context, finished) of each payload; ``finished``: the flags of
    their envelopes (default: none was the last)."""
    rows = []
    for p, is_last in zip(payloads, finished if finished is not None else [False] * len(payloads)):
        audio = None if p.codes is None else p.codes.audio
        sent = 0 if audio is None else audio.numel() // Q
        assert p.meta is not None
        rows.append((sent, p.meta.left_context_size, is_last))
    return rows


def run_frames(processor: TalkerToCode2WavProcessor, num_frames: int) -> Stream:
    stream = Stream(processor)
    for i in range(num_frames):
        stream.step(frame(i), finished=i == num_frames - 1)
    return stream


# ---------------------------------------------------------------- layout


def test_flatten_unflatten_are_inverse_for_random_codes() -> None:
    gen = torch.Generator().manual_seed(0)
    for t in (1, 4, 29, 50):
        frames = torch.randint(0, 2048, (t, Q), generator=gen)
        flat = flatten_codebook_major(frames)
        assert flat.shape == (t * Q,)
        assert torch.equal(flat[:t], frames[:, 0])  # codebook 0 of every frame comes first
        assert torch.equal(unflatten_codebook_major(flat, Q), frames.T)


def test_token_major_layout_fails_the_inverse_check() -> None:
    frames = torch.randint(0, 2048, (29, Q), generator=torch.Generator().manual_seed(1))
    token_major = frames.reshape(-1)  # the silent bug: a legal length, garbage audio
    assert token_major.numel() % Q == 0
    assert not torch.equal(unflatten_codebook_major(token_major, Q), frames.T)


def test_unflatten_rejects_a_length_that_is_not_a_multiple_of_q() -> None:
    with pytest.raises(PayloadEncodeError, match="not a multiple of Q=16"):
        unflatten_codebook_major(torch.zeros(33, dtype=torch.long), Q)


# ---------------------------------------------------------------- emission schedule


def test_deploy_schedule_4_29_50_50_with_left_context_0_4_25_25() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    stream = run_frames(processor, 4 + 25 * 3)
    assert summary(stream.payloads, stream.finished) == [
        (4, 0, False),
        (29, 4, False),
        (50, 25, False),
        (50, 25, True),
    ]


def test_payload_frames_are_the_last_frames_codebook_major() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    all_frames = torch.cat([frame(i) for i in range(4 + 25 * 3 + 7)])
    stream = run_frames(processor, all_frames.shape[0])
    cumulative_new = 0
    for payload in stream.payloads:
        window = unflatten_codebook_major(payload.codes.audio, Q).T  # [total, Q]
        left = payload.meta.left_context_size
        new = window.shape[0] - left
        assert torch.equal(window, all_frames[cumulative_new - left : cumulative_new + new])
        assert payload.codes.audio.dtype == torch.long
        cumulative_new += new
    assert cumulative_new == all_frames.shape[0]


def test_schedule_without_initial_chunk_is_25_50_50() -> None:
    stream = run_frames(TalkerToCode2WavProcessor(fixed()), 75)
    assert summary(stream.payloads, stream.finished) == [(25, 0, False), (50, 25, False), (50, 25, True)]


def test_tail_of_r_frames_is_flushed_on_finish() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    stream = run_frames(processor, 4 + 25 + 25 + 7)
    assert summary(stream.payloads, stream.finished) == [
        (4, 0, False),
        (29, 4, False),
        (50, 25, False),
        (32, 25, True),
    ]


def test_stream_ending_on_a_boundary_gets_a_terminal_only_payload() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    stream = Stream(processor)
    for i in range(4 + 25):
        stream.step(frame(i))
    # The Talker stops with codec EOS: the last step carries no audio frame.
    eos = torch.full((1, Q), 2150)
    terminal = stream.step(eos, finished=True)
    assert terminal is not None
    assert terminal.codes is None
    assert terminal.meta == Meta(left_context_size=0) and stream.finished[-1]
    assert summary(stream.payloads, stream.finished) == [(4, 0, False), (29, 4, False), (0, 0, True)]
    assert stream.state.is_finished and not stream.state.frames


def test_missing_audio_update_still_delivers_the_terminal() -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed()))
    assert stream.step(None, finished=False) is None
    terminal = stream.step(None, finished=True)
    assert terminal is not None and stream.finished == [True] and terminal.codes is None


def test_step_after_finish_is_an_error() -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed()))
    stream.step(frame(0), finished=True)
    with pytest.raises(PayloadEncodeError, match="after the stream finished"):
        stream.step(frame(1), finished=True)


def test_chunk_id_must_count_the_payloads_built() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    state = processor.new_state()
    for i in range(4):
        processor.step(state, frame(i), chunk_id=0, finished=False)
    with pytest.raises(PayloadEncodeError, match="chunk_id 0 does not match the 1 payload"):
        processor.step(state, frame(4), chunk_id=0, finished=False)
    with pytest.raises(PayloadEncodeError, match="chunk_id must be an int"):
        processor.step(state, frame(4), chunk_id=-1, finished=False)


def test_multi_frame_steps_count_frames_not_steps() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    all_frames = torch.cat([frame(i) for i in range(60)])
    stream = Stream(processor)
    # Steps of 2 and 3 frames: boundaries are crossed, never skipped.
    bounds = [0, 2, 5, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40, 43, 46, 49, 52, 55, 58, 60]
    for a, b in itertools.pairwise(bounds):
        stream.step(all_frames[a:b], finished=b == 60)
    sent = summary(stream.payloads, stream.finished)
    assert sent[0] == (5, 0, False)  # the first step reaching I=4 frames
    assert sum(total - left for total, left, _ in sent) == 60
    assert sent[-1][2] is True
    cumulative = 0
    for payload in stream.payloads:
        window = unflatten_codebook_major(payload.codes.audio, Q).T
        left = payload.meta.left_context_size
        assert torch.equal(window, all_frames[cumulative - left : cumulative - left + window.shape[0]])
        cumulative += window.shape[0] - left


def test_long_stream_keeps_bounded_history() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=4))
    stream = Stream(processor)
    for i in range(1000):
        stream.step(frame(i))
        retained = stream.state.num_frames - stream.state.num_dropped_frames
        assert retained <= 25 + 25 + 4
    assert stream.state.num_frames == 1000


def test_first_audio_is_copied_on_chunk_0_only() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=1))
    stream = Stream(processor)
    first = stream.step(frame(0), first_audio=False)
    assert first is not None and first.meta is not None and first.meta.first_audio is False
    stream = Stream(processor)
    first = stream.step(frame(0), first_audio=True)
    assert first is not None and first.meta is not None and first.meta.first_audio is True
    for i in range(1, 26):
        stream.step(frame(i), first_audio=True)
    assert len(stream.payloads) == 2
    assert stream.payloads[1].meta == Meta(left_context_size=1)  # no first_audio


# ---------------------------------------------------------------- valid-frame filter


def test_placeholder_rows_and_post_eos_rows_are_not_audio() -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=2)))
    assert stream.step(torch.zeros(1, Q, dtype=torch.long)) is None  # prefill placeholder
    assert stream.step(frame(0)) is None
    assert stream.state.num_frames == 1
    eos_row = torch.cat([torch.tensor([[2150]]), torch.ones(1, Q - 1, dtype=torch.long)], dim=1)
    assert stream.step(eos_row) is None
    assert stream.state.num_frames == 1
    # A multi-row step is cut at its first stop row.
    rows = torch.cat([frame(1), eos_row, frame(2)])
    out = stream.step(rows)
    assert stream.state.num_frames == 2 and out is not None
    assert summary([out]) == [(2, 0, False)]


def test_request_stop_ids_join_the_configured_ones() -> None:
    processor = TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=1))
    state = processor.new_state(stop_token_ids=[7])
    assert state.stop_token_ids == {2150, 7}
    stop_row = torch.full((1, Q), 7)
    assert processor.step(state, stop_row, chunk_id=0, finished=False) is None
    assert state.num_frames == 0


def test_codec_frame_valid_decides_when_present() -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=3)))
    # A flag overrides the all-zero and stop-token heuristics.
    stream.step(torch.zeros(1, Q, dtype=torch.long), codec_frame_valid=torch.tensor([True]))
    stream.step(frame(1), codec_frame_valid=False)
    assert stream.state.num_frames == 1
    # One flag per row filters rows; another length: the last flag decides for the span.
    stream.step(torch.cat([frame(2), frame(3)]), codec_frame_valid=[False, True])
    assert stream.state.num_frames == 2
    stream.step(torch.cat([frame(4), frame(5), frame(6)]), codec_frame_valid=torch.tensor([False, True]))
    assert stream.state.num_frames == 5
    with pytest.raises(PayloadEncodeError, match="codec_frame_valid is empty"):
        stream.step(frame(7), codec_frame_valid=torch.tensor([], dtype=torch.bool))


@pytest.mark.parametrize(
    ("codes", "match"),
    [
        (torch.ones(1, 8, dtype=torch.long), r"must be \[n, Q=16\]"),
        (torch.ones(1, 1, Q, dtype=torch.long), r"must be \[n, Q=16\]"),
        (torch.ones(1, Q), "integer tensor"),
        ([1] * Q, "must be a torch.Tensor"),
    ],
)
def test_bad_codec_steps_raise_clear_errors(codes: Any, match: str) -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed()))
    with pytest.raises(PayloadEncodeError, match=match):
        stream.step(codes)


def test_a_one_dimensional_frame_is_one_row() -> None:
    stream = Stream(TalkerToCode2WavProcessor(fixed(initial_codec_chunk_frames=1)))
    out = stream.step(frame(0).reshape(-1))
    assert out is not None and summary([out]) == [(1, 0, False)]


# ---------------------------------------------------------------- config and ramp


def test_config_defaults() -> None:
    cfg = TalkerToCode2WavConfig()
    assert cfg.codec_chunk_frames == 25 and cfg.codec_left_context_frames == 25
    assert cfg.initial_codec_chunk_frames == 0
    assert cfg.codec_chunk_ramp is None and cfg.num_codebooks == 16
    assert cfg.codec_chunk_adaptive is True  # continuous audio by default
    assert TalkerToCode2WavConfig(codec_chunk_ramp=(4, 25)).codec_chunk_adaptive is False
    assert 2150 in cfg.stop_token_ids


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec_chunk_frames": 0}, "codec_chunk_frames must be an int >= 1"),
        ({"codec_chunk_frames": True}, "codec_chunk_frames must be an int"),
        ({"codec_left_context_frames": -1}, "codec_left_context_frames must be an int >= 0"),
        ({"initial_codec_chunk_frames": "4"}, "initial_codec_chunk_frames must be an int"),
        ({"initial_codec_chunk_frames": 30}, "must not exceed codec_chunk_frames"),
        ({"num_codebooks": 0}, "num_codebooks"),
        ({"stop_token_ids": "2150"}, "stop_token_ids must be a collection"),
        ({"codec_chunk_adaptive": "yes"}, "codec_chunk_adaptive must be true or false"),
        ({"codec_chunk_margin_ms": -1}, "margin_s must be >= 0"),
        ({"codec_chunk_margin_ms": "100"}, "codec_chunk_margin_ms must be a number"),
        ({"codec_frame_ms": 0}, "frame_s must be > 0"),
        ({"codec_holdback_ms": 90}, "must be shorter than one frame"),
        ({"codec_holdback_ms": float("nan")}, "codec_holdback_ms must be a number"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TalkerToCode2WavConfig(**kwargs)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("4, 8,25", (4, 8, 25)), ([2, 25], (2, 25)), ((3, 5, 25), (3, 5, 25))],
)
def test_parse_ramp(value: Any, expected: Any) -> None:
    assert parse_codec_chunk_ramp(value) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("4", "at least 2 entries"),
        ([25], "at least 2 entries"),
        ("4,,25", "comma-separated list of positive ints"),
        ("4,x", "comma-separated list of positive ints"),
        ("", "comma-separated list"),
        ([4, 0], r"codec_chunk_ramp\[1\] must be an int >= 1"),
        ([4, True], r"codec_chunk_ramp\[1\] must be an int"),
        (4, "must be a list of ints or a comma string"),
    ],
)
def test_parse_ramp_rejects_malformed_values(value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_codec_chunk_ramp(value)


def test_ramp_not_ending_at_c_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnirelay.processors.codec_schedule"):
        TalkerToCode2WavConfig(codec_chunk_ramp="2,4")
    assert "does not end at codec_chunk_frames=25" in caplog.text


def test_from_extra_reads_codec_options_and_rejects_codec_typos() -> None:
    cfg = TalkerToCode2WavConfig.from_extra(
        {"initial_codec_chunk_frames": 4, "codec_chunk_ramp": "2,4,25", "shm_pool_slots": 8}
    )
    assert cfg.initial_codec_chunk_frames == 4 and cfg.codec_chunk_ramp == (2, 4, 25)
    with pytest.raises(ConfigError, match="unknown option 'codec_chunk_frame'"):
        TalkerToCode2WavConfig.from_extra({"codec_chunk_frame": 25})
    cfg = TalkerToCode2WavConfig.from_extra({"codec_chunk_adaptive": False, "codec_chunk_margin_ms": 80})
    assert cfg.codec_chunk_adaptive is False and cfg.codec_chunk_margin_ms == 80
    with pytest.raises(ConfigError, match="two schedules"):
        TalkerToCode2WavConfig.from_extra({"codec_chunk_adaptive": True, "codec_chunk_ramp": "2,25"})


def test_ramp_schedule_replaces_initial_chunk() -> None:
    cfg = TalkerToCode2WavConfig(initial_codec_chunk_frames=4, codec_chunk_ramp=(2, 4, 8, 25))
    stream = run_frames(TalkerToCode2WavProcessor(cfg), 2 + 4 + 8 + 25 + 25 + 3)
    assert summary(stream.payloads, stream.finished) == [
        (2, 0, False),
        (6, 2, False),
        (14, 6, False),
        (39, 14, False),
        (50, 25, False),
        (28, 25, True),
    ]


def test_ramp_finish_on_a_threshold_sends_an_empty_terminal() -> None:
    cfg = TalkerToCode2WavConfig(codec_chunk_ramp=(2, 25))
    stream = Stream(TalkerToCode2WavProcessor(cfg))
    for i in range(2):
        stream.step(frame(i))
    stream.step(None, finished=True)
    assert summary(stream.payloads, stream.finished) == [(2, 0, False), (0, 0, True)]


def test_per_request_initial_override_is_clamped_to_c() -> None:
    processor = TalkerToCode2WavProcessor(fixed())
    assert processor.new_state(initial_codec_chunk_frames=99).initial_chunk_frames == 25
    assert processor.new_state(initial_codec_chunk_frames=-3).initial_chunk_frames == 0
    state = processor.new_state(initial_codec_chunk_frames=2)
    stream = Stream(processor, state)
    for i in range(2 + 25):
        stream.step(frame(i))
    assert summary(stream.payloads, stream.finished) == [(2, 0, False), (27, 2, False)]


# ---------------------------------------------------------------- public surface


def test_processors_exports() -> None:
    assert sorted(processors.__all__) == sorted(set(processors.__all__))
    for name in processors.__all__:
        assert hasattr(processors, name), name
    assert {
        "TalkerToCode2WavProcessor",
        "ThinkerToTalkerProcessor",
        "build_aligner_input",
        "codes_batch_from_flat",
        "stream_trim",
        "chunked_decode",
        "flatten_codebook_major",
        "unflatten_codebook_major",
        "read_codec_chunk",
    } <= set(processors.__all__)


# ---------------------------------------------------------------- what a generation stage reads (docs/protocol.md §4.8)


def test_read_codec_chunk_turns_codes_into_the_prompt() -> None:
    one_d, info = read_codec_chunk(None, OmniPayload(codes=Codes(audio=torch.tensor([4, 5]))))
    assert one_d == [4, 5] and info is not None and info.codes == Codes()  # the ids left the info
    two_d, info = read_codec_chunk(None, OmniPayload(codes=Codes(audio=torch.ones(2, 3))))
    assert two_d == [0] and info is not None and info.codes.audio.shape == (2, 3)  # stays, runs on [0]
    empty_2d, _ = read_codec_chunk(None, OmniPayload(codes=Codes(audio=torch.ones(16, 0))))
    assert empty_2d == []
    listed, _ = read_codec_chunk(None, OmniPayload(codes=Codes(audio=[1, 2])))
    assert listed == [1, 2]
    floats, _ = read_codec_chunk(None, OmniPayload(codes=Codes(audio=torch.tensor([3.0, 4.0]))))
    assert floats == [3, 4] and all(type(x) is int for x in floats)
    missing, info = read_codec_chunk(None, OmniPayload(speaker="x"))
    assert missing == [] and info is not None and info.speaker == "x"
    nothing, same = read_codec_chunk(info, None)  # a boundary with no body keeps the info
    assert nothing == [] and same is info
    with pytest.raises(TypeError, match=r"codes\.audio must be a tensor or a list, got str"):
        read_codec_chunk(None, OmniPayload(codes=Codes(audio="abc")))
    with pytest.raises(TypeError, match="must be an OmniPayload, got dict"):
        read_codec_chunk(None, {"codes": {"audio": [1]}})


def test_runtime_info_merges_section_by_section_and_never_mutates() -> None:
    first = OmniPayload(
        codes=Codes(audio=[1], ref=torch.tensor([5])), meta=Meta(left_context_size=3), speaker="a"
    )
    _, info = read_codec_chunk(None, first)
    assert info is not None and info.codes.ref.tolist() == [5] and info.codes.audio is None
    assert info.meta == Meta(left_context_size=3) and info.speaker == "a"
    second = OmniPayload(meta=Meta(first_audio=True), speaker="b", extras={"k": 1})
    _, merged = read_codec_chunk(info, second)
    assert merged is not None and merged.codes.ref.tolist() == [5]
    assert merged.meta == Meta(left_context_size=3, first_audio=True) and merged.speaker == "b"
    _, merged2 = read_codec_chunk(merged, OmniPayload(extras={"j": 2}))
    assert merged2 is not None and merged2.extras == {"k": 1, "j": 2}
    assert info.speaker == "a" and info.meta == Meta(left_context_size=3)  # never mutated
    assert merged.extras == {"k": 1}
    replace = OmniPayload(codes=Codes(audio=[2]), meta=Meta(replace_runtime_additional_information=True))
    prompt, fresh = read_codec_chunk(merged, replace)
    assert prompt == [2] and fresh is not None and fresh.speaker is None and fresh.codes.ref is None
    assert merge_runtime_info(None, second) is second
