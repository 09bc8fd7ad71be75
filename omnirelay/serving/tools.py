"""Tools in chat completions (docs/protocol.md §7.1), as OpenAI's API carries them.

* :func:`read_chat_tools_request` — a request's ``tools``, ``tool_choice``,
  ``parallel_tool_calls`` and its messages' tool fields (an assistant turn's
  ``tool_calls``, a ``tool`` turn's ``tool_call_id``), checked against what the model
  takes: a 400 naming the field for anything wrong, and for tools on a model whose chat
  template takes none. None when the request uses no tools.
* :class:`ChatTools` — what was read: the model's call format, the choice, and the
  :class:`~omnirelay.models.tools.ToolPrompt` the prompt is made with (``tool_choice:
  "none"`` renders no definitions, so the model calls nothing; ``required`` and a named
  function start the assistant turn with the call's opening).
* :class:`ChatCallStream` — a streamed answer's text deltas in, chunk deltas out
  (:meth:`ChatTools.stream`); :meth:`ChatTools.complete` — the same over a whole answer:
  ``content`` (null when the answer only called), ``tool_calls``, ``finish_reason``.
* :func:`chat_delta` — one parser event as a ``chat.completion.chunk`` delta: text is
  ``content``; a call is OpenAI's index-keyed ``tool_calls`` deltas (the first with its
  ``id``, ``type`` and ``name``, then its ``arguments``).
* :func:`finish_reason` — ``tool_calls`` when the answer called (whatever ended it after
  its calls), ``stop`` for a named ``tool_choice`` (OpenAI's), else the answer's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnirelay.models.family import PromptSide
from omnirelay.models.tools import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    ParserEvent,
    TextDelta,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    ToolError,
    ToolFormat,
    ToolPrompt,
    read_chat_tools,
    read_tool_choice,
)
from omnirelay.serving.errors import ApiError

if TYPE_CHECKING:
    from omnirelay.serving.protocol import ChatCompletionRequest, ChatMessage

__all__ = [
    "ChatCallStream",
    "ChatTools",
    "chat_delta",
    "finish_reason",
    "message_tool_fields",
    "read_chat_tools_request",
]


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A chat request's tools, read and checked (see the module docstring)."""

    format: ToolFormat
    choice: ToolChoice
    prompt: ToolPrompt
    #: ``parallel_tool_calls``: False keeps the answer's first call only
    is_parallel: bool = True

    def parser(self) -> ToolCallParser | None:
        """A parser of the answer's calls (None: ``tool_choice: "none"``, the answer is text)."""
        return self.format.parser(self.prompt.prefix) if self.choice.allows_calls else None

    def stream(self) -> ChatCallStream:
        """The streamed answer's deltas, its calls parsed (:class:`ChatCallStream`)."""
        return ChatCallStream(self)

    def complete(self, text: str, reason: str) -> tuple[str | None, list[ToolCall], str]:
        """A whole answer's ``content`` (None: only calls), calls and ``finish_reason``."""
        calls = self.stream()
        deltas = calls.push(text) + calls.finish()
        content = "".join(d["content"] for d in deltas if "content" in d)
        if calls.calls and not content.strip():
            return None, calls.calls, calls.finish_reason(reason)
        return content, calls.calls, calls.finish_reason(reason)


class ChatCallStream:
    """One answer's text deltas in, ``chat.completion.chunk`` deltas out: text as
    ``content``, calls as ``tool_calls`` (:func:`chat_delta`); with ``parallel_tool_calls:
    false`` nothing after the first call is sent."""

    def __init__(self, tools: ChatTools) -> None:
        self.tools = tools
        self._parser = tools.parser()
        self.calls: list[ToolCall] = []

    @property
    def is_done(self) -> bool:
        """Whether the answer's last call was sent (``parallel_tool_calls: false``)."""
        return not self.tools.is_parallel and bool(self.calls)

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self._parser.push(text))

    def finish(self) -> list[dict[str, Any]]:
        return [] if self._parser is None else self._deltas(self._parser.finish())

    def finish_reason(self, reason: str) -> str:
        return finish_reason(self.tools, self.calls, reason)

    def _deltas(self, events: list[ParserEvent]) -> list[dict[str, Any]]:
        out = []
        for event in events:
            if self.is_done:
                break
            if isinstance(event, CallDone):
                self.calls.append(event.call)
            elif (delta := chat_delta(event)) is not None:
                out.append(delta)
        return out


def read_chat_tools_request(req: ChatCompletionRequest, prompts: PromptSide, model: str) -> ChatTools | None:
    """The request's tools (see the module docstring); None when it uses none."""
    where = _first_use(req)
    if where is None:
        return None
    fmt = prompts.tool_format
    if fmt is None:
        raise ApiError(
            400,
            f"model {model!r} takes no tools: {prompts.tool_refusal}; send the request without tools",
            param=where,
            code="unsupported_parameter",
        )
    try:
        tools = read_chat_tools(req.tools)
        choice = read_tool_choice(req.tool_choice, tools)
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc
    fields = [message_tool_fields(m, i) for i, m in enumerate(req.messages)]
    tooling = ToolPrompt(
        tools=tuple(tools) if choice.allows_calls else (),
        calls=tuple(c for c, _ in fields),
        call_ids=tuple(i for _, i in fields),
        prefix=fmt.forced_prefix(choice),
    )
    return ChatTools(fmt, choice, tooling, is_parallel=req.parallel_tool_calls is not False)


def _first_use(req: ChatCompletionRequest) -> str | None:
    """The field by which the request first uses tools (None: it uses none)."""
    if req.tools is not None and req.tools != []:
        return "tools"
    if req.tool_choice not in (None, "none"):
        return "tool_choice"
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            return f"messages[{i}].role"
        if m.tool_calls is not None:
            return f"messages[{i}].tool_calls"
    return None


def message_tool_fields(message: ChatMessage, index: int) -> tuple[tuple[ToolCall, ...], str | None]:
    """An assistant message's ``tool_calls`` and a ``tool`` message's ``tool_call_id``,
    checked (a 400 naming the field)."""
    where = f"messages[{index}]"
    if message.role == "tool":
        if not message.tool_call_id:
            raise ApiError(
                400,
                f"{where}.tool_call_id is required: the id of the call this message answers",
                param=f"{where}.tool_call_id",
            )
        return (), message.tool_call_id
    if message.tool_calls is None:
        return (), None
    if message.role != "assistant":
        raise ApiError(
            400, f"{where}.tool_calls: only assistant messages carry tool calls", param=f"{where}.tool_calls"
        )
    if not isinstance(message.tool_calls, list):
        raise ApiError(400, f"{where}.tool_calls must be an array of calls", param=f"{where}.tool_calls")
    return tuple(_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message.tool_calls)), None


def _call(value: Any, where: str) -> ToolCall:
    shape = "{'id': 'call_...', 'type': 'function', 'function': {'name': ..., 'arguments': '<JSON text>'}}"
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise ApiError(400, f"{where} must be a function call: {shape}", param=where)
    function = value.get("function")
    call_id = value.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(
            400, f"{where}.id is required: the call's id, as the answer gave it", param=f"{where}.id"
        )
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where}.function must name the function: {shape}", param=f"{where}.function")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise ApiError(
            400,
            f"{where}.function.arguments must be the arguments as JSON text (a string), as the answer gave them",
            param=f"{where}.function.arguments",
        )
    return ToolCall(call_id, function["name"], arguments)


def chat_delta(event: ParserEvent) -> dict[str, Any] | None:
    """The ``delta`` of one parser event (None: nothing to send for it)."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, CallStarted):
        call = {
            "index": event.index,
            "id": event.call_id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
        return {"tool_calls": [call]}
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]}
    return None


def finish_reason(tools: ChatTools, calls: Sequence[ToolCall], reason: str) -> str:
    """The answer's ``finish_reason`` (see the module docstring); ``reason``: its own."""
    if not calls:  # a call cut short by max_tokens never closed: it is text, and "length"
        return reason
    return "stop" if tools.choice.mode == "function" else "tool_calls"
