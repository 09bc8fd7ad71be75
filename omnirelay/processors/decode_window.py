"""Code2Wav decode-window math (docs/protocol.md §6): pure functions, no model.

* :func:`codes_batch_from_flat` — per-request codebook-major ids → ``[B, Q, Tmax]`` codes
  (right-padded with code 0) and each request's frame count (§6.1).
* :func:`validate_left_context` — each request's ``meta.left_context_size``, checked
  against the batch (docs/protocol.md §10.9: a mismatch is an error, never a silent 0).
* :func:`stream_trim` — which samples of one request's row of a streaming decode to emit
  (§6.2): ``tail = max(0, W·U − D)``, ``start = max(0, c·U − tail)``,
  ``end = max(0, T·U − tail)``.
* :func:`split_stream_output` — :func:`stream_trim` applied to every row of a decoded batch.
* :func:`chunked_decode` — decode a long window piecewise to bound memory (§6.3), with the
  same trim, so the pieces join without duplicated or missing samples.

``U`` is the decoder's total upsample factor (1920 samples per frame for Qwen3-Omni).
A causal decoder may hold back ``tail`` samples at the right edge of a window: they
depend on frames it has not seen. The streaming rule emits them one chunk later, when
the next window re-decodes that region from its left context. Invalid inputs raise
:class:`~omnirelay.errors.ModelError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from omnirelay.errors import ModelError

__all__ = [
    "DEFAULT_DECODE_CHUNK_FRAMES",
    "DEFAULT_DECODE_LEFT_CONTEXT_FRAMES",
    "chunked_decode",
    "codes_batch_from_flat",
    "split_stream_output",
    "stream_trim",
    "validate_left_context",
]

#: §6.3 defaults of the non-streaming chunked decode.
DEFAULT_DECODE_CHUNK_FRAMES = 300
DEFAULT_DECODE_LEFT_CONTEXT_FRAMES = 25


def _as_flat_ids(ids: torch.Tensor | Sequence[int], index: int) -> torch.Tensor:
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.long)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ModelError(f"request {index}: codec ids must be integers, got {t.dtype}")
    if t.dim() != 1:
        raise ModelError(
            f"request {index}: codec ids must be 1-D (codebook-major), got shape {tuple(t.shape)}"
        )
    return t.to(torch.long)


def codes_batch_from_flat(
    flat_ids_per_request: Sequence[torch.Tensor | Sequence[int]],
    num_codebooks: int,
    *,
    is_warmup: bool = False,
) -> tuple[torch.Tensor, list[int]]:
    """Stack each request's ``Q·Tᵢ`` codebook-major ids into ``[B, Q, max Tᵢ]`` (pad: code 0).

    Returns the codes (int64) and the frame counts ``[Tᵢ]``. Each request's ids must be a
    multiple of ``Q``: anything else was not built by ``flatten_codebook_major`` and is
    an error. Only a warmup (dummy) run concatenates everything, right-pads with zeros
    to a multiple of ``Q`` and returns ``[1, Q, T]``.
    """
    if isinstance(num_codebooks, bool) or not isinstance(num_codebooks, int) or num_codebooks <= 0:
        raise ModelError(f"num_codebooks must be a positive int, got {num_codebooks!r}")
    if len(flat_ids_per_request) == 0:
        raise ModelError("no requests to decode: flat_ids_per_request is empty")
    flats = [_as_flat_ids(ids, i) for i, ids in enumerate(flat_ids_per_request)]
    q = num_codebooks
    if is_warmup:
        flat = torch.cat(flats)
        pad = (-flat.numel()) % q
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        codes = flat.reshape(1, q, -1)
        return codes, [codes.shape[-1]]
    for i, flat in enumerate(flats):
        if flat.numel() % q != 0:
            raise ModelError(
                f"request {i}: {flat.numel()} codec ids are not a multiple of Q={q}; "
                "the payload is corrupt or was built for another number of codebooks"
            )
    lengths = [flat.numel() // q for flat in flats]
    codes = torch.zeros((len(flats), q, max(lengths)), dtype=torch.long)
    for i, (flat, n) in enumerate(zip(flats, lengths)):
        codes[i, :, :n] = flat.reshape(q, n)
    return codes, lengths


def validate_left_context(left_context_sizes: Sequence[int] | None, lengths: Sequence[int]) -> list[int]:
    """Return the per-request left context (frames), checked against the batch.

    ``None`` means no request carries context (non-streaming input): all zeros. A list
    must have one entry per request with ``0 ≤ cᵢ ≤ Tᵢ``.
    """
    if left_context_sizes is None:
        return [0] * len(lengths)
    lefts = list(left_context_sizes)
    if len(lefts) != len(lengths):
        raise ModelError(
            f"{len(lefts)} left_context_size value(s) for a batch of {len(lengths)} request(s); "
            "every scheduled request must report its meta.left_context_size"
        )
    for i, (c, t) in enumerate(zip(lefts, lengths)):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= t:
            raise ModelError(
                f"request {i}: left_context_size {c!r} is not an int in [0, {t}] (its frame count)"
            )
    return lefts


def stream_trim(
    decoded_len: int,
    window_frames: int,
    upsample: int,
    num_frames: int,
    left_context: int,
) -> tuple[int, int]:
    """``(start, end)`` of the samples to emit from one request's row of a window decode.

    ``decoded_len`` (D) is the decoded length of the whole padded window of
    ``window_frames`` (W) frames; ``num_frames`` (T) counts this request's real frames
    including its ``left_context`` (c) frames. The emitted range is shifted left by the
    decoder's hold-back ``tail``: it first re-emits the previous chunk's held-back samples
    (now decoded with context) and holds back its own last ``tail`` samples. ``tail`` comes
    from the window, not the row: zero padding is not valid context.

    Dropping ``c·U`` samples instead duplicates or loses ``tail`` samples at every chunk
    boundary. If ``c·U < tail`` (too little context) the previous chunk's hold-back cannot be
    fully re-emitted; give the stream more left context than the decoder holds back.
    """
    for name, value in (
        ("decoded_len", decoded_len),
        ("window_frames", window_frames),
        ("num_frames", num_frames),
        ("left_context", left_context),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"stream_trim: {name} must be an int >= 0, got {value!r}")
    if isinstance(upsample, bool) or not isinstance(upsample, int) or upsample <= 0:
        raise ModelError(f"stream_trim: upsample must be a positive int, got {upsample!r}")
    if num_frames > window_frames or left_context > num_frames:
        raise ModelError(
            f"stream_trim: need left_context ({left_context}) <= num_frames ({num_frames}) "
            f"<= window_frames ({window_frames})"
        )
    if decoded_len > window_frames * upsample:
        raise ModelError(
            f"decoder returned {decoded_len} samples for {window_frames} frames, more than "
            f"frames x upsample = {window_frames * upsample}; is the upsample factor {upsample} right?"
        )
    tail = window_frames * upsample - decoded_len
    start = max(0, left_context * upsample - tail)
    end = max(0, num_frames * upsample - tail)
    return start, end


def split_stream_output(
    wav: torch.Tensor,
    lengths: Sequence[int],
    left_context: Sequence[int],
    upsample: int,
    *,
    window_frames: int | None = None,
) -> list[torch.Tensor]:
    """Cut a decoded batch ``[B, …, D]`` into each request's emitted samples (§6.2).

    ``window_frames`` defaults to ``max(lengths)`` (the padded window of
    :func:`codes_batch_from_flat`). With all left contexts 0 this is the §6.3 crop of each
    request to its own frames.
    """
    if wav.dim() < 2 or wav.shape[0] != len(lengths):
        raise ModelError(
            f"decoded batch has shape {tuple(wav.shape)}; expected [B={len(lengths)}, ..., samples]"
        )
    lefts = validate_left_context(left_context, lengths)
    window = max(lengths) if window_frames is None else window_frames
    decoded_len = wav.shape[-1]
    pieces = []
    for i, (t, c) in enumerate(zip(lengths, lefts)):
        start, end = stream_trim(decoded_len, window, upsample, t, c)
        pieces.append(wav[i, ..., start:end])
    return pieces


def chunked_decode(
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    codes: torch.Tensor,
    *,
    upsample: int,
    chunk_size: int = DEFAULT_DECODE_CHUNK_FRAMES,
    left_context: int = DEFAULT_DECODE_LEFT_CONTEXT_FRAMES,
) -> torch.Tensor:
    """Decode ``codes [B, Q, T]`` in pieces of ``chunk_size`` frames and join them (§6.3).

    Each piece after the first is decoded with ``min(left_context, start)`` frames of
    context and trimmed by :func:`stream_trim`, so the result equals a one-shot
    ``decode_fn(codes)`` whenever the context covers the decoder's receptive field. With a
    decoder that holds nothing back this is the reference rule (drop ``ctx·U`` samples).
    ``decode_fn`` maps ``[B, Q, t]`` to ``[B, …, samples]``. This only bounds memory
    inside one decode; it says nothing about whether the upstream edge was chunked.
    """
    if codes.dim() != 3:
        raise ModelError(f"codes must be [B, Q, T], got shape {tuple(codes.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ModelError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(left_context, bool) or not isinstance(left_context, int) or left_context < 0:
        raise ModelError(f"left_context must be an int >= 0, got {left_context!r}")
    num_frames = codes.shape[-1]
    pieces: list[torch.Tensor] = []
    for start in range(0, num_frames, chunk_size):
        end = min(start + chunk_size, num_frames)
        ctx = min(left_context, start)
        piece = decode_fn(codes[..., start - ctx : end])
        window = end - start + ctx
        held_back = window * upsample - piece.shape[-1]
        if start > 0 and ctx * upsample < held_back:
            raise ModelError(
                f"left_context {left_context} frames ({ctx * upsample} samples) cannot cover the "
                f"{held_back} samples the decoder holds back; raise left_context"
            )
        lo, hi = stream_trim(piece.shape[-1], window, upsample, window, ctx)
        pieces.append(piece[..., lo:hi])
    if not pieces:
        raise ModelError("codes have no frames to decode")
    return torch.cat(pieces, dim=-1)
