"""Helpers around Hugging Face ``transformers`` and ``tokenizers`` that several families use.

* :func:`quiet_transformers` — ``transformers``' logging and progress bars silenced for
  the duration of a load.
* :func:`dummy_tokenizer` — a byte-level tokenizer whose chat and TTS special tokens
  carry a config's ids, for a model that has no tokenizer files (``load_format: dummy``,
  the tiny builds): prompts encode, the Talker finds the turns, generated ids decode (as
  bytes).

Both libraries are imported when a function is called, not on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from omnirelay.errors import ModelError

__all__ = ["dummy_tokenizer", "quiet_transformers"]

#: Special tokens of a Qwen chat tokenizer (Qwen3-Omni's, Qwen3-TTS's) and where the
#: config names their ids.
_SPECIAL_IDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("<|im_start|>", ("im_start_token_id",)),
    ("<|im_end|>", ("im_end_token_id",)),
    ("<|tts_bos|>", ("tts_bos_token_id",)),
    ("<|tts_eos|>", ("tts_eos_token_id",)),
    ("<|tts_pad|>", ("tts_pad_token_id",)),
    ("<|audio_start|>", ("thinker_config", "audio_start_token_id")),
    ("<|audio_pad|>", ("thinker_config", "audio_token_id")),
    ("<|image_pad|>", ("thinker_config", "image_token_id")),
    ("<|video_pad|>", ("thinker_config", "video_token_id")),
)
_ROLE_IDS: tuple[tuple[str, str], ...] = (
    ("system", "system_token_id"),
    ("user", "user_token_id"),
    ("assistant", "assistant_token_id"),
)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence ``transformers`` logging and progress bars for the duration (restored after).

    Loading one stage's part from a full checkpoint reports every other part's weights as
    "unexpected"; that report, the progress bars and config notes are noise here.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def dummy_tokenizer(config: Any) -> Any:
    """A byte-level tokenizer for ``config`` (a ``Qwen3OmniMoeConfig``, or a dict of the
    same keys): bytes are ids 0..255, the role words and the chat/TTS special tokens have
    the config's ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise ModelError("this tokenizers release maps bytes differently; cannot build the dummy tokenizer")
    vocab = {symbol: b for b, symbol in enumerate(symbols)}
    specials, roles = {}, {}
    for token, path in _SPECIAL_IDS:
        value = _config_value(config, path)
        if value is not None:
            specials[token] = value
    for word, key in _ROLE_IDS:
        value = _config_value(config, (key,))
        if value is not None:
            roles[word] = value
    for name in ("<|im_start|>", "<|im_end|>"):
        if name not in specials:
            raise ModelError(f"the config names no id for {name}; it is not a Qwen chat config")
    taken = {**vocab, **specials, **roles}
    if len(set(taken.values())) != len(taken):
        raise ModelError("the config's special token ids collide with each other or with the byte ids 0..255")
    tok = Tokenizer(models.BPE(vocab=taken, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(w, normalized=False) for w in roles])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", model_max_length=65536)


def _config_value(config: Any, path: tuple[str, ...]) -> int | None:
    value = config
    for key in path:
        value = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        if value is None:
            return None
    return int(value)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes 0..255, in byte order
    (printable Latin-1 bytes stand for themselves, the rest map to U+0100 onwards)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols
