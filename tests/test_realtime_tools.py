"""Tools in Realtime, end to end over the toy pipeline with a test model that calls tools
(:mod:`tests.tool_model`: a real chat template that takes tools; it answers by its
prompt): ``session.tools`` rendered into the prompt, the answer's call sent as a
``function_call`` output item with its arguments streamed, the client's
``function_call_output`` item answered by the next response; every event in the shape
of the ``openai`` package's GA types. A response that may call answers in text (the
voice would say the call): one asked with audio is refused, and the session goes on.
openai-agents' ``RealtimeRunner`` makes the same round trip with a ``function_tool``
(with the ``agents`` extra). Each test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from omnirelay.serving import ServerConfig
from tests.realtime_support import RealtimeClient
from tests.serving_support import Served, serve
from tests.tool_model import ScriptedToolModel

GA_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve("toy-3stage", ServerConfig(), prompts=ScriptedToolModel())


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def rt_url(srv: Served) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/realtime"


def test_a_call_round_trip_in_a_ga_session(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        session = {
            "type": "realtime",
            "output_modalities": ["text"],
            "tools": [WEATHER],
            "tool_choice": "auto",
        }
        await c.send({"type": "session.update", "session": {**session, "max_output_tokens": 60}})
        s = (await c.until("session.updated"))["session"]
        assert s["tools"] == [WEATHER] and s["tool_choice"] == "auto"
        ask = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
        }
        await c.send({"type": "conversation.item.create", "item": ask})
        await c.send({"type": "response.create"})
        done = (await c.until("response.done", timeout=120))["response"]
        message, call = done["output"]
        assert message["content"][0] == {"type": "output_text", "text": "Let me check.\n"}
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        streamed = "".join(e["delta"] for e in c.of("response.function_call_arguments.delta"))
        args_done = c.of("response.function_call_arguments.done")[0]
        assert (
            streamed == args_done["arguments"] == call["arguments"]
            and args_done["call_id"] == call["call_id"]
        )
        assert [e["item"]["type"] for e in c.of("response.output_item.added")] == ["message", "function_call"]

        # The client runs the tool and answers the call; the next response reads the result.
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp_c": 21}'}
        await c.send({"type": "conversation.item.create", "item": result})
        added = (await c.until("conversation.item.added"))["item"]
        assert added["type"] == "function_call_output" and added["output"] == '{"temp_c": 21}'
        await c.send({"type": "response.create"})
        done = (await c.until("response.done", timeout=120))["response"]
        assert done["output"][0]["content"][0]["text"] == 'The tool says: {"temp_c": 21}'

        # A response that may not call may speak.
        await c.send(
            {"type": "response.create", "response": {"tool_choice": "none", "output_modalities": ["audio"]}}
        )
        done = (await c.until("response.done", timeout=120))["response"]
        assert done["output_modalities"] == ["audio"] and [o["type"] for o in done["output"]] == ["message"]

        # Bad tool input: errors naming the field; the session goes on.
        for event, param in [
            (
                {"type": "response.create", "response": {"output_modalities": ["audio"]}},
                "response.output_modalities",
            ),
            (
                {"type": "session.update", "session": {"tools": [{"type": "function"}]}},
                "session.tools[0].name",
            ),
            ({"type": "session.update", "session": {"tool_choice": {"type": "function", "name": "x"}}}, None),
            ({"type": "conversation.item.create", "item": {**result, "call_id": "call_x"}}, "item.call_id"),
        ]:
            await c.send(event)
            error = (await c.until("error"))["error"]
            assert error["param"] == (param or "session.tool_choice"), error
        for received in c.events:
            GA_EVENT.validate_python(received.event)
        await c.close()

    asyncio.run(go())


@pytest.mark.skipif(
    importlib.util.find_spec("agents") is None,
    reason="openai-agents is not installed: pip install 'omnirelay[agents]'",
)
def test_openai_agents_runs_a_function_tool_and_answers_with_its_result(srv: Served) -> None:
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        ran.append(city)
        return "sunny, 21 C"

    async def talk() -> dict[str, Any]:
        agent = RealtimeAgent(name="assistant", instructions="Use the tools.", tools=[get_weather])
        settings: Any = {
            "model_name": "toy-3stage",
            "output_modalities": ["text"],
            "max_output_tokens": 60,
            "input_audio_transcription": None,  # the toy pipeline has no recognizer
            "voice": "chelsie",  # nor OpenAI's voice names
        }
        runner = RealtimeRunner(agent, config={"model_settings": settings, "tracing_disabled": True})
        seen: dict[str, Any] = {"errors": [], "types": [], "said": []}
        session = await runner.run(model_config={"url": rt_url(srv), "api_key": "unused"})
        async with session:
            await session.send_message("What is the weather in Paris?")
            async with asyncio.timeout(120):
                async for event in session:
                    seen["types"].append(event.type)
                    if event.type == "error":
                        seen["errors"].append(event.error)
                    elif event.type == "raw_model_event" and event.data.type == "raw_server_event":
                        if event.data.data.get("type") == "response.output_text.done":
                            seen["said"].append(event.data.data["text"])
                    elif event.type == "agent_end" and len(seen["said"]) == 2:
                        break  # the answer to the tool's result
        return seen

    seen = asyncio.run(talk())
    assert seen["errors"] == [] and ran == ["Paris"]
    assert {"tool_start", "tool_end"} <= set(seen["types"]) and seen["types"].count("agent_end") == 2
    assert seen["said"] == ["Let me check.\n", "The tool says: sunny, 21 C"]
