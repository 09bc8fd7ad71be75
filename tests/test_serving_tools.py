"""Tools in chat completions, end to end through the official ``openai`` client.

The server runs over the toy pipeline with a test model that calls tools
(:mod:`tests.tool_model`): its prompts are rendered by a real chat template that takes
tools, and it answers by its prompt, so the protocol path is the real one: the tools
rendered into the prompt, the answer's calls parsed from the model's own format and sent
as OpenAI's ``tool_calls`` (whole and streamed), the round trip through a ``tool``
message. Each test ends with a leak audit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from omnirelay.serving import ServerConfig
from omnirelay.serving.errors import ApiError
from omnirelay.serving.protocol import ChatCompletionRequest, parse
from omnirelay.serving.text import ByteCodec
from omnirelay.serving.tools import read_chat_tools_request
from tests.serving_support import Served, chat_stream_audio, serve
from tests.tool_model import PLAIN_ANSWER, ScriptedToolModel

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS: Any = [WEATHER_TOOL]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 60  # the scripted answers are shorter (3 characters a token)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve("toy-3stage", ServerConfig(max_concurrency=8), prompts=ScriptedToolModel())


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def _model(srv: Served) -> ScriptedToolModel:
    prompts = srv.frontend.prompts
    assert isinstance(prompts, ScriptedToolModel)
    return prompts


def _ask(srv: Served, messages: Any = ASK, **kwargs: Any) -> Any:
    return srv.client().chat.completions.create(
        model=srv.model, messages=messages, modalities=["text"], max_tokens=MAX_TOKENS, **kwargs
    )


def test_a_call_comes_back_as_tool_calls_and_the_round_trip_answers(srv: Served) -> None:
    r = _ask(srv, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert '"name": "get_weather"' in _model(srv).rendered[-1]  # the template rendered the tool

    # the round trip: the assistant's call and the tool's result go back into the prompt
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    final = _ask(srv, messages, tools=TOOLS)
    assert final.choices[0].finish_reason == "length"  # the toy runs to max_tokens
    assert final.choices[0].message.content == 'The tool says: {"temperature_c": 21}'
    assert final.choices[0].message.tool_calls is None
    prompt = _model(srv).rendered[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt


def test_streamed_calls_arrive_as_index_keyed_deltas(srv: Served) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    chunks = list(_ask(srv, ask, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not got["id"]  # the id comes once, with the call's first delta
                got["id"] = tc.id
                assert tc.type == "function"
            assert tc.function is not None
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
    assert text == "Let me check.\n"
    assert sorted(calls) == [0, 1]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # nothing of a call leaked into the text, though its tags came split across deltas
    assert "<tool" not in text and "weather" not in text


def test_the_clients_stream_helper_assembles_the_calls(srv: Served) -> None:
    with srv.client().chat.completions.stream(
        model=srv.model, messages=ASK, tools=TOOLS, modalities=["text"], max_tokens=MAX_TOKENS
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_and_named_start_the_call(srv: Served) -> None:
    r = _ask(srv, tools=TOOLS, tool_choice="required")
    assert _model(srv).rendered[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _ask(srv, tools=TOOLS, tool_choice=named, stream=False)
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "stop"  # OpenAI's, for a named function


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(srv: Served) -> None:
    r = _ask(srv, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in _model(srv).rendered[-1]
    assert r.choices[0].message.content == PLAIN_ANSWER and r.choices[0].message.tool_calls is None


def test_a_spoken_answer_carries_calls_where_the_voice_leaves_them_out(srv: Served) -> None:
    model = _model(srv)
    model.voice_skips_tool_calls = True  # as the voice pipeline's Thinker does
    try:
        audio: Any = {"voice": "ethan", "format": "pcm16"}
        r: Any = srv.client().chat.completions.create(
            model=srv.model,
            messages=ASK,
            tools=TOOLS,
            modalities=["text", "audio"],
            audio=audio,
            max_tokens=MAX_TOKENS,
        )
        message = r.choices[0].message
        assert message.content is None and message.audio is not None
        assert message.audio.transcript == "Let me check.\n"  # the call is not in what was said
        assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]
        assert r.choices[0].finish_reason == "tool_calls"
        chunks = srv.client().chat.completions.create(
            model=srv.model,
            messages=ASK,
            tools=TOOLS,
            modalities=["text", "audio"],
            audio=audio,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        text, pcm, seen = chat_stream_audio(chunks)
        deltas = [c.choices[0].delta for c in seen if c.choices]
        names = [
            tc.function.name for d in deltas for tc in d.tool_calls or [] if tc.function and tc.function.name
        ]
        assert pcm  # the voice spoke
        assert text == "Let me check.\n" and names == ["get_weather"]
    finally:
        model.voice_skips_tool_calls = False


def test_parallel_tool_calls_false_keeps_the_first_call(srv: Served) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    r = _ask(srv, ask, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "21"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"tools": TOOLS, "modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(srv: Served, body: dict[str, Any], param: str) -> None:
    payload = {"model": srv.model, "messages": ASK, "max_tokens": 5, **body}
    if param.endswith(".arguments"):
        payload["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_model_whose_template_takes_no_tools_refuses_them() -> None:
    req = parse(ChatCompletionRequest, {"messages": ASK, "tools": TOOLS})
    with pytest.raises(ApiError) as info:
        read_chat_tools_request(req, ByteCodec(), "toy")
    assert info.value.status == 400 and info.value.param == "tools"
    assert "takes no tools" in info.value.message
    plain = ScriptedToolModel(template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ApiError, match="does not render tool definitions"):
        read_chat_tools_request(req, plain, "plain")
    history = parse(
        ChatCompletionRequest, {"messages": [*ASK, {"role": "tool", "tool_call_id": "c", "content": "x"}]}
    )
    with pytest.raises(ApiError) as info:
        read_chat_tools_request(history, ByteCodec(), "toy")
    assert info.value.param == "messages[1].role"
    assert (
        read_chat_tools_request(parse(ChatCompletionRequest, {"messages": ASK}), ByteCodec(), "toy") is None
    )


def test_the_openai_client_raises_on_the_refusal(srv: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _ask(srv, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
