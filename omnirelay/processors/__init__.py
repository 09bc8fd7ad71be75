"""omnirelay.processors: what the next stage should see (docs/protocol.md §5, §6).

One file per role:

* ``base`` — :func:`check_chunk_id`, shared by the chunk processors. Every processor
  returns a typed :class:`~omnirelay.payload.OmniPayload`.
* ``thinker_to_talker`` — prefill and decode embeddings for the Talker (§5.1).
* ``talker_to_code2wav`` — codec frames in decode windows, codebook-major (§5.2, §5.3);
  its settings in ``codec_schedule`` and its adaptive pacing in ``pacing`` (no torch).
* ``code2wav_to_aligner`` — the full waveform for the forced aligner (§5.4).
* ``thinker_to_voice`` — the text edge: a :class:`TextChunk` per completed sentence.
* ``decode_window`` — Code2Wav batch building and the streaming trim (§6).
* ``codec_input`` — what a generation stage makes of a committed codec chunk: the prompt
  ids and the merged runtime info (§4.8, the consuming side of §5.2).

Processors know model semantics and nothing about transports.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirelay.processors.base import (
        check_chunk_id,
    )
    from omnirelay.processors.code2wav_to_aligner import (
        DEFAULT_SAMPLE_RATE,
        AlignerInput,
        build_aligner_input,
        build_aligner_prompt,
        extract_waveform,
        segment_words,
    )
    from omnirelay.processors.codec_input import (
        merge_runtime_info,
        read_codec_chunk,
    )
    from omnirelay.processors.codec_schedule import (
        DEFAULT_CODEC_STOP_TOKEN_IDS,
        TalkerToCode2WavConfig,
        parse_codec_chunk_ramp,
    )
    from omnirelay.processors.decode_window import (
        chunked_decode,
        codes_batch_from_flat,
        split_stream_output,
        stream_trim,
        validate_left_context,
    )
    from omnirelay.processors.talker_to_code2wav import (
        CodecStreamState,
        TalkerToCode2WavProcessor,
        flatten_codebook_major,
        unflatten_codebook_major,
    )
    from omnirelay.processors.thinker_to_talker import (
        EMBEDDING_LAYER,
        ThinkerStreamState,
        ThinkerToTalkerProcessor,
    )
    from omnirelay.processors.thinker_to_voice import (
        TextChunk,
        split_ready,
        split_sentences,
    )

#: Where each exported name lives; imported on first use, so a caller that needs only the
#: schedule's settings (``omnirelay check``) does not load torch.
_HOME_OF: dict[str, str] = {
    "AlignerInput": "omnirelay.processors.code2wav_to_aligner",
    "CodecStreamState": "omnirelay.processors.talker_to_code2wav",
    "DEFAULT_CODEC_STOP_TOKEN_IDS": "omnirelay.processors.codec_schedule",
    "DEFAULT_SAMPLE_RATE": "omnirelay.processors.code2wav_to_aligner",
    "EMBEDDING_LAYER": "omnirelay.processors.thinker_to_talker",
    "TalkerToCode2WavConfig": "omnirelay.processors.codec_schedule",
    "TalkerToCode2WavProcessor": "omnirelay.processors.talker_to_code2wav",
    "TextChunk": "omnirelay.processors.thinker_to_voice",
    "ThinkerStreamState": "omnirelay.processors.thinker_to_talker",
    "ThinkerToTalkerProcessor": "omnirelay.processors.thinker_to_talker",
    "build_aligner_input": "omnirelay.processors.code2wav_to_aligner",
    "build_aligner_prompt": "omnirelay.processors.code2wav_to_aligner",
    "check_chunk_id": "omnirelay.processors.base",
    "chunked_decode": "omnirelay.processors.decode_window",
    "codes_batch_from_flat": "omnirelay.processors.decode_window",
    "extract_waveform": "omnirelay.processors.code2wav_to_aligner",
    "flatten_codebook_major": "omnirelay.processors.talker_to_code2wav",
    "merge_runtime_info": "omnirelay.processors.codec_input",
    "parse_codec_chunk_ramp": "omnirelay.processors.codec_schedule",
    "read_codec_chunk": "omnirelay.processors.codec_input",
    "segment_words": "omnirelay.processors.code2wav_to_aligner",
    "split_ready": "omnirelay.processors.thinker_to_voice",
    "split_sentences": "omnirelay.processors.thinker_to_voice",
    "split_stream_output": "omnirelay.processors.decode_window",
    "stream_trim": "omnirelay.processors.decode_window",
    "unflatten_codebook_major": "omnirelay.processors.talker_to_code2wav",
    "validate_left_context": "omnirelay.processors.decode_window",
}


__all__ = [
    "DEFAULT_CODEC_STOP_TOKEN_IDS",
    "DEFAULT_SAMPLE_RATE",
    "EMBEDDING_LAYER",
    "AlignerInput",
    "CodecStreamState",
    "TalkerToCode2WavConfig",
    "TalkerToCode2WavProcessor",
    "TextChunk",
    "ThinkerStreamState",
    "ThinkerToTalkerProcessor",
    "build_aligner_input",
    "build_aligner_prompt",
    "check_chunk_id",
    "chunked_decode",
    "codes_batch_from_flat",
    "extract_waveform",
    "flatten_codebook_major",
    "merge_runtime_info",
    "parse_codec_chunk_ramp",
    "read_codec_chunk",
    "segment_words",
    "split_ready",
    "split_sentences",
    "split_stream_output",
    "stream_trim",
    "unflatten_codebook_major",
    "validate_left_context",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'omnirelay.processors' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value
