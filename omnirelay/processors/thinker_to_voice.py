"""Thinker → voice: the text edge. A chunk is one sentence (or clause) as soon as it is complete.

* :class:`TextChunk` — the typed payload of the edge (registered with the payload codec):
  ``text`` (one sentence or clause, as written) and ``index`` (its position in the
  request's answer: the voice seeds the sentence's noise with it).
* :func:`split_ready` — complete sentences at the front of a growing text, and the rest;
  :func:`split_sentences` — all of a finished text's sentences. Cutting a text as it
  grows gives the same pieces as cutting it whole: a cut depends only on the text up to
  one character past the boundary, never on how the text arrived.
* :class:`ThinkerToVoiceStage` — the Thinker stage's chunk processor (registered as
  ``thinker_to_voice``): per request it appends each step's text delta and sends a
  :class:`TextChunk` per completed piece; the last step flushes the rest.

Where a text is cut: after ``. ! ?`` (and a newline) followed by white space, unless the
word before a period is an abbreviation (``Dr.``, ``e.g.``) or a single letter (``U.S.``);
after ``, ; :`` once the piece has at least :data:`MIN_CLAUSE_WORDS` words (a short clause
sounds choppy alone); and at the last space before :data:`MAX_PIECE_CHARS` characters
when nothing else cuts (a run-on answer still streams).

A step may complete two pieces at once; they travel in one chunk (the adapter puts at
most one payload per step), joined by a space, under the first one's index: the voice
cuts a chunk's text again with :func:`split_sentences`, which gives back the same pieces.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import msgspec

from omnirelay.errors import PayloadEncodeError
from omnirelay.payload.schema import register_struct
from omnirelay.pipeline import PipelineConfig, StageConfig
from omnirelay.processors.base import check_chunk_id
from omnirelay.transfer import BuildRequest, ReleaseScope

__all__ = [
    "MAX_PIECE_CHARS",
    "MIN_CLAUSE_WORDS",
    "TextChunk",
    "ThinkerToVoiceStage",
    "split_ready",
    "split_sentences",
]

MIN_CLAUSE_WORDS = 6
MAX_PIECE_CHARS = 240
_PROCESSOR = "thinker_to_voice"
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "approx", "no"})
_BOUNDARY = re.compile(r"[.!?…]+[\"')\]]*(?=\s)|\n|[,;:](?=\s)")


class TextChunk(msgspec.Struct, kw_only=True, frozen=True):
    """One piece of the answer's text for the voice (see the module docstring)."""

    text: str
    index: int


register_struct(TextChunk)


def _is_abbreviation(text: str, end: int) -> bool:
    """Does the period ending at ``text[end - 1]`` close an abbreviation or an initial?"""
    m = re.search(r"(\S+?)\.+$", text[:end])
    word = m.group(1).lstrip("(\"'").lower() if m else ""
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or "." in word


def split_ready(text: str, *, final: bool) -> tuple[list[str], str]:
    """``(complete pieces, the rest)`` of ``text``; with ``final`` the rest is a piece too."""
    pieces: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end()
        piece = text[start:end]
        mark = m.group()[0]
        if mark == "." and _is_abbreviation(text, end):
            continue
        if mark in ",;:" and len(piece.split()) < MIN_CLAUSE_WORDS:
            continue
        if piece.strip():
            pieces.append(piece.strip())
        start = end
    rest = text[start:]
    while len(rest) > MAX_PIECE_CHARS:
        cut = rest.rfind(" ", 0, MAX_PIECE_CHARS)
        if cut <= 0:
            cut = MAX_PIECE_CHARS
        pieces.append(rest[:cut].strip())
        rest = rest[cut:]
    if final:
        if rest.strip():
            pieces.append(rest.strip())
        rest = ""
    return pieces, rest


def split_sentences(text: str) -> list[str]:
    """Every piece of a finished text, as the stream would have cut it."""
    return split_ready(text, final=True)[0]


class _Stream:
    """One request's pending text and how many pieces and payloads it sent."""

    __slots__ = ("num_built", "num_pieces", "pending")

    def __init__(self) -> None:
        self.pending = ""
        self.num_pieces = 0
        self.num_built = 0


class ThinkerToVoiceStage:
    """The Thinker stage's chunk processor; see the module docstring.

    The step output is the Thinker executor's ``next_stage_output``: the step's text
    delta (a ``str``; ``None`` or ``""`` when the step added no text).
    """

    def __init__(self, stage: StageConfig, pipeline: PipelineConfig) -> None:
        self.stage_id = stage.id
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}

    def build(self, req: BuildRequest) -> TextChunk | None:
        delta = req.output
        if delta is not None and not isinstance(delta, str):
            raise PayloadEncodeError(
                f"{_PROCESSOR}: stage {self.stage_id} step output must be the text delta (str), "
                f"got {type(delta).__name__}"
            )
        with self._lock:
            stream = self._streams.setdefault(req.external_id, _Stream())
        check_chunk_id(req.chunk_id, stream.num_built, processor=_PROCESSOR)
        stream.pending += delta or ""
        pieces, stream.pending = split_ready(stream.pending, final=req.is_finished)
        if not pieces:
            return None
        chunk = TextChunk(text=" ".join(pieces), index=stream.num_pieces)
        stream.num_pieces += len(pieces)
        stream.num_built += 1
        return chunk

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        with self._lock:
            self._streams.pop(external_id, None)

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            return {"thinker_to_voice_streams": sorted(self._streams)} if self._streams else {}


def register_voice_processors(processors: Any, *, replace: bool = False) -> Any:
    """Register ``thinker_to_voice`` in a processor :class:`~omnirelay.pipeline.Registry`."""
    processors.add(_PROCESSOR, ThinkerToVoiceStage, replace=replace)
    return processors
