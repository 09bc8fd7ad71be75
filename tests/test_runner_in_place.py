"""Decode attention that reads each row's KV slot in place (no per-layer gather), and
the slot table's packing when a request leaves (its last holder's cache moves): the
greedy ids of requests that share a runner, leave in the middle and are replaced, equal
those of each request decoded alone (tiny Thinker, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.runner import Buckets, Row, ThinkerRunner
from omnirelay.models.runner.decoder import StaticDecoder

STEPS = 12


@pytest.fixture(scope="module")
def thinker() -> Any:
    return open_checkpoint(ModelArgs(tiny=True, device="cpu")).load_thinker()


def _runner(model: Any) -> ThinkerRunner:
    text = getattr(model.model, "language_model", model.model)
    buckets = Buckets(max_num_seqs=4, max_model_len=64, batch_sizes=(1, 2, 4), prefill_tokens=(16,))
    return ThinkerRunner(
        text, model.lm_head, capture_layers=(0,), num_text_ids=200, buckets=buckets, cuda_graphs=False
    )


def _prompt(i: int) -> list[int]:
    return torch.randint(3, 200, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()


def _alone(model: Any, i: int, steps: int) -> list[int]:
    runner = _runner(model)
    runner.slots.acquire("x")
    prompt = _prompt(i)
    (out,) = runner.run([Row("x", 0, prompt, SamplingParams(), torch.Generator())], decode=False)
    ids = [int(out.token)]  # type: ignore[arg-type]
    for _ in range(steps - 1):
        start = runner.slots.length("x")
        (out,) = runner.run([Row("x", start, [ids[-1]], SamplingParams(), torch.Generator())], decode=True)
        ids.append(int(out.token))  # type: ignore[arg-type]
    return ids


def test_requests_that_leave_and_join_decode_as_if_alone(
    thinker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[bool] = []
    forward = StaticDecoder.forward

    def spy(self: StaticDecoder, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attn_len") is not None:
            modes.append(bool(kwargs.get("in_place")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "forward", spy)
    with torch.inference_mode():
        want = {i: _alone(thinker, i, STEPS) for i in range(4)}
        modes.clear()
        runner = _runner(thinker)
        got: dict[int, list[int]] = {}
        live: list[int] = []

        def admit(i: int) -> None:
            rid = f"r{i}"
            runner.slots.acquire(rid)
            (out,) = runner.run([Row(rid, 0, _prompt(i), SamplingParams(), torch.Generator())], decode=False)
            got[i] = [int(out.token)]  # type: ignore[arg-type]
            live.append(i)

        for i in range(3):
            admit(i)
        for step in range(STEPS * 2):
            if step == 3:  # r1 leaves early: r2 (the top slot) moves into its slot
                runner.slots.release("r1")
                live.remove(1)
                admit(3)
            if not live:
                break
            # One step leaves out the holder of slot 0: the others are a sparse run of
            # slots, which attention gathers (the fallback path).
            step_rows = [i for i in live if not (step == 5 and runner.slots.slot(f"r{i}") == 0)]
            rows = [
                Row(f"r{i}", runner.slots.length(f"r{i}"), [got[i][-1]], SamplingParams(), torch.Generator())
                for i in step_rows
            ]
            for i, out in zip(step_rows, runner.run(rows, decode=True)):
                got[i].append(int(out.token))  # type: ignore[arg-type]
            for i in [i for i in live if len(got[i]) == STEPS]:  # finished: leaves
                runner.slots.release(f"r{i}")
                live.remove(i)
    assert got[1] == want[1][: len(got[1])]
    for i in (0, 2, 3):
        assert got[i] == want[i], i
    assert modes.count(False) == 1 and len(modes) > 10  # every other decode read the cache in place
    assert runner.slots.holders() == [] and runner.slots.num_free == 4
