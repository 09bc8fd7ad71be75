"""Talker → Code2Wav: buffer codec frames and emit decode windows (docs/protocol.md §5.2, §5.3).

The Talker produces one codec frame of ``Q`` codebooks per step (``[1, Q]``; a step may
carry several rows). Code2Wav decodes windows of frames: each payload carries ``new``
frames never sent before plus up to ``Lc`` frames of left context already sent, so the
causal vocoder can re-decode the boundary (docs/protocol.md §6.2 trims the result).

* :class:`TalkerToCode2WavConfig` — ``C``/``Lc``/``I``/ramp/adaptive pacing/``Q``/stop ids,
  validated at construction (``from_extra`` reads the edge's connector ``extra`` options);
  with :func:`parse_codec_chunk_ramp` it lives in :mod:`omnirelay.processors.codec_schedule`
  (no torch: ``omnirelay check`` describes a schedule without loading it).
* :class:`CodecStreamState` — per request: accepted frames and the sent watermark.
* :class:`TalkerToCode2WavProcessor` — ``new_state()`` once per request, then ``step()``
  once per Talker scheduler step on the save thread, until it is called with
  ``finished`` (then it always returns a payload, and the state is spent).
* :func:`flatten_codebook_major` / :func:`unflatten_codebook_major` — the wire layout
  ``[T, Q] → [Q, T] → flat`` and the receiver's inverse.

Frames are the unit everywhere (docs/protocol.md §10.10): a multi-row step adds several frames, and
the schedule counts frames, not steps. Two schedules (docs/protocol.md §5.3):

* **adaptive** (the default): each chunk is sized from the stream's playback headroom and
  its measured frame interval (:mod:`omnirelay.processors.pacing`) — small first, growing
  as the stream banks audio, at most ``C`` frames — with up to ``Lc`` frames of left
  context on every chunk after the first;
* **fixed** (``codec_chunk_adaptive: false``, or a ``codec_chunk_ramp``): with one frame
  per step exactly the reference's: for ``I=4, C=25, Lc=25`` the payloads carry 4 → 29 →
  50 → 50 … frames with left context 0 → 4 → 25 → 25 ….

Either way a stream decodes to the same audio sample for sample whenever ``Lc`` covers
the decoder's receptive field: only where the windows start differs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from omnirelay.errors import PayloadEncodeError
from omnirelay.payload.schema import Codes, Meta, OmniPayload
from omnirelay.processors.base import check_chunk_id
from omnirelay.processors.codec_schedule import (
    DEFAULT_CODEC_STOP_TOKEN_IDS,
    TalkerToCode2WavConfig,
    parse_codec_chunk_ramp,
)
from omnirelay.processors.pacing import FrameRate, StreamPacer

__all__ = [
    "DEFAULT_CODEC_STOP_TOKEN_IDS",
    "CodecStreamState",
    "TalkerToCode2WavConfig",
    "TalkerToCode2WavProcessor",
    "flatten_codebook_major",
    "parse_codec_chunk_ramp",
    "unflatten_codebook_major",
]

_PROCESSOR = "talker->code2wav"


# --------------------------------------------------------------------------- layout


def flatten_codebook_major(frames: torch.Tensor) -> torch.Tensor:
    """``[T, Q]`` frames → 1-D ids, codebook-major: all T frames of codebook 0, then 1, ….

    A token-major flatten (``frames.reshape(-1)``) has the same legal length and decodes
    to garbage without any error, hence one function used by every sender.
    """
    if frames.dim() != 2:
        raise PayloadEncodeError(f"codec frames must be 2-D [T, Q], got shape {tuple(frames.shape)}")
    return frames.transpose(0, 1).reshape(-1)


def unflatten_codebook_major(flat: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """Codebook-major 1-D ids → ``[Q, T]``: the receiver's reshape, inverse of the flatten."""
    if flat.dim() != 1:
        raise PayloadEncodeError(f"flat codec ids must be 1-D, got shape {tuple(flat.shape)}")
    if num_codebooks <= 0 or flat.numel() % num_codebooks != 0:
        raise PayloadEncodeError(
            f"{flat.numel()} codec ids are not a multiple of Q={num_codebooks}; "
            "the payload was not built by flatten_codebook_major with the same Q"
        )
    return flat.reshape(num_codebooks, -1)


# --------------------------------------------------------------------------- state


@dataclass(slots=True)
class CodecStreamState:
    """One request's codec stream on this edge; written only by the save thread.

    ``frames`` holds accepted entries (one per accepted step, ``[n, Q]`` int64 on the
    CPU). Entries older than any future left context are dropped, so memory stays
    bounded; ``num_frames`` still counts every accepted frame.
    """

    stop_token_ids: frozenset[int]
    initial_chunk_frames: int
    #: the adaptive schedule's pacer (None: a fixed schedule)
    pacer: StreamPacer | None = None
    frames: deque[torch.Tensor] = field(default_factory=deque)
    num_frames: int = 0
    num_dropped_frames: int = 0
    num_sent_frames: int = 0
    num_payloads: int = 0
    num_ramp_chunks: int = 0
    is_finished: bool = False

    def tail_frames(self, count: int) -> torch.Tensor:
        """The last ``count`` accepted frames as ``[count, Q]``."""
        # Invariant: everything a payload may need is still retained.
        assert count <= self.num_frames - self.num_dropped_frames, (count, self.num_frames)
        return torch.cat(list(self.frames), dim=0)[self.num_frames - self.num_dropped_frames - count :]


# --------------------------------------------------------------------------- processor


class TalkerToCode2WavProcessor:
    """Builds Code2Wav payloads from Talker codec steps. Per request, all state is in its
    :class:`CodecStreamState`; across requests only the edge's mean frame interval is kept
    (the adaptive schedule's estimate for a stream's first frames). ``clock`` (seconds,
    monotonic) times the frames for the adaptive schedule."""

    def __init__(
        self, config: TalkerToCode2WavConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config if config is not None else TalkerToCode2WavConfig()
        self._clock = clock
        self._pacing = self.config.pacing()
        self.frame_rate = FrameRate()

    def new_state(
        self,
        *,
        stop_token_ids: Iterable[int] = (),
        initial_codec_chunk_frames: int | None = None,
    ) -> CodecStreamState:
        """Per-request state. ``stop_token_ids`` adds the request's own stop ids to the
        config's; ``initial_codec_chunk_frames`` overrides I for this request (clamped
        to ``[0, C]``, as the reference does)."""
        cfg = self.config
        if initial_codec_chunk_frames is None:
            initial = cfg.initial_codec_chunk_frames
        else:
            initial = min(max(0, int(initial_codec_chunk_frames)), cfg.codec_chunk_frames)
        pacer = None
        if cfg.codec_chunk_adaptive:
            pacer = StreamPacer(self._pacing, self.frame_rate, min_first_frames=max(1, initial))
            initial = 0  # the pacer sizes the first chunk; left context is min(sent, Lc)
        return CodecStreamState(
            stop_token_ids=cfg.stop_token_ids | frozenset(int(t) for t in stop_token_ids),
            initial_chunk_frames=initial,
            pacer=pacer,
        )

    # ---- called once per Talker step, on the save thread

    def step(
        self,
        state: CodecStreamState,
        codes_step: torch.Tensor | None,
        *,
        chunk_id: int,
        finished: bool,
        codec_frame_valid: torch.Tensor | bool | Sequence[bool] | None = None,
        first_audio: bool | None = None,
    ) -> OmniPayload | None:
        """Accept this step's frames and return the payload to put now, or ``None``.

        ``chunk_id`` is the adapter's count of successful puts for this request on this
        edge. When ``finished`` is true a payload is always returned: the tail flush, or a
        terminal-only payload (no codes) when every frame was sent; the adapter's envelope
        says it is the last.
        """
        if state.is_finished:
            raise PayloadEncodeError(f"{_PROCESSOR}: step() called after the stream finished")
        check_chunk_id(chunk_id, state.num_payloads, processor=_PROCESSOR)

        rows = self._accepted_rows(state, codes_step, codec_frame_valid)
        now = self._clock() if state.pacer is not None else 0.0
        if rows.shape[0] > 0:
            state.frames.append(rows)
            state.num_frames += rows.shape[0]
            if state.pacer is not None:
                state.pacer.on_frames(now, rows.shape[0])

        num_pending = state.num_frames - state.num_sent_frames
        if num_pending == 0:
            if not finished:
                return None
            return self._emit(
                state, chunk_id, num_new=0, left=0, finished=True, first_audio=first_audio, now=now
            )
        if not finished and not self._is_due(state, chunk_id, num_pending, now):
            return None
        left = self._left_context(state, chunk_id)
        return self._emit(
            state,
            chunk_id,
            num_new=num_pending,
            left=left,
            finished=finished,
            first_audio=first_audio,
            now=now,
        )

    # ---- the emission rule

    def _is_due(self, state: CodecStreamState, chunk_id: int, num_pending: int, now: float) -> bool:
        """Whether the ``num_pending`` unsent frames go out now (before the stream's end)."""
        if state.pacer is not None:
            return state.pacer.should_send(now, num_pending)
        return num_pending >= self._frames_needed(state, chunk_id)

    def _ramp_threshold(self, index: int) -> int:
        """Cumulative frames at the end of ramp chunk ``index`` (past the table: +C each)."""
        ramp = self.config.codec_chunk_ramp
        assert ramp is not None
        if index < len(ramp):
            return sum(ramp[: index + 1])
        return sum(ramp) + (index - len(ramp) + 1) * self.config.codec_chunk_frames

    def _frames_needed(self, state: CodecStreamState, chunk_id: int) -> int:
        """Unsent frames needed before a non-final chunk is emitted."""
        if self.config.codec_chunk_ramp is not None:
            return self._ramp_threshold(state.num_ramp_chunks) - state.num_sent_frames
        if state.initial_chunk_frames > 0 and chunk_id == 0:
            return state.initial_chunk_frames
        return self.config.codec_chunk_frames

    def _left_context(self, state: CodecStreamState, chunk_id: int) -> int:
        """Frames of already-sent context to resend before the new frames (rule 6)."""
        lc = self.config.codec_left_context_frames
        sent = state.num_sent_frames
        initial = state.initial_chunk_frames
        if self.config.codec_chunk_ramp is not None or initial == 0:
            return min(sent, lc)
        if chunk_id == 1:
            # The chunk after the small first one resends the first chunk (left = I), so it
            # carries everything so far.
            return min(sent, initial)
        # Reference rule: on the C-grid the first chunk's I frames are not context pool.
        return max(0, min(sent - initial, lc))

    def _emit(
        self,
        state: CodecStreamState,
        chunk_id: int,
        *,
        num_new: int,
        left: int,
        finished: bool,
        first_audio: bool | None,
        now: float,
    ) -> OmniPayload:
        meta = Meta(left_context_size=left)
        if chunk_id == 0 and first_audio is not None:
            meta.first_audio = bool(first_audio)
        codes: Codes | None = None
        if num_new > 0:
            total = left + num_new
            codes = Codes(audio=flatten_codebook_major(state.tail_frames(total)))
            state.num_sent_frames += num_new
            if state.pacer is not None:
                state.pacer.on_sent(now, num_new)
            if self.config.codec_chunk_ramp is not None:
                while self._ramp_threshold(state.num_ramp_chunks) <= state.num_sent_frames:
                    state.num_ramp_chunks += 1
            self._drop_old_frames(state)
        state.num_payloads += 1
        if finished:
            state.is_finished = True
            state.frames.clear()
        return OmniPayload(codes=codes, meta=meta)

    def _drop_old_frames(self, state: CodecStreamState) -> None:
        """Forget entries that no future left context can reach."""
        keep = max(self.config.codec_left_context_frames, state.initial_chunk_frames)
        horizon = state.num_sent_frames - keep
        while state.frames and state.num_dropped_frames + state.frames[0].shape[0] <= horizon:
            state.num_dropped_frames += state.frames.popleft().shape[0]

    # ---- the valid-frame filter

    def _accepted_rows(
        self,
        state: CodecStreamState,
        codes_step: torch.Tensor | None,
        codec_frame_valid: torch.Tensor | bool | Sequence[bool] | None,
    ) -> torch.Tensor:
        """This step's frames that carry audio, as ``[n, Q]`` int64 on the CPU (n may be 0)."""
        q = self.config.num_codebooks
        if codes_step is None:
            if codec_frame_valid is not None:
                _validity_mask(codec_frame_valid, 0)  # still reject an empty flag tensor
            return torch.empty((0, q), dtype=torch.long)
        rows = _as_frames(codes_step, q)
        if codec_frame_valid is not None:
            return rows[_validity_mask(codec_frame_valid, rows.shape[0])]
        # One host copy of the step's few frames answers both questions below (a tensor
        # op each cost more than the frame's other work, once per row and step).
        values = rows.tolist()
        if not any(map(any, values)):
            return torch.empty((0, q), dtype=torch.long)  # the prefill placeholder row is all zeros
        # Post-EOS rows are not audio: keep the rows before the first stop token in codebook 0.
        stops = state.stop_token_ids
        for i, frame in enumerate(values):
            if frame[0] in stops:
                return rows[:i]
        return rows


def _as_frames(codes_step: object, num_codebooks: int) -> torch.Tensor:
    if not isinstance(codes_step, torch.Tensor):
        raise PayloadEncodeError(
            f"{_PROCESSOR}: codes.audio must be a torch.Tensor [n, {num_codebooks}], got {type(codes_step).__name__}"
        )
    # A Talker's frame is [1, Q] int64 on the CPU: that case asks the tensor as little as
    # it can (each question is a call into torch, once per row and step).
    is_long = codes_step.dtype is torch.long
    if not is_long and (
        codes_step.is_floating_point() or codes_step.is_complex() or codes_step.dtype == torch.bool
    ):
        raise PayloadEncodeError(f"{_PROCESSOR}: codec ids must be an integer tensor, got {codes_step.dtype}")
    t = codes_step.detach() if codes_step.requires_grad else codes_step
    shape = t.shape
    if len(shape) == 1 and shape[0] in (0, num_codebooks):
        t = t.reshape(-1, num_codebooks)
        shape = t.shape
    if len(shape) != 2 or shape[1] != num_codebooks:
        raise PayloadEncodeError(
            f"{_PROCESSOR}: codec step must be [n, Q={num_codebooks}] (or [Q]), got shape {tuple(codes_step.shape)}"
        )
    if is_long and t.is_cpu:
        return t  # what .to() would return
    return t.to(device="cpu", dtype=torch.long)


def _validity_mask(flag: torch.Tensor | bool | Sequence[bool], num_rows: int) -> torch.Tensor:
    """``codec_frame_valid`` → a bool mask over the step's rows.

    One flag per row filters rows (frames are the unit); otherwise the last flag decides
    for the whole span, as in the reference. An empty flag is an error.
    """
    t = torch.as_tensor(flag).reshape(-1)
    if t.numel() == 0:
        raise PayloadEncodeError(f"{_PROCESSOR}: meta.codec_frame_valid is empty; expected a flag per frame")
    t = t.to(torch.bool)
    if t.numel() == num_rows:
        return t
    return t[-1].expand(num_rows)
