"""The Talker → Code2Wav chunk schedule's settings, without torch (docs/protocol.md §5.2, §5.3).

* :class:`TalkerToCode2WavConfig` — ``C``/``Lc``/``I``/ramp/adaptive pacing/``Q``/stop ids,
  validated at construction (``from_extra`` reads the edge's connector ``extra``);
  :meth:`~TalkerToCode2WavConfig.describe` says the schedule in words.
* :func:`parse_codec_chunk_ramp` — a ramp given as a list or a comma string.

The processor that follows the schedule is :mod:`omnirelay.processors.talker_to_code2wav`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omnirelay.errors import ConfigError
from omnirelay.processors.pacing import PacingConfig

__all__ = [
    "DEFAULT_CODEC_STOP_TOKEN_IDS",
    "REPRODUCIBLE_FIRST_CHUNK_FRAMES",
    "TalkerToCode2WavConfig",
    "parse_codec_chunk_ramp",
]

logger = logging.getLogger(__name__)

#: The codec EOS of the Qwen3-Omni pipeline constraint (docs/protocol.md §5.2).
DEFAULT_CODEC_STOP_TOKEN_IDS: frozenset[int] = frozenset({2150})


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


#: C, the largest (adaptive) or steady (fixed) chunk, when an edge sets none.
DEFAULT_CODEC_CHUNK_FRAMES = 25
#: The first chunk of an edge in reproducible mode that sets no fixed schedule of its own
#: (the seed's 4-then-25, docs/protocol.md §5.2).
REPRODUCIBLE_FIRST_CHUNK_FRAMES = 4


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

    codec_chunk_frames: int = DEFAULT_CODEC_CHUNK_FRAMES
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
        reproducible: bool = False,
    ) -> TalkerToCode2WavConfig:
        """Read the ``codec_*`` options of an edge's connector ``extra`` mapping.

        ``extra`` is shared with the connector's own options, so other keys are left to
        the connector; an unknown ``codec_*`` key (a typo such as ``codec_chunk_frame``)
        is an error rather than a silently ignored setting.

        ``reproducible`` (the pipeline's reproducible mode): the chunks are cut on a fixed
        frame schedule, never by timing (docs/protocol.md §5.3) — the edge's ramp or first
        chunk if it sets one, else :data:`REPRODUCIBLE_FIRST_CHUNK_FRAMES` then ``C``. An
        edge that asks for the adaptive schedule explicitly is a configuration error.
        """
        known = set(cls._KEYS)
        for key in extra:
            if isinstance(key, str) and key.startswith("codec_") and key not in known:
                raise ConfigError(f"unknown option {key!r}; known codec options: {sorted(known)}")
        kwargs: dict[str, Any] = {k: extra[k] for k in cls._KEYS if k in extra}
        if reproducible:
            if kwargs.get("codec_chunk_adaptive") is True:
                raise ConfigError(
                    "reproducible: true needs a fixed chunk schedule, but this edge sets "
                    "codec_chunk_adaptive: true (chunks sized by timing); drop it or set it to false"
                )
            kwargs["codec_chunk_adaptive"] = False
            if kwargs.get("codec_chunk_ramp") is None and not kwargs.get("initial_codec_chunk_frames"):
                chunk = kwargs.get("codec_chunk_frames", DEFAULT_CODEC_CHUNK_FRAMES)
                first = REPRODUCIBLE_FIRST_CHUNK_FRAMES
                kwargs["initial_codec_chunk_frames"] = min(first, chunk) if isinstance(chunk, int) else first
        return cls(num_codebooks=num_codebooks, stop_token_ids=frozenset(stop_token_ids), **kwargs)
