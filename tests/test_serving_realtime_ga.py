"""``WS /v1/realtime`` in OpenAI's GA interface over ``qwen3-omni-tiny`` (real processes;
the tiny models speak noise), every event the server sends checked against the GA types
of the official ``openai`` package: a GA ``session.update`` as the agent frameworks send
it (``semantic_vad``, ``tracing``, noise reduction, speed 1.0), a message at the root, a
response whose ``metadata`` is echoed, answered under GA's names; the answer truncated
where its audio was stopped, retrieved cut, an item deleted, a text-only answer; a client that sends
``OpenAI-Beta: realtime=v1`` keeps beta's session. Every test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from omnirelay.serving import ServerConfig
from omnirelay.serving.realtime.ga import EAGERNESS_SILENCE_MS
from omnirelay.serving.realtime.items import cut_transcript
from tests.realtime_support import RealtimeClient
from tests.serving_support import Served, serve

MODEL = "qwen3-omni-tiny"
RATE = 24000
PCM = {"type": "audio/pcm", "rate": RATE}
GA_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
BETA_NAMES = ("response.audio.", "response.audio_transcript.", "response.text.")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, ServerConfig())


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def rt_url(srv: Served) -> str:
    return srv.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"


def ga_session(**over: Any) -> dict[str, Any]:
    """A session as LiveKit Agents' and openai-agents' defaults make it."""
    return {
        "type": "realtime",
        "model": MODEL,
        "output_modalities": ["audio"],
        "audio": {
            "input": {
                "format": PCM,
                "noise_reduction": {"type": "near_field"},
                "transcription": None,
                "turn_detection": {"type": "semantic_vad", "eagerness": "low", "interrupt_response": True},
            },
            "output": {"format": PCM, "voice": "ethan", "speed": 1.0},
        },
        "max_output_tokens": 6,
        "tool_choice": "auto",
        "tools": [],
        "tracing": "auto",
        **over,
    }


def test_a_ga_session_answers_under_ga_names_and_its_answer_is_truncated(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send({"type": "session.update", "session": ga_session()})
        s = (await c.until("session.updated"))["session"]
        assert s["type"] == "realtime" and s["output_modalities"] == ["audio"] and "modalities" not in s
        assert s["audio"]["output"]["voice"] == "ethan"
        td = s["audio"]["input"]["turn_detection"]
        assert td["type"] == "server_vad" and td["silence_duration_ms"] == EAGERNESS_SILENCE_MS["low"]
        question = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hello there"}],
        }
        await c.send({"type": "conversation.item.create", "previous_item_id": "root", "item": question})
        assert (await c.until("conversation.item.done"))["item"]["content"][0]["text"] == "Hello there"
        await c.send(
            {
                "type": "response.create",
                "response": {"metadata": {"turn": "1"}, "output_modalities": ["audio"]},
            }
        )
        done = (await c.until("response.done", timeout=120))["response"]
        created = c.of("response.created")[0]["response"]
        assert created["metadata"] == done["metadata"] == {"turn": "1"}
        answer = done["output"][0]
        assert answer["content"][0]["type"] == "output_audio"
        kinds = [r.event["type"] for r in c.events]
        assert not [k for k in kinds if k.startswith(BETA_NAMES)]
        assert {"response.output_audio.delta", "response.output_audio_transcript.done"} <= set(kinds)
        assert kinds[-3:] == ["conversation.item.done", "response.output_item.done", "response.done"]
        transcript = c.of("response.output_audio_transcript.done")[0]["transcript"]
        audio = b"".join(base64.b64decode(e["delta"]) for e in c.of("response.output_audio.delta"))
        audio_ms = round(len(audio) / 2 * 1000 / RATE)
        assert transcript and audio_ms > 0

        # The user stopped it half way: the answer keeps what was heard.
        truncate = {"type": "conversation.item.truncate", "item_id": answer["id"], "content_index": 0}
        await c.send({**truncate, "audio_end_ms": audio_ms + 1000})
        assert (await c.until("error"))["error"]["param"] == "audio_end_ms"
        await c.send({**truncate, "audio_end_ms": audio_ms // 2})
        assert (await c.until("conversation.item.truncated"))["audio_end_ms"] == audio_ms // 2
        await c.send({"type": "conversation.item.retrieve", "item_id": answer["id"]})
        kept = (await c.until("conversation.item.retrieved"))["item"]["content"][0]["transcript"]
        whole = answer["status"] == "completed"
        assert kept == cut_transcript(transcript, audio_ms // 2, audio_ms, whole=whole)
        assert transcript.startswith(kept)

        # A text-only answer: output_text.
        await c.send(
            {"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 4}}
        )
        done = (await c.until("response.done", timeout=120))["response"]
        assert (
            done["output_modalities"] == ["text"] and done["output"][0]["content"][0]["type"] == "output_text"
        )
        assert c.of("response.output_text.done")[0]["text"] == done["output"][0]["content"][0]["text"]

        first = c.of("conversation.item.added")[0]["item"]["id"]
        await c.send({"type": "conversation.item.delete", "item_id": first})
        assert (await c.until("conversation.item.deleted"))["item_id"] == first
        await c.send({"type": "conversation.item.retrieve", "item_id": first})
        assert (await c.until("error"))["error"]["code"] == "item_not_found"
        for received in c.events:  # every event is one the GA types know, in their shape
            GA_EVENT.validate_python(received.event)
        await c.close()

    asyncio.run(go())


def test_a_refused_ga_field_is_named_and_the_session_goes_on(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        for audio, param in [
            ({"output": {"speed": 1.5}}, "session.audio.output.speed"),
            ({"input": {"format": {"type": "audio/pcmu"}}}, "session.audio.input.format.type"),
            (
                {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1}}},
                "session.audio.input.turn_detection.silence_duration_ms",
            ),
        ]:
            await c.send({"type": "session.update", "event_id": "evt_1", "session": ga_session(audio=audio)})
            error = (await c.until("error"))["error"]
            assert error["param"] == param and error["event_id"] == "evt_1"
        await c.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
        s = (await c.until("session.updated"))["session"]
        assert s["instructions"] == "Be brief." and s["audio"]["output"]["speed"] == 1.0
        await c.close()

    asyncio.run(go())


def test_a_beta_client_keeps_the_beta_session(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv), additional_headers={"OpenAI-Beta": "realtime=v1"})
        s = c.of("session.created")[0]["session"]
        assert "type" not in s and "audio" not in s and s["modalities"] == ["text", "audio"]
        await c.send({"type": "session.update", "session": ga_session()})
        assert (await c.until("error"))["error"]["code"] == "unsupported_field"
        await c.close()
        # A client that says nothing yet sees both shapes.
        c = await RealtimeClient.connect(rt_url(srv))
        s = c.of("session.created")[0]["session"]
        assert s["type"] == "realtime" and s["modalities"] == ["text", "audio"]
        GA_EVENT.validate_python(c.events[0].event)
        await c.close()

    asyncio.run(go())
