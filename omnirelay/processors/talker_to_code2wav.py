"""Talker → Code2Wav: buffer codec frames and emit decode windows (docs/protocol.md §5.2, §5.3).

The Talker produces one codec frame of ``Q`` codebooks per step (``[1, Q]``; a step may
carry several rows). Code2Wav decodes windows of frames: each payload carries ``new``
frames never sent before plus up to ``Lc`` frames of left context already sent, so the
causal vocoder can re-decode the boundary (docs/protocol.md §6.2 trims the result).

* :class:`TalkerToCode2WavConfig` — ``C``/``Lc``/``I``/ramp/adaptive pacing/``Q``/stop ids,
  validated at construction (``from_extra`` reads the edge's connector ``extra`` options).
* :func:`parse_codec_chunk_ramp` — a ramp given as a list or a comma string.
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

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.errors import ConfigError, PayloadEncodeError
from omnirelay.payload.schema import Codes, Meta, OmniPayload
from omnirelay.processors.base import check_chunk_id
from omnirelay.processors.pacing import FrameRate, PacingConfig, StreamPacer

__all__ = [
    "DEFAULT_CODEC_STOP_TOKEN_IDS",
    "CodecStreamState",
    "TalkerToCode2WavConfig",
    "TalkerToCode2WavProcessor",
    "flatten_codebook_major",
    "parse_codec_chunk_ramp",
    "unflatten_codebook_major",
]

logger = logging.getLogger(__name__)

#: The codec EOS of the Qwen3-Omni pipeline constraint (docs/protocol.md §5.2).
DEFAULT_CODEC_STOP_TOKEN_IDS: frozenset[int] = frozenset({2150})

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


# --------------------------------------------------------------------------- config


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def parse_codec_chunk_ramp(value: object) -> tuple[int, ...] | None:
    """Parse ``codec_chunk_ramp``: ``None``, a list/tuple of ints, or a comma string ``"4,8,25"``.

    A ramp needs at least two positive ints (docs/protocol.md §5.3). Unlike the reference, which
    disables a malformed ramp with a warning, a malformed ramp is a :class:`ConfigError`.
    """
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not value.strip() or any(not p for p in parts):
            raise ConfigError(
                f"codec_chunk_ramp {value!r} is not a comma-separated list of positive ints "
                "(example: '4,8,16,25')"
            )
        try:
            entries: list[object] = [int(p) for p in parts]
        except ValueError as exc:
            raise ConfigError(
                f"codec_chunk_ramp {value!r} is not a comma-separated list of positive ints "
                "(example: '4,8,16,25')"
            ) from exc
    elif isinstance(value, list | tuple):
        entries = list(value)
    else:
        raise ConfigError(
            f"codec_chunk_ramp must be a list of ints or a comma string, got {type(value).__name__}"
        )
    if len(entries) < 2:
        raise ConfigError(
            f"codec_chunk_ramp needs at least 2 entries, got {len(entries)}; "
            "for a single first chunk size use initial_codec_chunk_frames"
        )
    return tuple(_check_int(f"codec_chunk_ramp[{i}]", e, 1) for i, e in enumerate(entries))


@dataclass(frozen=True, slots=True)
class TalkerToCode2WavConfig:
    """Chunking of the Talker → Code2Wav edge (docs/protocol.md §5.2 config, §5.3 ramp).

    ``codec_chunk_adaptive`` (default: on unless a ramp is given) paces chunks by playback
    headroom: ``C`` is then the largest chunk, I the smallest first chunk (0 counts as 1),
    ``codec_chunk_margin_ms`` the headroom kept in reserve, ``codec_frame_ms`` the audio
    of one frame and ``codec_holdback_ms`` what the decoder holds back at a window's end
    (the defaults are Qwen3-Omni's: 80 ms frames, 555 samples at 24 kHz).

    Fixed schedules: ``initial_codec_chunk_frames`` (I) > 0 sends a small first chunk of I
    frames to cut time to first audio; ``codec_chunk_ramp`` replaces I by a table of chunk
    sizes. ``codec_chunk_ramp`` may be given as a list or comma string; it is stored as a
    tuple.
    """

    codec_chunk_frames: int = 25
    codec_left_context_frames: int = 25
    initial_codec_chunk_frames: int = 0
    codec_chunk_ramp: tuple[int, ...] | None = None
    codec_chunk_adaptive: bool | None = None
    codec_chunk_margin_ms: float = 150.0
    codec_frame_ms: float = 80.0
    codec_holdback_ms: float = 23.125
    num_codebooks: int = 16
    stop_token_ids: frozenset[int] = DEFAULT_CODEC_STOP_TOKEN_IDS

    def __post_init__(self) -> None:
        chunk = _check_int("codec_chunk_frames", self.codec_chunk_frames, 1)
        _check_int("codec_left_context_frames", self.codec_left_context_frames, 0)
        initial = _check_int("initial_codec_chunk_frames", self.initial_codec_chunk_frames, 0)
        if initial > chunk:
            raise ConfigError(
                f"initial_codec_chunk_frames ({initial}) must not exceed codec_chunk_frames ({chunk}); "
                "the first chunk exists to be smaller than the steady one"
            )
        _check_int("num_codebooks", self.num_codebooks, 1)
        ramp = parse_codec_chunk_ramp(self.codec_chunk_ramp)
        object.__setattr__(self, "codec_chunk_ramp", ramp)
        if ramp is not None and ramp[-1] != chunk:
            logger.warning(
                "codec_chunk_ramp %s does not end at codec_chunk_frames=%d; chunks past the ramp use %d",
                list(ramp),
                chunk,
                chunk,
            )
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, Iterable):
            raise ConfigError(f"stop_token_ids must be a collection of ints, got {self.stop_token_ids!r}")
        stops = frozenset(_check_int("stop_token_ids[]", t, 0) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)
        adaptive = self.codec_chunk_adaptive
        if adaptive is not None and not isinstance(adaptive, bool):
            raise ConfigError(f"codec_chunk_adaptive must be true or false, got {adaptive!r}")
        if adaptive and ramp is not None:
            raise ConfigError(
                "codec_chunk_adaptive: true and a codec_chunk_ramp are two schedules; keep one "
                "(the ramp is a fixed schedule: set codec_chunk_adaptive: false or drop it)"
            )
        object.__setattr__(self, "codec_chunk_adaptive", ramp is None if adaptive is None else adaptive)
        for name in ("codec_chunk_margin_ms", "codec_frame_ms", "codec_holdback_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a number of milliseconds, got {value!r}")
        # PacingConfig checks the ranges; build it once so a bad value fails at load.
        self.pacing()

    def describe(self) -> str:
        """The schedule in words (``omnirelay check``)."""
        lc = f"left context {self.codec_left_context_frames} frames"
        if self.codec_chunk_adaptive:
            least = max(1, self.initial_codec_chunk_frames)
            return (
                f"adaptive: a first chunk of {least}+ frames (more while frames come slowly), then sized "
                f"by playback headroom (margin {self.codec_chunk_margin_ms:g} ms), at most "
                f"{self.codec_chunk_frames} frames; {lc}"
            )
        if self.codec_chunk_ramp is not None:
            ramp = ", ".join(str(n) for n in self.codec_chunk_ramp)
            return f"fixed ramp {ramp}, then {self.codec_chunk_frames} frames; {lc}"
        first = f"{self.initial_codec_chunk_frames}, then " if self.initial_codec_chunk_frames else ""
        return f"fixed: {first}{self.codec_chunk_frames} frames per chunk; {lc}"

    def pacing(self) -> PacingConfig:
        """The adaptive pacer's settings of this edge."""
        return PacingConfig(
            frame_s=self.codec_frame_ms / 1000.0,
            holdback_s=self.codec_holdback_ms / 1000.0,
            max_frames=self.codec_chunk_frames,
            margin_s=self.codec_chunk_margin_ms / 1000.0,
        )

    _KEYS = (
        "codec_chunk_frames",
        "codec_left_context_frames",
        "initial_codec_chunk_frames",
        "codec_chunk_ramp",
        "codec_chunk_adaptive",
        "codec_chunk_margin_ms",
        "codec_frame_ms",
        "codec_holdback_ms",
    )

    @classmethod
    def from_extra(
        cls,
        extra: Mapping[str, Any],
        *,
        num_codebooks: int = 16,
        stop_token_ids: Iterable[int] = DEFAULT_CODEC_STOP_TOKEN_IDS,
    ) -> TalkerToCode2WavConfig:
        """Read the ``codec_*`` options of an edge's connector ``extra`` mapping.

        ``extra`` is shared with the connector's own options, so other keys are left to
        the connector; an unknown ``codec_*`` key (a typo such as ``codec_chunk_frame``)
        is an error rather than a silently ignored setting.
        """
        known = set(cls._KEYS)
        for key in extra:
            if isinstance(key, str) and key.startswith("codec_") and key not in known:
                raise ConfigError(f"unknown option {key!r}; known codec options: {sorted(known)}")
        kwargs: dict[str, Any] = {k: extra[k] for k in cls._KEYS if k in extra}
        return cls(num_codebooks=num_codebooks, stop_token_ids=frozenset(stop_token_ids), **kwargs)


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
        empty = torch.empty((0, q), dtype=torch.long)
        if codes_step is None:
            if codec_frame_valid is not None:
                _validity_mask(codec_frame_valid, 0)  # still reject an empty flag tensor
            return empty
        rows = _as_frames(codes_step, q)
        if codec_frame_valid is not None:
            return rows[_validity_mask(codec_frame_valid, rows.shape[0])]
        if rows.numel() == 0 or not bool(rows.any()):
            return empty  # the prefill placeholder row is all zeros
        # Post-EOS rows are not audio: keep the rows before the first stop token in codebook 0.
        for i, token in enumerate(rows[:, 0].tolist()):
            if token in state.stop_token_ids:
                return rows[:i]
        return rows


def _as_frames(codes_step: object, num_codebooks: int) -> torch.Tensor:
    if not isinstance(codes_step, torch.Tensor):
        raise PayloadEncodeError(
            f"{_PROCESSOR}: codes.audio must be a torch.Tensor [n, {num_codebooks}], got {type(codes_step).__name__}"
        )
    if codes_step.is_floating_point() or codes_step.is_complex() or codes_step.dtype == torch.bool:
        raise PayloadEncodeError(f"{_PROCESSOR}: codec ids must be an integer tensor, got {codes_step.dtype}")
    t = codes_step.detach()
    if t.dim() == 1 and t.numel() in (0, num_codebooks):
        t = t.reshape(-1, num_codebooks)
    if t.dim() != 2 or t.shape[1] != num_codebooks:
        raise PayloadEncodeError(
            f"{_PROCESSOR}: codec step must be [n, Q={num_codebooks}] (or [Q]), got shape {tuple(codes_step.shape)}"
        )
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
