"""Qwen3-TTS: the Talker with its code predictor, and the 12 Hz tokenizer's decoder as Code2Wav.

One file per role:

* ``config`` — the checkpoint's two configs as typed values (:class:`TTSConfig`,
  :class:`CodecConfig`);
* ``layers`` / ``talker_model`` / ``codec`` — the architecture in ``torch``, with the
  checkpoint's parameter names (equal to the reference ``qwen-tts`` forward:
  ``tests/test_qwen3_tts_reference.py``);
* ``conditioning`` — a request's prefill and per-frame text rows (speaker, language,
  instruction);
* ``seeded`` — weights drawn by parameter name (the tiny model, ``load_format: dummy``,
  the reference fixtures).
"""

from __future__ import annotations

from omnirelay.models.qwen3_tts.config import CodecConfig, TTSConfig

__all__ = ["CodecConfig", "TTSConfig"]
