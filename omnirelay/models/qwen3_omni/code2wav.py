"""The Qwen3-Omni Code2Wav stage: the checkpoint's Code2Wav behind the shared executor.

The executor is :class:`~omnirelay.models.code2wav.Code2WavExecutor` (codec frames →
24 kHz waveform; streamed, windowed and complete decodes); what is Qwen3-Omni's is the
model, ``Qwen3OmniMoeCode2Wav`` loaded from the checkpoint, and how a stage's
``executor_args`` choose CUDA graphs and the streams' state.

* :func:`open_code2wav` — the executor of a checkpoint's Code2Wav.
* :func:`create_code2wav` — the registry factory: ``create_code2wav(**executor_args)``.
"""

from __future__ import annotations

from typing import Any

from omnirelay.models.code2wav import Code2WavExecutor
from omnirelay.models.qwen3_omni.loader import DEFAULT_SLOTS, Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.runner.vocoder import stream_compile_backend

__all__ = ["create_code2wav", "open_code2wav"]


def open_code2wav(checkpoint: Checkpoint, args: ModelArgs | None = None) -> Code2WavExecutor:
    """The executor of ``checkpoint``'s Code2Wav. ``args``: CUDA graphs unless
    ``cuda_graphs: false`` or ``runner: dynamic``; streams keep their decoder state unless
    ``stateful: false`` (up to ``max_num_seqs`` streams at once)."""
    graphs = args is not None and args.cuda_graphs and args.runner != "dynamic"
    return Code2WavExecutor(
        checkpoint.load_code2wav(),
        cuda_graphs=graphs and checkpoint.device.type == "cuda",
        stateful=args.stateful if args is not None else True,
        max_streams=args.num_slots if args is not None else DEFAULT_SLOTS,
        compile=stream_compile_backend(graphs and checkpoint.device.type == "cuda"),
    )


def create_code2wav(**executor_args: Any) -> Code2WavExecutor:
    """Registry factory of ``qwen3_omni.code2wav`` (keys: see :class:`ModelArgs`)."""
    args = ModelArgs.from_executor_args(executor_args)
    return open_code2wav(open_checkpoint(args), args)
