"""A release's slot moves come after the stage's launched steps by stream order
(docs/design.md §12), shown with fake CUDA streams that log what waits for what.

* the Talker: a request that leaves moves the top slot's holder into its slot on the
  current stream, which first waits for the Talker's own stream (its launched steps
  read and write those slots);
* Code2Wav: a stream that leaves moves the top slot's decoder state on Code2Wav's stream,
  which first waits for the current one; the move's copies are enqueued with Code2Wav's
  stream current.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.models.code2wav import Code2WavExecutor
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from tests.test_qwen3_tts_talker import executor, model  # noqa: F401 - a fixture

log: list[str] = []


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: _Stream) -> None:
        log.append(f"{self.name} waits for {other.name}")


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Stream]:
    """The current stream and what is current while a ``torch.cuda.stream`` context runs."""
    log.clear()
    current = {"now": _Stream("default")}

    class _Context:
        def __init__(self, stream: _Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            self.before, current["now"] = current["now"], self.stream

        def __exit__(self, *exc: object) -> None:
            current["now"] = self.before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["now"])
    monkeypatch.setattr(torch.cuda, "stream", _Context)
    return current


def test_a_talker_slot_move_waits_for_the_talkers_stream(
    model: tuple[TTSTalker, TTSConfig],  # noqa: F811
    streams: dict[str, _Stream],
) -> None:
    ex = executor(model, text_streaming=False)
    runner = ex.runner
    runner._stream = _Stream("talker")  # type: ignore[assignment]
    move = runner.kv.move

    def logged(src: int, dst: int, length: int) -> None:
        log.append(f"move {src}->{dst} on {streams['now'].name}")
        move(src, dst, length)

    runner.kv.move = logged  # type: ignore[method-assign]
    for rid in ("a", "b", "c"):
        runner.slots.acquire(rid)
        runner.slots.set_length(rid, 3)
    ex.release("a")  # "c" (slot 2) moves into slot 0
    assert log == ["default waits for talker", "move 2->0 on default"]
    log.clear()
    with torch.cuda.stream(runner._stream):
        ex.release("c")  # a failing launch releases on the Talker's own stream: no wait
    assert log == ["move 1->0 on talker"]  # "b" (slot 1) into "c"'s slot 0
    ex.release("b")
    assert runner.slots.holders() == [] and ex.leak_state() == {}


def test_a_code2wav_state_move_runs_on_its_stream_after_the_current_one(streams: dict[str, _Stream]) -> None:
    codec = TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()
    ex = Code2WavExecutor(codec, max_streams=4)
    vocoder = ex.vocoder
    assert vocoder is not None
    ex._stream = _Stream("code2wav")  # type: ignore[assignment]
    moved: list[Any] = []

    def logged(src: int, dst: int, length: int) -> None:
        log.append(f"move {src}->{dst} on {streams['now'].name}")
        moved.append((src, dst))

    vocoder.slots.on_move = logged
    for rid in ("a", "b", "c"):
        vocoder.slots.acquire(rid)
    ex.release("a")
    assert log == ["code2wav waits for default", "move 2->0 on code2wav"]
    assert streams["now"].name == "default"  # the context ended
    for rid in ("b", "c"):
        ex.release(rid)
    assert ex.leak_state() == {}
