"""One realtime session's conversation: :class:`Conversation`, bounded, oldest items first out.

An item is one message: a user's text or transcribed speech, an assistant's answer (the
text it said, cut where a barge-in or a cancel stopped it), or a system note. A
response's prompt is the session's instructions, then every item's text in order.

Bounds keep a long session's prompt and memory finite: at most ``max_items`` items, at
most ``max_chars`` characters of text and ``max_audio_samples`` of speech in all. Adding an item past either drops
the oldest items (never the one just added) and returns them, so the session can tell
the client (``conversation.item.deleted``, and the count in ``session.updated``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from omnirelay.models.tools import ToolCall

__all__ = ["ROOT", "Conversation", "Item"]

#: ``previous_item_id`` of an item that goes first
ROOT = "root"


@dataclass(slots=True)
class Item:
    """``role``: user, assistant or system; ``kind``: the content type OpenAI names
    (``input_text``, ``input_audio``, ``text``, ``audio``); ``status``: ``completed``,
    ``in_progress`` or ``incomplete`` (an answer that was cut)."""

    id: str
    role: str
    kind: str
    text: str = ""
    status: str = "completed"
    #: the user's committed speech (float32 at the rate pipelines hear), heard again by
    #: each response until the recognizer's transcript of it is known
    audio: Any = field(default=None, repr=False)
    #: the recognizer's transcript of ``audio`` is known (it is ``text``, maybe empty)
    is_heard: bool = False
    #: an assistant's answer: the samples of its audio sent to the client (at the
    #: session's rate), up to where ``conversation.item.truncate`` cut it
    output_samples: int = 0
    #: a ``function_call`` item's call (an assistant's); a ``function_call_output``
    #: item's ``call_id`` (role ``tool``, its ``text`` the output)
    call: ToolCall | None = None
    call_id: str | None = None

    def event_item(self) -> dict[str, Any]:
        """The item as OpenAI's realtime ``item`` object."""
        head = {"id": self.id, "object": "realtime.item", "type": self.kind, "status": self.status}
        if self.call is not None:
            return {**head, "call_id": self.call.id, "name": self.call.name, "arguments": self.call.arguments}
        if self.call_id is not None:
            return {**head, "call_id": self.call_id, "output": self.text}
        part: dict[str, Any] = {"type": self.kind}
        if self.kind in ("input_text", "text"):
            part["text"] = self.text
        elif self.kind == "input_audio":  # heard inside the pipeline: no transcript here
            part["transcript"] = self.text or None
        else:
            part["transcript"] = self.text if self.text or self.status != "in_progress" else None
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [part],
        }


class Conversation:
    """See the module docstring."""

    def __init__(self, max_items: int, max_chars: int, *, max_audio_samples: int | None = None) -> None:
        self.max_items = max_items
        self.max_chars = max_chars
        self.max_audio_samples = max_audio_samples
        self._items: OrderedDict[str, Item] = OrderedDict()
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    @property
    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def get(self, item_id: str) -> Item | None:
        return self._items.get(item_id)

    def add(self, item: Item, previous: str | None = None) -> list[Item]:
        """Add ``item`` after the item ``previous`` (None: at the end; :data:`ROOT`: first);
        returns the items dropped to stay within the bounds."""
        self._items[item.id] = item
        if previous is not None:
            keys = list(self._items)
            after = 0 if previous == ROOT else keys.index(previous) + 1
            for key in keys[after:-1]:
                self._items.move_to_end(key)
        return self.trim(keep=item.id)

    def remove(self, item_id: str) -> Item | None:
        return self._items.pop(item_id, None)

    def trim(self, keep: str | None = None) -> list[Item]:
        """Drop the oldest items but ``keep`` until the bounds hold (an item's text may have grown)."""
        dropped: list[Item] = []
        while len(self._items) > 1 and (len(self._items) > self.max_items or self.num_chars > self.max_chars):
            oldest = iter(self._items)
            key = next(oldest)
            dropped.append(self._items.pop(next(oldest) if key == keep else key))
        self.num_dropped += len(dropped)
        return dropped

    @property
    def num_chars(self) -> int:
        return sum(len(item.text) for item in self._items.values())

    @property
    def num_audio_samples(self) -> int:
        return sum(int(item.audio.size) for item in self._items.values() if item.audio is not None)

    @property
    def has_user_turn(self) -> bool:
        return any(
            item.role == "user" and (item.text or item.audio is not None) for item in self._items.values()
        )

    def items(self) -> list[Item]:
        return list(self._items.values())

    def _entries(self, instructions: str) -> list[tuple[str, list[Any], list[ToolCall], str | None]]:
        """The prompt's turns with their tool fields: ``(role, parts, calls, call_id)``; an
        assistant's calls join its turn (the message before them in the same answer)."""
        out: list[tuple[str, list[Any], list[ToolCall], str | None]] = []
        if instructions:
            out.append(("system", [instructions], [], None))
        for item in self._items.values():
            if item.call is not None:
                if item.status != "completed":
                    continue  # cut before its end
                if out and out[-1][0] == "assistant":
                    out[-1][2].append(item.call)
                else:
                    out.append(("assistant", [""], [item.call], None))
            elif item.call_id is not None:
                out.append(("tool", [item.text], [], item.call_id))
            elif item.audio is not None and not item.is_heard:
                out.append((item.role, [item.audio], [], None))
            elif item.text:
                out.append((item.role, [item.text], [], None))
        return out

    def turns(self, instructions: str) -> list[tuple[str, list[Any]]]:
        """The prompt's turns as chat input takes them (:mod:`omnirelay.serving.media.chat_turns`):
        ``(role, [text | clip])``; a user's speech is its clip until it has a transcript."""
        return [(role, parts) for role, parts, _, _ in self._entries(instructions)]

    def tool_fields(
        self, instructions: str
    ) -> tuple[tuple[tuple[ToolCall, ...], ...], tuple[str | None, ...]]:
        """Each turn's calls and answered call id, beside :meth:`turns`."""
        entries = self._entries(instructions)
        return tuple(tuple(c) for _, _, c, _ in entries), tuple(i for _, _, _, i in entries)

    def unheard(self) -> list[Item]:
        """The speech items without a transcript yet, in the order :meth:`turns` gives their
        clips (the recognizer's transcripts come back in that order)."""
        return [item for item in self._items.values() if item.audio is not None and not item.is_heard]

    def messages(self, instructions: str) -> list[tuple[str, str]]:
        """``(role, text)`` turns of a prompt: the instructions, then each item with text."""
        turns = [("system", instructions)] if instructions else []
        turns += [(item.role, item.text) for item in self._items.values() if item.text]
        return turns

    def window(self) -> dict[str, Any]:
        """The bounds and what they dropped so far (``session.conversation``, an omnirelay
        extension of the session object)."""
        return {
            "max_items": self.max_items,
            "max_chars": self.max_chars,
            "num_items": len(self._items),
            "num_dropped_items": self.num_dropped,
        }
