"""Incremental detokenization, shared by the text models of every family.

:class:`IncrementalDetokenizer` — the new text of each generated token, without
splitting a multi-byte character across steps. Works with any tokenizer that has
``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)``: a
``transformers`` tokenizer (the tiny byte-level BPE or a real checkpoint's) or
SmolLM2's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing list of generated ids.

    Decodes a short window of recent ids rather than the whole output each step, and
    holds back a delta that ends in a partial UTF-8 character (shown as U+FFFD) until
    the next token completes it. Special tokens are skipped. ``context`` (the ids before
    the first generated one, e.g. the prompt) is never emitted; its last few ids only
    give the first delta its left context (a leading space, a completed character).
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_tokenizer")

    #: Ids of left context kept for decoding the first delta.
    CONTEXT_IDS = 6

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = [int(t) for t in list(context)[-self.CONTEXT_IDS :]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append newly generated ids; return the text they complete (may be empty)."""
        self._ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of the request)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
