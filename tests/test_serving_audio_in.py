"""Chat with ``input_audio`` parts on the tiny Qwen3-Omni pipeline, through the official
``openai`` client: the Thinker's own audio encoder hears the clip (its tokens fill the
prompt's audio placeholders), and every bad input is a 400 that names the problem, with
the server healthy and nothing left behind after it.

The server runs with small audio limits (3 s, 200 kB) so the limit tests stay fast.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from omnirelay.engine.interfaces import BatchItem, SamplingParams
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs
from omnirelay.models.qwen3_omni.audio import QwenAudioEncoder, num_audio_tokens
from omnirelay.models.qwen3_omni.prompt import AUDIO_PAD
from omnirelay.serving import ServerConfig
from omnirelay.serving.media.audio_in import PCM16_RATE
from omnirelay.serving.media.audio_out import pcm16, wav_header
from tests.serving_support import Served, chat_stream_audio, serve

MODEL = "qwen3-omni-tiny"
LIMITS = ServerConfig(max_audio_input_bytes=200_000, max_audio_input_s=3.0)
QUESTION = {"type": "text", "text": "What do you hear?"}


def _tone(rate: int, seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    return wav_header(rate, samples.size) + pcm16(samples)


def _part(raw: bytes | str, fmt: str) -> dict[str, Any]:
    data = raw if isinstance(raw, str) else base64.b64encode(raw).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, LIMITS)


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def _ask(srv: Served, *parts: dict[str, Any], **kwargs: Any) -> Any:
    return srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [QUESTION, *parts]}], max_tokens=8, **kwargs
    )


def test_the_thinker_hears_the_clip(srv: Served) -> None:
    """A 1 s clip is 13 audio tokens plus its start and end: the prompt the Thinker computed
    grew by 15; two different clips give two different greedy answers."""
    text_only = _ask(srv)
    tone = _ask(srv, _part(_wav(_tone(24_000, 1.0, 440), 24_000), "wav"))
    assert (
        tone.usage.prompt_tokens == text_only.usage.prompt_tokens + num_audio_tokens(AUDIO_INPUT_RATE, 50) + 2
    )
    assert num_audio_tokens(AUDIO_INPUT_RATE, 50) == 13
    noise = np.random.default_rng(0).normal(0.0, 0.3, PCM16_RATE).astype(np.float32)
    other = _ask(srv, _part(pcm16(noise), "pcm16"))
    assert other.usage.prompt_tokens == tone.usage.prompt_tokens
    assert tone.choices[0].message.content != other.choices[0].message.content


def test_streamed_chat_with_audio_in_and_out(srv: Served) -> None:
    stream = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [_part(_wav(_tone(16_000, 0.5, 300), 16_000), "wav")]}],
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"},
        stream=True,
        max_tokens=4,
    )
    text, audio, chunks = chat_stream_audio(stream)
    assert text and audio and len(audio) % 2 == 0
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


TOO_LONG = _wav(_tone(16_000, 4.0, 300), 16_000)  # 128 kB: inside the byte limit, past 3 s
TOO_BIG = _wav(np.zeros(120_000, dtype=np.float32), 24_000)  # 240 kB


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([_part("bm90IGJhc2U2NA=!", "wav")], r"content\[0\]\.input_audio\.data is not valid base64"),
        ([_part(b"RIFF", "flac")], r"input_audio\.format 'flac' is not supported; supported input formats"),
        ([_part(TOO_LONG, "wav")], r"longer than the limit of 3 s of audio \(max_audio_input_s\)"),
        ([_part(TOO_BIG, "wav")], r"the limit is 200000 bytes \(max_audio_input_bytes\)"),
        (
            [_part(b"RIFF\x24\x00\x00\x00WAVEfmt garbage" * 4, "wav")],
            r"input_audio\.data is not a readable wav file",
        ),
        (
            [_part(TOO_LONG[: len(TOO_LONG) // 2], "wav"), _part(TOO_LONG[: len(TOO_LONG) // 2], "wav")],
            r"content\[1\]\.input_audio\.data: the request's input audio is 4\.0 s; the limit is 3 s for all parts",
        ),
        (
            [{"type": "input_file", "file": {"file_data": "AAAA"}}],
            r"content\[0\] has type 'input_file'; this part is not supported",
        ),
        ([{"type": "input_audio"}], r"content\[0\]\.input_audio is required"),
        (
            [
                QUESTION,
                {"type": "text", "text": f"{AUDIO_PAD}"},
                _part(_wav(_tone(16_000, 0.2, 300), 16_000), "wav"),
            ],
            r"reserved for audio",
        ),
    ],
)
def test_bad_input_audio_is_a_400_that_names_the_problem(srv: Served, content: Any, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as info:
        srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_audio_outside_a_user_turn_is_refused(srv: Served) -> None:
    messages = [
        {"role": "assistant", "content": [_part(_wav(_tone(16_000, 0.2, 300), 16_000), "wav")]},
        {"role": "user", "content": "Hi"},
    ]
    with pytest.raises(openai.BadRequestError, match=r"audio input is taken in user messages only"):
        srv.client().chat.completions.create(model=MODEL, messages=messages)
    resp = httpx.get(srv.url + "/health", params={"audit": 1})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_audio_rows_fill_the_placeholders_in_order(runner: str) -> None:
    """In one process, on either runner: the Thinker's embeddings (hidden state 0) at the
    prompt's audio positions are the audio encoder's rows for the clips, in order; its
    text positions are the token embeddings."""
    from omnirelay.models.qwen3_omni.thinker import create_thinker

    torch.set_flush_denormal(True)
    static = {"cuda_graphs": False, "max_num_seqs": 2, "max_model_len": 256} if runner == "static" else {}
    ex = create_thinker(tiny=True, seed=0, num_threads=1, runner=runner, **static)
    clips = [_tone(AUDIO_INPUT_RATE, 0.6, 300), _tone(AUDIO_INPUT_RATE, 1.3, 900)]
    counts = [num_audio_tokens(c.size, 50) for c in clips]
    text = (
        "<|im_start|>user\n"
        + "".join(f"<|audio_start|>{AUDIO_PAD * n}<|audio_end|> and " for n in counts)
        + "?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = ex.tokenizer.encode(text, add_special_tokens=False)
    item = BatchItem(
        internal_id="r#0.0",
        external_id="r",
        input_token_ids=ids,
        all_token_ids=ids,
        num_computed_tokens=0,
        is_prefill=True,
        sampling=SamplingParams(max_tokens=4),
        inputs=audio_inputs(clips),
    )
    try:
        (result,) = ex.step([item])
        embeds = result.next_stage_output["hidden_layers"][0]
        expected = QwenAudioEncoder(ex.model.model.audio_tower).embed([torch.from_numpy(c) for c in clips])
        pads = torch.tensor(ids) == ex.audio_token_id
        assert int(pads.sum()) == sum(counts) == expected.shape[0]
        torch.testing.assert_close(embeds[pads], expected)
        torch.testing.assert_close(embeds[~pads], ex._text.embed_tokens(torch.tensor(ids)[~pads]))
        assert ex.num_audio_clips == 2
    finally:
        ex.release(item.internal_id)
    assert ex.num_live_requests() == 0
