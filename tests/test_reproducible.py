"""Reproducible mode (``reproducible: true``, docs/usage.md "Reproducible answers").

The pipeline key and its checks, the fixed codec schedule it imposes, stages stepping each
request on its own, and end to end on the real multi-process ``qwen3-omni-tiny``: one
request alone and the same request entering while a crowd is mid-answer give the same
text, the same Talker codes and the same audio, byte for byte. The crowd is in flight
before the request comes (each crowd member has delivered its first output: events, no
sleeps); the test ends with a leak audit and a shutdown audit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.api import Pipeline
from omnirelay.cli.check import build_report
from omnirelay.engine.components import build_stage_components
from omnirelay.engine.interfaces import SamplingParams, StageOutput
from omnirelay.errors import ConfigError
from omnirelay.models.qwen3_omni import encode_chat_prompt, load_tokenizer
from omnirelay.models.qwen3_omni.tiny import CACHE_ENV
from omnirelay.orchestrator.handle import RequestHandle
from omnirelay.pipeline import load_pipeline, parse_pipeline
from omnirelay.pipeline.reproducible import with_reproducible
from omnirelay.pipeline.yamlfile import parse_yaml, read_pipeline_text
from omnirelay.processors import TalkerToCode2WavConfig
from omnirelay.worker import leak_paths
from omnirelay.worker.factory import default_registry
from tests.orchestrator_audit import audit_stopped
from tests.test_models_support import tiny_cache, tiny_dir

TALKER = 1


def _data(name: str, **extra: object) -> dict[str, Any]:
    """A shipped pipeline file as parsed YAML, with ``extra`` top-level keys."""
    source, text = read_pipeline_text(name)
    data = parse_yaml(text, source)
    assert isinstance(data, dict)
    return {**data, **extra}


def test_the_key_is_parsed_strictly() -> None:
    plain = load_pipeline("qwen3-omni-tiny")
    assert plain.reproducible is False
    on = with_reproducible(plain)
    assert on.reproducible is True and with_reproducible(on) is on
    with pytest.raises(ConfigError, match="reproducible"):
        parse_pipeline({"name": "x", "reproducible": "yes", "stages": []})


def test_a_codec_edge_takes_a_fixed_schedule() -> None:
    adaptive = TalkerToCode2WavConfig.from_extra({"codec_chunk_frames": 25})
    assert adaptive.codec_chunk_adaptive is True
    fixed = TalkerToCode2WavConfig.from_extra({"codec_chunk_frames": 25}, reproducible=True)
    assert fixed.codec_chunk_adaptive is False and fixed.initial_codec_chunk_frames == 4
    ramp = TalkerToCode2WavConfig.from_extra({"codec_chunk_ramp": "2,8,25"}, reproducible=True)
    assert ramp.codec_chunk_ramp == (2, 8, 25) and ramp.codec_chunk_adaptive is False
    small = TalkerToCode2WavConfig.from_extra({"codec_chunk_frames": 3}, reproducible=True)
    assert small.initial_codec_chunk_frames == 3
    with pytest.raises(ConfigError, match="fixed chunk schedule"):
        TalkerToCode2WavConfig.from_extra({"codec_chunk_adaptive": True}, reproducible=True)
    schedules = [
        e["schedule"] for e in build_report(with_reproducible(load_pipeline("qwen3-omni-tiny")))["edges"]
    ]
    assert "fixed: 4, then 25 frames per chunk; left context 0 frames" in schedules


def test_an_explicit_adaptive_edge_is_refused_at_load() -> None:
    data = _data("qwen3-omni-tiny")
    data["connectors"]["codec_shm"]["extra"]["codec_chunk_adaptive"] = True
    assert parse_pipeline(data).reproducible is False  # fine without the mode
    with pytest.raises(ConfigError, match="codec_chunk_adaptive: true"):
        parse_pipeline({**data, "reproducible": True})


def test_each_request_is_stepped_on_its_own() -> None:
    registry = default_registry()
    batched = build_stage_components(registry, parse_pipeline(_data("toy-3stage")), 1).executor
    alone = build_stage_components(
        registry, parse_pipeline(_data("toy-3stage", reproducible=True)), 1
    ).executor
    assert batched.supports_batching is True
    assert alone.supports_batching is False


# --------------------------------------------------------------------------- end to end


class TalkerCodes:
    """The Talker's first codebook of every frame, per request (``on_stage_output``)."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[int]] = {}

    def __call__(self, out: StageOutput) -> None:
        if out.stage_id == TALKER:
            self.by_request.setdefault(out.request_id, []).extend(out.token_ids)


@pytest.fixture(scope="module")
def codes() -> TalkerCodes:
    return TalkerCodes()


@pytest.fixture(scope="module")
def pipe(codes: TalkerCodes) -> Iterator[Pipeline]:
    tiny_dir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tiny_cache()))
        p = Pipeline.start(with_reproducible(load_pipeline("qwen3-omni-tiny")), on_stage_output=codes)
        yield p
        audit_stopped(p)  # nothing in /dev/shm, no process left


def _ask(pipe: Pipeline, prompt: list[int], rid: str) -> RequestHandle:
    sampling = {
        0: SamplingParams(temperature=0.0, max_tokens=6),
        # Sampled codes (a near tie flips with batched float sums) over a few chunks.
        TALKER: SamplingParams(temperature=0.9, seed=42, max_tokens=36, stop_token_ids=(2150,)),
    }
    return pipe.submit(prompt, modalities=["text", "audio"], sampling=sampling, request_id=rid)


def test_alone_and_inside_a_crowd_give_the_same_bytes(pipe: Pipeline, codes: TalkerCodes) -> None:
    tok = load_tokenizer(tiny=True, seed=0)
    prompt = encode_chat_prompt(tok, "Tell me something about the number 0.")
    alone = _ask(pipe, prompt, "alone").result(300)

    crowd = [
        _ask(pipe, encode_chat_prompt(tok, "Tell me " + "really " * (3 * k) + f"about {k}."), f"crowd{k}")
        for k in range(3)
    ]
    for h in crowd:  # every crowd member is mid-answer before the request comes
        h.next_output(300)
    inside = _ask(pipe, prompt, "inside").result(300)
    for h in crowd:
        h.result(300)

    assert inside.token_ids("text") == alone.token_ids("text")
    talker = codes.by_request
    assert talker["inside"] == talker["alone"] and len(talker["alone"]) > 8
    assert alone.audio is not None and inside.audio is not None
    a, b = alone.audio.to(torch.float32).numpy(), inside.audio.to(torch.float32).numpy()
    assert a.size > 4 * 1920 and a.tobytes() == b.tobytes()
    assert {sid: leak_paths(s) for sid, s in pipe.leak_state().items() if leak_paths(s)} == {}
