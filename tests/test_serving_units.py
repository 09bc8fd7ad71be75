"""Serving-layer pieces without a server: output accumulation (docs/protocol.md §7.3), WAV/PCM,
stop sequences, sentence splitting, request parsing, admission, config, timestamps header."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from omnirelay.errors import ConfigError
from omnirelay.models.qwen3_omni.prompt import format_chat, format_chat_prompt
from omnirelay.serving import AdmissionGate, ApiError, AudioEmitter, OutputKind, ServerConfig
from omnirelay.serving.media.audio_out import AudioStreamError, parse_wav, pcm16, wav_bytes, wav_header
from omnirelay.serving.protocol import ChatCompletionRequest, SpeechRequest, check_request_id, parse
from omnirelay.serving.routes.chat import StopMatcher
from omnirelay.serving.routes.speech import timestamps_header
from omnirelay.serving.routes.speech_stream import split_text
from omnirelay.serving.text import ByteCodec

# ------------------------------------------------------------------ docs/protocol.md §7.3 emission


def _segments() -> list[torch.Tensor]:
    # Three constant-valued segments of 800, 1,200 and 400 samples (docs/protocol.md §8 item 11).
    return [torch.full((n,), v) for n, v in ((800, 0.1), (1200, 0.2), (400, 0.3))]


def test_cumulative_audio_is_sent_exactly_once() -> None:
    segs = _segments()
    emitter = AudioEmitter(OutputKind.CUMULATIVE)
    sent = []
    for k in range(1, 4):
        cumulative = torch.cat(segs[:k])  # 800, 2000, 2400 samples
        new = emitter.push(cumulative, 24000)
        assert new is not None
        sent.append(new)
    out = torch.cat(sent)
    assert out.numel() == 2400  # not 800 + 2000 + 2400 = 5200
    assert torch.equal(out, torch.cat(segs))  # each segment's values and boundaries intact
    assert emitter.emitted_samples == 2400
    assert out.numel() / emitter.sample_rate == pytest.approx(0.1)  # 100 ms at 24 kHz
    assert emitter.push(torch.cat(segs), 24000) is None  # nothing new: nothing sent


def test_delta_tensors_are_sent_as_they_are() -> None:
    emitter = AudioEmitter(OutputKind.DELTA)
    segs = _segments()
    out = [emitter.push(s, 24000) for s in segs]
    assert [o.numel() for o in out if o is not None] == [800, 1200, 400]
    assert emitter.prev_count == 3 and emitter.emitted_samples == 2400


def test_list_values_send_only_new_items() -> None:
    emitter = AudioEmitter()
    segs = _segments()
    first = emitter.push(segs[:1], [24000])
    second = emitter.push(segs[:3], torch.tensor([24000, 24000]))
    assert first is not None and second is not None
    assert first.numel() == 800 and second.numel() == 1600
    assert emitter.prev_count == 3


def test_sample_rate_change_mid_stream_is_an_error() -> None:
    emitter = AudioEmitter()
    emitter.push(torch.zeros(10), 24000)
    with pytest.raises(AudioStreamError, match="changed mid-stream from 24000 Hz to 16000 Hz"):
        emitter.push(torch.zeros(10), 16000)


def test_wav_stream_needs_a_sample_rate_and_others_default_to_24k() -> None:
    with pytest.raises(AudioStreamError, match="no sample rate"):
        AudioEmitter(require_sample_rate=True).push(torch.zeros(4), None)
    emitter = AudioEmitter()
    emitter.push(torch.zeros(4), None)
    assert emitter.sample_rate == 24000


def test_cumulative_value_that_shrinks_is_an_error() -> None:
    emitter = AudioEmitter(OutputKind.CUMULATIVE)
    emitter.push(torch.zeros(10), 24000)
    with pytest.raises(AudioStreamError, match="shrank"):
        emitter.push(torch.zeros(5), 24000)


def test_wav_round_trip_and_streamed_header() -> None:
    samples = torch.tensor([0.0, 0.5, -0.5, 1.5, -2.0])
    data = wav_bytes(samples, 16000)
    ints, rate = parse_wav(data)
    assert rate == 16000
    assert ints.tolist() == [0, 16384, -16384, 32767, -32767]  # clipped to [-1, 1]
    assert data[44:] == pcm16(samples)
    streamed = wav_header(16000) + pcm16(samples)  # sizes unknown: data runs to the end
    assert np.array_equal(parse_wav(streamed)[0], ints)
    with pytest.raises(AudioStreamError):
        parse_wav(b"not a wav file")


# ------------------------------------------------------------------ text


def test_stop_matcher_cuts_at_the_first_match_across_deltas() -> None:
    m = StopMatcher(["END", "xyz"])
    out = m.push("hello E") + m.push("N") + m.push("D more")
    assert out == "hello " and m.is_stopped
    assert m.push("later") == "" and m.finish() == ""
    plain = StopMatcher(["END"])
    assert plain.push("hello E") + plain.finish() == "hello E"
    assert StopMatcher([]).push("as is") == "as is"


def test_split_text_by_sentence_and_clause() -> None:
    assert split_text("One. Two! Thr", "sentence", final=False) == (["One.", "Two!"], " Thr")
    assert split_text("One, two. Three", "clause", final=True) == (["One,", "two.", "Three"], "")
    assert split_text("No split. Here", "none", final=False) == ([], "No split. Here")
    assert split_text("No split. Here", "none", final=True) == (["No split. Here"], "")
    assert split_text("   ", "none", final=True) == ([], "")


def test_chat_format_matches_the_models_prompt() -> None:
    assert format_chat([("user", "hi")]) == format_chat_prompt("hi")
    assert format_chat([("developer", "be brief"), ("user", "hi")]) == format_chat_prompt(
        "hi", system="be brief"
    )
    assert ByteCodec().encode_chat([("user", "Hi")]) == list(b"user: Hi")
    assert ByteCodec().detokenizer([]).push([106, 107, 1]) == "jk?"


# ------------------------------------------------------------------ requests


def _error(fn, *args) -> ApiError:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_parse_names_the_field_that_failed() -> None:
    err = _error(parse, ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.status == 400 and err.message.startswith("messages[0].content:")
    err = _error(parse, ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})
    assert "messages[0].role" in err.message
    err = _error(parse, SpeechRequest, {"voice": "x"})
    assert err.message == "input is required"
    err = _error(parse, ChatCompletionRequest, {"messages": [{"role": "user"}], "max_tokens": "5"})
    assert "max_tokens" in err.message  # strict: a string is not an int
    err = _error(parse, ChatCompletionRequest, {"messages": [{"role": "user"}], "stream": 1})
    assert "stream" in err.message
    ok = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "unknown_field": 1})
    assert ok.messages[0].text(0) == "x"
    parts = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    err = _error(parts.messages[0].text, 0)
    assert "only text parts" in err.message


def test_request_ids_from_clients_are_checked() -> None:
    assert check_request_id("abc-1", "x") == "abc-1"
    assert check_request_id(None, "chatcmpl").startswith("chatcmpl-")
    assert _error(check_request_id, "a\x01b", "x").status == 400
    assert "256" in _error(check_request_id, "a" * 300, "x").message


def test_admission_limits_and_releases() -> None:
    adm = AdmissionGate(2, retry_after_s=3)
    a, b = adm.acquire(), adm.acquire()
    err = _error(adm.acquire)
    assert err.status == 429 and err.headers == {"Retry-After": "3"} and adm.num_rejected == 1
    a.release()
    a.release()  # idempotent
    c = adm.acquire()
    b.release()
    c.release()
    assert adm.num_active == 0
    budget = AdmissionGate(5, max_live_bytes=100)
    budget.live_bytes = 101
    assert "budget of 100" in _error(budget.acquire).message


def test_websockets_hold_connection_slots_of_their_own() -> None:
    """An open socket is counted against max_websockets (by default max_concurrency), not
    against the requests: a server full of sockets still admits requests, and the reverse."""
    assert AdmissionGate(3).max_websockets == 3
    adm = AdmissionGate(1, max_websockets=2, retry_after_s=4)
    a, b = adm.open_websocket(), adm.open_websocket()
    err = _error(adm.open_websocket)
    assert err.status == 429 and err.code == "server_busy" and err.headers == {"Retry-After": "4"}
    assert "limit of 2 open WebSocket connections" in err.message and adm.num_websockets_refused == 1
    request = adm.acquire()  # the request slot is another pool
    assert (adm.num_active, adm.num_websockets, adm.num_rejected) == (1, 2, 0)
    a.release()
    a.release()  # idempotent
    c = adm.open_websocket()
    for slot in (b, c, request):
        slot.release()
    assert (adm.num_active, adm.num_websockets) == (0, 0)


def test_server_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        ServerConfig(max_concurrency=0)
    with pytest.raises(ConfigError, match="default_voice"):
        ServerConfig(default_voice="nobody")
    with pytest.raises(ConfigError, match="ws_idle_timeout_s"):
        ServerConfig(ws_idle_timeout_s=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_websockets"):
        ServerConfig(max_websockets=0)
    assert ServerConfig(max_concurrency=5).max_websockets is None  # the gate takes max_concurrency


def test_timestamps_header_fits_or_says_why_not() -> None:
    words = [{"word": "hi", "start_ms": 0, "end_ms": 80}]
    assert timestamps_header(words, 4096) == {"X-Word-Timestamps": json.dumps(words, separators=(",", ":"))}
    many = [{"word": f"w{i}", "start_ms": i, "end_ms": i + 1} for i in range(200)]
    header = timestamps_header(many, 4096)
    size = len(json.dumps(many, separators=(",", ":")))
    assert header == {"X-Word-Timestamps-Omitted": f"oversize; bytes={size}; limit=4096"}
    assert timestamps_header(None, 4096) == {"X-Word-Timestamps": "null"}


def test_openai_voice_map_checks_targets_against_the_servers_voices() -> None:
    from omnirelay.serving.server_config import openai_voice_map

    voices = ("chelsie", "Ethan")
    assert openai_voice_map({"Alloy": "Chelsie", "echo": "ethan"}, voices, "p.yaml") == {
        "alloy": "chelsie",
        "echo": "ethan",
    }
    with pytest.raises(
        ConfigError,
        match=r"p.yaml: openai_voices.alloy: 'bob' is not one of the pipeline's voices \['chelsie', 'ethan'\]",
    ):
        openai_voice_map({"alloy": "bob"}, voices, "p.yaml")
    with pytest.raises(
        ConfigError, match="'ethan' is already one of the pipeline's voices; remove the entry"
    ):
        openai_voice_map({"ethan": "chelsie"}, voices, "p.yaml")


def test_serve_checks_the_openai_voices_before_any_stage_starts() -> None:
    from omnirelay.cli.serve import server_config
    from omnirelay.pipeline import load_pipeline

    cfg = load_pipeline("voice-cpu")
    assert server_config(cfg).voices == ("joe",)
    bad = msgspec.structs.replace(cfg, openai_voices={"alloy": "chelsie"})
    with pytest.raises(ConfigError, match="'chelsie' is not one of the pipeline's voices \\['joe'\\]"):
        server_config(bad)
