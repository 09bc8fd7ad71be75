"""``omnirelay check``: validates a pipeline and prints its resolved contracts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirelay.cli.main import main

_TWO_STAGES = """\
name: two
stages:
  - id: 0
    name: thinker
    execution_type: ar
    executor: fake.thinker
    chunk_processor: thinker_to_talker
    final_output: true
    final_output_type: text
  - id: 1
    name: talker
    execution_type: ar
    executor: fake.talker
    input_sources: [0]
    final_output: true
    final_output_type: audio
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_pipeline_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "qwen3-omni-tiny"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "pipeline qwen3-omni-tiny" in out
    assert "any stage chunks: yes" in out
    for line in (
        "[0] thinker: ar, executor qwen3_omni.thinker",
        "[1] talker: ar, executor qwen3_omni.talker",
        "[2] code2wav: generation, executor qwen3_omni.code2wav",
        "async_chunk: on (inherits pipeline async_chunk=true, set in the file)",
        "receives chunks: yes",
        "0 -> 1  thinker -> talker: chunks",
        "1 -> 2  talker -> code2wav: chunks",
        "connector codec_shm (shm: codec_chunk_frames=25, codec_left_context_frames=0); "
        "processor talker_to_code2wav",
        "chunk schedule: adaptive: a first chunk of 1+ frames (more while frames come slowly), then "
        "sized by playback headroom (margin 150 ms), at most 25 frames; left context 0 frames",
        "audio streams at once: no fixed limit",
        "  text: stage 0",
        "  audio: stage 2",
    ):
        assert line in out, line


def test_mixed_contracts_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "qwen3-tts-tiny"]) == 0
    out = capsys.readouterr().out
    assert "0 -> 1  talker -> code2wav: chunks" in out
    assert "1 -> 2  code2wav -> aligner: complete input" in out
    assert "input builder code2wav_to_aligner" in out
    assert "async_chunk: off (the stage opts out with async_chunk: false" in out
    assert "timestamps: stage 2" in out


def test_async_chunk_override(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "qwen3-omni", "--async-chunk", "false"]) == 0
    out = capsys.readouterr().out
    assert "async_chunk: false (from --async-chunk)" in out
    assert "any stage chunks: no" in out
    assert ": chunks" not in out
    assert out.count(": complete input") == 2


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "report.json"
    assert main(["check", "qwen3-tts-tiny", "--json", str(target)]) == 0
    capsys.readouterr()
    report = json.loads(target.read_text())
    assert report["name"] == "qwen3-tts-tiny"
    assert report["any_stage_chunks"] is True
    assert [s["resolved_async_chunk"] for s in report["stages"]] == [True, True, False]
    assert [s["receives_chunks"] for s in report["stages"]] == [False, True, False]
    assert [(e["label"], e["contract"]) for e in report["edges"]] == [
        ("0 -> 1", "chunks"),
        ("1 -> 2", "complete input"),
    ]
    assert report["edges"][0]["extra"]["codec_chunk_frames"] == 25
    assert report["final_outputs"] == {"audio": [1], "timestamps": [2]}


def test_json_write_failure_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "qwen3-omni-tiny", "--json", str(tmp_path)]) == 1
    assert "--json" in capsys.readouterr().err


def test_file_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _TWO_STAGES)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert str(path) in out
    assert "0 -> 1  thinker -> talker: chunks" in out
    assert "connector default (shm); processor thinker_to_talker" in out


def test_invalid_pipeline_exits_1_naming_file_stage_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, _TWO_STAGES + '    async_chunk: "false"\n')
    assert main(["check", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"omnirelay check: error: {path}, stage 1 (talker), key 'async_chunk'")
    assert "Fix:" in err


def test_mismatched_edge_exits_1_naming_the_edge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _TWO_STAGES + "    async_chunk: false\n")
    assert main(["check", str(path)]) == 1
    assert "edge 0 -> 1 (thinker -> talker), key 'async_chunk'" in capsys.readouterr().err
    # The same file is consistent with chunking off everywhere.
    assert main(["check", str(path), "--async-chunk", "false"]) == 0


def test_missing_pipeline_lists_shipped_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "no-such-pipeline"]) == 1
    err = capsys.readouterr().err
    assert "no-such-pipeline" in err
    for name in ("qwen3-omni", "qwen3-omni-tiny", "qwen3-tts-tiny"):
        assert name in err


def test_timeout_zero_warns_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _TWO_STAGES.replace("name: two\n", "name: two\ninput_wait_timeout_s: 0\n"))
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "omnirelay check: warning:" in err and "disables the input deadline" in err
    assert "input wait timeout: disabled" in out


def test_help_and_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--async-chunk" in out and "--json" in out and "qwen3-omni-tiny" in out
    with pytest.raises(SystemExit) as info:
        main(["check", "qwen3-omni", "--async-chunk", "maybe"])
    assert info.value.code == 2
    capsys.readouterr()


def test_check_without_a_name_checks_the_default_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    """As ``run`` and ``serve``, ``check`` defaults to voice-cpu."""
    assert main(["check"]) == 0
    assert "pipeline voice-cpu" in capsys.readouterr().out
