"""Audio a client sends in: untrusted bytes → a mono float32 waveform at the rate a
pipeline listens at. Shared by chat's ``input_audio`` parts and any endpoint that takes
a user's voice.

* :func:`decode_base64_audio` ``(data, fmt, *, sample_rate, limits)`` — OpenAI's
  ``input_audio`` {``data``: base64, ``format``}: checks the base64 text, then
  :func:`decode_audio`.
* :func:`decode_audio` ``(raw, fmt, *, sample_rate, limits)`` — encoded bytes in one of
  :data:`INPUT_FORMATS` → a 1-D ``numpy.float32`` array in [-1, 1] at ``sample_rate``
  (channels mixed down, resampled by FFmpeg's resampler through PyAV).
* :class:`AudioLimits` — the largest encoded size and the longest decoded duration.
* :class:`AudioInputError` — what is wrong with the input, in a sentence a client can act
  on (an :class:`~omnirelay.errors.InvalidRequestError`: the server answers 400
  ``invalid_request_error``); ``param`` names the field when the caller gave one.

Formats: ``wav`` (RIFF/WAVE, any PCM or float sample format and channel count FFmpeg
reads), ``mp3``, and ``pcm16`` — raw 16-bit little-endian mono PCM at
:data:`PCM16_RATE` (24 kHz, as OpenAI's Realtime API; it carries no rate of its own).
Each format is opened with its own demuxer only: bytes are never probed as some other
container. Decoding stops as soon as the decoded audio passes the duration limit, so a
header that lies about its length costs no more than the limit.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import itertools
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from omnirelay.errors import InvalidRequestError

__all__ = [
    "DEFAULT_AUDIO_LIMITS",
    "FILE_EXTENSIONS",
    "FILE_FORMATS",
    "INPUT_FORMATS",
    "PCM16_RATE",
    "AudioInputError",
    "AudioLimits",
    "decode_audio",
    "decode_base64_audio",
]

#: Formats a client may send (OpenAI's ``input_audio.format`` names plus raw ``pcm16``).
INPUT_FORMATS = ("wav", "mp3", "pcm16")
#: Formats of an uploaded audio file (``/v1/audio/transcriptions``), as OpenAI takes them.
FILE_FORMATS = ("wav", "mp3", "flac", "ogg", "webm", "mp4")
#: A file name's extension → its format (OpenAI names the format by the extension).
FILE_EXTENSIONS = {
    "wav": "wav",
    "mp3": "mp3",
    "mpeg": "mp3",
    "mpga": "mp3",
    "flac": "flac",
    "ogg": "ogg",
    "oga": "ogg",
    "opus": "ogg",
    "webm": "webm",
    "mp4": "mp4",
    "m4a": "mp4",
}
#: The rate of raw ``pcm16`` input, which has no header to say it (OpenAI's Realtime rate).
PCM16_RATE = 24_000
#: the container FFmpeg opens for each format (pcm16 needs none)
_DEMUXERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "webm": "matroska", "mp4": "mov"}


class AudioInputError(InvalidRequestError):
    """Input audio that cannot be used; the message says why and what the limit is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class AudioLimits:
    """The most input audio one request may carry."""

    #: encoded bytes (after base64 decoding)
    max_bytes: int = 2 * 1024 * 1024
    #: decoded duration, in seconds
    max_duration_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"AudioLimits.max_bytes must be an int > 0, got {self.max_bytes!r}")
        if (
            isinstance(self.max_duration_s, bool)
            or not isinstance(self.max_duration_s, int | float)
            or not self.max_duration_s > 0
        ):
            raise ValueError(f"AudioLimits.max_duration_s must be a number > 0, got {self.max_duration_s!r}")


DEFAULT_AUDIO_LIMITS = AudioLimits()


def decode_base64_audio(
    data: object,
    fmt: object,
    *,
    sample_rate: int,
    limits: AudioLimits = DEFAULT_AUDIO_LIMITS,
    param: str | None = None,
) -> np.ndarray:
    """The waveform of base64 ``data`` in format ``fmt`` at ``sample_rate`` (see the module
    docstring). ``param`` (``messages[0].content[1].input_audio``) prefixes the field names
    of errors. Raises :class:`AudioInputError`."""
    where = f"{param}." if param else ""
    _check_format(fmt, f"{where}format")
    if not isinstance(data, str) or not data:
        raise AudioInputError(f"{where}data must be a non-empty base64 string", param=f"{where}data")
    # Checked on the text first: a too-large clip is refused before it is decoded.
    encoded_limit = 4 * ((limits.max_bytes + 2) // 3)
    if len(data) > encoded_limit:
        raise AudioInputError(
            f"{where}data is about {len(data) * 3 // 4} bytes of audio; the limit is "
            f"{limits.max_bytes} bytes (max_audio_input_bytes)",
            param=f"{where}data",
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioInputError(
            f"{where}data is not valid base64 ({exc}); send the file's bytes base64-encoded",
            param=f"{where}data",
        ) from exc
    return decode_audio(raw, str(fmt), sample_rate=sample_rate, limits=limits, param=param)


def decode_audio(
    raw: bytes,
    fmt: str,
    *,
    sample_rate: int,
    limits: AudioLimits = DEFAULT_AUDIO_LIMITS,
    param: str | None = None,
    formats: tuple[str, ...] = INPUT_FORMATS,
) -> np.ndarray:
    """Encoded ``raw`` bytes in format ``fmt`` (one of ``formats``) → mono float32 at
    ``sample_rate``. Raises :class:`AudioInputError` (format, size, duration, undecodable
    bytes, no audio)."""
    where = f"{param}." if param else ""
    _check_format(fmt, f"{where}format", formats)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be an int > 0, got {sample_rate!r}")
    if len(raw) > limits.max_bytes:
        raise AudioInputError(
            f"{where}data is {len(raw)} bytes of audio; the limit is {limits.max_bytes} bytes "
            "(max_audio_input_bytes)",
            param=f"{where}data",
        )
    max_samples = int(limits.max_duration_s * sample_rate)
    try:
        pieces = _decode(raw, fmt, sample_rate, max_samples, where)
    except AudioInputError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OverflowError) as exc:
        raise AudioInputError(
            f"{where}data is not a readable {fmt} file (could not decode audio: {_reason(exc)})",
            param=f"{where}data",
        ) from exc
    waveform = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    if waveform.size == 0:
        raise AudioInputError(f"{where}data holds no audio samples", param=f"{where}data")
    return np.clip(waveform, -1.0, 1.0).astype(np.float32, copy=False)


def _check_format(fmt: object, param: str, formats: tuple[str, ...] = INPUT_FORMATS) -> None:
    if fmt not in formats or (fmt != "pcm16" and fmt not in _DEMUXERS):
        shown = repr(fmt) if isinstance(fmt, str) else type(fmt).__name__
        pcm = f" (pcm16: raw 16-bit little-endian mono at {PCM16_RATE} Hz)" if "pcm16" in formats else ""
        raise AudioInputError(
            f"{param} {shown} is not supported; supported input formats: {list(formats)}{pcm}", param=param
        )


def _decode(raw: bytes, fmt: str, rate: int, max_samples: int, where: str) -> list[np.ndarray]:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    pieces: list[np.ndarray] = []
    total = 0
    frames = iter(_pcm16_frames(raw, where)) if fmt == "pcm16" else _container_frames(raw, fmt)
    with contextlib.closing(frames) if isinstance(frames, Generator) else contextlib.nullcontext():
        for frame in itertools.chain(frames, (None,)):
            for out in resampler.resample(frame):
                samples = out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
                total += samples.size
                if total > max_samples:
                    raise AudioInputError(
                        f"{where}data is longer than the limit of {max_samples / rate:g} s of audio "
                        "(max_audio_input_s)",
                        param=f"{where}data",
                    )
                pieces.append(samples)
    return pieces


def _pcm16_frames(raw: bytes, where: str) -> list[Any]:
    if len(raw) % 2:
        raise AudioInputError(
            f"{where}data has {len(raw)} bytes; pcm16 is 2 bytes per sample (an even count)",
            param=f"{where}data",
        )
    samples = np.frombuffer(raw, dtype="<i2")
    if samples.size == 0:
        return []
    frame = av.AudioFrame.from_ndarray(samples.astype(np.int16).reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = PCM16_RATE
    frame.pts = 0
    return [frame]


def _container_frames(raw: bytes, fmt: str) -> Iterator[Any]:
    """Every decoded frame of the first audio stream, lazily (so decoding stops at the
    duration limit); mono layouts are made by the resampler."""
    container: Any = av.open(io.BytesIO(raw), mode="r", format=_DEMUXERS[fmt])
    try:
        if not container.streams.audio:
            raise ValueError("it has no audio stream")
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            frame.pts = None  # the resampler counts samples itself; broken timestamps do not matter
            yield frame
    finally:
        container.close()


def _reason(exc: BaseException) -> str:
    """Why the bytes did not decode, in words: FFmpeg's message without its error number
    and the ``'<none>'`` file name of bytes read from memory."""
    text = exc.strerror if isinstance(exc, av.FFmpegError) and exc.strerror else str(exc)
    text = text.strip() or type(exc).__name__
    return text[:1].lower() + text[1:200]
