"""The realtime endpoint's pure parts: the server VAD on synthesized signals (speech edges
known to the sample), client event parsing, and the bounded conversation."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from omnirelay.serving.realtime.conversation import Conversation, Item
from omnirelay.serving.realtime.events import (
    EventError,
    RealtimeSettings,
    apply_session_update,
    decode_audio,
    decode_frame,
    parse_text_item,
)
from omnirelay.serving.realtime.session import InputBuffer
from omnirelay.serving.realtime.vad import EnergyVad, VadParams
from tests.realtime_support import noise, speechlike, utterance

RATE = 22050
TOLERANCE_S = 0.1


def run_vad(x: np.ndarray, params: VadParams | None = None, *, chunk: int = 2205) -> list[tuple[str, float]]:
    vad = EnergyVad(params or VadParams(), RATE)
    events = []
    for i in range(0, x.size, chunk):
        events += vad.push(x[i : i + chunk])
    return [(e.kind, e.sample / RATE) for e in events]


@pytest.mark.parametrize("level", [0.05, 0.3, 0.9])
def test_speech_edges_are_found_within_100_ms(level: float) -> None:
    x = utterance(RATE, 1.0, 1.2, 1.0, level=level)
    events = run_vad(x)
    assert [k for k, _ in events] == ["start", "stop"]
    assert abs(events[0][1] - 1.0) <= TOLERANCE_S and abs(events[1][1] - 2.2) <= TOLERANCE_S


def test_the_same_samples_give_the_same_events_however_they_are_split() -> None:
    x = utterance(RATE, 0.7, 0.9, 0.8)
    as_int16 = (x * 32767).astype(np.int16)
    first = run_vad(x, chunk=2205)
    assert run_vad(x, chunk=97) == first == run_vad(as_int16.astype(np.float32) / 32768, chunk=x.size)
    vad = EnergyVad(VadParams(), RATE)
    assert [(e.kind, e.sample / RATE) for e in vad.push(as_int16)] == first


def test_two_utterances_and_a_short_pause_inside_one() -> None:
    rate = RATE
    parts = [noise(rate, 0.5), speechlike(rate, 0.6), noise(rate, 0.2, seed=2), speechlike(rate, 0.5, seed=3)]
    parts += [noise(rate, 1.0, seed=4), speechlike(rate, 0.4, seed=5), noise(rate, 0.8, seed=6)]
    events = run_vad(np.concatenate(parts))
    # The 200 ms pause is shorter than silence_duration_ms (500): one utterance, not two.
    kinds = [k for k, _ in events]
    assert kinds == ["start", "stop", "start", "stop"]
    for (_, got), want in zip(events, [0.5, 1.8, 2.8, 3.2]):
        assert abs(got - want) <= TOLERANCE_S, events


def test_clicks_silence_and_a_steady_background_are_not_speech() -> None:
    x = noise(RATE, 3.0, db=-70)
    x[RATE : RATE + 441] += 0.8  # a 20 ms click: shorter than min_speech_ms
    assert run_vad(x) == []
    assert run_vad(np.zeros(RATE * 2, np.float32)) == []
    # A louder steady background from the start (-35 dBFS): the floor rises to it.
    hum = noise(RATE, 2.0, db=-35, seed=9)
    assert run_vad(hum) == []
    # Speech over that background is still found.
    loud = np.concatenate(
        [hum, speechlike(RATE, 0.8) + noise(RATE, 0.8, db=-35, seed=8), noise(RATE, 1.0, db=-35)]
    )
    events = run_vad(loud)
    assert [k for k, _ in events] == ["start", "stop"] and abs(events[0][1] - 2.0) <= TOLERANCE_S


def test_threshold_sets_how_loud_speech_must_be() -> None:
    quiet = utterance(RATE, 0.8, 0.8, 0.8, level=0.01)  # ~12 dB over the -60 dBFS noise
    assert run_vad(quiet, VadParams(threshold=0.9)) == []
    assert [k for k, _ in run_vad(quiet, VadParams(threshold=0.2, min_level_db=-70))] == ["start", "stop"]


def test_silence_duration_decides_when_the_stop_is_settled() -> None:
    x = utterance(RATE, 0.5, 0.5, 1.5)
    for silence_ms in (200, 800):
        vad = EnergyVad(VadParams(silence_duration_ms=silence_ms), RATE)
        stop = next(e for e in vad.push(x) if e.kind == "stop")
        assert abs(stop.sample / RATE - 1.0) <= TOLERANCE_S
        assert abs((stop.at_sample - stop.sample) / RATE - silence_ms / 1000) <= 0.02


# ------------------------------------------------------------------------ client events


def test_malformed_frames_are_fatal_and_unknown_types_are_not() -> None:
    for frame in ({"bytes": b"x"}, {"text": "not json"}, {"text": "[1]"}, {"text": "x" * 101}):
        with pytest.raises(EventError) as info:
            decode_frame(frame, 100)
        assert info.value.fatal
    with pytest.raises(EventError) as info:
        decode_frame({"text": '{"type": "output_audio_buffer.clear"}'}, 100)
    assert not info.value.fatal and info.value.code == "invalid_event_type"


def test_audio_must_be_base64_of_whole_samples() -> None:
    samples = np.array([0, 1, -1, 32767], dtype="<i2")
    assert decode_audio(base64.b64encode(samples.tobytes()).decode()).tolist() == samples.tolist()
    for bad in ("%%%", base64.b64encode(b"abc").decode(), 7):
        with pytest.raises(EventError):
            decode_audio(bad)


def _update(session: object) -> RealtimeSettings:
    return apply_session_update(
        RealtimeSettings(modalities=("text", "audio"), voice="joe"),
        session,
        check_voice=lambda v: v.lower(),
        check_modalities=lambda m: m,
        sample_rate=RATE,
    )


def test_session_update_applies_all_or_nothing_and_names_the_field() -> None:
    s = _update({"turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300}})
    assert s.turn_detection is not None and s.turn_detection.vad.threshold == 0.7
    assert s.turn_detection.vad.silence_duration_ms == 300 and s.turn_detection.vad.prefix_padding_ms == 300
    assert _update({"turn_detection": None}).turn_detection is None
    bad = [
        ({"input_audio_format": "g711_ulaw"}, "session.input_audio_format"),
        ({"turn_detection": {"type": "semantic_vad"}}, "session.turn_detection.type"),
        ({"turn_detection": {"threshold": 2}}, "session.turn_detection.threshold"),
        ({"turn_detection": {"silence_duration_ms": "1"}}, "session.turn_detection.silence_duration_ms"),
        ({"sample_rate": 16000}, "session.sample_rate"),
        ({"tools": [{"type": "function"}]}, "session.tools"),
        ({"bogus": 1}, "session.bogus"),
        ({"temperature": True}, "session.temperature"),
    ]
    for session, param in bad:
        with pytest.raises(EventError) as info:
            _update(session)
        assert info.value.param == param, (session, info.value.message)


def test_text_items() -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    assert parse_text_item({"item": item}) == (None, "user", "Hi")
    wrong = {**item, "content": [{"type": "input_audio", "audio": ""}]}
    with pytest.raises(EventError, match="input_text"):
        parse_text_item({"item": wrong})


def test_the_conversation_drops_its_oldest_items_first() -> None:
    conv = Conversation(max_items=3, max_chars=20)
    dropped = [conv.add(Item(f"i{n}", "user", "input_text", "hello")) for n in range(4)]
    assert dropped[:3] == [[], [], []] and [i.id for i in dropped[3]] == ["i0"]
    assert [i.id for i in conv.add(Item("big", "user", "input_text", "x" * 15))] == ["i1", "i2"]
    assert conv.messages("be brief") == [("system", "be brief"), ("user", "hello"), ("user", "x" * 15)]
    assert conv.window()["num_dropped_items"] == 3


def test_the_input_buffer_keeps_the_session_clock() -> None:
    buf = InputBuffer()
    for n in range(5):
        buf.append(np.arange(n * 10, n * 10 + 10, dtype=np.int16))
    buf.drop_before(15)
    assert (buf.start, buf.end, buf.num_samples) == (15, 50, 35)
    assert buf.take(20, 32).tolist() == list(range(20, 32))
    assert (buf.start, buf.num_samples) == (32, 18)
    buf.clear()
    assert (buf.start, buf.end) == (50, 50) and buf.take(0, 100).size == 0
