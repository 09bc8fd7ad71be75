"""The tiny Qwen3-TTS: the real layout at toy widths, with seeded weights, built in memory.

What is tiny and what is not: every transformer is one or two layers of width 32–64,
but the codec layout is the released one — 16 codebooks of 2048 codes, the codec special
ids (EOS 2150), the nine CustomVoice speakers and their dialects, the languages, and the
decoder's up-sampling to 1920 samples per frame (80 ms at 24 kHz) — so processors, stop
ids and chunk schedules see the numbers of the real model. The Talker's code predictor is
narrower than the Talker (the 1.7B's ``small_to_mtp_projection``), and the Talker takes
instructions (a 1.7B CustomVoice); ``model`` picks another released variant at the same
widths (``0.6b-customvoice``: no instructions, no projection). The text vocabulary is bytes plus the chat and TTS
special tokens (:func:`tiny_tokenizer`).

Nothing is cached on disk: weights are drawn by parameter name
(:mod:`omnirelay.models.qwen3_tts.seeded`) in a fraction of a second; the decoder's last
convolution is then scaled so that its output is audible noise (std :data:`TINY_AUDIO_STD`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from omnirelay.models.qwen3_tts.codec import TTSCodec

__all__ = [
    "TINY_AUDIO_STD",
    "scale_codec_output",
    "tiny_codec_config",
    "tiny_tokenizer",
    "tiny_tts_config",
]

#: Standard deviation of the tiny decoder's output on random codes (before the ±1 clamp).
TINY_AUDIO_STD = 0.1

_SHIPPED = Path(__file__).with_name("configs")
#: Text ids of the tiny vocabulary past the 256 bytes.
_TEXT_IDS = {
    "im_start_token_id": 256,
    "im_end_token_id": 257,
    "tts_pad_token_id": 258,
    "tts_bos_token_id": 259,
    "tts_eos_token_id": 260,
    "system_token_id": 261,
    "user_token_id": 262,
    "assistant_token_id": 263,
}


def tiny_tts_config(model: str = "1.7b-customvoice") -> dict[str, Any]:
    """``config.json`` of the tiny model: the shipped ``model`` (its variant, speakers and
    whether it takes instructions) at toy widths; a 0.6B keeps its code predictor as wide
    as its Talker (no projection), a 1.7B a narrower one."""
    from omnirelay.models.qwen3_tts.loader import SHIPPED_MODELS

    full = json.loads((_SHIPPED / SHIPPED_MODELS[model]).read_text())
    talker = copy.deepcopy(full["talker_config"])
    talker.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_scaling={"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
        max_position_embeddings=4096,
        text_hidden_size=48,
        text_vocab_size=max(_TEXT_IDS.values()) + 1,
    )
    talker["code_predictor_config"].update(
        hidden_size=32 if full["tts_model_size"] == "1b7" else 64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    return {**full, **_TEXT_IDS, "torch_dtype": "float32", "talker_config": talker}


def tiny_codec_config() -> dict[str, Any]:
    """``speech_tokenizer/config.json`` of the tiny model: the released up-sampling at toy widths."""
    full = json.loads((_SHIPPED / "qwen3-tts-tokenizer-12hz.json").read_text())
    decoder = dict(full["decoder_config"])
    decoder.update(
        codebook_dim=32,
        hidden_size=32,
        latent_dim=32,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        sliding_window=8,
        decoder_dim=64,
    )
    return {**full, "torch_dtype": "float32", "decoder_config": decoder}


def tiny_tokenizer() -> Any:
    """Bytes 0..255 and the chat/TTS specials and role words at the tiny config's ids."""
    from omnirelay.models.hf import dummy_tokenizer

    return dummy_tokenizer(_TEXT_IDS)


def scale_codec_output(codec: TTSCodec, *, std: float = TINY_AUDIO_STD, seed: int = 0) -> None:
    """Scale the decoder's last convolution so random codes decode to noise of ``std``."""
    config = codec.config
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, int(config.codebook_size), (1, int(config.num_quantizers), 8), generator=gen)
    last: Any = codec.decoder[-1]
    last = last.conv
    device = last.weight.device
    with torch.inference_mode():
        measured = float(codec(codes.to(device)).float().std())
        if measured > 0:
            last.weight.mul_(std / measured)
            last.bias.mul_(std / measured)
