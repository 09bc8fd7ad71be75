"""The conversation's items as a client edits them: ``conversation.item.create``,
``.truncate``, ``.delete`` and ``.retrieve``.

An interruption, as the agent frameworks make one: the user speaks over an answer, the
server cancels it (barge-in), and the client says how much of it was played with
``conversation.item.truncate`` {``item_id``, ``content_index``, ``audio_end_ms``}. The
answer's item then holds only what the user heard: its audio ends at ``audio_end_ms``
and its transcript where that audio got to, back to a word boundary, so the next turn's
prompt holds only that. Where the transcript gets to is estimated from the audio: at
the same fraction of the transcript as ``audio_end_ms`` is of the answer's audio when
the answer was spoken whole, or at :data:`CHARS_PER_S` when it was cut (its text ran
ahead of its audio).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omnirelay.serving.errors import ApiError
from omnirelay.serving.realtime.conversation import ROOT, Item
from omnirelay.serving.realtime.events import EventError, new_id, parse_text_item
from omnirelay.serving.realtime.tools import parse_call_item

if TYPE_CHECKING:
    from omnirelay.serving.realtime.session import Session

__all__ = ["CHARS_PER_S", "create", "cut_transcript", "delete", "retrieve", "truncate"]

#: the speaking rate (characters of English text a second) a cut answer is read at
CHARS_PER_S = 15.0


def _item_id(event: Mapping[str, Any]) -> str:
    item_id = event.get("item_id")
    if not isinstance(item_id, str) or not item_id:
        raise EventError(f"{event['type']} needs a string field 'item_id'", param="item_id")
    return item_id


def _existing(session: Session, event: Mapping[str, Any]) -> Item:
    item_id = _item_id(event)
    item = session.conversation.get(item_id)
    if item is None:
        raise EventError(
            f"there is no item {item_id!r} in the conversation", code="item_not_found", param="item_id"
        )
    return item


async def create(session: Session, event: Mapping[str, Any]) -> None:
    """A text message, a tool call or a call's output, after ``previous_item_id`` (an
    item's id, ``root``: first; absent: last)."""
    conversation = session.conversation
    previous = event.get("previous_item_id")
    raw = event.get("item")
    if isinstance(raw, dict) and raw.get("type") in ("function_call", "function_call_output"):
        call_item = parse_call_item(raw, session.fe, session)
        if call_item.id in conversation:
            raise EventError(f"an item with id {call_item.id!r} already exists", param="item.id")
        await session.add_item(call_item, conversation.last_id)
        return
    item_id, role, text = parse_text_item(event)
    if previous is not None and previous != ROOT and previous not in conversation:
        raise EventError(
            f"previous_item_id {str(previous)[:64]!r} is not an item of the conversation (nor 'root')",
            code="item_not_found",
            param="previous_item_id",
        )
    if item_id is not None and item_id in conversation:
        raise EventError(f"an item with id {item_id!r} already exists", param="item.id")
    try:
        session.fe.check_text(text, "item.content[0].text")
    except ApiError as exc:
        raise EventError(exc.message, code="input_too_long", param=exc.param) from exc
    kind = "text" if role == "assistant" else "input_text"
    item = Item(id=item_id or new_id("item"), role=role, kind=kind, text=text)
    said = conversation.last_id if previous is None else None if previous == ROOT else previous
    await session.add_item(item, said, after=previous)


def cut_transcript(text: str, end_ms: int, audio_ms: int, *, whole: bool) -> str:
    """The part of ``text`` said in the first ``end_ms`` of its ``audio_ms`` of audio
    (``whole``: the audio says all of ``text``), back to a word boundary."""
    if end_ms >= audio_ms and whole:
        return text
    if whole:
        n = round(len(text) * end_ms / max(audio_ms, 1))
    else:
        n = min(len(text), round(end_ms * CHARS_PER_S / 1000))
    if n >= len(text):
        return text
    if n < len(text) and not text[n].isspace():
        n = text.rfind(" ", 0, n) + 1  # the word under the cut was not finished
    return text[:n].rstrip()


async def truncate(session: Session, event: Mapping[str, Any]) -> None:
    """``conversation.item.truncate``: an answer heard up to ``audio_end_ms`` (see the module
    docstring); one still being said is cancelled first."""
    item = _existing(session, event)
    if item.role != "assistant" or item.kind != "audio":
        raise EventError("only an assistant's audio item can be truncated", param="item_id")
    content_index = event.get("content_index", 0)
    if content_index != 0:
        raise EventError("content_index must be 0 (an answer has one audio part)", param="content_index")
    end_ms = event.get("audio_end_ms")
    if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
        raise EventError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
    current = session.runner.current
    if current is not None and current.item is item:
        await session.runner.cancel("client_cancelled")
    audio_ms = session.ms(item.output_samples)
    if end_ms > audio_ms:
        raise EventError(
            f"audio_end_ms {end_ms} is past the item's audio ({audio_ms} ms)", param="audio_end_ms"
        )
    item.text = cut_transcript(item.text, end_ms, audio_ms, whole=item.status == "completed")
    item.output_samples = min(item.output_samples, round(end_ms * session.rate / 1000))
    await session.send(
        "conversation.item.truncated", {"item_id": item.id, "content_index": 0, "audio_end_ms": end_ms}
    )


async def delete(session: Session, event: Mapping[str, Any]) -> None:
    item = _existing(session, event)
    current = session.runner.current
    if current is not None and current.item is item:
        raise EventError(
            f"item {item.id!r} is the answer in progress; cancel the response first", param="item_id"
        )
    session.conversation.remove(item.id)
    await session.send("conversation.item.deleted", {"item_id": item.id})


async def retrieve(session: Session, event: Mapping[str, Any]) -> None:
    item = _existing(session, event)
    await session.send("conversation.item.retrieved", {"item": item.event_item()})
