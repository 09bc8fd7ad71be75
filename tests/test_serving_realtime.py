"""``WS /v1/realtime`` over ``qwen3-omni-tiny`` (real processes; the tiny models speak
noise): the session's lifecycle, text turns with transcript and audio deltas, several
turns, a response's own voice, format and conversation (its audio is chat's for the same
turn and voice), server VAD events from a synthesized WAV, turn detection without
``create_response`` or without ``interrupt_response``, cancel and barge-in, bad events,
the bounds, and the server's security and admission on this route. Every test ends with
a leak audit: nothing of any response left in any stage.
"""

from __future__ import annotations

import asyncio
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from omnirelay.serving import AdmissionGate, ServerConfig, ServerThread, create_app
from tests.realtime_support import RealtimeClient, append_events, pcm16, pcm_of, utterance
from tests.serving_support import Served, assert_same_pcm, chat_stream_audio, serve

MODEL = "qwen3-omni-tiny"
RATE = 24000
CONFIG = ServerConfig(realtime_max_buffer_s=3.0, realtime_max_items=6)
SHORT = {"max_response_output_tokens": 6}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, CONFIG)


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def rt_url(srv: Served | str, query: str = "") -> str:
    base = srv if isinstance(srv, str) else srv.url
    return base.replace("http://", "ws://") + "/v1/realtime" + query


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_session_created_and_updated(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv, f"?model={MODEL}"))
        s = c.of("session.created")[0]["session"]
        assert s["model"] == MODEL and s["sample_rate"] == RATE and s["modalities"] == ["text", "audio"]
        assert s["input_audio_format"] == s["output_audio_format"] == "pcm16"
        assert s["turn_detection"] == {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
            "create_response": True,
            "interrupt_response": True,
        }
        update = {"voice": "ethan", "turn_detection": {"threshold": 0.7}, "sample_rate": RATE}
        await c.send({"type": "session.update", "session": update})
        s = (await c.until("session.updated"))["session"]
        assert s["voice"] == "ethan" and s["turn_detection"]["threshold"] == 0.7 and s["sample_rate"] == RATE
        # A bad field: an error naming it, and nothing of the update applied.
        bad = {"voice": "chelsie", "turn_detection": {"silence_duration_ms": 5}}
        await c.send({"type": "session.update", "event_id": "evt_1", "session": bad})
        err = (await c.until("error"))["error"]
        assert err["param"] == "session.turn_detection.silence_duration_ms" and err["event_id"] == "evt_1"
        await c.send({"type": "session.update", "session": {}})
        assert (await c.until("session.updated"))["session"]["voice"] == "ethan"
        for received in c.events:
            assert received.event["event_id"].startswith("event_") and received.event["type"]
        await c.close()

    run(go())


def test_a_text_turn_streams_its_transcript_and_audio(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        done = await c.text_turn("Hello there", {"max_response_output_tokens": 8})
        resp = done["response"]
        # All its 8 tokens, as many as it was given: incomplete, as OpenAI's.
        assert resp["status"] == "incomplete" and resp["usage"]["output_tokens"] == 8
        assert resp["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
        kinds = [r.event["type"] for r in c.events]
        start = kinds.index("response.created")
        assert kinds[start : start + 4] == [
            "response.created",
            "response.output_item.added",
            "conversation.item.created",
            "response.content_part.added",
        ]
        assert kinds[-5:] == [
            "response.audio.done",
            "response.audio_transcript.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.done",
        ]
        events = [r.event for r in c.events]
        transcript = "".join(e["delta"] for e in c.of("response.audio_transcript.delta"))
        assert transcript and c.of("response.audio_transcript.done")[0]["transcript"] == transcript
        assert len(pcm_of(events, resp["id"])) > 0
        assert resp["output"][0]["content"][0] == {"type": "audio", "transcript": transcript}
        await c.close()

    run(go())


def test_text_only_answers_and_later_turns_see_the_earlier_ones(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send(
            {"type": "session.update", "session": {"modalities": ["text"], "instructions": "Be brief."}}
        )
        await c.until("session.updated")
        first = (await c.text_turn("One", SHORT))["response"]
        assert not c.of("response.audio.delta") and c.of("response.text.delta") and c.of("response.text.done")
        second = (await c.text_turn("Two", SHORT))["response"]
        # The second prompt holds the first question, its answer and the second question.
        assert (
            second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        )
        await c.close()

    run(go())


def _differs(a: bytes, b: bytes) -> bool:
    """Another waveform, not the same one rounded differently (see ``assert_same_pcm``)."""
    if len(a) != len(b):
        return True
    x, y = np.frombuffer(a, dtype="<i2").astype(np.int32), np.frombuffer(b, dtype="<i2").astype(np.int32)
    return bool((np.abs(x - y) > 1).mean() > 0.5)


def test_a_session_and_a_response_speak_in_their_own_voices(srv: Served) -> None:
    """A session's ``voice`` (``session.update``), and a ``response.create``'s {voice,
    output_audio_format: pcm16, conversation: auto} over it: each answer to the
    conversation is chat's answer to the same turn in that voice, sample for sample, and
    the two voices differ."""

    def chat_pcm(voice: str) -> bytes:
        stream = srv.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there"}],
            modalities=["text", "audio"],
            audio={"voice": voice, "format": "pcm16"},
            max_tokens=8,
            stream=True,
        )
        return chat_stream_audio(stream)[1]

    async def answer(response: dict[str, object]) -> tuple[dict[str, Any], bytes]:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send({"type": "session.update", "session": {"voice": "aiden"}})
        assert (await c.until("session.updated"))["session"]["voice"] == "aiden"
        done = await c.text_turn("Hello there", {"max_response_output_tokens": 8, **response})
        await c.close()
        resp = done["response"]
        return resp, pcm_of([r.event for r in c.events], str(resp["id"]))

    aiden, aiden_audio = asyncio.run(answer({}))
    ethan, ethan_audio = asyncio.run(
        answer({"voice": "Ethan", "output_audio_format": "pcm16", "conversation": "auto"})
    )
    assert (aiden["voice"], ethan["voice"]) == ("aiden", "ethan")
    assert aiden["output_audio_format"] == ethan["output_audio_format"] == "pcm16"
    assert_same_pcm(aiden_audio, chat_pcm("aiden"))
    assert_same_pcm(ethan_audio, chat_pcm("ethan"))
    assert _differs(aiden_audio, ethan_audio)


def test_the_conversation_drops_its_oldest_items(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        ids = []
        for n in range(CONFIG.realtime_max_items + 2):
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"n{n}"}]}
            await c.send({"type": "conversation.item.create", "item": item})
            ids.append((await c.until("conversation.item.created"))["item"]["id"])
        await c.send({"type": "session.update", "session": {}})
        last = (await c.until("session.updated"))["session"]["conversation"]
        assert [e["item_id"] for e in c.of("conversation.item.deleted")] == ids[:2]
        assert last["num_dropped_items"] == 2 and last["num_items"] == CONFIG.realtime_max_items
        await c.close()

    run(go())


def test_vad_events_match_the_speech_edges_of_a_wav(srv: Served, tmp_path: Path) -> None:
    # Speech from 1.0 s to 2.2 s in background noise, written to a WAV file and read back.
    # Short answers: the session asks for them before the turn is spoken.
    path = tmp_path / "turn.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm16(utterance(RATE, 1.0, 1.2, 1.3)))
    with wave.open(str(path), "rb") as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767

    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send({"type": "session.update", "session": {"max_response_output_tokens": 6}})
        await c.until("session.updated")
        for event in append_events(samples, RATE):
            await c.send(event)
        started = await c.until("input_audio_buffer.speech_started")
        stopped = await c.until("input_audio_buffer.speech_stopped")
        # OpenAI's convention: the start includes prefix_padding_ms, the end silence_duration_ms.
        assert abs(started["audio_start_ms"] + 300 - 1000) <= 100, started
        assert abs(stopped["audio_end_ms"] - 500 - 2200) <= 100, stopped
        assert started["item_id"] == stopped["item_id"]
        # The turn is committed as the user's speech, which the Thinker's audio tower hears.
        committed = await c.until("input_audio_buffer.committed")
        created = await c.until("conversation.item.created")
        assert committed["item_id"] == created["item"]["id"] == started["item_id"]
        assert created["item"]["content"] == [{"type": "input_audio", "transcript": None}]
        done = await c.until("response.done")
        assert done["response"]["status"] in ("completed", "incomplete")
        assert pcm_of([r.event for r in c.events], done["response"]["id"])
        await c.close()

    run(go())


def test_turn_detection_without_create_response_commits_and_waits(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        session = {"turn_detection": {"create_response": False}, "max_response_output_tokens": 6}
        await c.send({"type": "session.update", "session": session})
        assert (await c.until("session.updated"))["session"]["turn_detection"]["create_response"] is False
        for event in append_events(utterance(RATE, 0.5, 0.8, 0.8), RATE):
            await c.send(event)
        committed = await c.until("input_audio_buffer.committed")
        assert (await c.until("conversation.item.created"))["item"]["id"] == committed["item_id"]
        # The server handles events in order: had the turn started a response, it would
        # have said so before answering this later event.
        await c.send({"type": "session.update", "session": {}})
        await c.until("session.updated")
        assert c.of("input_audio_buffer.speech_stopped") and not c.of("response.created")
        # The turn waits in the conversation for the client to ask.
        await c.send({"type": "response.create"})
        done = await c.until("response.done")
        assert done["response"]["status"] in ("completed", "incomplete")
        await c.close()

    run(go())


def test_turn_detection_without_interrupt_response_lets_the_answer_finish(srv: Served) -> None:
    """Speech while an answer plays does not cut it; the turn it ends is answered after."""

    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        session = {"turn_detection": {"interrupt_response": False}, "max_response_output_tokens": 6}
        await c.send({"type": "session.update", "session": session})
        await c.until("session.updated")
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk"}]}
        await c.send({"type": "conversation.item.create", "item": item})
        await c.send({"type": "response.create", "response": {"max_response_output_tokens": 100}})
        playing = (await c.until("response.audio.delta"))["response_id"]
        for event in append_events(utterance(RATE, 0.3, 0.5, 0.8), RATE):
            await c.send(event)
        started = await c.until("input_audio_buffer.speech_started")
        first = await c.until("response.done")
        # The turn started and ended while the answer played (its done came after), and
        # did not cut it.
        (stopped,) = c.of("input_audio_buffer.speech_stopped")
        assert first["response"]["id"] == playing and c.at(started) <= c.at(stopped) <= c.at(first)
        assert first["response"]["status"] in ("completed", "incomplete")
        assert c.of("input_audio_buffer.committed")
        # The turn's own answer, asked by the server once the first was done.
        created = await c.until("response.created")
        second = await c.until("response.done")
        assert second["response"]["id"] == created["response"]["id"] != playing and not c.of("error")
        assert second["response"]["status"] in ("completed", "incomplete")
        await c.close()

    run(go())


def test_response_cancel_and_barge_in_end_the_response_and_its_request(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        long = {"max_response_output_tokens": 400}
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk"}]}
        await c.send({"type": "conversation.item.create", "item": item})
        await c.send({"type": "response.create", "response": long})
        first = await c.until("response.audio.delta")
        await c.send({"type": "response.cancel"})
        done = await c.until("response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert done["response"]["output"][0]["status"] == "incomplete"
        # Barge-in: speech while the next response plays.
        await c.send({"type": "response.create", "response": long})
        await c.until("response.audio.delta")
        for event in append_events(utterance(RATE, 0.3, 0.5, 0.0), RATE):
            await c.send(event)
        started = await c.until("input_audio_buffer.speech_started")
        cut = await c.until("response.done")
        assert cut["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        assert c.at(cut) - c.at(started) < 0.1
        await c.send({"type": "response.cancel"})  # nothing left to cancel
        assert (await c.until("error"))["error"]["code"] == "response_cancel_not_active"
        await c.close()
        assert first["response_id"] != cut["response"]["id"]

    run(go())


def test_bad_events_get_errors_and_the_session_goes_on(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        bad = [
            ({"type": "conversation.item.truncate"}, "invalid_value"),
            ({"type": "input_audio_buffer.append", "audio": "***"}, "invalid_audio"),
            ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
            ({"type": "response.create"}, "empty_conversation"),
            ({"type": "response.cancel"}, "response_cancel_not_active"),
            ({"type": "conversation.item.create", "item": {"role": "tool"}}, "invalid_value"),
            ({"type": "response.create", "response": {"tools": []}}, "unsupported_field"),
            ({"type": "response.create", "response": {"conversation": "none"}}, "invalid_value"),
            ({"type": "conversation.item.delete", "item_id": "x"}, "item_not_found"),
            ({"type": "conversation.item.retrieve", "item_id": "x"}, "item_not_found"),
            ({"type": "transcription_session.update", "session": {}}, "invalid_event_type"),
            ({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}, "invalid_value"),
            ({"type": "session.update", "session": {"output_audio_format": "g711_alaw"}}, "invalid_value"),
            ({"type": "session.update", "session": {"sample_rate": 16000}}, "invalid_value"),
            (
                {"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}},
                "invalid_value",
            ),
            (
                {"type": "session.update", "session": {"input_audio_noise_reduction": None}},
                "unsupported_field",
            ),
            ({"type": "session.update", "session": {"tools": [{"type": "function"}]}}, "invalid_value"),
            # The test bed has no recognizer stage: nothing to transcribe with.
            (
                {"type": "session.update", "session": {"input_audio_transcription": {"model": "whisper-1"}}},
                "unsupported_field",
            ),
        ]
        for event, code in bad:
            await c.send(event)
            assert (await c.until("error"))["error"]["code"] == code, event
        # More than realtime_max_buffer_s (3 s) of audio: refused, the buffer kept.
        await c.send({"type": "session.update", "session": {"turn_detection": None}})
        await c.until("session.updated")
        for event in append_events(np.zeros(RATE * 2, np.float32), RATE, chunk_ms=2000):
            await c.send(event)
        await c.send(append_events(np.zeros(RATE * 2, np.float32), RATE, chunk_ms=2000)[0])
        assert (await c.until("error"))["error"]["code"] == "input_audio_buffer_full"
        await c.send({"type": "input_audio_buffer.clear"})
        await c.until("input_audio_buffer.cleared")
        await c.close()

    run(go())


@pytest.mark.parametrize(
    "frame",
    [b"\x00binary", "not json", json.dumps([1]), json.dumps({"type": "x" * (5 * 1024 * 1024)})],
    ids=["binary", "not-json", "not-an-object", "too-large"],
)
def test_malformed_frames_get_an_error_and_close_1008(srv: Served, frame: str | bytes) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send(frame)
        err = await c.until("error")
        assert err["error"]["code"] in ("invalid_frame", "invalid_json", "event_too_large")
        with pytest.raises(websockets.ConnectionClosed) as info:
            await c.next()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008

    run(go())


def test_an_unknown_model_is_refused(srv: Served) -> None:
    async def go() -> None:
        async with websockets.connect(rt_url(srv, "?model=gpt-4o-realtime-preview")) as ws:
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["error"]["code"] == "model_not_found"
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008

    run(go())


# ------------------------------------------- the server's security and limits on this route


@pytest.fixture
def guarded(served: Served) -> Iterator[tuple[str, AdmissionGate]]:
    """A second server over the same pipeline: a key, one request slot, one WebSocket."""
    admission = AdmissionGate(1, max_websockets=1)
    config = ServerConfig(api_keys=("sk-rt",))
    with ServerThread(create_app(served.pipe, config, admission=admission)) as server:
        yield server.base_url, admission
    served.audit()


def test_keys_origins_capacity_and_the_session_limit(guarded: tuple[str, AdmissionGate]) -> None:
    url, admission = guarded

    async def refused(headers: dict[str, str]) -> int:
        with pytest.raises(websockets.InvalidStatus) as info:
            await websockets.connect(rt_url(url), additional_headers=headers)
        return info.value.response.status_code

    assert run(refused({})) == 401
    assert run(refused({"Origin": "https://evil.example", "Authorization": "Bearer sk-rt"})) == 403
    assert httpx.get(url + "/").status_code == 404  # the page is opt-in

    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(url, "?api_key=sk-rt"))
        # One WebSocket at most: a second is told why and closed with 1013.
        async with websockets.connect(rt_url(url, "?api_key=sk-rt")) as ws:
            error = json.loads(await ws.recv())["error"]
            assert error["code"] == "server_busy" and error["retry_after_s"] == 1
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1013
        slot = admission.acquire()  # the server is full
        try:
            done = await c.text_turn("Hi", SHORT)
        finally:
            slot.release()
        err = c.of("error")[0]["error"]
        assert err["code"] == "server_busy" and err["retry_after_s"] == 1
        assert done["response"]["status"] == "failed"
        assert (await c.text_turn("Hi", SHORT))["response"]["status"] == "incomplete"  # served: 6 of 6
        await c.close()

    run(go())
