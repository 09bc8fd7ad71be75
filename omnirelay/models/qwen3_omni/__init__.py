"""Qwen3-Omni: the Thinker, the Talker and Code2Wav on ``transformers``, their checkpoint
loader, the tiny and dummy builds, and the Thinker's audio and vision input."""
