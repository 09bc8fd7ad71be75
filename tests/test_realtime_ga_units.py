"""The realtime endpoint's GA translation and item edits, without a server: GA's
``session.update`` and ``response.create`` in beta's terms (what is refused names GA's
field), server events reshaped as GA's, which interface a client speaks, a truncated
answer's transcript, items inserted after an item or at the root, and tools (which
model takes them, when an answer that may call speaks, the calls and results beside the
prompt's turns)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omnirelay.models.tools import HERMES, ToolCall, ToolChoice, ToolSpec
from omnirelay.serving.realtime import ga
from omnirelay.serving.realtime.conversation import ROOT, Conversation, Item
from omnirelay.serving.realtime.events import EventError, RealtimeSettings, apply_session_update
from omnirelay.serving.realtime.items import cut_transcript
from omnirelay.serving.realtime.tools import read_tools, tool_prompt

RATE = 24000
PCM = {"type": "audio/pcm", "rate": RATE}


def _apply(session: dict[str, Any]) -> RealtimeSettings:
    start = RealtimeSettings(modalities=("text", "audio"), voice="ethan")
    beta = ga.session_to_beta(session, RATE)
    try:
        return apply_session_update(
            start,
            beta,
            check_voice=lambda v: v,
            check_modalities=lambda m: m,
            sample_rate=RATE,
            can_transcribe=True,
        )
    except EventError as exc:
        raise ga.ga_error(exc) from None


def test_a_frameworks_session_update_is_honoured() -> None:
    """The shape LiveKit Agents and openai-agents send by default."""
    settings = _apply(
        {
            "type": "realtime",
            "model": "m",
            "output_modalities": ["audio"],
            "instructions": "Be brief.",
            "audio": {
                "input": {
                    "format": PCM,
                    "noise_reduction": {"type": "near_field"},
                    "transcription": {"model": "gpt-4o-mini-transcribe"},
                    "turn_detection": {
                        "type": "semantic_vad",
                        "eagerness": "high",
                        "interrupt_response": True,
                    },
                },
                "output": {"format": PCM, "voice": "chelsie", "speed": 1.0},
            },
            "max_output_tokens": 24,
            "tool_choice": "auto",
            "tools": [],
            "tracing": "auto",
        }
    )
    assert settings.modalities == ("text", "audio") and settings.voice == "chelsie"
    assert settings.instructions == "Be brief." and settings.max_output_tokens == 24
    assert settings.transcription is not None and settings.transcription["model"] == "gpt-4o-mini-transcribe"
    td = settings.turn_detection
    assert td is not None and td.vad.silence_duration_ms == ga.EAGERNESS_SILENCE_MS["high"]
    assert _apply({"type": "realtime", "output_modalities": ["text"]}).modalities == ("text",)
    assert _apply({"audio": {"input": {"turn_detection": None}}}).turn_detection is None


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"type": "transcription"}, "session.type"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format.type"),
        (
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "session.audio.output.format.rate",
        ),
        ({"audio": {"output": {"speed": 1.25}}}, "session.audio.output.speed"),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
            "session.audio.input.turn_detection.idle_timeout_ms",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1}}}},
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "x"}}}}, None),
        ({"include": ["item.input_audio_transcription.logprobs"]}, "session.include"),
        ({"truncation": "disabled"}, "session.truncation"),
        ({"prompt": {"id": "p"}}, "session.prompt"),
        ({"type": "realtime", "voice": "ethan"}, "session.voice"),  # beta's field in a GA update
        ({"output_modalities": "audio"}, "session.output_modalities"),
    ],
)
def test_what_would_change_what_the_user_gets_is_refused_by_its_ga_name(
    session: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(EventError) as info:
        _apply(session)
    want = param or "session.audio.input.turn_detection.eagerness"
    assert info.value.param == want and want in info.value.message


def test_tools_need_a_model_whose_template_takes_them() -> None:
    takes_none = SimpleNamespace(
        model_name="m",
        prompts=SimpleNamespace(tool_format=None, tool_refusal="its template renders no tools"),
    )
    takes = SimpleNamespace(model_name="m", prompts=SimpleNamespace(tool_format=HERMES))
    start = RealtimeSettings(modalities=("text",), voice="v")
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    session = {"instructions": "x", "tools": [tool], "tool_choice": "required"}
    with pytest.raises(EventError) as info:
        read_tools(session, start, takes_none)  # type: ignore[arg-type]
    assert info.value.param == "session.tools" and "renders no tools" in info.value.message
    rest, values = read_tools(session, start, takes)  # type: ignore[arg-type]
    assert rest == {"instructions": "x"} and values["tool_choice"] == ToolChoice("required")
    assert [t.name for t in values["tools"]] == ["get_weather"]
    # GA's defaults without tools: nothing to call.
    assert (
        read_tools({"tools": [], "tool_choice": "auto"}, start, takes_none)[1]["tool_choice"].mode == "none"
    )  # type: ignore[arg-type]


def test_a_ga_response_create_and_its_metadata() -> None:
    response, metadata = ga.response_to_beta(
        {
            "output_modalities": ["text"],
            "instructions": "x",
            "audio": {"output": {"voice": "ethan"}},
            "max_output_tokens": 8,
            "metadata": {"client_event_id": "abc"},
            "conversation": "auto",
            "tool_choice": "auto",
        },
        RATE,
    )
    assert response == {
        "instructions": "x",
        "conversation": "auto",
        "modalities": ["text"],
        "max_response_output_tokens": 8,
        "voice": "ethan",
    }
    assert metadata == {"client_event_id": "abc"}
    for bad, param in [
        ({"metadata": {"k": 1}}, "response.metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "response.metadata"),
        ({"input": [{"type": "message"}]}, "response.input"),
        ({"tools": [{"type": "function"}]}, "response.tools"),
        ({"modalities": ["text"]}, "response.modalities"),  # beta's name in GA
    ]:
        with pytest.raises(EventError) as info:
            ga.response_to_beta(bad, RATE)
        assert info.value.param == param


def test_the_interface_is_the_header_or_the_first_session_that_tells() -> None:
    assert ga.protocol_of({"openai-beta": "realtime=v1"}) == ga.BETA
    assert ga.protocol_of({"openai-beta": "assistants=v2, realtime=v1"}) == ga.BETA
    assert ga.protocol_of({}) == ga.AUTO
    assert ga.shape_of({"type": "realtime"}) == ga.GA
    assert ga.shape_of({"audio": {}}) == ga.GA
    assert ga.shape_of({"voice": "x", "turn_detection": None}) == ga.BETA
    assert ga.shape_of({"instructions": "x"}) == ga.AUTO


def test_server_events_are_reshaped_as_ga() -> None:
    answer = {
        "id": "item_1",
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "audio", "transcript": "Hi."}],
    }
    ga_answer = {**answer, "content": [{"type": "output_audio", "transcript": "Hi."}]}
    renamed = {
        "response.audio.delta": "response.output_audio.delta",
        "response.audio.done": "response.output_audio.done",
        "response.audio_transcript.delta": "response.output_audio_transcript.delta",
        "response.audio_transcript.done": "response.output_audio_transcript.done",
        "response.text.delta": "response.output_text.delta",
        "response.text.done": "response.output_text.done",
    }
    for beta, name in renamed.items():
        assert ga.server_events(beta, {"delta": "x"}) == [(name, {"delta": "x"})]
    text_answer = {**answer, "content": [{"type": "text", "text": "Hi."}]}
    [(_, added_text)] = ga.server_events("response.output_item.added", {"item": text_answer})
    assert added_text["item"]["content"] == [{"type": "output_text", "text": "Hi."}]
    assert ga.server_events("response.output_item.done", {"response_id": "r", "item": answer}) == [
        ("conversation.item.done", {"item": ga_answer}),
        ("response.output_item.done", {"response_id": "r", "item": ga_answer}),
    ]
    added = ga.server_events("conversation.item.created", {"previous_item_id": None, "item": answer})
    assert [k for k, _ in added] == ["conversation.item.added", "conversation.item.done"]
    pending = {**answer, "status": "in_progress"}
    added = ga.server_events("conversation.item.created", {"previous_item_id": None, "item": pending})
    assert [k for k, _ in added] == ["conversation.item.added"]
    body = {
        "id": "r",
        "status": "completed",
        "modalities": ["text", "audio"],
        "voice": "ethan",
        "output": [answer],
    }
    [(kind, payload)] = ga.server_events("response.done", {"response": body, "metadata": None})
    response = payload["response"]
    assert kind == "response.done" and response["output"] == [ga_answer]
    assert response["output_modalities"] == ["audio"] and response["audio"]["output"]["voice"] == "ethan"
    assert "modalities" not in response and "voice" not in response


def test_a_truncated_transcript_ends_at_a_word_where_the_audio_did() -> None:
    text = "The capital of France is Paris."
    assert cut_transcript(text, 1000, 1000, whole=True) == text
    assert cut_transcript(text, 500, 1000, whole=True) == "The capital of"
    assert cut_transcript(text, 0, 1000, whole=True) == ""
    # A cut answer's text ran ahead of its audio: read at the speaking rate.
    assert cut_transcript(text, 1000, 3000, whole=False) == "The capital of"
    assert cut_transcript(text, 10_000, 10_000, whole=False) == text


def test_items_go_after_their_previous_item_or_first() -> None:
    c = Conversation(4, 10_000)
    for name in ("a", "b"):
        c.add(Item(id=name, role="user", kind="input_text", text=name))
    c.add(Item(id="r", role="system", kind="input_text", text="r"), ROOT)
    c.add(Item(id="m", role="user", kind="input_text", text="m"), "a")
    assert [t[1][0] for t in c.turns("")] == ["r", "a", "m", "b"]
    # Past the bounds the oldest goes, never the item just added, even first.
    dropped = c.add(Item(id="n", role="system", kind="input_text", text="n"), ROOT)
    assert [d.id for d in dropped] == ["r"] and c.last_id == "b" and len(c) == 4
    assert c.remove("m") is not None and c.remove("m") is None
    assert [t[1][0] for t in c.turns("")] == ["n", "a", "b"]


def test_a_response_that_may_call_speaks_only_where_the_voice_leaves_the_calls_out() -> None:
    conversation = Conversation(8, 10_000)
    conversation.add(Item(id="u", role="user", kind="input_text", text="Weather in Paris?"))
    conversation.add(Item(id="a", role="assistant", kind="text", text="Let me check."))
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    conversation.add(Item(id="c", role="assistant", kind="function_call", call=call))
    conversation.add(Item(id="o", role="tool", kind="function_call_output", text="21 C", call_id="call_1"))
    session: Any = SimpleNamespace(conversation=conversation)
    tool = ToolSpec("get_weather")
    settings = RealtimeSettings(("text", "audio"), "v", tools=(tool,), tool_choice=ToolChoice("auto"))
    reads: Any = SimpleNamespace(prompts=SimpleNamespace(tool_format=HERMES, voice_skips_tool_calls=False))
    with pytest.raises(EventError) as info:
        tool_prompt(reads, settings, session)
    assert info.value.param == "response.output_modalities"
    skips: Any = SimpleNamespace(prompts=SimpleNamespace(tool_format=HERMES, voice_skips_tool_calls=True))
    prompt = tool_prompt(skips, settings, session)
    # The call joins the answer it ends; its output is a tool turn answering it.
    assert conversation.turns("") == [
        ("user", ["Weather in Paris?"]),
        ("assistant", ["Let me check."]),
        ("tool", ["21 C"]),
    ]
    assert prompt is not None and prompt.tools == (tool,) and prompt.prefix == ""
    assert prompt.calls == ((), (call,), ()) and prompt.call_ids == (None, None, "call_1")
    # A call cut before its end is left out of the prompt.
    call_item = conversation.get("c")
    assert call_item is not None
    call_item.status = "incomplete"
    assert conversation.tool_fields("") == (((), (), ()), (None, None, "call_1"))
