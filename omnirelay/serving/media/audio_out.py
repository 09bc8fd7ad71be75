"""Audio on the wire: streaming emission (docs/protocol.md §7.3) and PCM16 / WAV encoding.

* :class:`AudioEmitter` — turns the audio values of a request's outputs into the new
  samples to send, each sample exactly once:

  - a **list** value (an engine's accumulating list of pieces) → only
    ``items[prev_count:]``, then ``prev_count = len(items)``;
  - a **tensor** in :attr:`OutputKind.DELTA` → sent as is, ``prev_count += 1``;
  - a **tensor** in :attr:`OutputKind.CUMULATIVE` (the whole waveform so far, as
    timestamp requests run) → ``audio[emitted_samples:]``, then ``emitted_samples`` = its
    length; nothing when empty. The trim happens before any encoding.

  The sample rate is read from each value (``sr``; its last element when a list or a
  tensor); a change mid-stream is an :class:`AudioStreamError`. This is a different
  de-duplication from Code2Wav's decode-window trim (docs/protocol.md §6.2): that one removes
  window overlap inside a stage; this one removes repetition of cumulative outputs.
* :func:`pcm16` / :func:`wav_header` / :func:`wav_bytes` — 16-bit little-endian mono PCM
  and its RIFF header; a streamed WAV has the header (sizes unknown: ``0xFFFFFFFF``)
  before the first audio bytes. :func:`parse_wav` reads one back (tests, bench).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnirelay.errors import OmniRelayError

__all__ = [
    "DEFAULT_SAMPLE_RATE",
    "AudioEmitter",
    "AudioStreamError",
    "OutputKind",
    "parse_wav",
    "pcm16",
    "wav_bytes",
    "wav_header",
]

DEFAULT_SAMPLE_RATE = 24000
_UNKNOWN_SIZE = 0xFFFFFFFF


class AudioStreamError(OmniRelayError):
    """An audio stream that cannot be sent as one stream (its sample rate changed, a WAV
    stream without a sample rate, an audio value of an unknown kind)."""


class OutputKind(enum.Enum):
    """How a request's audio values relate to each other (docs/protocol.md §7.1, §7.2)."""

    DELTA = "delta"  # each value holds only new samples
    CUMULATIVE = "cumulative"  # each value holds every sample so far


def _flat(value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).reshape(-1)


def _rate_of(sample_rate: Any) -> int | None:
    if sample_rate is None:
        return None
    if isinstance(sample_rate, torch.Tensor | np.ndarray):
        flat = sample_rate.reshape(-1)
        return int(flat[-1]) if len(flat) else None
    if isinstance(sample_rate, Sequence) and not isinstance(sample_rate, str | bytes):
        return _rate_of(sample_rate[-1]) if sample_rate else None
    return int(sample_rate)


class AudioEmitter:
    """Per request and stream: which samples of the next audio value are new (docs/protocol.md §7.3).

    Called once per output that carries audio, in arrival order, on one task.
    """

    def __init__(
        self,
        kind: OutputKind = OutputKind.DELTA,
        *,
        require_sample_rate: bool = False,
        default_sample_rate: int = DEFAULT_SAMPLE_RATE,
    ) -> None:
        self.kind = kind
        self.require_sample_rate = require_sample_rate
        self.default_sample_rate = default_sample_rate
        self.sample_rate: int | None = None
        self.emitted_samples = 0  # samples handed out so far
        self.prev_count = 0  # list items / delta tensors consumed so far

    @property
    def has_started(self) -> bool:
        return self.sample_rate is not None

    def push(self, audio: Any, sample_rate: Any = None) -> torch.Tensor | None:
        """The new samples of ``audio`` (1-D float32), or None when nothing is new."""
        if audio is None:
            return None
        if isinstance(audio, list | tuple):
            items = list(audio)
            new_items = items[self.prev_count :]
            self.prev_count = len(items)
            new = torch.cat([_flat(a) for a in new_items]) if new_items else torch.zeros(0)
        elif isinstance(audio, torch.Tensor | np.ndarray):
            samples = _flat(audio)
            if self.kind is OutputKind.CUMULATIVE:
                if samples.numel() < self.emitted_samples:
                    raise AudioStreamError(
                        f"a cumulative audio value shrank from {self.emitted_samples} to "
                        f"{samples.numel()} samples"
                    )
                new = samples[self.emitted_samples :]
            else:
                new = samples
                self.prev_count += 1
        else:
            raise AudioStreamError(
                f"audio value of type {type(audio).__name__} is neither a list nor a tensor"
            )
        if new.numel() == 0:
            return None
        self._check_rate(_rate_of(sample_rate))
        self.emitted_samples += new.numel()
        return new

    def _check_rate(self, rate: int | None) -> None:
        if self.sample_rate is None:
            if rate is None and self.require_sample_rate:
                raise AudioStreamError("the first audio carries no sample rate, which a WAV stream needs")
            self.sample_rate = rate if rate is not None else self.default_sample_rate
        elif rate is not None and rate != self.sample_rate:
            raise AudioStreamError(
                f"the sample rate changed mid-stream from {self.sample_rate} Hz to {rate} Hz"
            )


def pcm16(samples: torch.Tensor | np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped) as 16-bit little-endian PCM."""
    x = np.asarray(torch.as_tensor(samples, dtype=torch.float32).reshape(-1).numpy())
    ints = np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")
    return ints.tobytes()


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """The 44-byte RIFF/WAVE header of mono 16-bit PCM; ``None``: a stream of unknown length."""
    if num_samples is None:
        data_size = riff_size = _UNKNOWN_SIZE
    else:
        data_size = 2 * num_samples
        riff_size = min(36 + data_size, _UNKNOWN_SIZE)
    return b"".join(
        (
            b"RIFF",
            struct.pack("<I", riff_size),
            b"WAVEfmt ",
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16),
            b"data",
            struct.pack("<I", data_size),
        )
    )


def wav_bytes(samples: torch.Tensor | np.ndarray, sample_rate: int) -> bytes:
    """A complete WAV file of ``samples``."""
    data = pcm16(samples)
    return wav_header(sample_rate, len(data) // 2) + data


def parse_wav(data: bytes) -> tuple[np.ndarray, int]:
    """``(int16 samples, sample rate)`` of a mono 16-bit WAV (also one streamed with
    unknown sizes: the data chunk then runs to the end)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioStreamError("not a RIFF/WAVE file")
    pos = 12
    rate: int | None = None
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = pos + 8
        if tag == b"fmt ":
            fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", data[body : body + 16])
            if fmt != 1 or channels != 1 or bits != 16:
                raise AudioStreamError(
                    f"only mono 16-bit PCM is read (format {fmt}, {channels} ch, {bits} bit)"
                )
        elif tag == b"data":
            if rate is None:
                raise AudioStreamError("the data chunk comes before the fmt chunk")
            end = len(data) if size == _UNKNOWN_SIZE else body + size
            return np.frombuffer(data[body:end], dtype="<i2").copy(), rate
        pos = body + size + (size & 1)
    raise AudioStreamError("no data chunk")
