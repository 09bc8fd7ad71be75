"""Tool calling: tool definitions, the model's call format, and a streaming call parser.

Pure (no model library is imported); shared by chat completions and Realtime. A model
takes tools when its own chat template renders them (``apply_chat_template(...,
tools=...)``); its calls are read in the format that template tells it to write.

Definitions and choices (what a request sends; each reader raises :class:`ToolError`
naming the field):

* :class:`ToolSpec` — one function tool: ``name``, ``description``, ``parameters`` (a
  JSON Schema object), ``strict``. :func:`read_chat_tools` reads chat completions'
  ``tools`` (``[{"type": "function", "function": {...}}]``); :func:`read_realtime_tools`
  reads Realtime's ``session.tools`` (``[{"type": "function", "name": ..., ...}]``).
  :meth:`ToolSpec.template` is the form chat templates take.
* :class:`ToolChoice` — ``auto``, ``none``, ``required`` or one named function;
  :func:`read_tool_choice` reads either API's form (``{"type": "function", "function":
  {"name": ...}}`` or ``{"type": "function", "name": ...}``).

Conversation (what the template renders):

* :class:`ToolCall` — one call: ``id`` (``call_…``), ``name``, ``arguments`` (JSON text,
  as OpenAI's API carries it); :meth:`ToolCall.chat` is chat completions' form.
* :class:`Message` — one turn with tool fields: an assistant turn's ``tool_calls``, a
  ``tool`` turn's ``tool_call_id``; :meth:`Message.template` is the form chat templates
  take (a call's arguments as an object).
* :class:`ToolPrompt` — what tools add to a prompt of ``(role, text)`` turns: the
  definitions, each turn's calls or answered call id, the forced prefix; it travels in a
  request's ``extras`` (under :data:`TOOLS_EXTRA`) as JSON when the prompt is made after
  recognition.

The model's side:

* :class:`ToolFormat` — how a model writes calls; :data:`HERMES` (``<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>``: Qwen's and most open models' templates) is the
  one read today. :meth:`ToolFormat.forced_prefix` is the text the assistant turn is
  started with to make the model call (``required``) or call one function (named).
* :class:`ChatTemplateTools` — a ``transformers`` tokenizer's chat template seen from
  here, probed once when made: ``format`` (the call format, None when it takes no
  tools) and ``refusal`` (why not); :meth:`~ChatTemplateTools.render` renders messages
  and tools.
* :class:`ToolCallParser` — the streaming parser: :meth:`~ToolCallParser.push` a text
  delta, get :data:`ParserEvent` s back (:class:`TextDelta`, :class:`CallStarted`,
  :class:`ArgumentsDelta`, :class:`CallDone`); :meth:`~ToolCallParser.finish` at the
  end. Text that may be the start of a call is held until the next delta decides; a call
  is sent whole once its closing tag arrives (it is checked before any of it is sent);
  a call whose JSON is malformed is text, and so is one left open at the end unless its
  JSON is whole: nothing is lost.
  :func:`parse_tool_calls` is the same over a whole answer.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "HERMES",
    "TOOLS_EXTRA",
    "ArgumentsDelta",
    "CallDone",
    "CallStarted",
    "ChatTemplateTools",
    "Message",
    "ParserEvent",
    "TextDelta",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "ToolError",
    "ToolFormat",
    "ToolPrompt",
    "ToolSpec",
    "new_call_id",
    "parse_tool_calls",
    "read_chat_tools",
    "read_realtime_tools",
    "read_tool_choice",
]

#: The ``extras`` key of a request whose prompt is made after recognition
#: (``asr_to_thinker``): its :class:`ToolPrompt` as JSON.
TOOLS_EXTRA = "chat_tools"
#: OpenAI's rule for a function name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The most tools one request may define.
MAX_TOOLS = 128


class ToolError(ValueError):
    """A tool definition, choice or call that cannot be taken; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """A fresh call id, in OpenAI's form (``call_`` and 24 letters and digits)."""
    return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------- definitions


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function tool (see the module docstring)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None

    def template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's chat form)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters) if self.parameters is not None else {"type": "object"}
        return {"type": "function", "function": function}


def read_chat_tools(value: Any, param: str = "tools") -> list[ToolSpec]:
    """Chat completions' ``tools``: ``[{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}]``. ``None`` or ``[]``: no tools."""
    items = _tool_list(value, param)
    specs = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        _check_type(item, where)
        function = item.get("function")
        if not isinstance(function, dict):
            raise ToolError(
                f"{where}.function must be an object with the function's name", f"{where}.function"
            )
        specs.append(_spec(function, f"{where}.function"))
    return _unique(specs, param)


def read_realtime_tools(value: Any, param: str = "session.tools") -> list[ToolSpec]:
    """Realtime's ``tools``: ``[{"type": "function", "name", "description",
    "parameters"}]``. ``None`` or ``[]``: no tools."""
    items = _tool_list(value, param)
    specs = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        _check_type(item, where)
        specs.append(_spec(item, where))
    return _unique(specs, param)


def _tool_list(value: Any, param: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError(f"{param} must be an array of tools", param)
    if len(value) > MAX_TOOLS:
        raise ToolError(f"{param} has {len(value)} tools; at most {MAX_TOOLS} are allowed", param)
    return value


def _check_type(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ToolError(f"{where} must be an object", where)
    kind = item.get("type")
    if kind != "function":
        raise ToolError(
            f"{where}.type is {kind!r}; only function tools ({{'type': 'function'}}) are supported",
            f"{where}.type",
        )


def _spec(function: Mapping[str, Any], where: str) -> ToolSpec:
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(
            f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}"[:200],
            f"{where}.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description must be a string", f"{where}.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"{where}.parameters must be a JSON Schema object", f"{where}.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.strict must be a boolean", f"{where}.strict")
    return ToolSpec(name, description, parameters, strict)


def _unique(specs: list[ToolSpec], param: str) -> list[ToolSpec]:
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ToolError(
                f"{param}[{i}]: the function name {spec.name!r} is defined twice", f"{param}[{i}]"
            )
        seen.add(spec.name)
    return specs


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode``: ``auto`` (the model decides), ``none`` (no call), ``required`` (at least
    one call) or ``function`` (a call of ``name``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    @property
    def allows_calls(self) -> bool:
        return self.mode != "none"


def read_tool_choice(value: Any, tools: Sequence[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """``tool_choice`` in either API's form, checked against ``tools``. Absent: ``auto``
    with tools, ``none`` without (OpenAI's defaults)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("auto", "none", "required"):
        mode: Literal["auto", "none", "required"] = value
        if mode != "none" and not tools:
            raise ToolError(f"{param} is {mode!r} but no tools are defined; add tools or omit it", param)
        return ToolChoice(mode)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else value.get("name")
        names = [t.name for t in tools]
        if not isinstance(name, str) or name not in names:
            raise ToolError(
                f"{param} names the function {name!r}, which is not among the tools {names}", param
            )
        return ToolChoice("function", name)
    shown = json.dumps(value)[:80] if _is_json(value) else type(value).__name__
    raise ToolError(
        f"{param} must be 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
        f"got {shown}",
        param,
    )


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- conversation


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made (or a client replays): ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def chat(self) -> dict[str, Any]:
        """Chat completions' form: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class Message:
    """One turn as a chat template renders it: ``role`` (``system``, ``user``,
    ``assistant``, ``tool``), its text, an assistant turn's calls, a tool turn's call id."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def template(self) -> dict[str, Any]:
        """The HF chat-template form; a call's arguments as an object where they are one
        (what templates expect), else as the text."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments_object(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """What tools add to a prompt of turns ``(role, text)``: the definitions, each turn's
    calls (an assistant turn) or the call it answers (a ``tool`` turn), and the text the
    assistant turn is started with (:meth:`ToolFormat.forced_prefix`). ``calls`` and
    ``call_ids`` run beside the turns, one entry a turn.

    It travels in a request's ``extras`` (:meth:`extra`, :meth:`from_extra`: plain JSON)
    when the prompt is made after recognition (``asr_to_thinker``)."""

    tools: tuple[ToolSpec, ...] = ()
    calls: tuple[tuple[ToolCall, ...], ...] = ()
    call_ids: tuple[str | None, ...] = ()
    prefix: str = ""

    def messages(self, turns: Sequence[tuple[str, str]]) -> list[Message]:
        """``turns`` with their tool fields. ValueError when they do not line up."""
        if len(turns) != len(self.calls) or len(turns) != len(self.call_ids):
            raise ValueError(f"{len(turns)} turns but tool fields for {len(self.calls)}")
        return [
            Message(role, text, calls, call_id)
            for (role, text), calls, call_id in zip(turns, self.calls, self.call_ids, strict=True)
        ]

    def extra(self) -> dict[str, Any]:
        return {
            "tools": [t.template() for t in self.tools],
            "calls": [[c.chat() for c in calls] for calls in self.calls],
            "call_ids": list(self.call_ids),
            "prefix": self.prefix,
        }

    @classmethod
    def from_extra(cls, value: Mapping[str, Any]) -> ToolPrompt:
        return cls(
            tools=tuple(read_chat_tools(value.get("tools"))),
            calls=tuple(
                tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls)
                for calls in value.get("calls", ())
            ),
            call_ids=tuple(value.get("call_ids", ())),
            prefix=str(value.get("prefix", "")),
        )


# --------------------------------------------------------------------------- the model's format


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes a call: ``open`` + a JSON object ``{"name", "arguments"}`` + ``close``."""

    name: str
    open: str
    close: str

    def forced_prefix(self, choice: ToolChoice) -> str:
        """The text the assistant turn starts with so that the model calls: a call's
        opening for ``required``, and the function's name too for a named choice; empty
        otherwise."""
        if choice.mode == "required":
            return self.open + "\n"
        if choice.mode == "function":
            return self.open + "\n" + '{"name": ' + json.dumps(choice.name) + ', "arguments": '
        return ""

    def parser(self, prefix: str = "") -> ToolCallParser:
        """A parser of one answer whose turn was started with ``prefix`` (:meth:`forced_prefix`)."""
        return ToolCallParser(self, prefix)


#: Hermes-style calls: Qwen's templates (Qwen2.5, Qwen3, Qwen3-Omni) and many others.
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
_FORMATS = (HERMES,)

#: A tool no conversation defines: the probe that tells whether a template renders tools.
_PROBE_TOOL = ToolSpec("omnirelay_probe_tool", "probe", {"type": "object", "properties": {}})


class ChatTemplateTools:
    """A ``transformers`` tokenizer's chat template, for tools (see the module docstring).

    ``apply``: the tokenizer's ``apply_chat_template``. The probe renders one user turn
    with and without a probe tool: the template takes tools when only the first holds the
    tool's name, and its format is the one whose opening tag it names."""

    def __init__(self, apply: Callable[..., Any]) -> None:
        self._apply = apply
        self.format: ToolFormat | None = None
        #: why the template takes no tools (None: it takes them)
        self.refusal: str | None = None
        self._probe()

    def _probe(self) -> None:
        turns = [{"role": "user", "content": "hi"}]
        try:
            with_tools = str(self._apply(turns, tools=[_PROBE_TOOL.template()], tokenize=False))
            without = str(self._apply(turns, tokenize=False))
        except Exception as exc:  # a template that raises on tools or on a lone user turn
            self.refusal = f"its chat template does not render tools ({type(exc).__name__})"
            return
        if _PROBE_TOOL.name not in with_tools or _PROBE_TOOL.name in without:
            self.refusal = "its chat template does not render tool definitions"
            return
        self.format = next((f for f in _FORMATS if f.open in with_tools), None)
        if self.format is None:
            self.refusal = (
                "its chat template writes tool calls in a format omnirelay does not read (only <tool_call>)"
            )

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec], *, prefix: str = "") -> str:
        """``messages`` and ``tools`` (none: no definitions) as the template writes them,
        the open assistant turn, then ``prefix``. ValueError when the template refuses them."""
        turns = [m.template() for m in messages]
        defined = [t.template() for t in tools] or None
        try:
            text = self._apply(turns, tools=defined, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError, raise_exception() in the template …
            raise ValueError(f"the model's chat template refused these turns: {exc}") from exc
        return str(text) + prefix


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Answer text (outside any call)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    """Call ``index`` (0, 1, … in the answer) begins: its id and function name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """More of call ``index``'s arguments (JSON text)."""

    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class CallDone:
    """Call ``index`` is complete."""

    index: int
    call: ToolCall


ParserEvent = TextDelta | CallStarted | ArgumentsDelta | CallDone


@dataclass
class ToolCallParser:
    """The streaming parser of one answer (see the module docstring). ``prefix``: the
    text the turn was started with (:meth:`ToolFormat.forced_prefix`): the parser reads it
    first, as if the model had written it."""

    format: ToolFormat
    prefix: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    #: text outside calls not sent yet (it may begin a call)
    _held: str = ""
    #: the body of the call being read (None: outside a call)
    _body: str | None = None
    #: whitespace after a call, sent only when more text follows it
    _gap: str = ""

    def __post_init__(self) -> None:
        primed = self.push(self.prefix) if self.prefix else []
        assert not primed  # Invariant: a forced prefix opens a call and sends nothing
        self.prefix = ""

    def push(self, text: str) -> list[ParserEvent]:
        """Events for one more piece of the model's text."""
        events: list[ParserEvent] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._body is None:
                at = buf.find(self.format.open)
                if at < 0:
                    keep = _partial_suffix(buf, self.format.open)
                    self._text(buf[: len(buf) - keep], events)
                    self._held = buf[len(buf) - keep :]
                    return events
                self._text(buf[:at], events)
                self._body = ""
                buf = buf[at + len(self.format.open) :]
            else:
                body = self._body + buf
                at = body.find(self.format.close)
                if at < 0:
                    self._body = body
                    return events
                self._body = None
                buf = body[at + len(self.format.close) :]
                self._call(body[:at], events)
        return events

    def finish(self) -> list[ParserEvent]:
        """Events for the end of the answer: held text, and a call left open (taken when
        its JSON is whole, else text)."""
        events: list[ParserEvent] = []
        if self._body is not None:
            body, self._body = self._body, None
            self._call(body, events, is_closed=False)
        held, self._held = self._held, ""
        self._text(held, events)
        return events

    def _text(self, text: str, events: list[ParserEvent]) -> None:
        if not text:
            return
        if self.calls and not text.strip():  # whitespace after a call: only before more text
            self._gap += text
            return
        text, self._gap = self._gap + text, ""
        events.append(TextDelta(text))

    def _call(self, body: str, events: list[ParserEvent], *, is_closed: bool = True) -> None:
        call = _read_call(body)
        if call is None:
            tail = self.format.close if is_closed else ""
            self._text(self.format.open + body + tail, events)
            return
        self._gap = ""
        index = len(self.calls)
        name, arguments = call
        made = ToolCall(new_call_id(), name, arguments)
        self.calls.append(made)
        events += [CallStarted(index, made.id, name), ArgumentsDelta(index, arguments), CallDone(index, made)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _read_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call's body, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return value["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(
    text: str, format: ToolFormat = HERMES, *, prefix: str = ""
) -> tuple[str, list[ToolCall]]:
    """The whole answer ``text`` as its text outside calls and its calls."""
    parser = format.parser(prefix)
    events = parser.push(text) + parser.finish()
    return "".join(e.text for e in events if isinstance(e, TextDelta)), parser.calls
