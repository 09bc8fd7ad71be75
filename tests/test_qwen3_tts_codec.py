"""The 12 Hz decoder as Qwen3-TTS's Code2Wav: fully causal (nothing held back), and
decoded chunk by chunk with each stream's state it is the whole-utterance decode,
whatever the chunk sizes and however streams share a step."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from omnirelay.models.code2wav import decoder_holdback, measure_receptive_field
from omnirelay.models.qwen3_tts.codec import TTSCodec
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.qwen3_tts.model_config import CodecConfig
from omnirelay.models.runner.vocoder import StreamingVocoder, StreamRow
from tests.test_models_support import single_thread

Q = 16
U = 1920


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module")
def codec() -> TTSCodec:
    return TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()


def whole(model: TTSCodec, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(codes.unsqueeze(0))[0, 0]


def test_the_decoder_is_causal_and_holds_nothing_back(codec: TTSCodec) -> None:
    assert codec.total_upsample == U
    assert decoder_holdback(codec) == 0
    lookback, holdback = measure_receptive_field(codec, num_frames=64)
    assert holdback == 0 and lookback > 0  # a frame reaches forward, never back
    assert StreamingVocoder(codec, max_streams=1, cuda_graphs=False).holdback == 0


def test_streams_chunked_and_batched_at_any_point_decode_the_whole_utterance(codec: TTSCodec) -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    lengths = {"a": 30, "b": 17, "c": 1}
    codes = {rid: torch.randint(0, 2048, (Q, n), generator=gen) for rid, n in lengths.items()}
    voc = StreamingVocoder(codec, max_streams=3, cuda_graphs=False)
    sent = dict.fromkeys(lengths, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in lengths}
    step = 0
    with torch.inference_mode():
        while any(sent[r] < n for r, n in lengths.items()):
            rows = []
            for rid, n in lengths.items():
                if sent[rid] >= n or (rid == "c" and step < 2) or rng.random() < 0.2:
                    continue
                k = min(rng.choice([1, 2, 3, 5, 9, 12]), n - sent[rid])
                rows.append(StreamRow(rid, codes[rid][:, sent[rid] : sent[rid] + k]))
                sent[rid] += k
            for row, piece in zip(rows, voc.decode(rows)):
                assert piece.shape[0] == row.codes.shape[1] * U  # a first chunk too
                pieces[row.rid].append(piece)
            step += 1
    for rid in lengths:
        streamed = torch.cat(pieces[rid])
        expected = whole(codec, codes[rid])
        torch.testing.assert_close(streamed, expected, atol=1e-5, rtol=1e-4)
        voc.release(rid)
    assert voc.slots.holders() == []


def test_a_window_longer_than_the_attention_window_streams_exactly() -> None:
    """Chunks cross the transformer's sliding window (4 frames here) and the convolutions'
    receptive field: the state carries both."""
    config = CodecConfig(
        codebook_dim=16, hidden_size=16, latent_dim=16, head_dim=8, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, num_hidden_layers=2, sliding_window=4,
        upsample_rates=(3, 2), upsampling_ratios=(2,), decoder_dim=16,
    )  # fmt: skip
    from omnirelay.models.qwen3_tts.seeded import fill_seeded

    model = TTSCodec(config).eval()
    fill_seeded(model.state_dict(keep_vars=True), 3, prefix="decoder.")
    codes = torch.randint(0, 2048, (Q, 23), generator=torch.Generator().manual_seed(1))
    voc = StreamingVocoder(model, max_streams=1, cuda_graphs=False)
    out = []
    with torch.inference_mode():
        for start, end in ((0, 1), (1, 6), (6, 7), (7, 15), (15, 23)):
            out.extend(voc.decode([StreamRow("x", codes[:, start:end])]))
    torch.testing.assert_close(torch.cat(out), whole(model, codes), atol=1e-5, rtol=1e-4)
