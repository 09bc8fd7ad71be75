"""Tools in Realtime: ``session.tools`` / ``tool_choice``, calls in a response, results as items.

Definitions and calls are the chat side's (:mod:`omnirelay.models.tools`): the model's
own chat template renders the tools, the calls and their results, and the answer's calls
are read in the model's own format. A model that takes no tools refuses them (an
``error`` naming ``session.tools``), as chat does.

* :func:`read_tools` — ``session.tools`` and ``tool_choice`` of an update, over the
  session's.
* :func:`parse_call_item` — ``conversation.item.create`` of a ``function_call`` (a call
  replayed) or a ``function_call_output`` (a call's result, the client's answer to it).
* :func:`tool_prompt` — what a response's prompt adds: the tools, each turn's calls or
  answered call id, the forced opening of a ``required`` or named choice.
* :class:`CallRelay` — a response's answer text through the call parser: text goes on as
  the answer's, a call becomes an output item of its own (``response.output_item.added``,
  ``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``)
  and a ``function_call`` item of the conversation.

A response that may call speaks only where the pipeline's voice leaves the calls out (the
voice pipeline's Thinker does); elsewhere it answers in text, and ``response.create``
with tools and audio is refused with an error that says so (chat's rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
    ToolPrompt,
    read_realtime_tools,
    read_tool_choice,
)
from omnirelay.serving.realtime.conversation import Item
from omnirelay.serving.realtime.events import EventError, RealtimeSettings, new_id

if TYPE_CHECKING:
    from omnirelay.serving.frontend import Frontend
    from omnirelay.serving.realtime.response import Response
    from omnirelay.serving.realtime.session import Session

__all__ = ["CallRelay", "parse_call_item", "read_tools", "tool_prompt"]

_NO_CALLS = ToolChoice("none")


def read_tools(
    session: Mapping[str, Any], current: RealtimeSettings, fe: Frontend
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``session`` less ``tools`` and ``tool_choice``, and the settings they make
    (``{}``: the update sets neither)."""
    rest = {k: v for k, v in session.items() if k not in ("tools", "tool_choice")}
    if "tools" not in session and "tool_choice" not in session:
        return rest, {}
    try:
        specs = read_realtime_tools(session["tools"]) if "tools" in session else list(current.tools)
        value = session.get("tool_choice")
        choice = (
            _NO_CALLS
            if not specs and value in (None, "auto", "none")
            else read_tool_choice(value, specs, "session.tool_choice")
        )
    except ToolError as exc:
        raise EventError(str(exc), param=exc.param) from exc
    if specs and fe.prompts.tool_format is None:
        raise EventError(
            f"model {fe.model_name!r} takes no tools: {fe.prompts.tool_refusal}; set session.tools to []",
            code="unsupported_field",
            param="session.tools",
        )
    return rest, {"tools": tuple(specs), "tool_choice": choice}


def parse_call_item(item: Mapping[str, Any], fe: Frontend, session: Session) -> Item:
    """A ``function_call`` or ``function_call_output`` item of ``conversation.item.create``."""
    kind = item["type"]
    if fe.prompts.tool_format is None:
        raise EventError(
            f"item.type {kind!r}: model {fe.model_name!r} takes no tools: {fe.prompts.tool_refusal}",
            code="unsupported_field",
            param="item.type",
        )
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise EventError(f"a {kind} item needs a string field 'call_id'", param="item.call_id")
    given = item.get("id")
    item_id = given if isinstance(given, str) and given else new_id("item")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise EventError("a function_call_output item needs a string field 'output'", param="item.output")
        if not any(i.call is not None and i.call.id == call_id for i in session.conversation.items()):
            raise EventError(
                f"no function_call with call_id {call_id!r} in the conversation", param="item.call_id"
            )
        return Item(id=item_id, role="tool", kind=kind, text=output, call_id=call_id)
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise EventError("a function_call item needs string fields 'name' and 'arguments'", param="item.name")
    return Item(id=item_id, role="assistant", kind=kind, call=ToolCall(call_id, name, arguments))


def tool_prompt(fe: Frontend, settings: RealtimeSettings, session: Session) -> ToolPrompt | None:
    """A response's tools, calls and results (None: no tools, no calls in the conversation)."""
    fmt = fe.prompts.tool_format
    choice = settings.tool_choice or _NO_CALLS
    calls, call_ids = session.conversation.tool_fields(settings.instructions)
    if fmt is None or not (settings.tools or any(calls) or any(call_ids)):
        return None
    if choice.allows_calls and "audio" in settings.modalities and not fe.prompts.voice_skips_tool_calls:
        raise EventError(
            "this pipeline's voice would say the tool calls aloud: a response that may call a tool "
            "answers in text only here; set output_modalities to ['text'], or tool_choice to 'none'",
            param="response.output_modalities",
        )
    return ToolPrompt(
        tools=settings.tools if choice.allows_calls else (),
        calls=calls,
        call_ids=call_ids,
        prefix=fmt.forced_prefix(choice),
    )


class CallRelay:
    """One response's answer text through the model's call parser (the module docstring)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self.items: dict[int, Item] = {}

    async def push(self, session: Session, resp: Response, text: str) -> str:
        """Relay ``text``'s calls; returns its answer text (outside any call)."""
        return await self._relay(session, resp, self._parser.push(text))

    async def finish(self, session: Session, resp: Response) -> str:
        return await self._relay(session, resp, self._parser.finish())

    async def _relay(self, session: Session, resp: Response, events: list[ParserEvent]) -> str:
        text = ""
        for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, CallStarted):
                call = ToolCall(event.call_id, event.name, "")
                item = Item(
                    id=new_id("item"), role="assistant", kind="function_call", status="in_progress", call=call
                )
                self.items[event.index] = item
                resp.calls.append(item)
                added = {"response_id": resp.id, "output_index": len(resp.calls), "item": item.event_item()}
                await session.send("response.output_item.added", added, unless=resp)
                await session.add_item(item, session.conversation.last_id)
            elif isinstance(event, ArgumentsDelta):
                item = self.items[event.index]
                assert item.call is not None
                await session.send(
                    "response.function_call_arguments.delta",
                    {**self._ids(resp, item), "delta": event.delta},
                    unless=resp,
                )
            elif isinstance(event, CallDone):
                item = self.items[event.index]
                item.call, item.status = event.call, "completed"
                done = {**self._ids(resp, item), "name": event.call.name, "arguments": event.call.arguments}
                await session.send("response.function_call_arguments.done", done, unless=resp)
                index = resp.calls.index(item) + 1
                body = {"response_id": resp.id, "output_index": index, "item": item.event_item()}
                await session.send("response.output_item.done", body, unless=resp)
        return text

    @staticmethod
    def _ids(resp: Response, item: Item) -> dict[str, Any]:
        assert item.call is not None
        return {
            "response_id": resp.id,
            "item_id": item.id,
            "output_index": resp.calls.index(item) + 1,
            "call_id": item.call.id,
        }
