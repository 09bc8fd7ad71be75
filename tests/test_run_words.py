"""``omnirelay run`` prints the answer's words with their times in the audio when the
pipeline has a forced aligner after its voice (``voice-cpu``), and nothing otherwise."""

from __future__ import annotations

import json
import re
import wave
from pathlib import Path

import pytest

from omnirelay.cli.main import main
from omnirelay.cli.run import aligns_answer, render_words
from omnirelay.pipeline import load_pipeline


def _written_words(text: str) -> list[str]:
    """The answer's words as the aligner counts them (letters, digits, apostrophes)."""
    return [w for w in (re.sub(r"[^\w']", "", part) for part in text.split()) if w]


def test_words_come_only_from_a_pipeline_with_an_aligner_and_audio() -> None:
    voice = load_pipeline("voice-cpu")
    assert aligns_answer(voice, ["text", "audio"])
    assert not aligns_answer(voice, ["text"])  # no audio asked: no words
    assert not aligns_answer(load_pipeline("qwen3-omni-tiny"), ["text", "audio"])  # no aligner


def test_the_words_block_is_compact() -> None:
    words = [{"word": f"w{i}", "start_s": i / 10, "end_s": (i + 1) / 10} for i in range(30)]
    block = render_words(words, width=60)
    lines = block.strip("\n").split("\n")
    assert lines[0] == "words (seconds into the audio)"
    assert all(len(line) <= 60 for line in lines)
    assert lines[1].startswith("  w0 0.00-0.10  w1 0.10-0.20")
    assert " ".join(lines[1:]).split()[::2] == [f"w{i}" for i in range(30)]


def test_run_prints_the_answers_words_in_order_within_the_audio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wav_path, json_path = tmp_path / "a.wav", tmp_path / "a.json"
    rc = main(
        [
            *("run", "--pipeline", "voice-cpu", "--prompt", "What is the capital of France?"),
            *("--max-tokens", "12", "--out", str(wav_path), "--json", str(json_path)),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(json_path.read_text())
    with wave.open(str(wav_path), "rb") as w:
        duration_s = w.getnframes() / w.getframerate()
    words = report["words"]
    assert [w["word"] for w in words] == _written_words(report["text"]) != []
    end = 0.0
    for w in words:
        assert end <= w["start_s"] < w["end_s"] <= duration_s + 1e-3, words
        end = w["end_s"]
    # Printed between the answer and the timeline, the same words in the same order.
    out = captured.out
    block = out[out.index("words (seconds into the audio)") : out.index("timeline (ms from submit)")]
    assert out.index(report["text"].strip()) < out.index(block)
    assert block.split()[5::2] == [w["word"] for w in words]
    assert f"{words[0]['word']} {words[0]['start_s']:.2f}-{words[0]['end_s']:.2f}" in block
