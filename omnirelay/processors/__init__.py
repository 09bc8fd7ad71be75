"""omnirelay.processors: what the next stage should see (docs/protocol.md §5, §6).

One file per role:

* ``base`` — :func:`check_chunk_id`, shared by the chunk processors. Every processor
  returns a typed :class:`~omnirelay.payload.OmniPayload`.
* ``thinker_to_talker`` — prefill and decode embeddings for the Talker (§5.1).
* ``talker_to_code2wav`` — codec frames in decode windows, codebook-major (§5.2, §5.3).
* ``code2wav_to_aligner`` — the full waveform for the forced aligner (§5.4).
* ``thinker_to_voice`` — the text edge: a :class:`TextChunk` per completed sentence.
* ``decode_window`` — Code2Wav batch building and the streaming trim (§6).
* ``codec_input`` — what a generation stage makes of a committed codec chunk: the prompt
  ids and the merged runtime info (§4.8, the consuming side of §5.2).

Processors know model semantics and nothing about transports.
"""

from omnirelay.processors.base import check_chunk_id
from omnirelay.processors.code2wav_to_aligner import (
    DEFAULT_SAMPLE_RATE,
    AlignerInput,
    build_aligner_input,
    build_aligner_prompt,
    extract_waveform,
    segment_words,
)
from omnirelay.processors.codec_input import merge_runtime_info, read_codec_chunk
from omnirelay.processors.decode_window import (
    chunked_decode,
    codes_batch_from_flat,
    split_stream_output,
    stream_trim,
    validate_left_context,
)
from omnirelay.processors.talker_to_code2wav import (
    DEFAULT_CODEC_STOP_TOKEN_IDS,
    CodecStreamState,
    TalkerToCode2WavConfig,
    TalkerToCode2WavProcessor,
    flatten_codebook_major,
    parse_codec_chunk_ramp,
    unflatten_codebook_major,
)
from omnirelay.processors.thinker_to_talker import (
    EMBEDDING_LAYER,
    ThinkerStreamState,
    ThinkerToTalkerProcessor,
)
from omnirelay.processors.thinker_to_voice import TextChunk, split_ready, split_sentences

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
