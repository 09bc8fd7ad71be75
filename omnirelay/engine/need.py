"""Which running requests a tick steps: by need, the streams short of playback first.

In a device group (docs/design.md §12) one loop launches every stage's steps, and a step
in flight is a wait for whatever arrives meanwhile. A tick that steps every running
request makes a new stream's first frame or chunk wait for a batch of streams that have
seconds of audio banked. :class:`NeedPolicy` picks the tick's requests instead:

* a request is **urgent** while it has produced nothing (a new request's prefill, a
  stream's first chunk) or while its *headroom* — the audio it produced, less the time
  since its first output — is below ``headroom_s``;
* a tick with urgent requests steps those alone: a short step of their own, launched
  first (the group's loop launches a stage's next step as soon as its last one ended);
  the others wait one tick, which their headroom covers. A stream left out grows
  short of headroom and becomes urgent itself, so no stream starves;
* a tick with none steps everyone, at most ``max_step_tokens`` of work (the scheduler's
  token budget; a step stays short, so an urgent request arriving during it waits little).

What a request produced: ``seconds_per_token`` per output token (an AR stage whose
tokens are codec frames: the Talker, 80 ms a frame), else the audio its outputs carried
(:attr:`~omnirelay.engine.request.Request.output_seconds`: Code2Wav). The headroom is the
producer's view, judged from its first output — the same view as the adaptive chunk
schedule's (docs/protocol.md §5.3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

__all__ = [
    "DECODER_STEP_TOKENS",
    "DECODER_URGENT_HEADROOM_S",
    "FRAMES_URGENT_HEADROOM_S",
    "NeedPolicy",
    "audio_seconds",
]

#: A decoder stream (Code2Wav) is urgent below this headroom: its first chunk, and a
#: stream whose player ran dry. Its later chunks come when the producer's headroom nears
#: the schedule's margin (docs/protocol.md §5.3), and a step decodes them within it.
DECODER_URGENT_HEADROOM_S = 0.0
#: A decoder step without urgent streams decodes at most this much (None: no cap of its
#: own; docs/performance.md: the cap's extra steps cost more than they save).
DECODER_STEP_TOKENS: int | None = None
#: A frame producer's stream (the Talker) is urgent below this headroom: a new request,
#: and a stream behind real time. A larger one keeps streams in their slots longer
#: (they are stepped only to stay that far ahead), which fills the slots at load.
FRAMES_URGENT_HEADROOM_S = 0.0


class _Produces(Protocol):
    """What a request shows of its outputs (:class:`~omnirelay.engine.request.Request`)."""

    @property
    def first_token_time(self) -> float | None: ...

    @property
    def output_seconds(self) -> float: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


R = TypeVar("R", bound=_Produces)


@dataclasses.dataclass(frozen=True, slots=True)
class NeedPolicy:
    """See the module docstring."""

    #: below this headroom a request is urgent (seconds)
    headroom_s: float
    #: the audio of one output token (None: count the outputs' audio)
    seconds_per_token: float | None = None
    #: the token budget of a tick without urgent requests (None: the scheduler's own)
    max_step_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.headroom_s < 0:
            raise ValueError(f"headroom_s must be >= 0, got {self.headroom_s}")
        if self.seconds_per_token is not None and self.seconds_per_token <= 0:
            raise ValueError(f"seconds_per_token must be > 0, got {self.seconds_per_token}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    def headroom(self, request: _Produces, now: float) -> float | None:
        """Seconds of audio produced and not yet played; None: nothing produced yet."""
        start = request.first_token_time
        if start is None:
            return None
        if self.seconds_per_token is None:
            produced = request.output_seconds
        else:
            produced = len(request.output_token_ids) * self.seconds_per_token
        return produced - (now - start)

    def is_urgent(self, request: _Produces, now: float) -> bool:
        headroom = self.headroom(request, now)
        return headroom is None or headroom < self.headroom_s

    def select(self, requests: Sequence[R], now: float) -> tuple[list[R], bool]:
        """The requests a tick steps, in their order, and whether they are the urgent ones
        (the others wait); with no urgent request, all of them."""
        urgent = [r for r in requests if self.is_urgent(r, now)]
        if urgent and len(urgent) < len(requests):
            return urgent, True
        return list(requests), bool(urgent)


def audio_seconds(audio: Any, sample_rate: int | None) -> float:
    """The duration of an output's audio (a 1-D sample tensor or sequence); 0 without a rate."""
    if audio is None or not sample_rate:
        return 0.0
    numel = getattr(audio, "numel", None)
    return (int(numel()) if callable(numel) else len(audio)) / sample_rate
