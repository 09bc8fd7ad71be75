"""Code2Wav → forced aligner input builder (docs/protocol.md §5.4, §8 item 11)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from omnirelay.errors import PayloadEncodeError
from omnirelay.processors import (
    DEFAULT_SAMPLE_RATE,
    build_aligner_input,
    build_aligner_prompt,
    extract_waveform,
    segment_words,
)
from omnirelay.processors.code2wav_to_aligner import TIMESTAMP_MARKER

PROMPT = {"additional_information": {"text": ["Hello, world! It's fine."]}, "language": "en"}
SEGMENTS = [(800, 0.25), (1200, -0.5), (400, 0.75)]


def segment(num_samples: int, value: float) -> torch.Tensor:
    return torch.full((1, num_samples), value)


def test_cumulative_aligner_input_from_three_segments() -> None:
    """Three constant segments of 800, 1200 and 400 samples: only the finished output counts."""
    inputs = []
    accumulated: list[torch.Tensor] = []
    for i, (n, value) in enumerate(SEGMENTS):
        accumulated.append(segment(n, value))
        output = {"audio": list(accumulated), "sr": torch.tensor(24000)}
        inputs.append(build_aligner_input(output, is_finished=i == len(SEGMENTS) - 1, prompt=PROMPT))
    assert inputs[0] is None and inputs[1] is None  # non-finished outputs: no aligner input
    final = inputs[2]
    assert final is not None
    wave = final.waveform
    assert wave.dtype == np.float32 and wave.shape == (2400,)
    assert np.all(wave[:800] == 0.25) and np.all(wave[800:2000] == -0.5) and np.all(wave[2000:] == 0.75)
    assert final.sample_rate == 24000
    assert final.audio_duration_ms == pytest.approx(100.0)
    assert final.multi_modal_data["audio"][1] == 24000
    assert final.multi_modal_data["audio"][0] is wave
    assert final.additional_information == {
        "text": "Hello, world! It's fine.",
        "words": ["Hello", "world", "It's", "fine"],
        "audio_duration_ms": pytest.approx(100.0),
        "language": "en",
    }
    assert final.prompt.count(TIMESTAMP_MARKER) == 2 * 4


def test_one_cumulative_tensor_is_the_whole_waveform() -> None:
    whole = torch.cat([segment(n, v) for n, v in SEGMENTS], dim=1).unsqueeze(0)  # [1, 1, 2400]
    result = build_aligner_input({"audio": whole}, is_finished=True, prompt=PROMPT)
    assert result is not None
    assert result.waveform.shape == (2400,)
    assert result.sample_rate == DEFAULT_SAMPLE_RATE
    assert result.audio_duration_ms == pytest.approx(100.0)


def test_model_outputs_is_the_fallback_and_sr_takes_the_last_entry() -> None:
    wave, sr = extract_waveform({"model_outputs": [np.ones((1, 160), dtype=np.float64)], "sr": [16000, 8000]})
    assert wave.dtype == np.float32 and wave.shape == (160,) and sr == 8000
    _, sr = extract_waveform({"audio": torch.ones(3), "sr": torch.tensor([24000, 48000])})
    assert sr == 48000
    _, sr = extract_waveform({"audio": torch.ones(3), "sr": np.int64(22050)})
    assert sr == 22050


def test_empty_waveform_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnirelay.processors.code2wav_to_aligner"):
        assert build_aligner_input({"audio": torch.zeros(1, 0)}, is_finished=True, prompt=PROMPT) is None
        assert build_aligner_input({}, is_finished=True, prompt=PROMPT) is None
    assert "empty waveform" in caplog.text


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ({"audio": torch.ones(2, 100)}, "expected mono audio"),
        ({"audio": "wave"}, "must be a tensor or numpy array"),
        ({"audio": torch.ones(10), "sr": 0}, "sample rate must be a positive int"),
        ({"audio": torch.ones(10), "sr": 22050.5}, "sample rate must be a positive int"),
        ({"audio": torch.ones(10), "sr": True}, "sample rate must be a positive int"),
    ],
)
def test_bad_outputs_raise_clear_errors(output: dict[str, Any], match: str) -> None:
    with pytest.raises(PayloadEncodeError, match=match):
        build_aligner_input(output, is_finished=True, prompt=PROMPT)


def test_text_is_indexed_and_missing_text_gives_an_empty_word_list() -> None:
    prompt = {"additional_information": {"text": ["first one", "second"], "language": ["en", "zh"]}}
    second = build_aligner_input({"audio": torch.ones(10)}, is_finished=True, prompt=prompt, index=1)
    assert second is not None and second.words == ("second",) and second.language == "zh"
    bare = build_aligner_input({"audio": torch.ones(10)}, is_finished=True, prompt=None)
    assert bare is not None and bare.words == () and bare.text == ""
    assert bare.prompt.count(TIMESTAMP_MARKER) == 1


def test_segment_words_drops_punctuation_and_splits_cjk_characters() -> None:
    assert segment_words("Hello, world!  don't -- stop.") == ["Hello", "world", "don't", "stop"]
    assert segment_words("我爱Python编程 42") == ["我", "爱", "Python", "编", "程", "42"]
    assert segment_words("") == []


def test_prompt_has_two_markers_per_word() -> None:
    prompt = build_aligner_prompt(["a", "b"])
    assert f"a{TIMESTAMP_MARKER}{TIMESTAMP_MARKER}b{TIMESTAMP_MARKER}{TIMESTAMP_MARKER}" in prompt
    assert prompt.startswith("<|im_start|>user\n<|audio_start|>")
