"""``conversation.item.input_audio_transcription.failed``: a realtime session whose committed
turn the recognizer cannot transcribe says so, names the turn and why, and goes on.

The server runs over an in-process stand-in for a started ``voice-cpu`` pipeline (what the
server calls of one; no processes): its recognizer stage fails every clip it is given, and
while :attr:`FailingRecognizer.busy` is set the pipeline is at its real-time capacity, so
a request is refused before it is admitted. The test ends with the leak audit: no request
left in the stand-in, no request slot and no WebSocket held by the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from omnirelay.cli.serve import server_config
from omnirelay.errors import RequestFailedError
from omnirelay.models.inputs import AUDIO_INPUT_RATE
from omnirelay.orchestrator.requests import RequestOutput
from omnirelay.pipeline import load_pipeline
from omnirelay.serving import ServerThread, create_app
from omnirelay.serving.frontend import Frontend
from tests.realtime_support import RealtimeClient, append_events, utterance
from tests.test_serving_speech import HeldHandle

RATE = 24000
#: what the stand-in's recognizer says of every clip
FAILURE = "stage 0 (asr) failed: the recognizer cannot take this clip"


class FailingRecognizer:
    """``voice-cpu`` as the server sees it, whose recognizer fails every request."""

    def __init__(self) -> None:
        self.config = load_pipeline("voice-cpu")
        self.submitted: list[dict[str, Any]] = []
        self.active: set[str] = set()  # requests whose outputs have not ended
        self.held: set[str] = set()  # ids whose handle the server has not closed
        self.busy: str | None = None

    def submit(self, prompt: list[int], *, request_id: str, **kwargs: Any) -> HeldHandle:
        self.submitted.append(kwargs)
        self.active.add(request_id)
        self.held.add(request_id)
        return HeldHandle(request_id, self._outputs(request_id), self.held)

    async def _outputs(self, rid: str) -> AsyncIterator[RequestOutput]:
        try:
            raise RequestFailedError(rid, FAILURE)
            yield  # an async generator that fails at its first output
        finally:
            self.active.discard(rid)

    def abort(self, request_id: str) -> None:
        """Nothing runs long enough to be aborted."""

    def capacity_problem(self, modalities: Any) -> str | None:
        return self.busy

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.held

    def prompt_side(self) -> None:
        return None  # the server's byte codec: no response is asked for here


@pytest.fixture
def served() -> Iterator[tuple[FailingRecognizer, Frontend, str]]:
    pipe = FailingRecognizer()
    app = create_app(pipe, server_config(pipe.config))  # type: ignore[arg-type]
    fe = app.state.frontend
    with ServerThread(app) as server:
        yield pipe, fe, server.base_url.replace("http://", "ws://") + "/v1/realtime"
        # The leak audit: every request ended, and the server holds nothing.
        deadline = time.monotonic() + 10
        while pipe.active or pipe.held or fe.admission.num_active or fe.admission.num_websockets:
            assert time.monotonic() < deadline, (pipe.active, pipe.held, fe.admission.num_active)
            time.sleep(0.005)


async def _commit_a_turn(c: RealtimeClient) -> str:
    for event in append_events(utterance(RATE, 0.2, 0.5, 0.2), RATE):
        await c.send(event)
    await c.send({"type": "input_audio_buffer.commit"})
    return str((await c.until("input_audio_buffer.committed"))["item_id"])


def test_a_turn_the_recognizer_cannot_transcribe_is_said_failed(
    served: tuple[FailingRecognizer, Frontend, str],
) -> None:
    pipe, fe, url = served

    async def go() -> None:
        c = await RealtimeClient.connect(url)
        session = {"input_audio_transcription": {"model": "whisper-1"}, "turn_detection": None}
        await c.send({"type": "session.update", "session": session})
        await c.until("session.updated")
        # The recognizer fails the clip.
        item_id = await _commit_a_turn(c)
        failed = await c.until("conversation.item.input_audio_transcription.failed")
        assert failed["item_id"] == item_id and failed["content_index"] == 0
        assert failed["error"] == {
            "type": "server_error",
            "code": "transcription_failed",
            "message": f"the pipeline failed the request: {FAILURE}",
        }
        assert fe.admission.num_active == 0  # its request slot was freed before it was said
        (asked,) = pipe.submitted  # the transcript alone, at the recognizer, of the turn's clip
        assert asked["modalities"] == ["transcript"] and asked["entry_stage_id"] == 0
        (clip,) = asked["inputs"]["audio"]
        assert asked["inputs"]["sample_rate"] == AUDIO_INPUT_RATE
        assert abs(clip.numel() - 0.9 * AUDIO_INPUT_RATE) <= AUDIO_INPUT_RATE // 100
        # The pipeline refuses the next one for capacity: failed too, with the refusal's code.
        pipe.busy = "the pipeline is at its real-time capacity of 1 audio streams"
        item_id = await _commit_a_turn(c)
        failed = await c.until("conversation.item.input_audio_transcription.failed")
        assert failed["item_id"] == item_id and failed["error"]["code"] == "audio_capacity"
        assert failed["error"]["message"].startswith(pipe.busy)
        # The session goes on.
        await c.send({"type": "session.update", "session": {}})
        await c.until("session.updated")
        assert not c.of("error") and not c.of("conversation.item.input_audio_transcription.completed")
        await c.close()

    asyncio.run(go())
    assert len(pipe.submitted) == 1  # the refused one never reached the pipeline
