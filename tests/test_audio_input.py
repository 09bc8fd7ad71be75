"""Input audio: untrusted base64 in wav, mp3 or pcm16 → mono float32 at the pipeline's rate,
and every way it can be wrong refused with a message that names the problem."""

from __future__ import annotations

import base64
import io
import time

import av
import numpy as np
import pytest
import torch

from omnirelay.errors import InvalidRequestError
from omnirelay.serving.media.audio_in import (
    PCM16_RATE,
    AudioInputError,
    AudioLimits,
    decode_audio,
    decode_base64_audio,
)
from omnirelay.serving.media.audio_out import pcm16, wav_header
from omnirelay.serving.media.encoding import AudioEncoder

RATE = 16_000


def _tone(rate: int, seconds: float, hz: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    mono = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return np.stack([mono] * channels) if channels > 1 else mono


def _wav(samples: np.ndarray, rate: int) -> bytes:
    return wav_header(rate, samples.size) + pcm16(samples)


def _stereo_float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A 32-bit float stereo WAV written by FFmpeg (``samples``: two rows)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=rate, layout="stereo")
        interleaved = np.ascontiguousarray(samples.T).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(interleaved, format="flt", layout="stereo")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spectrum) * rate / x.size)


def test_wav_is_resampled_to_the_pipeline_rate() -> None:
    out = decode_base64_audio(
        base64.b64encode(_wav(_tone(24_000, 0.5), 24_000)).decode(), "wav", sample_rate=RATE
    )
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(out.size - RATE // 2) <= 64
    assert abs(_peak_hz(out, RATE) - 440) < 5
    assert 0.4 < float(np.abs(out).max()) <= 0.51


def test_stereo_float_wav_is_mixed_to_mono() -> None:
    raw = _stereo_float_wav(_tone(44_100, 0.25, channels=2), 44_100)
    out = decode_audio(raw, "wav", sample_rate=RATE)
    assert abs(out.size - RATE // 4) <= 64 and abs(_peak_hz(out, RATE) - 440) < 8


def test_mp3_decodes() -> None:
    encoder = AudioEncoder("mp3", is_streaming=False)
    encoder.push(torch.from_numpy(_tone(24_000, 1.0, hz=1000)), 24_000)
    raw = encoder.finish(24_000)
    out = decode_base64_audio(base64.b64encode(raw).decode(), "mp3", sample_rate=RATE)
    # the encoder's priming and padding add a few ms
    assert RATE <= out.size < RATE * 1.1 and abs(_peak_hz(out, RATE) - 1000) < 5


def test_pcm16_is_24khz_raw() -> None:
    raw = pcm16(_tone(PCM16_RATE, 0.5, hz=300))
    out = decode_base64_audio(base64.b64encode(raw).decode(), "pcm16", sample_rate=RATE)
    assert abs(out.size - RATE // 2) <= 64 and abs(_peak_hz(out, RATE) - 300) < 5


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        ("not base64!!", "wav", r"data is not valid base64"),
        ("", "wav", r"data must be a non-empty base64 string"),
        (base64.b64encode(b"abc").decode(), "ogg", r"format 'ogg' is not supported.*'wav', 'mp3', 'pcm16'"),
        (
            base64.b64encode(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk").decode(),
            "wav",
            r"not a readable wav file",
        ),
        (base64.b64encode(bytes(range(256)) * 8).decode(), "wav", r"not a readable wav file"),
        (
            base64.b64encode(bytes(range(256)) * 8).decode(),
            "mp3",
            r"(not a readable mp3 file|holds no audio)",
        ),
        (base64.b64encode(b"\x00\x01\x02").decode(), "pcm16", r"3 bytes; pcm16 is 2 bytes per sample"),
        (base64.b64encode(wav_header(RATE, 0)).decode(), "wav", r"holds no audio samples"),
    ],
)
def test_bad_input_is_refused_with_its_reason(data: str, fmt: str, message: str) -> None:
    with pytest.raises(AudioInputError, match=message) as info:
        decode_base64_audio(data, fmt, sample_rate=RATE, param="messages[0].content[0].input_audio")
    assert isinstance(info.value, InvalidRequestError)  # the server's 400
    assert str(info.value).startswith("messages[0].content[0].input_audio.")
    assert info.value.param is not None and info.value.param.startswith("messages[0].content[0].input_audio.")


def test_size_limit_is_checked_before_decoding() -> None:
    limits = AudioLimits(max_bytes=1000)
    big = base64.b64encode(_wav(_tone(RATE, 0.1), RATE)).decode()  # 3244 bytes
    with pytest.raises(AudioInputError, match=r"the limit is 1000 bytes \(max_audio_input_bytes\)"):
        decode_base64_audio(big, "wav", sample_rate=RATE, limits=limits)
    with pytest.raises(AudioInputError, match=r"3244 bytes of audio; the limit is 1000 bytes"):
        decode_audio(base64.b64decode(big), "wav", sample_rate=RATE, limits=limits)


def test_duration_limit_stops_decoding_early() -> None:
    """Ten minutes of audio against a 1 s limit: refused after about a second's worth of
    decoding, whatever the header says."""
    raw = _wav(np.zeros(RATE * 600, dtype=np.float32), RATE)
    limits = AudioLimits(max_bytes=len(raw), max_duration_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(AudioInputError, match=r"longer than the limit of 1 s of audio \(max_audio_input_s\)"):
        decode_audio(raw, "wav", sample_rate=RATE, limits=limits)
    assert time.perf_counter() - t0 < 1.0
    # A header that claims more than the file holds: the samples present count.
    lying = wav_header(RATE, RATE * 600) + pcm16(_tone(RATE, 0.5))
    assert abs(decode_audio(lying, "wav", sample_rate=RATE, limits=limits).size - RATE // 2) <= 64


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        AudioLimits(max_bytes=0)
    with pytest.raises(ValueError, match="max_duration_s"):
        AudioLimits(max_duration_s=float("nan"))
