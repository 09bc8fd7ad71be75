"""The Qwen3-TTS Talker executor on the static runner (eager on the CPU): greedy, it speaks
the reference's codes frame for frame (``tests/fixtures/qwen3_tts``: ``qwen-tts``'s own
``generate`` with its repetition penalty and minimum length); batched, each request
speaks what it speaks alone; EOS ends a request, never before its minimum length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import BatchItem, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.seeded import fill_seeded
from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.models.runner import Buckets

META: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "qwen3_tts" / "reference.json").read_text()
)
CASES = {c["name"]: c for c in META["talker_cases"]}


@pytest.fixture(scope="module")
def model() -> tuple[TTSTalker, TTSConfig]:
    config = TTSConfig.from_dict(META["tts_config"])
    talker = TTSTalker(config.talker_config).eval()
    fill_seeded(talker.state_dict(keep_vars=True), META["provenance"]["seed"], prefix="talker.")
    return talker, config


def executor(model: tuple[TTSTalker, TTSConfig], *, text_streaming: bool) -> TTSTalkerExecutor:
    talker, config = model
    return TTSTalkerExecutor(
        talker, config, buckets=Buckets(max_num_seqs=4, max_model_len=128), text_streaming=text_streaming
    )


def item(rid: str, case: dict[str, Any], step: int, sampling: SamplingParams | None = None) -> BatchItem:
    ids = case["input_ids"]
    inputs = {"speaker": case["speaker"], "language": case["language"], "instruct_ids": case["instruct_ids"]}
    return BatchItem(
        internal_id=rid,
        external_id=rid,
        input_token_ids=ids if step == 0 else [0],
        all_token_ids=ids,
        num_computed_tokens=0 if step == 0 else len(ids),
        is_prefill=step == 0,
        sampling=sampling or SamplingParams(),
        inputs=inputs,
    )


def speak(
    ex: TTSTalkerExecutor, rids: dict[str, dict[str, Any]], frames: int, **kw: Any
) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {rid: [] for rid in rids}
    for step in range(frames):
        results = ex.step([item(rid, case, step, **kw) for rid, case in rids.items()])
        for rid, result in zip(rids, results):
            out[rid].append(result.next_stage_output[0].tolist())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_frames_are_the_reference_codes(name: str, model: tuple[TTSTalker, TTSConfig]) -> None:
    case = CASES[name]
    ex = executor(model, text_streaming=not case["non_streaming_mode"])
    codes = speak(ex, {"r": case}, len(case["codes"]))["r"]
    assert codes == case["codes"]  # every codebook of every frame, the penalty included
    ex.release("r")
    assert ex.num_live_requests() == 0 and ex.leak_state() == {}


def test_batched_requests_speak_what_they_speak_alone(model: tuple[TTSTalker, TTSConfig]) -> None:
    case = CASES["ryan_english"]
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=7)
    alone = speak(executor(model, text_streaming=False), {"a": case}, 6, sampling=sampling)["a"]
    ex = executor(model, text_streaming=False)
    together = speak(ex, {"a": case, "b": case, "c": case}, 6, sampling=sampling)
    assert together["a"] == together["b"] == together["c"] == alone
    for rid in "abc":
        ex.release(rid)
    assert ex.runner.slots.holders() == []


def test_a_launched_step_speaks_what_the_step_speaks(model: tuple[TTSTalker, TTSConfig]) -> None:
    """``launch`` (a device group's split step) gives the frames ``step`` gives; on the
    CPU the launched step has ended when ``launch`` returns. A failing launch releases
    its batch, as a failing step does."""
    case = CASES["ryan_english"]
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=7)
    stepped = speak(executor(model, text_streaming=False), {"a": case, "b": case}, 5, sampling=sampling)
    ex = executor(model, text_streaming=False)
    launched: dict[str, list[list[int]]] = {"a": [], "b": []}
    for step in range(5):
        pending = ex.launch([item(rid, case, step, sampling) for rid in ("a", "b")])
        assert pending.is_done()
        for rid, result in zip(("a", "b"), pending.result()):
            launched[rid].append(result.next_stage_output[0].tolist())
    assert launched == stepped
    with pytest.raises(ModelError, match="twice"):
        ex.launch([item("a", case, 5), item("a", case, 5)])
    bad = item("c", case, 0)
    bad.inputs = {"speaker": "nobody"}
    with pytest.raises(ModelError, match="nobody"):
        ex.launch([item("a", case, 5), bad])
    assert "a" not in ex.runner.slots.holders()  # the failed launch released its batch
    ex.release("b")
    assert ex.num_live_requests() == 0 and ex.leak_state() == {}


class _CountedTail:
    """The runner's code predictor, recording the batch of every call."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor
        self.batches: list[int] = []

    def __call__(self, last: torch.Tensor, *args: Any, **kw: Any) -> Any:
        self.batches.append(last.shape[0])
        return self.predictor(last, *args, **kw)


def test_a_request_admitted_mid_stream_shares_the_steps_one_tail(model: tuple[TTSTalker, TTSConfig]) -> None:
    """A step that admits a request runs one code-predictor tail for the new row and the
    continuing ones together, and both still speak exactly what they speak alone."""
    a, b = CASES["ryan_english"], CASES[sorted(CASES)[-1]]
    alone_a = speak(executor(model, text_streaming=False), {"a": a}, 5)["a"]
    alone_b = speak(executor(model, text_streaming=False), {"b": b}, 3)["b"]
    ex = executor(model, text_streaming=False)
    tail = _CountedTail(ex.runner.predictor)
    ex.runner.predictor = tail  # type: ignore[assignment]
    got: dict[str, list[list[int]]] = {"a": [], "b": []}
    for step in range(5):
        batch = [item("a", a, step)] + ([item("b", b, step - 2)] if step >= 2 else [])
        for it, result in zip(batch, ex.step(batch)):
            got[it.internal_id].append(result.next_stage_output[0].tolist())
    assert got == {"a": alone_a, "b": alone_b}
    assert tail.batches == [1, 1, 2, 2, 2]  # one tail a step, the admitting step included
    for rid in "ab":
        ex.release(rid)
    assert ex.num_live_requests() == 0 and ex.leak_state() == {}


def test_eos_waits_for_the_minimum_length_and_ends_the_request(model: tuple[TTSTalker, TTSConfig]) -> None:
    talker, config = model
    eos = config.talker_config.codec_eos_token_id
    rigged = TTSTalker(config.talker_config).eval()
    rigged.load_state_dict(talker.state_dict())
    with torch.no_grad():  # the last row is its codec embedding, shifted along ones: EOS wins
        for layer in rigged.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        rigged.model.codec_embedding.weight.add_(100.0)
        rigged.model.norm.weight.fill_(1.0)
        rigged.codec_head.weight[eos] = 50.0
    ex = TTSTalkerExecutor(rigged, config, buckets=Buckets(max_num_seqs=2, max_model_len=128))
    case = CASES["ryan_english"]
    results = [ex.step([item("r", case, step)])[0] for step in range(3)]
    assert [r.token_ids[0] == eos for r in results] == [False, False, True]  # min_new_tokens = 2
    assert [r.finished for r in results] == [False, False, True]
    assert results[2].next_stage_output[0, 1:].tolist() == [0] * (config.talker_config.num_code_groups - 1)
    with pytest.raises(ModelError, match="after its codec EOS"):
        ex.step([item("r", case, 3)])
    ex.release("r")


def test_an_unknown_speaker_or_language_fails_the_request_by_name(model: tuple[TTSTalker, TTSConfig]) -> None:
    ex = executor(model, text_streaming=False)
    case = {**CASES["ryan_english"], "speaker": "nobody"}
    with pytest.raises(ModelError, match="unknown speaker 'nobody'"):
        ex.step([item("r", case, 0)])
    case = {**CASES["ryan_english"], "language": "klingon"}
    with pytest.raises(ModelError, match="unknown language 'klingon'"):
        ex.step([item("s", case, 0)])
    assert ex.num_live_requests() == 0 and ex.runner.slots.holders() == []  # the failed batch was released
