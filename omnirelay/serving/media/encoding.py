"""Audio formats on the wire: :data:`FORMATS` and :class:`AudioEncoder` (one per response).

=========  ==============================  ===========================================
format     Content-Type                    bytes
=========  ==============================  ===========================================
``mp3``    ``audio/mpeg``                  MPEG-1/2 Layer III (LAME), 64 kbit/s mono
``opus``   ``audio/ogg``                   Opus in Ogg, 48 kHz, 32 kbit/s mono
``aac``    ``audio/aac``                   AAC-LC in ADTS frames, 64 kbit/s mono
``flac``   ``audio/flac``                  FLAC, 16-bit mono
``wav``    ``audio/wav``                   RIFF/WAVE, 16-bit PCM mono
``pcm``    ``audio/pcm``                   raw 16-bit little-endian PCM mono, 24 kHz
=========  ==============================  ===========================================

The compressed formats are encoded and muxed by FFmpeg's libraries through PyAV; the
pipeline's rate is kept when the encoder takes it, else PyAV's resampler converts (Opus
always runs at 48 kHz). The same resampler cuts the audio into the encoder's frame size.
Raw ``pcm`` carries no rate of its own, so it is always at :data:`PCM_RATE` (24 kHz, the
rate OpenAI's ``pcm`` and Realtime ``pcm16`` are at): audio of another rate goes through
PyAV's resampler; ``wav`` keeps the pipeline's rate, which its header names.

An encoder is **streaming** or **whole**:

* streaming — :meth:`AudioEncoder.push` returns the bytes ready so far (the container's
  header with the first ones), :meth:`~AudioEncoder.finish` the rest. The concatenation
  is a playable file that never needed a seek: a WAV header of unknown length, a FLAC
  STREAMINFO without a sample count, an MP3 without a gapless tag (decoders then play
  the encoder's priming and padding, a few ms of silence). An encoder holds back at most
  what its next frame needs (plus, for Opus, one Ogg page of up to 100 ms) until more
  audio or the end arrives.
* whole — :meth:`~AudioEncoder.push` returns nothing; :meth:`~AudioEncoder.finish` returns
  the complete file, written into a seekable buffer, so sizes, sample counts and MP3's
  gapless tag are filled in.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from omnirelay.serving.media.audio_out import pcm16, wav_header

__all__ = ["FORMATS", "PCM_RATE", "AudioEncoder", "AudioFormat", "PcmResampler"]

#: The rate of raw ``pcm`` output (OpenAI's): a format without a header cannot say another.
PCM_RATE = 24_000


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """One ``response_format``: its Content-Type and how PyAV makes it."""

    name: str
    media_type: str
    #: PyAV's muxer and encoder; None: written here (``wav``, ``pcm``)
    container: str | None = None
    codec: str | None = None
    sample_format: str | None = None
    bit_rate: int | None = None
    #: the one rate the encoder runs at (None: the pipeline's, or the nearest it takes)
    fixed_rate: int | None = None
    #: muxer options (Ogg: the longest page, in microseconds, so pages go out promptly)
    options: tuple[tuple[str, str], ...] = ()


FORMATS: dict[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("mp3", "audio/mpeg", "mp3", "libmp3lame", "s16p", 64_000),
        AudioFormat(
            "opus", "audio/ogg", "ogg", "libopus", "flt", 32_000, 48_000, (("page_duration", "100000"),)
        ),
        AudioFormat("aac", "audio/aac", "adts", "aac", "fltp", 64_000),
        AudioFormat("flac", "audio/flac", "flac", "flac", "s16"),
        AudioFormat("wav", "audio/wav"),
        AudioFormat("pcm", "audio/pcm", fixed_rate=PCM_RATE),
    )
}


class _Sink:
    """A write-only, unseekable file for PyAV's muxer: what it wrote since the last take."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class PcmResampler:
    """Float samples at ``in_rate`` → 16-bit PCM at ``out_rate``, as a stream: FFmpeg's
    resampler through PyAV, which keeps its filter's history between pushes; :meth:`flush`
    returns what it still holds, so that the whole lasts as long as the input (to the
    nearest output sample: a clip shorter than the filter gets its missing samples as
    silence). The same rate passes straight through."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._resampler: Any = (
            None if in_rate == out_rate else av.AudioResampler(format="s16", layout="mono", rate=out_rate)
        )
        self._in_samples = 0
        self._out_samples = 0

    def push(self, samples: np.ndarray) -> bytes:
        flat = np.ascontiguousarray(np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0))
        if self._resampler is None:
            return pcm16(flat)
        if flat.size == 0:
            return b""
        frame = av.AudioFrame.from_ndarray(flat.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.in_rate
        frame.pts = self._in_samples
        self._in_samples += flat.size
        return self._bytes(self._resampler.resample(frame))

    def flush(self) -> bytes:
        if self._resampler is None:
            return b""
        tail = self._bytes(self._resampler.resample(None))
        missing = round(self._in_samples * self.out_rate / self.in_rate) - self._out_samples
        return tail + bytes(2 * missing) if missing > 0 else tail

    def _bytes(self, frames: list[Any]) -> bytes:
        data = b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)
        self._out_samples += len(data) // 2
        return data


def _encoder_rate(fmt: AudioFormat, rate: int) -> int:
    """The rate ``fmt``'s encoder runs at for audio of ``rate`` Hz."""
    if fmt.fixed_rate is not None:
        return fmt.fixed_rate
    assert fmt.codec is not None
    rates = av.codec.Codec(fmt.codec, "w").audio_rates
    if not rates or rate in rates:
        return rate
    above = [r for r in rates if r >= rate]
    return min(above) if above else max(rates)


class _PyAVWriter:
    """One PyAV output container with one mono audio stream."""

    def __init__(self, fmt: AudioFormat, rate: int, *, is_streaming: bool) -> None:
        assert fmt.container is not None and fmt.codec is not None and fmt.sample_format is not None
        self.out: _Sink | io.BytesIO = _Sink() if is_streaming else io.BytesIO()
        self.rate = _encoder_rate(fmt, rate)
        self._container: Any = av.open(self.out, mode="w", format=fmt.container, options=dict(fmt.options))
        stream: Any = self._container.add_stream(fmt.codec, rate=self.rate, layout="mono")
        self._codec = stream.codec_context
        self._codec.format = fmt.sample_format
        if fmt.bit_rate is not None:
            self._codec.bit_rate = fmt.bit_rate
        self._stream = stream
        self._resampler = av.AudioResampler(
            format=fmt.sample_format, layout="mono", rate=self.rate, frame_size=self._codec.frame_size or None
        )
        self._in_rate = rate
        self._in_samples = 0

    def write(self, samples: np.ndarray | None) -> None:
        """Encode ``samples`` (float32 in [-1, 1]); None: flush everything and close."""
        if samples is None:
            self._encode(self._resampler.resample(None))
            self._mux(self._stream.encode(None))
            self._container.close()
            return
        if samples.size == 0:
            return
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self._in_rate
        frame.pts = self._in_samples
        self._in_samples += samples.size
        self._encode(self._resampler.resample(frame))

    def _encode(self, frames: list[Any]) -> None:
        for frame in frames:
            self._mux(self._stream.encode(frame))

    def _mux(self, packets: list[Any]) -> None:
        if packets:
            self._container.mux(packets)

    def take(self) -> bytes:
        return self.out.take() if isinstance(self.out, _Sink) else b""


class AudioEncoder:
    """One response's audio in ``fmt`` (see the module docstring). The sample rate is
    given with the first audio (:meth:`push`), or to :meth:`finish` when there was none."""

    def __init__(self, fmt: str, *, is_streaming: bool) -> None:
        self.format = FORMATS[fmt]
        self.is_streaming = is_streaming
        self.input_rate: int | None = None
        self.output_rate: int | None = None
        self._pcm: list[bytes] = []  # wav/pcm of a whole response
        self._writer: _PyAVWriter | None = None
        self._resampler: PcmResampler | None = None  # pcm of another rate than PCM_RATE
        self._is_finished = False

    @property
    def media_type(self) -> str:
        return self.format.media_type

    def push(self, samples: Any, sample_rate: int) -> bytes:
        """Encode new samples (1-D floats); the bytes ready now (always ``b""`` when whole)."""
        assert not self._is_finished, "push after finish"
        flat = np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(-1))
        first = self._start(sample_rate)
        if self.format.container is None:
            data = (
                self._resampler.push(flat) if self._resampler is not None else pcm16(np.clip(flat, -1.0, 1.0))
            )
            if not self.is_streaming:
                self._pcm.append(data)
                return b""
            return wav_header(sample_rate) + data if first and self.format.name == "wav" else data
        assert self._writer is not None
        self._writer.write(np.clip(flat, -1.0, 1.0))
        return self._writer.take()

    def finish(self, default_rate: int) -> bytes:
        """Flush the encoder: the last bytes of a stream, or the whole file."""
        assert not self._is_finished, "finish twice"
        first = self._start(default_rate)
        self._is_finished = True
        if self.format.container is None:
            tail = self._resampler.flush() if self._resampler is not None else b""
            if self.is_streaming:
                # A stream that never had audio still owes its header.
                return wav_header(default_rate) if first and self.format.name == "wav" else tail
            data = b"".join([*self._pcm, tail])
            self._pcm.clear()
            if self.format.name == "wav":
                assert self.input_rate is not None
                return wav_header(self.input_rate, len(data) // 2) + data
            return data
        assert self._writer is not None
        self._writer.write(None)
        out = self._writer.out
        return out.take() if isinstance(out, _Sink) else out.getvalue()

    def _start(self, rate: int) -> bool:
        """Open the encoder at the first audio's rate; True when this call opened it."""
        if self.input_rate is not None:
            return False
        self.input_rate = rate
        if self.format.container is None:
            self.output_rate = self.format.fixed_rate or rate
            if self.output_rate != rate:
                self._resampler = PcmResampler(rate, self.output_rate)
        else:
            self._writer = _PyAVWriter(self.format, rate, is_streaming=self.is_streaming)
            self.output_rate = self._writer.rate
        return True
