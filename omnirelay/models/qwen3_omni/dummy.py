"""``load_format: dummy``: a model built from its configuration alone, with random weights.

* :data:`FULL_SIZE_CONFIG` — the shipped configuration of Qwen3-Omni-30B-A3B (the
  checkpoint's own values; the library's ``Qwen3OmniMoeConfig()`` defaults are not that
  model). A stage with ``load_format: dummy`` and no ``model_dir``/``tiny`` builds this.
* :func:`build_part` — one part (Thinker, Talker, Code2Wav) of a config, allocated
  directly on the target device in the target dtype, every tensor initialized.
* :func:`dummy_tokenizer` — a byte-level tokenizer whose chat and TTS special tokens
  carry the config's ids, for a model that has no tokenizer files: prompts encode, the
  Talker finds the turns, generated ids decode (as bytes).

Why re-draw weights after the library's initializer: its ``_init_weights`` does not know
some parameter blocks (the Talker's routers and experts, the Thinker text model's down
projections in some releases), which keep whatever ``torch.empty`` left in memory — on a
GPU often zeros, so every token routes to the same experts and the timing of a dummy model
says nothing about the real one. Every MoE router and experts block is drawn again here
from the seeded generator (normal, ``initializer_range``). The vocoder gets variance-
preserving convolutions so that its output is audible noise, not 1e-7 (see
:func:`omnirelay.models.qwen3_omni.tiny.scale_code2wav`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ModelError

__all__ = [
    "FULL_SIZE_CONFIG",
    "DummyBuild",
    "build_part",
    "dummy_tokenizer",
    "redraw_moe",
]

#: The shipped Qwen3-Omni-30B-A3B configuration (a checkpoint's ``config.json``).
FULL_SIZE_CONFIG = Path(__file__).with_name("configs") / "qwen3-omni-30b-a3b.json"

#: Special tokens of a Qwen3-Omni tokenizer and where the config names their ids.
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


class DummyBuild:
    """What one dummy build took (for the stage's startup report)."""

    def __init__(self, part: str, seconds: float, num_params: int) -> None:
        self.part = part
        self.seconds = seconds
        self.num_params = num_params

    def __repr__(self) -> str:
        return f"{self.part}: {self.num_params / 1e9:.2f}B parameters in {self.seconds:.1f} s"


def redraw_moe(model: torch.nn.Module, std: float, generator: torch.Generator | None = None) -> int:
    """Draw every MoE router and experts block of ``model`` again (normal 0, ``std``);
    the number of tensors drawn."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("Experts") or name.endswith("TopKRouter"):
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std, generator=generator)
                    count += 1
    return count


def build_part(
    cls: Any, config: Any, *, part: str, device: torch.device, dtype: torch.dtype, seed: int
) -> Any:
    """``cls`` (a ``transformers`` model class) from ``config`` with random weights,
    allocated on ``device`` in ``dtype``; eval mode, no gradients. Deterministic for a
    seed, device and library version."""
    from omnirelay.models.qwen3_omni.tiny import quiet_transformers, scale_code2wav

    start = time.monotonic()
    with quiet_transformers(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        try:
            with device:
                model = cls._from_config(config, dtype=dtype)
        except torch.OutOfMemoryError as exc:
            raise ModelError(f"the {part} does not fit on {device}: {exc}") from exc
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        redraw_moe(model, float(getattr(config, "initializer_range", 0.02)), generator)
        if part == "code2wav":
            scale_code2wav(model)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    num_params = sum(p.numel() for p in model.parameters())
    model.omnirelay_build = DummyBuild(part, time.monotonic() - start, num_params)
    return model


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


def dummy_tokenizer(config: Any) -> Any:
    """A byte-level tokenizer for ``config`` (a ``Qwen3OmniMoeConfig`` or its dict): bytes
    are ids 0..255, the role words and the chat/TTS special tokens have the config's ids."""
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
            raise ModelError(f"the config names no id for {name}; it is not a Qwen3-Omni config")
    taken = {**vocab, **specials, **roles}
    if len(set(taken.values())) != len(taken):
        raise ModelError("the config's special token ids collide with each other or with the byte ids 0..255")
    tok = Tokenizer(models.BPE(vocab=taken, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(w, normalized=False) for w in roles])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", model_max_length=65536)
