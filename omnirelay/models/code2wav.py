"""The Code2Wav executor the families share: codec frames → waveform.

* :class:`Code2WavExecutor` — the :class:`~omnirelay.engine.interfaces.Executor` of a
  Code2Wav stage (``execution_type = "generation"``): every step decodes each item's
  codes and returns its samples in ``ItemResult.audio`` (1-D float32, CPU) with the
  decoder's ``sample_rate`` (24000 for both shipped decoders). A streamed request holds
  its decoder state between chunks (the stateful mode, the default) until it is released.
* :func:`measure_receptive_field`, :func:`decoder_holdback`,
  :func:`frames_of_context_needed` — what a decoder's window needs to stream exactly.

It takes any causal codec decoder with this interface: ``[B, Q, T]`` codes →
``[B, 1, samples]``, ``config.num_quantizers``, ``config.codebook_size``,
``total_upsample``. Each family opens its own decoder and hands it here: Qwen3-Omni's
Code2Wav (:func:`~omnirelay.models.qwen3_omni.code2wav.create_code2wav`), Qwen3-TTS's
12 Hz tokenizer decoder (:func:`~omnirelay.models.qwen3_tts.code2wav.create_code2wav`).

A committed Talker → Code2Wav chunk (an :class:`~omnirelay.payload.OmniPayload`) is read
by :meth:`Code2WavExecutor.read_chunk` (:func:`~omnirelay.processors.read_codec_chunk`,
docs/protocol.md §4.8): its 1-D ``codes.audio`` becomes the item's ``input_token_ids``,
the rest is merged into the request's runtime info, an ``OmniPayload`` handed to the step
as ``additional_information``.

Input of one item (first match wins):

1. the runtime info's ``codes.audio`` as a ``[Q, T]`` (or ``[1, Q, T]``) tensor
   (docs/protocol.md §4.8: a ≥2-D codes tensor stays in the runtime info);
2. ``inputs["codes"]`` — a ``[Q, T]`` tensor, or a mapping with ``audio`` as in (1)
   (a complete input forwarded over a non-chunk edge);
3. the item's ``input_token_ids``: ``Q·T`` codebook-major ids (docs/protocol.md §6.1).

Two modes, per item:

* **streaming, stateful** (the default; the runtime info carries
  ``meta.left_context_size``: the edge is chunked) — each chunk's new frames are decoded
  with the stream's state (:class:`~omnirelay.models.runner.vocoder.StreamingVocoder`):
  the concatenated chunks are the whole-utterance decode, whatever the chunk sizes; left
  context frames a chunk carries were decoded already and are skipped.
* **streaming, by windows** (``stateful: false``) — the windows of all streaming items
  are stacked into one ``[B, Q, max T]``
  batch (:func:`~omnirelay.processors.codes_batch_from_flat`), decoded once, and each row
  is cut with the exact trim of docs/protocol.md §6.2 (:func:`~omnirelay.processors.split_stream_output`):
  the concatenated chunks of a stream have exactly the whole-utterance sample count, and
  equal the whole-utterance decode wherever the left context covers the decoder's
  receptive field (:func:`measure_receptive_field`).
* **complete** (no ``left_context_size``) — the non-streaming chunked decode of docs/protocol.md §6.3
  (:func:`~omnirelay.processors.chunked_decode`, 300 frames with 25 of context), batched
  over the complete items, then each cropped to its own frames.

Codes outside ``[0, codebook_size)`` (a codec EOS that slipped through, a transposed
layout) are an error naming the request, never decoded into another codebook's table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.runner.code2wav import (
    CODE2WAV_PRIORITY,
    DEFAULT_DECODE_BATCHES,
    DEFAULT_DECODE_FRAMES,
    GraphedCode2Wav,
    decoder_widths,
    graph_budget_bytes,
)
from omnirelay.models.runner.graphs import GraphPool, own_stream
from omnirelay.models.runner.memory import bucket_grid, module_bytes, peak_activation_bytes
from omnirelay.models.runner.vocoder import (
    DEFAULT_STREAM_BATCHES,
    DEFAULT_STREAM_FRAMES,
    StreamingVocoder,
    StreamRow,
)
from omnirelay.payload.schema import OmniPayload
from omnirelay.processors.codec_input import read_codec_chunk
from omnirelay.processors.decode_window import (
    DEFAULT_DECODE_CHUNK_FRAMES,
    DEFAULT_DECODE_LEFT_CONTEXT_FRAMES,
    chunked_decode,
    codes_batch_from_flat,
    split_stream_output,
    validate_left_context,
)

__all__ = [
    "SAMPLE_RATE",
    "Code2WavExecutor",
    "decoder_holdback",
    "frames_of_context_needed",
    "measure_receptive_field",
]

#: The output rate of both shipped decoders (Qwen3-Omni's Code2Wav, Qwen3-TTS's 12 Hz
#: tokenizer); a decoder of another rate passes its own ``sample_rate``.
SAMPLE_RATE = 24_000
_GIB = 2**30


@dataclass(slots=True)
class _Input:
    item: BatchItem
    codes: torch.Tensor  # [Q, T] int64
    left_context: int | None  # None: a complete input


class Code2WavExecutor:
    """Decodes codec windows to audio; see the module docstring."""

    execution_type = "generation"
    supports_batching = True
    #: What a committed Talker → Code2Wav chunk means here (a ChunkReader; pure).
    read_chunk = staticmethod(read_codec_chunk)

    def __init__(
        self,
        model: Any,
        *,
        chunk_frames: int = DEFAULT_DECODE_CHUNK_FRAMES,
        chunk_left_context: int = DEFAULT_DECODE_LEFT_CONTEXT_FRAMES,
        max_decode_batch: int | None = None,
        cuda_graphs: bool = False,
        stateful: bool = True,
        max_streams: int = 64,
        sample_rate: int = SAMPLE_RATE,
        compile: str | None = None,
    ) -> None:
        self.model = model  # a codec decoder (see the module docstring)
        self.device = next(model.parameters()).device
        #: the model, or its window decodes replayed from CUDA graphs (captured here);
        #: streamed requests' decoder state (None: streams are decoded by windows)
        self._decoder, self.vocoder = _build_decoders(
            model, cuda_graphs=cuda_graphs, stateful=stateful, max_streams=max_streams, compile=compile
        )
        if max_decode_batch is None:
            # The vocoder's convs are compute-bound on a CPU: stacking more than two windows
            # costs more than decoding them apart (docs/performance.md).
            max_decode_batch = 2 if self.device.type == "cpu" else 16
        if max_decode_batch < 1:
            raise ModelError(f"max_decode_batch must be >= 1, got {max_decode_batch}")
        self.max_decode_batch = max_decode_batch
        self.num_codebooks = int(model.config.num_quantizers)
        self.codebook_size = int(model.config.codebook_size)
        self.upsample = int(model.total_upsample)
        self.sample_rate = sample_rate
        self.chunk_frames = chunk_frames
        self.chunk_left_context = chunk_left_context
        #: the stream launched decodes run on (:meth:`launch`; made on first use)
        self._stream: torch.cuda.Stream | None = None

    # ----------------------------------------------------------------- Executor

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """Decode every item's codes (engine thread); results in batch order."""
        inputs = [self._read(item) for item in batch]
        return self._results(inputs, self._decode_all(inputs, _to_host))

    def launch(self, batch: list[BatchItem]) -> _LaunchedDecode:
        """The step split in two (docs/design.md §12): on CUDA the decode is enqueued on
        this executor's own high-priority stream, its audio copied non-blocking into
        pinned host memory, an event recorded after it; ``is_done()`` polls the event.
        Elsewhere the step runs now."""
        inputs = [self._read(item) for item in batch]
        if self.device.type != "cuda":
            return _LaunchedDecode(self._results(inputs, self._decode_all(inputs, _to_host)))
        if self._stream is None:
            self._stream = own_stream(self.device, CODE2WAV_PRIORITY)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the inputs are ready
        with torch.cuda.stream(stream):
            audio = self._decode_all(inputs, _to_pinned_host)
            done = torch.cuda.Event()
            done.record(stream)
        # The inputs stay referenced until the event completed: no allocation reuses them.
        return _LaunchedDecode(self._results(inputs, audio), done, inputs)

    def _results(self, inputs: list[_Input], audio: dict[int, torch.Tensor]) -> list[ItemResult]:
        return [
            ItemResult(
                internal_id=x.item.internal_id,
                audio=audio.get(i, torch.zeros(0, dtype=torch.float32)),
                sample_rate=self.sample_rate,
            )
            for i, x in enumerate(inputs)
        ]

    def _decode_all(
        self, inputs: list[_Input], to_host: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Each item's audio (by batch index), brought to the host by ``to_host``."""
        audio: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            if self.vocoder is not None:
                streams = [(i, x) for i, x in enumerate(inputs) if x.left_context is not None]
                inputs_left = [x if x.left_context is None else None for x in inputs]
                decoded = self._decode_stateful(streams)
                if decoded:  # one copy to the host for every stream's samples, split there
                    sizes = [int(piece.numel()) for _, piece in decoded]
                    host = to_host(torch.cat([piece.reshape(-1) for _, piece in decoded]))
                    for (i, _), piece in zip(decoded, host.split(sizes)):
                        audio[i] = piece
            else:
                inputs_left = list(inputs)
            for group in self._groups(inputs_left):
                is_stream = group[0][1].left_context is not None
                pieces = self._decode_stream(group) if is_stream else self._decode_complete(group)
                for (i, _), piece in zip(group, pieces):
                    audio[i] = to_host(piece)
        return audio

    def release(self, internal_id: str) -> None:
        """Free the stream's decoder state (idempotent; nothing when decoding by windows)."""
        if self.vocoder is None:
            return
        if self._stream is None:
            self.vocoder.release(internal_id)
            return
        # Another stream's state may move into the freed slot: on the decode stream, after
        # the steps launched there (and whatever the current stream holds) and before the next.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.vocoder.release(internal_id)

    def num_live_requests(self) -> int:
        return 0 if self.vocoder is None else len(self.vocoder.slots)

    def leak_state(self) -> dict[str, Any]:
        held = [] if self.vocoder is None else self.vocoder.slots.holders()
        return {"code2wav_streams": held} if held else {}

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot decode of ``[B, Q, T]`` codes → ``[B, 1, samples]`` (no trimming)."""
        with torch.inference_mode():
            return self._decoder(codes)

    # ----------------------------------------------------------------- decoding

    def _decode_stateful(self, streams: list[tuple[int, _Input]]) -> list[tuple[int, torch.Tensor]]:
        """Each streamed item's new frames (past its left context, decoded already)
        with its stream's state, all in one step; items with no new frame decode nothing."""
        assert self.vocoder is not None
        todo = [(i, x) for i, x in streams if x.codes.shape[1] > (x.left_context or 0)]
        rows = [StreamRow(x.item.internal_id, x.codes[:, x.left_context or 0 :]) for _, x in todo]
        if not rows:
            return []
        return list(zip((i for i, _ in todo), self.vocoder.decode(rows)))

    def _groups(self, inputs: list[_Input | None]) -> list[list[tuple[int, _Input]]]:
        """Decode batches: streaming and complete items apart, similar lengths together
        (padding is wasted work), at most ``max_decode_batch`` items each (``None``:
        decoded elsewhere)."""
        groups = []
        for is_stream in (True, False):
            todo = [
                (i, x)
                for i, x in enumerate(inputs)
                if x is not None and (x.left_context is not None) == is_stream
            ]
            todo = sorted((p for p in todo if p[1].codes.shape[1] > 0), key=lambda p: p[1].codes.shape[1])
            groups += [
                todo[k : k + self.max_decode_batch] for k in range(0, len(todo), self.max_decode_batch)
            ]
        return groups

    def _decode_stream(self, group: list[tuple[int, _Input]]) -> list[torch.Tensor]:
        flats = [x.codes.reshape(-1) for _, x in group]  # [Q, T] → codebook-major
        codes, lengths = codes_batch_from_flat(flats, self.num_codebooks)
        lefts = validate_left_context([x.left_context or 0 for _, x in group], lengths)
        wav = self._decoder(codes)
        return split_stream_output(wav, lengths, lefts, self.upsample)

    def _decode_complete(self, group: list[tuple[int, _Input]]) -> list[torch.Tensor]:
        flats = [x.codes.reshape(-1) for _, x in group]
        codes, lengths = codes_batch_from_flat(flats, self.num_codebooks)
        wav = chunked_decode(
            self._decoder,
            codes.to(self.device),
            upsample=self.upsample,
            chunk_size=self.chunk_frames,
            left_context=self.chunk_left_context,
        )
        # Crop each request to its own frames (the window's hold-back applies to every row).
        return split_stream_output(
            wav, lengths, [0] * len(lengths), self.upsample, window_frames=codes.shape[-1]
        )

    # ----------------------------------------------------------------- input

    def _read(self, item: BatchItem) -> _Input:
        rid = item.internal_id
        info = item.additional_information
        if info is not None and type(info) is not OmniPayload:
            raise ModelError(
                f"request {rid!r}: the runtime info must be the OmniPayload read_chunk made, "
                f"got {type(info).__name__}"
            )
        meta = None if info is None else info.meta
        left = None if meta is None else meta.left_context_size
        codes = _codes_tensor(None if info is None or info.codes is None else info.codes.audio)
        if codes is None and isinstance(item.inputs, Mapping):  # a forwarded complete input
            forwarded = item.inputs.get("codes")
            codes = _codes_tensor(forwarded.get("audio") if isinstance(forwarded, Mapping) else forwarded)
        if codes is None:
            flat = torch.as_tensor(list(item.input_token_ids), dtype=torch.long)
            if flat.numel() % self.num_codebooks:
                raise ModelError(
                    f"request {rid!r}: {flat.numel()} codec ids are not a multiple of Q={self.num_codebooks}; "
                    "Code2Wav input must be codebook-major Q·T ids"
                )
            codes = flat.reshape(self.num_codebooks, -1)
        if codes.dim() == 3 and codes.shape[0] == 1:
            codes = codes[0]
        if codes.dim() != 2 or codes.shape[0] != self.num_codebooks:
            raise ModelError(
                f"request {rid!r}: codes must be [Q={self.num_codebooks}, T] (codebook-major), "
                f"got shape {tuple(codes.shape)}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ModelError(
                f"request {rid!r}: codec ids must lie in [0, {self.codebook_size}); got "
                f"[{int(codes.min())}, {int(codes.max())}] — a stop token or a wrong layout reached Code2Wav"
            )
        if left is not None and (
            isinstance(left, bool) or not isinstance(left, int) or not 0 <= left <= codes.shape[1]
        ):
            raise ModelError(
                f"request {rid!r}: meta.left_context_size {left!r} is not an int in [0, {codes.shape[1]}]"
            )
        return _Input(item=item, codes=codes.to(torch.long), left_context=left)


def _to_host(piece: torch.Tensor) -> torch.Tensor:
    return piece.reshape(-1).to(device="cpu", dtype=torch.float32)


def _to_pinned_host(piece: torch.Tensor) -> torch.Tensor:
    """A copy into pinned host memory, enqueued on the current stream (not waited for)."""
    flat = piece.reshape(-1).to(dtype=torch.float32)
    host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    return host


class _LaunchedDecode:
    """A launched Code2Wav step (:class:`~omnirelay.engine.interfaces.PendingStep`): its
    results, whose audio is complete once ``done`` (a CUDA event; None: already) completed."""

    def __init__(
        self, results: list[ItemResult], done: torch.cuda.Event | None = None, inputs: Any = None
    ) -> None:
        self._results = results
        self._done = done
        self._inputs = inputs

    def is_done(self) -> bool:
        if self._done is None or self._done.query():
            self._inputs = None
            return True
        return False

    def result(self) -> list[ItemResult]:
        if self._done is not None:
            self._done.synchronize()  # only when asked before it ended (a step outside a group)
            self._done = self._inputs = None
        return self._results


def _codes_tensor(value: Any) -> torch.Tensor | None:
    """A ≥2-D codes tensor, or None (1-D ids travel as the prompt)."""
    if value is None:
        return None
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() < 2:
        return None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ModelError(f"codec codes must be integers, got {t.dtype}")
    return t


def _build_decoders(
    model: Any, *, cuda_graphs: bool, stateful: bool, max_streams: int, compile: str | None
) -> tuple[GraphedCode2Wav, StreamingVocoder | None]:
    """The window decoder and the streaming one (None: not ``stateful``), their graphs
    captured in one pool for the buckets whose step fits the activation budget
    (:func:`~omnirelay.models.runner.code2wav.graph_budget_bytes`, docs/design.md §12),
    and one startup line: weights, streams, graph pools."""
    weight = next(model.parameters())
    graphed = cuda_graphs and weight.device.type == "cuda"
    windows = streams = pool = None
    per_row_frame = budget = 0
    if graphed:
        per_row_frame = peak_activation_bytes(decoder_widths(model), weight.element_size())
        budget = graph_budget_bytes()
        windows = bucket_grid(
            DEFAULT_DECODE_BATCHES,
            DEFAULT_DECODE_FRAMES,
            budget_bytes=budget,
            bytes_per_row_frame=per_row_frame,
        )
        streams = bucket_grid(
            DEFAULT_STREAM_BATCHES,
            DEFAULT_STREAM_FRAMES,
            budget_bytes=budget,
            bytes_per_row_frame=per_row_frame,
        )
        pool = GraphPool()  # one pool and capture stream for both sets
    decoder = GraphedCode2Wav(model, cuda_graphs=cuda_graphs, buckets=windows, pool=pool)
    decoder.capture_graphs()
    vocoder = None
    if stateful:
        vocoder = StreamingVocoder(
            model,
            max_streams=max_streams,
            cuda_graphs=cuda_graphs,
            compile=compile,
            buckets=streams,
            pool=pool,
        )
        vocoder.capture_graphs()
    if graphed:
        reports = [decoder.graphs.report] + ([vocoder.graphs.report] if vocoder is not None else [])
        pools = sum(r.pool_bytes or 0 for r in reports)
        captured = [key for r in reports for key in r.keys]
        largest = max(captured, key=lambda bt: bt[0] * bt[1], default=(0, 0))
        print(
            f"omnirelay: code2wav on {weight.device}: weights {module_bytes(model) / _GIB:.2f} GiB, "
            f"{max_streams if vocoder is not None else 0} streams' state, graph pools {pools / _GIB:.2f} GiB "
            f"(steps up to {largest[0]} rows x {largest[1]} frames: "
            f"{largest[0] * largest[1] * per_row_frame / _GIB:.2f} GiB of activations estimated, "
            f"budget {budget / _GIB:g} GiB)",
            file=sys.stderr,
            flush=True,
        )
    return decoder, vocoder


def measure_receptive_field(model: Any, *, num_frames: int = 64, seed: int = 0) -> tuple[int, int]:
    """``(lookback, holdback)`` of a Code2Wav decoder, in samples, measured by perturbation.

    ``lookback``: how many samples past the end of a frame still change when that frame's
    codes change (how far a frame reaches forward in time). ``holdback``: samples a window
    decode holds back at its right edge (``T·U − D``). A streaming chunk decodes exactly
    like the whole utterance iff its left context ``c`` frames satisfy
    ``c·U − holdback ≥ lookback`` — see :func:`frames_of_context_needed`.
    """
    config = model.config
    upsample = int(model.total_upsample)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(
        0, int(config.codebook_size), (1, int(config.num_quantizers), num_frames), generator=gen
    )
    device = next(model.parameters()).device
    frame = num_frames // 2
    changed = codes.clone()
    changed[0, :, frame] = (changed[0, :, frame] + 1 + torch.arange(changed.shape[1])) % int(
        config.codebook_size
    )
    with torch.inference_mode():
        base = model(codes.to(device))[0, 0].cpu()
        other = model(changed.to(device))[0, 0].cpu()
    diff = torch.nonzero(base != other).flatten()
    holdback = num_frames * upsample - base.shape[-1]
    if diff.numel() == 0:
        return 0, holdback
    reach = int(diff.max()) + 1 - (frame + 1) * upsample
    if int(diff.max()) + 1 >= base.shape[-1]:
        raise ModelError(
            f"the decoder's receptive field exceeds the {num_frames}-frame probe; use more frames"
        )
    return max(0, reach), holdback


def decoder_holdback(model: Any, *, num_frames: int = 8) -> int:
    """Samples a window decode holds back at its right edge (``T·U − output length``)."""
    codes = torch.zeros((1, int(model.config.num_quantizers), num_frames), dtype=torch.long)
    device = next(model.parameters()).device
    with torch.inference_mode():
        samples = int(model(codes.to(device)).shape[-1])
    return num_frames * int(model.total_upsample) - samples


def frames_of_context_needed(lookback: int, holdback: int, upsample: int) -> int:
    """Smallest left context (frames) for an exact streaming decode: ``c·U − holdback ≥ lookback``."""
    need = lookback + holdback
    return 0 if need <= 0 else -(-need // upsample)
