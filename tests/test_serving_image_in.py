"""Chat with ``image_url`` parts on the tiny Qwen3-Omni pipeline, through the official
``openai`` client: the Thinker's own vision tower sees the image (its tokens fill the
prompt's image placeholders), and every bad input is a 400 that names the problem, with
the server healthy and nothing left behind after it.

The server runs with small image limits (60 kB, 200 x 200 pixels) so the limit tests stay
fast; the tiny model's processor takes 16 x 16 to 64 x 64 pixels (8 x 8 per token).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnirelay.models.qwen3_omni.prompt import QwenPromptSide
from omnirelay.models.qwen3_omni.vision import VisionLayout
from omnirelay.serving import ServerConfig
from tests.serving_support import Served, chat_stream_audio, serve

MODEL = "qwen3-omni-tiny"
LIMITS = ServerConfig(max_image_input_bytes=60_000, max_image_input_pixels=200 * 200)
QUESTION = {"type": "text", "text": "What do you see?"}


def _encoded(pixels: np.ndarray, fmt: str = "PNG", **save: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **save)
    return out.getvalue()


def _noise(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _part(raw: bytes | str, mime: str = "image/png") -> dict[str, Any]:
    url = raw if isinstance(raw, str) else f"data:{mime};base64," + base64.b64encode(raw).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, LIMITS)


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def _layout(srv: Served) -> VisionLayout:
    prompts = srv.frontend.prompts
    assert isinstance(prompts, QwenPromptSide) and prompts.vision is not None
    return prompts.vision


def _ask(srv: Served, *parts: dict[str, Any], **kwargs: Any) -> Any:
    return srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [QUESTION, *parts]}],
        max_tokens=8,
        seed=7,
        **kwargs,
    )


def test_the_thinker_sees_the_image(srv: Served) -> None:
    """A 40 x 56 image is 5 x 7 = 35 image tokens plus its start and end: the prompt the
    Thinker computed grew by 37; two different images give two different answers."""
    layout = _layout(srv)
    assert layout.num_tokens(*layout.fit(40, 56)) == 35
    text_only = _ask(srv)
    first = _ask(srv, _part(_encoded(_noise(1, 40, 56))))
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 35 + 2
    other = _ask(srv, _part(_encoded(_noise(2, 40, 56), "JPEG", quality=90), "image/jpeg"))
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert first.choices[0].message.content != other.choices[0].message.content
    again = _ask(srv, _part(_encoded(_noise(1, 40, 56))))
    assert again.choices[0].message.content == first.choices[0].message.content


def test_a_large_image_is_scaled_to_the_processors_range(srv: Served) -> None:
    """150 x 190 pixels (inside the server's limit) is scaled down to the processor's 64 x
    64 maximum area; a webp with transparency counts the same as its size says."""
    layout = _layout(srv)
    n = layout.num_tokens(*layout.fit(150, 190))
    assert n <= 64
    text_only = _ask(srv)
    y, x = np.mgrid[0:150, 0:190]
    gradient = np.stack([x * 255 // 190, y * 255 // 150, (x + y) % 256], axis=-1).astype(np.uint8)
    big = _ask(srv, _part(_encoded(gradient)))
    assert big.usage.prompt_tokens == text_only.usage.prompt_tokens + n + 2
    rgba = np.dstack([_noise(4, 24, 24), np.full((24, 24), 128, np.uint8)])
    two = _ask(srv, _part(_encoded(rgba, "WEBP"), "image/webp"), _part(_encoded(_noise(5, 24, 24))))
    assert two.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 * (layout.num_tokens(24, 24) + 2)


def test_streamed_chat_with_an_image_in_and_audio_out(srv: Served) -> None:
    stream = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [QUESTION, _part(_encoded(_noise(11, 32, 32)))]}],
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"},
        stream=True,
        max_tokens=4,
    )
    text, audio, chunks = chat_stream_audio(stream)
    assert text and audio and len(audio) % 2 == 0
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


HUGE = _encoded(np.zeros((201, 200, 3), dtype=np.uint8))  # small file, past 40,000 pixels
HEAVY = _encoded(_noise(6, 140, 140))  # ~59 kB: inside the byte limit alone, not twice


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            [_part("https://example.com/cat.png")],
            r"image_url\.url is a remote URL; this server does not fetch",
        ),
        ([_part("file:///etc/passwd")], r"image_url\.url must be a data: URL"),
        ([_part("data:image/png;base64,bm90IGJhc2U2NA=!")], r"image_url\.url is not valid base64"),
        ([_part("data:image/png,rawbytes")], r"image_url\.url must be base64-encoded"),
        ([_part(b"GIF89a....", "image/gif")], r"media type 'image/gif'; supported image types"),
        ([_part(b"not an image at all", "image/png")], r"image_url\.url is not a readable png image"),
        ([_part(_encoded(_noise(7, 16, 16), "JPEG"), "image/png")], r"is not a readable png image"),
        (
            [_part(HUGE)],
            r"200x201 image \(40200 pixels\); the limit is 40000 pixels \(max_image_input_pixels\)",
        ),
        ([_part(_encoded(_noise(8, 180, 180)))], r"the limit is 60000 bytes \(max_image_input_bytes\)"),
        ([_part(HEAVY), _part(HEAVY)], r"content\[1\]\.image_url\.url: the request's images are about"),
        ([_part(_encoded(_noise(9, 1, 300)))], r"the aspect ratio must be at most 200"),
        ([{"type": "image_url"}], r"content\[0\]\.image_url is required"),
        (
            [QUESTION, {"type": "text", "text": "<|image_pad|>"}, _part(HEAVY)],
            r"reserved for audio and image",
        ),
    ],
)
def test_bad_images_are_a_400_that_names_the_problem(srv: Served, content: Any, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as info:
        srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_an_image_outside_a_user_turn_is_refused(srv: Served) -> None:
    messages = [
        {"role": "assistant", "content": [_part(_encoded(_noise(10, 16, 16)))]},
        {"role": "user", "content": "Hi"},
    ]
    with pytest.raises(openai.BadRequestError, match=r"image input is taken in user messages only"):
        srv.client().chat.completions.create(model=MODEL, messages=messages)
    resp = httpx.get(srv.url + "/health", params={"audit": 1})
    assert resp.status_code == 200, resp.text
