"""Code2Wav decode-window math (docs/protocol.md §6): batch building, the streaming trim, chunked decode.

The trim is checked against a fake causal decoder with the two properties that make the
rule necessary: a finite receptive field over past frames (zero history at a window's
left edge, like a causal convolution's padding) and a hold-back of ``tail`` samples at
the right edge (samples that depend on frames not yet seen). Streaming the frames
through the real Talker → Code2Wav processor and trimming each window must reproduce the
one-shot decode of the whole utterance sample for sample.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.payload import OmniPayload
from omnirelay.processors import (
    TalkerToCode2WavConfig,
    TalkerToCode2WavProcessor,
    chunked_decode,
    codes_batch_from_flat,
    split_stream_output,
    stream_trim,
    validate_left_context,
)

Q = 16
U = 1920  # Qwen3-Omni: 8·5·4·3·2·2 samples per frame


class FakeCausalDecoder:
    """``[B, Q, W]`` codes → ``[B, 1, W·U − tail]`` float64 samples.

    Frame value ``x[f]`` mixes all codebooks (so a wrong layout changes the audio).
    Frame ``m`` of the window filters ``x[m−R … m]`` (missing history is 0). Window sample
    ``j`` belongs to frame ``m = (j + tail) // U``: it looks ``tail`` samples ahead, so the
    last ``tail`` samples of a window cannot be produced yet and are held back.
    """

    def __init__(self, *, tail: int, receptive_frames: int, upsample: int = U) -> None:
        self.tail = tail
        self.receptive_frames = receptive_frames
        self.upsample = upsample
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(codes.shape))
        weights = torch.arange(1, Q + 1, dtype=torch.float64) ** 2
        x = (codes.to(torch.float64) * weights.reshape(1, Q, 1)).sum(dim=1)  # [B, W]
        num_frames = x.shape[1]
        y = x.clone()
        for k in range(1, min(self.receptive_frames, num_frames - 1) + 1):
            y[:, k:] += (k + 1) * x[:, : num_frames - k]  # frame m hears frame m − k
        num_samples = max(0, x.shape[1] * self.upsample - self.tail)
        index = torch.arange(num_samples) + self.tail
        frame_of, phase = index // self.upsample, (index % self.upsample).to(torch.float64)
        return (y[:, frame_of] * (phase + 1) + phase).unsqueeze(1)


def random_frames(num_frames: int, seed: int) -> torch.Tensor:
    """``[T, Q]`` codec frames that pass the valid-frame filter (codebook 0 is never 2150)."""
    return torch.randint(1, 2048, (num_frames, Q), generator=torch.Generator().manual_seed(seed))


def stream_payloads(frames: torch.Tensor, initial: int) -> list[OmniPayload]:
    """The Talker → Code2Wav payloads of one request, one frame per Talker step."""
    processor = TalkerToCode2WavProcessor(
        TalkerToCode2WavConfig(initial_codec_chunk_frames=initial, codec_chunk_adaptive=False)
    )
    state = processor.new_state()
    payloads: list[OmniPayload] = []
    for i in range(frames.shape[0]):
        out = processor.step(
            state, frames[i : i + 1], chunk_id=len(payloads), finished=i == frames.shape[0] - 1
        )
        if out is not None:
            payloads.append(out)
    return payloads


def streamed_audio(
    decoder: FakeCausalDecoder, payloads: list[OmniPayload], *, naive: bool = False
) -> torch.Tensor:
    """Decode each payload's window alone and concatenate what the trim emits."""
    pieces = []
    for payload in payloads:
        if payload.codes is None:
            continue
        codes, lengths = codes_batch_from_flat([payload.codes.audio], Q)
        left = payload.meta.left_context_size
        wav = decoder(codes)
        if naive:  # the tempting wrong rule: drop the context's c·U samples
            pieces.append(wav[0, :, left * U :])
        else:
            pieces.extend(split_stream_output(wav, lengths, [left], U))
    return torch.cat(pieces, dim=-1)


def one_shot(decoder: FakeCausalDecoder, frames: torch.Tensor) -> torch.Tensor:
    return decoder(frames.T.unsqueeze(0))[0]


# ---------------------------------------------------------------- streaming trim


@pytest.mark.parametrize("tail", [0, 5, U + 7])
def test_streamed_chunks_equal_the_one_shot_decode(tail: int) -> None:
    frames = random_frames(4 + 25 * 3 + 7, seed=0)
    payloads = stream_payloads(frames, initial=4)
    schedule = [(p.codes.audio.numel() // Q, p.meta.left_context_size) for p in payloads]
    assert schedule == [(4, 0), (29, 4), (50, 25), (50, 25), (32, 25)]
    decoder = FakeCausalDecoder(tail=tail, receptive_frames=4)  # covered by every chunk's context
    expected = one_shot(decoder, frames)
    got = streamed_audio(decoder, payloads)
    assert got.shape == expected.shape == (1, frames.shape[0] * U - tail)
    assert torch.equal(got, expected)  # no duplicated, dropped or altered sample


def test_naive_drop_context_rule_fails() -> None:
    frames = random_frames(4 + 25 * 3, seed=1)
    payloads = stream_payloads(frames, initial=4)
    decoder = FakeCausalDecoder(tail=5, receptive_frames=4)
    expected = one_shot(decoder, frames)
    naive = streamed_audio(decoder, payloads, naive=True)
    # Every boundary loses the previous chunk's held-back samples.
    assert naive.shape[-1] == expected.shape[-1] - 5 * (len(payloads) - 1)
    assert not torch.equal(naive[..., : expected.shape[-1]], expected)


def test_layout_mistake_changes_the_audio() -> None:
    frames = random_frames(29, seed=2)
    decoder = FakeCausalDecoder(tail=0, receptive_frames=2)
    codes, _ = codes_batch_from_flat([frames.reshape(-1)], Q)  # token-major by mistake
    assert codes.shape == (1, Q, 29)
    assert not torch.equal(decoder(codes)[0], one_shot(decoder, frames))


def test_batch_padding_two_requests_of_different_length_in_one_window() -> None:
    decoder = FakeCausalDecoder(tail=11, receptive_frames=4)
    frames_a = random_frames(4 + 25 * 2 + 3, seed=3)  # windows of 4, 29, 50, 28 frames
    frames_b = random_frames(25 * 3 + 10, seed=4)  # windows of 25, 50, 50, 35 frames
    payloads_a = stream_payloads(frames_a, initial=4)
    payloads_b = stream_payloads(frames_b, initial=0)
    assert len(payloads_a) == len(payloads_b) == 4
    assert payloads_a[0].codes.audio.numel() != payloads_b[0].codes.audio.numel()
    audio: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for pa, pb in zip(payloads_a, payloads_b):
        # Chunk k of both requests decoded together: the shorter one is right-padded.
        codes, lengths = codes_batch_from_flat([pa.codes.audio, pb.codes.audio], Q)
        lefts = validate_left_context([pa.meta.left_context_size, pb.meta.left_context_size], lengths)
        assert codes.shape[-1] == max(lengths)
        piece_a, piece_b = split_stream_output(decoder(codes), lengths, lefts, U)
        audio["a"].append(piece_a)
        audio["b"].append(piece_b)
    assert torch.equal(torch.cat(audio["a"], dim=-1), one_shot(decoder, frames_a))
    assert torch.equal(torch.cat(audio["b"], dim=-1), one_shot(decoder, frames_b))


def test_tail_comes_from_the_window_not_the_row() -> None:
    # W=50 frames decoded to D = 50·U − 11; a row of 29 frames with 4 frames of context.
    start, end = stream_trim(50 * U - 11, 50, U, 29, 4)
    assert (start, end) == (4 * U - 11, 29 * U - 11)
    # Computing tail from the row (29·U − D < 0 → 0) would emit 11 samples too many.
    row_tail = max(0, 29 * U - (50 * U - 11))
    assert (4 * U - row_tail, 29 * U - row_tail) != (start, end)


def test_stream_trim_examples_and_clamps() -> None:
    assert stream_trim(4 * U - 5, 4, U, 4, 0) == (0, 4 * U - 5)  # first chunk: start 0
    assert stream_trim(50 * U, 50, U, 50, 25) == (25 * U, 50 * U)  # no hold-back: drop c·U
    assert stream_trim(0, 1, U, 0, 0) == (0, 0)
    assert stream_trim(10, 1, 16, 1, 0) == (0, 10)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((50 * U + 1, 50, U, 50, 25), "more than frames x upsample"),
        ((100, 4, U, 5, 0), r"num_frames \(5\) <= window_frames \(4\)"),
        ((100, 4, U, 3, 4), r"left_context \(4\) <= num_frames \(3\)"),
        ((100, 4, 0, 3, 0), "upsample must be a positive int"),
        ((-1, 4, U, 3, 0), "decoded_len must be an int >= 0"),
        ((100, 4, U, 3.0, 0), "num_frames must be an int"),
    ],
)
def test_stream_trim_rejects_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        stream_trim(*args)


def test_split_stream_output_checks_the_batch() -> None:
    with pytest.raises(ModelError, match=r"expected \[B=2"):
        split_stream_output(torch.zeros(1, 1, 10), [1, 1], [0, 0], U)
    with pytest.raises(ModelError, match="1 left_context_size value"):
        split_stream_output(torch.zeros(2, 1, U), [1, 1], [0], U)


# ---------------------------------------------------------------- batch building


def test_codes_batch_pads_right_with_code_0() -> None:
    a, b = random_frames(3, seed=5), random_frames(5, seed=6)
    codes, lengths = codes_batch_from_flat([a.T.reshape(-1), b.T.reshape(-1).tolist()], Q)
    assert codes.shape == (2, Q, 5) and codes.dtype == torch.long
    assert lengths == [3, 5]
    assert torch.equal(codes[0, :, :3], a.T) and torch.equal(
        codes[0, :, 3:], torch.zeros(Q, 2, dtype=torch.long)
    )
    assert torch.equal(codes[1], b.T)


def test_codes_batch_rejects_ids_that_are_not_a_multiple_of_q() -> None:
    with pytest.raises(ModelError, match="request 1: 17 codec ids are not a multiple of Q=16"):
        codes_batch_from_flat([torch.ones(16, dtype=torch.long), torch.ones(17, dtype=torch.long)], Q)


def test_warmup_pads_to_a_multiple_of_q() -> None:
    codes, lengths = codes_batch_from_flat(
        [torch.ones(10, dtype=torch.long), torch.ones(13, dtype=torch.long)], Q, is_warmup=True
    )
    assert codes.shape == (1, Q, 2) and lengths == [2]
    assert int(codes.sum()) == 23


@pytest.mark.parametrize(
    ("flat", "q", "match"),
    [
        ([], Q, "flat_ids_per_request is empty"),
        ([torch.ones(16)], Q, "must be integers"),
        ([torch.ones(1, 16, dtype=torch.long)], Q, "must be 1-D"),
        ([torch.ones(16, dtype=torch.long)], 0, "num_codebooks must be a positive int"),
    ],
)
def test_codes_batch_rejects_bad_input(flat: Any, q: int, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        codes_batch_from_flat(flat, q)


def test_left_context_validation() -> None:
    assert validate_left_context(None, [3, 5]) == [0, 0]
    assert validate_left_context([1, 5], [3, 5]) == [1, 5]
    with pytest.raises(ModelError, match="1 left_context_size value"):
        validate_left_context([0], [3, 5])  # the reference silently zeroes every context here
    with pytest.raises(ModelError, match=r"request 0: left_context_size 4 is not an int in \[0, 3\]"):
        validate_left_context([4, 0], [3, 5])
    with pytest.raises(ModelError, match="is not an int"):
        validate_left_context([True, 0], [3, 5])


# ---------------------------------------------------------------- chunked (non-streaming) decode


@pytest.mark.parametrize("tail", [0, 13, U + 3])
def test_chunked_decode_equals_one_shot_when_context_covers_the_receptive_field(tail: int) -> None:
    decoder = FakeCausalDecoder(tail=tail, receptive_frames=20)
    codes = torch.stack([random_frames(1000, seed=7).T, random_frames(1000, seed=8).T])
    got = chunked_decode(decoder, codes, upsample=U)
    assert [shape[-1] for shape in decoder.calls] == [300, 325, 325, 125]
    expected = decoder(codes)
    assert got.shape == expected.shape == (2, 1, 1000 * U - tail)
    assert torch.equal(got, expected)


def test_chunked_decode_without_hold_back_is_the_reference_rule() -> None:
    decoder = FakeCausalDecoder(tail=0, receptive_frames=3)
    codes = random_frames(70, seed=9).T.unsqueeze(0)
    got = chunked_decode(decoder, codes, upsample=U, chunk_size=30, left_context=5)
    manual = [
        decoder(codes[..., 0:30]),
        decoder(codes[..., 25:60])[..., 5 * U :],
        decoder(codes[..., 55:70])[..., 5 * U :],
    ]
    assert torch.equal(got, torch.cat(manual, dim=-1))


def test_chunked_decode_then_crop_each_request_to_its_frames() -> None:
    decoder = FakeCausalDecoder(tail=7, receptive_frames=2)
    a, b = random_frames(40, seed=10), random_frames(25, seed=11)
    codes, lengths = codes_batch_from_flat([a.T.reshape(-1), b.T.reshape(-1)], Q)
    wav = chunked_decode(decoder, codes, upsample=U, chunk_size=16, left_context=4)
    out_a, out_b = split_stream_output(wav, lengths, [0, 0], U)
    assert torch.equal(out_a, one_shot(decoder, a))
    assert torch.equal(out_b, one_shot(decoder, b))


def test_chunked_decode_rejects_context_smaller_than_the_hold_back() -> None:
    decoder = FakeCausalDecoder(tail=U + 1, receptive_frames=0)
    with pytest.raises(ModelError, match="cannot cover"):
        chunked_decode(
            decoder, random_frames(20, seed=12).T.unsqueeze(0), upsample=U, chunk_size=10, left_context=1
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"left_context": -1}, "left_context must be an int >= 0"),
    ],
)
def test_chunked_decode_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        chunked_decode(
            FakeCausalDecoder(tail=0, receptive_frames=0),
            torch.ones(1, Q, 2, dtype=torch.long),
            upsample=U,
            **kwargs,
        )
    with pytest.raises(ModelError, match=r"codes must be \[B, Q, T\]"):
        chunked_decode(
            FakeCausalDecoder(tail=0, receptive_frames=0), torch.ones(Q, 2, dtype=torch.long), upsample=U
        )
