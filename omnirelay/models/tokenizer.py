"""Text in and out of the Thinker: the chat prompt and incremental detokenization.

* :func:`format_chat_prompt` / :func:`encode_chat_prompt` — a user message (and an
  optional system message) in the Qwen ChatML form the Thinker and the Talker expect:
  ``<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n``. The Talker finds the
  user turn and the open assistant turn by these tokens, so prompts must use this form.
* :func:`load_tokenizer` — the tokenizer of a stage's ``executor_args`` (the tiny one or
  the checkpoint's), for the front end that turns ``--prompt`` into ids.
* :class:`IncrementalDetokenizer` — the new text of each generated token, without
  splitting a multi-byte character across steps.

Works with any ``transformers`` tokenizer: the tiny byte-level BPE or a real checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "IncrementalDetokenizer",
    "encode_chat_prompt",
    "encode_chat_turns",
    "format_chat_prompt",
    "load_tokenizer",
    "thinker_audio_window",
]

_REPLACEMENT = "\ufffd"


def format_chat_prompt(text: str, *, system: str | None = None) -> str:
    """One user turn (after an optional system turn) and the open assistant turn."""
    parts = []
    if system is not None:
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)


def encode_chat_prompt(tokenizer: Any, text: str, *, system: str | None = None) -> list[int]:
    """Token ids of :func:`format_chat_prompt` (no extra BOS/EOS tokens); a tokenizer with
    a chat template of its own (``chat_ids(messages)``, SmolLM2's) uses that instead."""
    chat_ids = getattr(tokenizer, "chat_ids", None)
    if callable(chat_ids):
        turns = ([("system", system)] if system is not None else []) + [("user", text)]
        return [int(t) for t in chat_ids(turns)]
    ids = tokenizer.encode(format_chat_prompt(text, system=system), add_special_tokens=False)
    return [int(t) for t in ids]


def encode_chat_turns(tokenizer: Any, turns: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of ``(role, text)`` turns and the open assistant turn: the tokenizer's own
    chat template (``chat_ids``, SmolLM2's), else ChatML."""
    chat_ids = getattr(tokenizer, "chat_ids", None)
    if callable(chat_ids):
        return [int(t) for t in chat_ids([(r, t) for r, t in turns])]
    parts = [f"<|im_start|>{'system' if r == 'developer' else r}\n{t}<|im_end|>\n" for r, t in turns]
    text = "".join(parts) + "<|im_start|>assistant\n"
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def load_tokenizer(**executor_args: Any) -> Any:
    """The tokenizer of the checkpoint a stage's ``executor_args`` name (same keys)."""
    from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs

    args = ModelArgs.from_executor_args(executor_args)
    return Checkpoint.open(args.resolve_dir(), load_format=args.load_format).load_tokenizer()


def thinker_audio_window(**executor_args: Any) -> int | None:
    """The audio encoder window (``n_window``) of the Thinker a stage's ``executor_args``
    name, read from its config (None when it has no audio encoder): the front lays out a
    clip's audio tokens with it."""
    from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs

    args = ModelArgs.from_executor_args(executor_args)
    config = Checkpoint.open(args.resolve_dir(), load_format=args.load_format).config
    audio = getattr(config.thinker_config, "audio_config", None)
    window = getattr(audio, "n_window", None)
    return int(window) if window is not None else None


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
