"""Tool definitions, choices and the streaming call parser (omnirelay.models.tools)."""

from __future__ import annotations

import json

import pytest

from omnirelay.models.tools import (
    HERMES,
    TOOLS_EXTRA,
    ArgumentsDelta,
    CallDone,
    CallStarted,
    ChatTemplateTools,
    Message,
    ParserEvent,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolError,
    ToolPrompt,
    ToolSpec,
    parse_tool_calls,
    read_chat_tools,
    read_realtime_tools,
    read_tool_choice,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def _stream(text: str, size: int, prefix: str = "") -> list[ParserEvent]:
    parser = HERMES.parser(prefix)
    events: list[ParserEvent] = []
    for i in range(0, len(text), size):
        events += parser.push(text[i : i + size])
    return events + parser.finish()


def _summary(events: list[ParserEvent]) -> tuple[str, list[tuple[str, str]]]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallDone)]
    return text, calls


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_markers_split_across_deltas_give_the_same_calls(size: int) -> None:
    text = "Let me check." + WEATHER + "\n" + TIME
    assert _summary(_stream(text, size)) == (
        "Let me check.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
    )


def test_each_call_is_started_then_its_arguments_then_done_with_one_id() -> None:
    events = _stream(WEATHER + TIME, 4)
    kinds = [type(e) for e in events]
    assert kinds == [CallStarted, ArgumentsDelta, CallDone] * 2
    first = events[:3]
    assert isinstance(first[0], CallStarted) and isinstance(first[2], CallDone)
    assert first[0].index == 0 and events[3].index == 1  # type: ignore[union-attr]
    assert first[0].call_id == first[2].call.id and first[0].call_id.startswith("call_")
    assert first[0].call_id != events[5].call.id  # type: ignore[union-attr]


def test_text_that_only_looks_like_a_tag_is_sent_once_decided() -> None:
    parser = HERMES.parser()
    assert parser.push("a <tool") == [TextDelta("a ")]  # "<tool" may begin a call: held
    assert parser.push("box> b") == [TextDelta("<toolbox> b")]
    assert parser.finish() == []


def test_malformed_json_is_returned_as_text_not_lost() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    text, calls = parse_tool_calls("Hi " + bad + " bye")
    assert calls == [] and text == "Hi " + bad + " bye"
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(no_name) == (no_name, [])


def test_a_call_left_open_is_a_call_when_whole_else_text() -> None:
    text, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    cut = '<tool_call>\n{"name": "f", "argu'
    assert parse_tool_calls(cut) == (cut, [])


def test_whitespace_between_and_after_calls_is_dropped_but_text_after_is_kept() -> None:
    assert parse_tool_calls(WEATHER + "\n\n")[0] == ""
    assert parse_tool_calls(WEATHER + "\nDone.")[0] == "\nDone."


def test_arguments_given_as_a_json_string_are_kept_as_they_are() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert calls[0].arguments == '{"a": 2}'


def test_a_forced_prefix_is_read_as_the_start_of_the_answer() -> None:
    choice = ToolChoice("function", "get_weather")
    prefix = HERMES.forced_prefix(choice)
    assert prefix.startswith("<tool_call>\n") and '"get_weather"' in prefix
    text, calls = parse_tool_calls('{"city": "Paris"}}\n</tool_call>', prefix=prefix)
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # the model went off script: its whole turn comes back as text
    text, calls = parse_tool_calls("I cannot.", prefix=HERMES.forced_prefix(ToolChoice("required")))
    assert calls == [] and text == "<tool_call>\nI cannot."
    assert HERMES.forced_prefix(ToolChoice("auto")) == ""


def test_chat_tools_are_read_and_bad_ones_name_the_field() -> None:
    specs = read_chat_tools(
        [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ]
    )
    assert specs == [ToolSpec("f", "d", {"type": "object"})]
    assert specs[0].template() == {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
    }
    assert read_chat_tools(None) == [] and read_chat_tools([]) == []
    cases = [
        ("x", "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "tools[1]"),
    ]
    for value, param in cases:
        with pytest.raises(ToolError) as info:
            read_chat_tools(value)
        assert info.value.param == param, (value, info.value)


def test_realtime_tools_are_flat() -> None:
    specs = read_realtime_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert specs == [ToolSpec("f", None, {"type": "object"})]
    with pytest.raises(ToolError, match=r"session.tools\[0\].name"):
        read_realtime_tools([{"type": "function"}])


def test_tool_choice_in_both_forms() -> None:
    tools = [ToolSpec("f")]
    assert read_tool_choice(None, tools) == ToolChoice("auto")
    assert read_tool_choice(None, []) == ToolChoice("none")
    assert read_tool_choice("required", tools) == ToolChoice("required")
    assert read_tool_choice({"type": "function", "function": {"name": "f"}}, tools) == ToolChoice(
        "function", "f"
    )
    assert read_tool_choice({"type": "function", "name": "f"}, tools) == ToolChoice("function", "f")
    for value, tools_ in [
        ("required", []),
        ({"type": "function", "function": {"name": "g"}}, tools),
        ("any", tools),
    ]:
        with pytest.raises(ToolError):
            read_tool_choice(value, tools_)


def test_messages_give_templates_arguments_as_objects() -> None:
    msg = Message("assistant", "", (ToolCall("call_1", "f", '{"a": 1}'),))
    assert msg.template()["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    assert Message("tool", "21 C", tool_call_id="call_1").template() == {
        "role": "tool",
        "content": "21 C",
        "tool_call_id": "call_1",
    }


def _template(source: str) -> ChatTemplateTools:
    import jinja2

    env = jinja2.Environment()
    compiled = env.from_string(source)

    def apply(messages: list[dict], tools: list[dict] | None = None, **kwargs: object) -> str:
        return compiled.render(
            messages=messages, tools=tools, add_generation_prompt=kwargs.get("add_generation_prompt")
        )

    return ChatTemplateTools(apply)


def test_the_probe_tells_templates_that_take_tools_from_those_that_do_not() -> None:
    plain = _template("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert plain.format is None and plain.refusal and "does not render" in plain.refusal
    hermes = _template(
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %} use <tool_call>{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    assert hermes.format is HERMES and hermes.refusal is None
    assert "get_weather" in hermes.render([Message("user", "hi")], [ToolSpec("get_weather")], prefix="<p>")
    other = _template(
        "{% if tools %}{{ tools | tojson }} reply [TOOL_CALLS]{% endif %}{{ messages[0].content }}"
    )
    assert other.format is None and other.refusal and "format" in other.refusal


def test_the_families_prompt_sides_render_tools_with_their_templates() -> None:
    from omnirelay.models.family import PromptSide
    from omnirelay.models.qwen3_omni.prompt import QwenPromptSide
    from omnirelay.models.voice.chat_model import ChatTokenizer
    from omnirelay.models.voice.prompt import SmolPromptSide
    from tests.tool_model import make_tokenizer

    tooling = ToolPrompt(
        tools=(ToolSpec("get_weather"),), calls=((),), call_ids=(None,), prefix="<tool_call>\n"
    )
    for side in (SmolPromptSide(ChatTokenizer(make_tokenizer())), QwenPromptSide(make_tokenizer())):
        assert side.tool_format is HERMES
        text = side.tokenizer.decode(
            side.encode_chat_tools([("user", "hi")], tooling), skip_special_tokens=False
        )
        assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n<tool_call>\n")
    refusals: list[tuple[PromptSide, str]] = [
        (QwenPromptSide(make_tokenizer(None)), "no chat template"),
        (SmolPromptSide(object()), "serve a --model checkpoint whose template does"),
    ]
    for plain, refusal in refusals:
        assert plain.tool_format is None and refusal in plain.tool_refusal
        with pytest.raises(ValueError, match="takes no tools"):
            plain.encode_chat_tools([("user", "hi")], tooling)


def test_after_recognition_the_tools_travel_in_extras_into_the_prompt() -> None:
    import msgspec

    from omnirelay.orchestrator.input_builders import CHAT_TURNS_EXTRA, TranscriptToPrompt
    from omnirelay.orchestrator.requests import PipelineRequest, SourceOutput
    from tests.tool_model import ScriptedToolModel

    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    tooling = ToolPrompt(
        tools=(ToolSpec("get_weather", "now", {"type": "object"}),),
        calls=((), (call,), (), ()),
        call_ids=(None, None, "call_1", None),
    )
    turns = [["user", [{"audio": 0}]], ["assistant", [""]], ["tool", ["21 C"]], ["user", [{"audio": 1}]]]
    request = PipelineRequest(
        request_id="r",
        prompt_token_ids=[0],
        extras={CHAT_TURNS_EXTRA: turns, TOOLS_EXTRA: tooling.extra()},
    )
    # as the request crosses to the orchestrator: plain data
    request = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=PipelineRequest)
    assert ToolPrompt.from_extra(request.extras[TOOLS_EXTRA]) == tooling
    builder = object.__new__(TranscriptToPrompt)  # its prompt side given, not loaded for a stage
    model = ScriptedToolModel()
    builder.prompts = model
    source = SourceOutput(
        stage_id=0,
        token_ids=[],
        text="weather in Paris?\nand Rome?",
        audio=[],
        sample_rate=None,
        finished=True,
    )
    built = builder(source, request, None)  # type: ignore[arg-type]
    assert built is not None and built.prompt_token_ids
    prompt = model.rendered[-1]
    assert '"name": "get_weather"' in prompt and "weather in Paris?" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt and prompt.endswith(
        "and Rome?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_voice_thinker_leaves_tool_calls_out_of_what_the_voice_reads() -> None:
    import torch

    from omnirelay.engine.interfaces import BatchItem, SamplingParams
    from omnirelay.models.voice.chat_model import ChatTokenizer
    from omnirelay.models.voice.smollm2 import SmolLM2Executor
    from tests.tool_model import make_tokenizer

    tok = ChatTokenizer(make_tokenizer())
    ex = SmolLM2Executor(torch.nn.Linear(1, 1), tok)  # a scripted answer computes nothing
    said = "Let me check. " + WEATHER + " One moment."
    ids = tok.chat_ids([("user", "hi")])
    prompt_len = len(ids)
    text, spoken, finished = "", "", False
    while not finished:
        item = BatchItem(
            internal_id="r",
            external_id="r",
            input_token_ids=ids[-1:] if len(ids) > prompt_len else ids,
            all_token_ids=list(ids),
            num_computed_tokens=len(ids) - 1 if len(ids) > prompt_len else 0,
            is_prefill=len(ids) == prompt_len,
            sampling=SamplingParams(max_tokens=500),
            additional_information=None,
            inputs={"speak_text": said},
        )
        [result] = ex.step([item])
        ids += result.token_ids
        text += result.text or ""
        spoken += result.next_stage_output or ""
        finished = result.finished
    ex.release("r")
    assert text == said  # the client's text keeps the call: it is parsed there
    assert spoken == "Let me check.  One moment."
    assert ex.leak_state() == {}


def test_a_clip_and_tools_go_into_the_template_together() -> None:
    from omnirelay.models.family import AudioSlot
    from omnirelay.models.qwen3_omni.prompt import AUDIO_START, QwenPromptSide
    from tests.tool_model import make_tokenizer

    side = QwenPromptSide(make_tokenizer(), audio_window=50)
    tooling = ToolPrompt(tools=(ToolSpec("get_weather"),), calls=((),), call_ids=(None,))
    ids = side.encode_chat_media([("user", ["weather here? ", AudioSlot(16_000)])], tooling)
    text = side.tokenizer.decode(ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "weather here? " + AUDIO_START in text
    assert text.endswith("<|im_start|>assistant\n")
