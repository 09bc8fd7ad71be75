"""``asr.pocketsphinx``: speech recognition in front of a Thinker (docs/protocol.md §1.9).

The stage declared ``entry_input: audio``: a request that carries audio enters here with
its clips as the full input (:mod:`omnirelay.models.qwen3_omni.audio`: 16 kHz mono float32), and
leaves with one step — its text is the transcript of each clip, one line per clip, in
order — which the orchestrator forwards complete to the prompt stage (the
``asr_to_thinker`` input builder makes the transcripts the user's words). Requests
without audio never reach this stage. A request whose ``inputs`` also say
``"word_timestamps": True`` (a transcription, which ends here) gets its words timed
instead: the text is the JSON list of :func:`timed_transcripts`, one entry per clip.

PocketSphinx's bundled US English acoustic model, dictionary and language model
(:class:`~omnirelay.models.asr.sphinx.Recognizer`); lower-case words, no punctuation.
Each clip is heard on its own, its speech cut from the background around it and put
between fixed silence (:mod:`omnirelay.models.asr.speech_span`), so a clip is heard the
same whichever endpoint it came from — a chat ``input_audio`` part, a transcription's
file, a realtime turn (the server VAD's segment of the same recording) — and whatever
the stage heard before; a clip with no speech is heard as nothing (an empty line).
Recognition runs on the engine thread, one clip at a time: a clip costs about a fifth of
its duration on one core.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.asr import RECOGNIZER_EXECUTOR
from omnirelay.models.asr.sphinx import Recognizer
from omnirelay.models.inputs import AUDIO_INPUT_RATE, read_audio_inputs

__all__ = [
    "RECOGNIZER_EXECUTOR",
    "WORD_TIMESTAMPS",
    "SphinxRecognizerExecutor",
    "create_sphinx_recognizer",
    "timed_transcripts",
]

#: The ``inputs`` key of a request that wants its recognized words timed.
WORD_TIMESTAMPS = "word_timestamps"


def timed_transcripts(clips: Sequence[Sequence[tuple[str, int, int]]]) -> str:
    """Each clip's ``(word, start_ms, end_ms)`` as the recognizer's text of a timed request:
    ``[{"text": "what is it", "words": [{"word": "what", "start_ms": 120, "end_ms": 300}, …]}, …]``."""
    return json.dumps(
        [
            {
                "text": " ".join(w for w, _, _ in words),
                "words": [{"word": w, "start_ms": int(a), "end_ms": int(b)} for w, a, b in words],
            }
            for words in clips
        ],
        separators=(",", ":"),
    )


class SphinxRecognizerExecutor:
    """A generation executor: one step per request, its complete audio in, its transcript out."""

    execution_type = "generation"
    supports_batching = True

    def __init__(self, recognizer: Recognizer | None = None) -> None:
        self.recognizer = recognizer or Recognizer()
        #: clips recognized so far (observable in tests)
        self.num_clips = 0

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        return [self._recognize(item) for item in batch]

    def _recognize(self, item: BatchItem) -> ItemResult:
        who = f"request {item.external_id!r}"
        clips = read_audio_inputs(item.inputs, who)
        if not clips:
            raise ModelError(
                f"{who}: the recognizer needs the request's audio "
                f"(inputs {{'audio': [clips], 'sample_rate': {AUDIO_INPUT_RATE}}})"
            )
        self.num_clips += len(clips)
        if isinstance(item.inputs, Mapping) and item.inputs.get(WORD_TIMESTAMPS) is True:
            timed = [self.recognizer.transcribe(clip.numpy(), AUDIO_INPUT_RATE) for clip in clips]
            return ItemResult(internal_id=item.internal_id, finished=True, text=timed_transcripts(timed))
        lines = [" ".join(self.recognizer.words(clip.numpy(), AUDIO_INPUT_RATE)) for clip in clips]
        return ItemResult(internal_id=item.internal_id, finished=True, text="\n".join(lines))

    def release(self, internal_id: str) -> None:
        """Nothing is kept between steps."""

    def num_live_requests(self) -> int:
        return 0

    def leak_state(self) -> dict[str, Any]:
        return {}


def create_sphinx_recognizer(**executor_args: Any) -> SphinxRecognizerExecutor:
    """Registry factory of ``asr.pocketsphinx`` (``device``: ``cpu`` only)."""
    unknown = set(executor_args) - {"device"}
    if unknown:
        raise ModelError(f"{RECOGNIZER_EXECUTOR}: unknown executor_args {sorted(unknown)}")
    if executor_args.get("device", "cpu") not in (None, "cpu"):
        raise ModelError(f"{RECOGNIZER_EXECUTOR} runs on the CPU")
    return SphinxRecognizerExecutor()
