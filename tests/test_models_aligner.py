"""The weight-free aligner (``aligner.vad``): voice activity, proportional allocation,
repair, and the executor contract (one step on the complete input)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnirelay.engine.interfaces import BatchItem, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.asr.vad_aligner import align_words, create_aligner, voiced_regions

SR = 24000


def _speech(spans_ms: list[tuple[int, int]], total_ms: int) -> np.ndarray:
    """Noise bursts (speech) at ``spans_ms`` over a faint noise floor."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.001, SR * total_ms // 1000).astype(np.float32)
    for a, b in spans_ms:
        x[SR * a // 1000 : SR * b // 1000] += rng.normal(0, 0.3, SR * (b - a) // 1000).astype(np.float32)
    return x


def test_voiced_regions_find_the_bursts_and_merge_short_gaps() -> None:
    x = _speech([(200, 700), (760, 900), (1300, 1600)], 2000)  # 60 ms gap merges; 400 ms does not
    assert voiced_regions(x, SR) == [(200, 900), (1300, 1600)]
    assert voiced_regions(np.zeros(SR, dtype=np.float32), SR) == []


def test_words_share_the_voiced_time_by_length_and_stay_in_order() -> None:
    x = _speech([(200, 700), (1000, 1600)], 2000)
    stamps = align_words(x, SR, ["hello", "big", "world"])
    assert [s["word"] for s in stamps] == ["hello", "big", "world"]
    assert stamps[0]["start_ms"] == 200 and stamps[-1]["end_ms"] == 1600
    prev = 0
    for s in stamps:
        assert prev <= s["start_ms"] <= s["end_ms"] <= 2000
        prev = s["end_ms"]
    # "hello" (5 of 13 characters) gets 5/13 of the 1,100 ms of voiced time
    assert stamps[0]["end_ms"] - stamps[0]["start_ms"] == pytest.approx(1100 * 5 / 13, abs=2)


def test_silence_and_no_words_give_empty_results() -> None:
    assert align_words(np.zeros(SR, dtype=np.float32), SR, ["a", "b"]) == []
    assert align_words(_speech([(0, 500)], 1000), SR, []) == []


def test_executor_answers_once_with_json_and_refuses_checkpoints() -> None:
    aligner = create_aligner(tiny=True, seed=0)
    item = BatchItem(
        internal_id="i0",
        external_id="r0",
        input_token_ids=[0],
        all_token_ids=[0],
        num_computed_tokens=0,
        is_prefill=True,
        sampling=SamplingParams(),
        inputs={"waveform": _speech([(100, 900)], 1000), "sample_rate": SR, "words": ["one", "two"]},
    )
    (result,) = aligner.step([item])
    assert result.finished and [w["word"] for w in json.loads(result.text or "")] == ["one", "two"]
    with pytest.raises(ModelError, match="the complete waveform"):
        aligner.step([BatchItem(**{**_fields(item), "inputs": None})])
    with pytest.raises(ModelError, match="not supported yet"):
        create_aligner(model_dir="/models/aligner")


def _fields(item: BatchItem) -> dict[str, object]:
    return {f: getattr(item, f) for f in item.__struct_fields__}
