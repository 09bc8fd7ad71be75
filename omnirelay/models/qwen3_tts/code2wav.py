"""The Qwen3-TTS Code2Wav stage: the 12 Hz tokenizer's decoder behind the shared Code2Wav executor.

The executor is :class:`~omnirelay.models.code2wav.Code2WavExecutor` unchanged — it
takes any causal codec decoder with the same interface (``[B, Q, T]`` codes →
``[B, 1, samples]``, ``config.num_quantizers``, ``config.codebook_size``,
``total_upsample``): streamed chunks decode with each stream's state
(:class:`~omnirelay.models.runner.vocoder.StreamingVocoder`, which knows this decoder's
layout), windows and complete inputs replay from CUDA graphs on a GPU. What is
Qwen3-TTS's is the model: :class:`~omnirelay.models.qwen3_tts.codec.TTSCodec`, fully
causal, so a window holds nothing back (``codec_holdback_ms: 0`` on its edge) and one
frame is 1920 samples (``codec_frame_ms: 80``).
"""

from __future__ import annotations

from typing import Any

import torch

from omnirelay.models.code2wav import Code2WavExecutor
from omnirelay.models.qwen3_tts import SAMPLE_RATE
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner.vocoder import stream_compile_backend

__all__ = ["create_code2wav"]


def create_code2wav(**executor_args: Any) -> Code2WavExecutor:
    """Registry factory of ``qwen3_tts.code2wav`` (keys: :class:`TTSModelArgs`; up to
    ``max_num_seqs`` streams keep their decoder state unless ``stateful: false``)."""
    args = TTSModelArgs.from_executor_args(executor_args)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    codec = TTSCheckpoint.open(args).load_codec()
    graphs = args.uses_cuda_graphs()
    return Code2WavExecutor(
        codec,
        cuda_graphs=graphs,
        stateful=args.stateful,
        max_streams=args.max_num_seqs,
        sample_rate=SAMPLE_RATE,
        compile=stream_compile_backend(graphs),
    )
