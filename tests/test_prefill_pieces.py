"""A long prompt prefilled in pieces over several steps (``max_prefill_piece_tokens``):
the AR scheduler's budget arithmetic, its lifecycle between pieces, the config checks,
and the tiny Qwen3-Omni Thinker giving the tokens and Talker rows of a one-step prefill."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.engine import (
    ARScheduler,
    BatchItem,
    ItemResult,
    Request,
    RequestStatus,
    SamplingParams,
    StageEngine,
    StageRequest,
)
from omnirelay.errors import ConfigError
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.loader import ModelArgs
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.testing.toy import CountingLM, toy_registry
from omnirelay.pipeline.config import PipelineConfig
from omnirelay.pipeline.parse import parse_pipeline
from tests.test_models_support import single_thread, tiny_dir

S = RequestStatus


class PieceLM(CountingLM):
    """CountingLM that takes a prompt in pieces; records every item it is given."""

    supports_prefill_pieces = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.items: list[BatchItem] = []

    def step_one(self, item: BatchItem) -> ItemResult:
        self.items.append(item)
        if item.num_computed_tokens + len(item.input_token_ids) < len(item.all_token_ids):
            return ItemResult(internal_id=item.internal_id, is_partial_prefill=True)
        return super().step_one(item)


def _sched(**kw: Any) -> ARScheduler:
    args: dict[str, Any] = {
        "stage_id": 0,
        "max_num_seqs": 8,
        "receives_chunks": False,
        "supports_batching": True,
        "clock": lambda: 100.0,
    }
    args.update(kw)
    return ARScheduler(**args)


def _req(name: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        internal_id=f"{name}@s0.1",
        external_id=name,
        stage_id=0,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_time=100.0,
    )


def _tick(sched: ARScheduler, executor: Any) -> tuple[list[list[BatchItem]], list[Any]]:
    out = sched.schedule()
    sched.check_invariants()
    results = [executor.step(list(batch)) for batch in out.batches]
    update = sched.update_from_output(out, results)
    sched.check_invariants()
    return [list(b) for b in out.batches], list(update.updates)


def _pieces(batches: list[list[BatchItem]], rid: str) -> list[tuple[int, int]]:
    """(start, length) of ``rid``'s item in each batch."""
    return [
        (i.num_computed_tokens, len(i.input_token_ids)) for b in batches for i in b if i.internal_id == rid
    ]


# ----------------------------------------------------------------- the scheduler


def test_a_long_prompt_runs_in_pieces_and_samples_only_after_the_last() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=4), PieceLM()
    r = _req("long", list(range(10)), max_tokens=2)
    sched.add_request(r)
    seen: list[tuple[int, int]] = []
    for expect_computed in (4, 8):
        batches, updates = _tick(sched, lm)
        seen += _pieces(batches, r.internal_id)
        (u,) = updates
        assert not u.new_token_ids and u.next_stage_output is None and not u.is_finished
        assert r.num_computed_tokens == expect_computed and r.output_token_ids == []
        assert r.status is S.RUNNING and sched.num_slots_held == 1  # it keeps its slot
        assert all(i.is_prefill for b in batches for i in b)
    batches, (u,) = _tick(sched, lm)
    seen += _pieces(batches, r.internal_id)
    assert u.new_token_ids == (10,) and u.next_stage_output is not None and not u.is_recompute
    assert seen == [(0, 4), (4, 4), (8, 2)]
    assert r.num_steps == 1 and r.num_prefill_pieces == 2
    _, (u,) = _tick(sched, lm)  # a decode: one token, not a prefill
    assert lm.items[-1].input_token_ids == [10] and not lm.items[-1].is_prefill
    assert r.status is S.FINISHED_LENGTH and r.output_token_ids == [10, 11]
    assert sched.leak_state() == {}


def test_without_the_setting_a_prompt_runs_in_one_step() -> None:
    sched, lm = _sched(), PieceLM()
    r = _req("long", list(range(10)), max_tokens=1)
    sched.add_request(r)
    batches, _ = _tick(sched, lm)
    assert _pieces(batches, r.internal_id) == [(0, 10)] and r.is_finished


@pytest.mark.parametrize(
    ("cap", "budget", "ticks"),
    [
        # a decode (1) and a piece (4) fit 6: both run every tick
        (4, 6, [{"dec": 1, "long": 4}, {"dec": 1, "long": 4}, {"dec": 1, "long": 2}]),
        # 5 tokens left of the budget after the decode: the whole prompt of 10 waits a tick
        (None, 6, [{"dec": 1}, {"long": 10}]),
        # the cap bounds a piece under a larger budget too
        (
            3,
            100,
            [{"dec": 1, "long": 3}, {"dec": 1, "long": 3}, {"dec": 1, "long": 3}, {"dec": 1, "long": 1}],
        ),
    ],
    ids=["cap-within-budget", "no-cap", "cap-under-big-budget"],
)
def test_the_tick_budget_counts_a_piece_not_the_whole_prompt(
    cap: int | None, budget: int, ticks: list[dict[str, int]]
) -> None:
    sched, lm = _sched(max_prefill_piece_tokens=cap, max_num_batched_tokens=budget), PieceLM()
    dec = _req("dec", [7], max_tokens=50)
    sched.add_request(dec)
    _tick(sched, lm)  # dec is prefilled: it decodes from now on
    long = _req("long", list(range(10)), max_tokens=50)
    sched.add_request(long)
    for want in ticks:
        batches, _ = _tick(sched, lm)
        assert {i.external_id: len(i.input_token_ids) for b in batches for i in b} == want
    assert long.output_token_ids == [10]


def test_two_long_prompts_share_a_small_budget_in_turns() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=4, max_num_batched_tokens=6), PieceLM()
    a, b = _req("a", list(range(8)), max_tokens=1), _req("b", list(range(8)), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    order = []
    while sched.requests:
        batches, _ = _tick(sched, lm)
        assert sum(len(i.input_token_ids) for bt in batches for i in bt) <= 6
        order += [(i.internal_id[0], i.num_computed_tokens) for bt in batches for i in bt]
    assert order == [("a", 0), ("b", 0), ("a", 4), ("b", 4)]  # round robin, a piece each
    assert a.output_token_ids == [8] and b.output_token_ids == [8]


def test_abort_between_pieces_ends_the_request_and_leaves_nothing() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=4), PieceLM()
    r, other = _req("long", list(range(10))), _req("other", [3], max_tokens=3)
    sched.add_request(r)
    sched.add_request(other)
    _tick(sched, lm)
    assert r.num_computed_tokens == 4
    assert sched.abort(r.internal_id) is r and r.status is S.FINISHED_ABORTED
    while sched.requests:
        batches, _ = _tick(sched, lm)
        assert all(i.internal_id == other.internal_id for bt in batches for i in bt)
    assert r.output_token_ids == [] and other.output_token_ids == [4, 5, 6]
    assert sched.leak_state() == {} and sched.num_slots_held == 0


def test_a_stop_on_the_first_token_ends_the_request_at_its_last_piece() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=3), PieceLM()
    r = _req("long", list(range(7)), max_tokens=5)
    r.sampling = SamplingParams(max_tokens=5, stop_token_ids=(7,))
    sched.add_request(r)
    for _ in range(3):
        _tick(sched, lm)
    assert r.status is S.FINISHED_STOPPED and r.output_token_ids == [7]
    assert _pieces([lm.items], r.internal_id) == [(0, 3), (3, 3), (6, 1)]
    assert sched.leak_state() == {}


def test_preemption_mid_prefill_starts_over_and_still_sends_downstream() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=4), PieceLM()
    r = _req("long", list(range(10)), max_tokens=3)
    sched.add_request(r)
    _tick(sched, lm)
    sched.preempt(r.internal_id)
    assert r.num_computed_tokens == 0 and not r.is_recompute  # nothing went downstream yet
    updates = []
    for _ in range(3):
        _, u = _tick(sched, lm)
        updates += u
    assert _pieces([lm.items], r.internal_id) == [(0, 4), (0, 4), (4, 4), (8, 2)]
    assert updates[-1].new_token_ids == (10,) and not updates[-1].is_recompute
    # After tokens went out, a recompute is split the same way and sends nothing.
    sched.preempt(r.internal_id)
    assert r.is_recompute
    updates = []
    for _ in range(3):
        _, u = _tick(sched, lm)
        updates += u
    assert _pieces([lm.items[-3:]], r.internal_id) == [(0, 4), (4, 4), (8, 3)]
    assert updates[-1].is_recompute and updates[-1].new_token_ids == (11,)


def test_an_executor_that_samples_on_a_piece_fails_the_request_with_the_setting_named() -> None:
    sched, lm = _sched(max_prefill_piece_tokens=4), CountingLM()
    r = _req("long", list(range(10)))
    sched.add_request(r)
    _, (u,) = _tick(sched, lm)
    assert r.status is S.FINISHED_ERROR and not u.new_token_ids
    assert r.error is not None and "max_prefill_piece_tokens" in r.error
    assert sched.leak_state() == {}


# ----------------------------------------------------------------- the config


def _pipeline(**stage: Any) -> PipelineConfig:
    data = {
        "name": "pieces",
        "stages": [
            {
                "id": 0,
                "name": "counter",
                "execution_type": "ar",
                "executor": "toy.counting_lm",
                "final_output": True,
                "final_output_type": "text",
                **stage,
            }
        ],
    }
    return parse_pipeline(data, source="<test>", registry=toy_registry())


def test_the_setting_is_checked_when_the_pipeline_is_read() -> None:
    assert _pipeline().stages[0].max_prefill_piece_tokens is None
    assert _pipeline(max_prefill_piece_tokens=512).stages[0].max_prefill_piece_tokens == 512
    with pytest.raises(ConfigError, match=r"max_prefill_piece_tokens.*≥ 1"):
        _pipeline(max_prefill_piece_tokens=0)
    with pytest.raises(ConfigError, match=r"max_prefill_piece_tokens.*only an AR stage"):
        _pipeline(
            max_prefill_piece_tokens=8,
            execution_type="generation",
            executor="toy.sample_generator",
            final_output_type="audio",
        )


def test_an_executor_that_cannot_take_pieces_is_refused_when_the_engine_is_built() -> None:
    pipeline = _pipeline(max_prefill_piece_tokens=4)
    with pytest.raises(ConfigError, match="max_prefill_piece_tokens is set but executor CountingLM"):
        StageEngine(0, pipeline, CountingLM(), None)
    engine = StageEngine(0, pipeline, PieceLM(), None)
    engine.add_request(
        StageRequest(request_id="r", prompt_token_ids=list(range(10)), sampling=SamplingParams(max_tokens=2))
    )
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == [10, 11] and outputs[-1].finished
    assert engine.leak_state() == {}
    engine.shutdown()


@pytest.mark.parametrize("command", ["abort", "release"])
def test_an_abort_or_release_between_pieces_through_the_engine_leaves_nothing(command: str) -> None:
    lm = PieceLM()
    engine = StageEngine(0, _pipeline(max_prefill_piece_tokens=4), lm, None)
    engine.add_request(
        StageRequest(request_id="r", prompt_token_ids=list(range(10)), sampling=SamplingParams(max_tokens=2))
    )
    assert engine.step() == [] and lm.live == {lm.items[-1].internal_id}  # the first piece: no output
    getattr(engine, command)("r")
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [o.token_ids for o in outputs if o.token_ids] == []
    if command == "abort":
        assert [o.finish_reason for o in outputs] == ["abort"]
    assert engine.take_released() == (["r"] if command == "release" else [])
    assert len(lm.items) == 1 and lm.live == set()  # no later piece ran; its state is freed
    assert engine.leak_state() == {}
    engine.shutdown()


# ----------------------------------------------------------------- the tiny Thinker


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module", params=("dynamic", "static"))
def thinker(request: pytest.FixtureRequest) -> ThinkerExecutor:
    args = ModelArgs(runner=request.param, max_num_seqs=4, max_model_len=256)
    return ThinkerExecutor.from_checkpoint(Checkpoint.open(tiny_dir()), args)


def _audit(thinker: ThinkerExecutor, sched: ARScheduler) -> None:
    assert sched.leak_state() == {}
    assert thinker.num_live_requests() == 0
    if thinker.runner is not None:
        assert thinker.runner.slots.num_free == 4


def _run(thinker: ThinkerExecutor, cap: int | None, long: list[int], short: list[int]) -> dict[str, Any]:
    """``short`` decoding while ``long`` is prefilled (in pieces with ``cap``); per
    request its tokens and the first payload for the Talker. Also which ticks held a
    piece of ``long`` and a decode of ``short`` together."""
    sched = _sched(max_prefill_piece_tokens=cap, max_num_seqs=4)
    reqs = {"short": _req("short", short, max_tokens=12), "long": _req("long", long, max_tokens=4)}
    sched.add_request(reqs["short"])
    while not reqs["short"].output_token_ids:  # short is prefilled before long arrives
        _tick(sched, thinker)
    sched.add_request(reqs["long"])
    first: dict[str, Any] = {}
    together = 0
    while sched.requests:
        batches, updates = _tick(sched, thinker)
        kinds = {i.internal_id.split("@")[0]: i.is_prefill for b in batches for i in b}
        together += kinds.get("long") is True and kinds.get("short") is False
        for u in updates:
            name = u.request.external_id
            if u.next_stage_output is not None:
                first.setdefault(name, u.next_stage_output)
            if u.is_finished:
                thinker.release(u.request.internal_id)  # as the engine does
    _audit(thinker, sched)
    return {
        "tokens": {k: r.output_token_ids for k, r in reqs.items()},
        "first": first,
        "together": together,
    }


def test_a_prompt_in_pieces_gives_the_tokens_and_talker_rows_of_one_piece(thinker: ThinkerExecutor) -> None:
    tok = thinker.tokenizer
    long = encode_chat_prompt(tok, "Tell me a long and winding story about a lighthouse keeper and a cat.")
    short = encode_chat_prompt(tok, "Hi")
    whole = _run(thinker, None, long, short)
    split = _run(thinker, 5, long, short)
    assert whole["together"] == 1  # the whole prompt in one step, beside a decode
    assert split["together"] == -(-len(long) // 5) > 2  # every piece beside a decode
    assert split["tokens"] == whole["tokens"]
    got, want = split["first"]["long"], whole["first"]["long"]
    assert got["token_ids"] == want["token_ids"] == [*long, split["tokens"]["long"][0]]
    assert got["hidden_layers"].keys() == want["hidden_layers"].keys()
    for layer, rows in want["hidden_layers"].items():
        assert rows.shape[0] == len(long)
        torch.testing.assert_close(got["hidden_layers"][layer], rows, rtol=1e-5, atol=1e-5)


def test_an_abort_between_pieces_frees_the_thinker(thinker: ThinkerExecutor) -> None:
    long = encode_chat_prompt(thinker.tokenizer, "A prompt long enough for a few pieces, surely.")
    sched = _sched(max_prefill_piece_tokens=4, max_num_seqs=4)
    r = _req("long", long)
    sched.add_request(r)
    _tick(sched, thinker)
    _tick(sched, thinker)
    assert r.num_computed_tokens == 8 and thinker.num_live_requests() == 1
    sched.abort(r.internal_id)
    thinker.release(r.internal_id)  # the engine releases an aborted request's state
    _audit(thinker, sched)
    # The same id prefilled afresh afterwards gives what a fresh request would.
    again = _run(thinker, 4, long, [1, 2])
    assert again["tokens"] == _run(thinker, None, long, [1, 2])["tokens"]
