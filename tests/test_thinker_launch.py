"""The Thinker's step split in launch and completion (a device group's loop): greedy
decodes on the static runner come back through ``launch`` with the same ids, text and
hidden rows as ``step``; a prefill or a sampled row runs at once; a completion asked
before the work ended still returns it; a failing launch releases its requests (tiny
Thinker, CPU: the launch runs its work at once, and the split's bookkeeping is what is
tested here — tests/test_thinker_launch_cuda.py covers the stream)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.qwen3_omni import create_thinker
from tests.test_models_support import Lockstep

STEPS = 6
PROMPTS = {"a": [5, 9, 14, 3], "b": [7, 7, 2, 30, 11, 4, 8]}


@pytest.fixture(scope="module")
def executors() -> tuple[Any, Any]:
    args = {"tiny": True, "device": "cpu", "runner": "static", "max_num_seqs": 4, "max_model_len": 64}
    return create_thinker(**args), create_thinker(**args)


def _drive(executor: Any, *, launched: bool) -> tuple[dict[str, Lockstep], list[bool]]:
    streams = {rid: Lockstep(rid, prompt, accept_hidden_layer=1) for rid, prompt in PROMPTS.items()}
    done_before: list[bool] = []
    for step in range(STEPS):
        live = [s for s in streams.values() if not s.is_finished]
        batch = [s.next_item() for s in live]
        if launched:
            pending = executor.launch(batch)
            done_before.append(pending.is_done())
            results = pending.result()
        else:
            results = executor.step(batch)
        for stream, result in zip(live, results, strict=True):
            stream.apply(result, is_last=step == STEPS - 1)
    for rid in PROMPTS:
        executor.release(rid)
    return streams, done_before


def test_launched_decodes_equal_the_steps(executors: tuple[Any, Any]) -> None:
    stepped, _ = _drive(executors[0], launched=False)
    launched, done = _drive(executors[1], launched=True)
    assert done == [True] * STEPS  # on the CPU the work ran in the launch
    for rid in PROMPTS:
        assert launched[rid].tokens == stepped[rid].tokens and len(stepped[rid].tokens) == STEPS
        assert launched[rid].text == stepped[rid].text
        for a, b in zip(launched[rid].results, stepped[rid].results, strict=True):
            ha, hb = a.next_stage_output["hidden_layers"], b.next_stage_output["hidden_layers"]
            assert ha.keys() == hb.keys()
            for layer in ha:
                torch.testing.assert_close(ha[layer], hb[layer])
    assert executors[1].num_live_requests() == 0 and executors[1].runner.slots.holders() == []


def test_the_runner_launches_only_greedy_decodes(
    executors: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = executors[1]
    calls: list[int] = []
    launch_decode = type(executor.runner).launch_decode

    def spy(self: Any, rows: Any, stream: Any) -> Any:
        calls.append(len(rows))
        return launch_decode(self, rows, stream)

    monkeypatch.setattr(type(executor.runner), "launch_decode", spy)
    a = Lockstep("a", PROMPTS["a"])
    a.apply(executor.launch([a.next_item()]).result()[0])  # a prefill: run at once
    assert calls == []
    sampled = a.next_item(SamplingParams(temperature=0.8, seed=1))
    a.apply(executor.launch([sampled]).result()[0])  # a sampled row: run at once
    assert calls == []
    a.apply(executor.launch([a.next_item()]).result()[0])
    assert calls == [1]
    executor.release("a")


def test_a_failing_launch_releases_its_requests(
    executors: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = executors[1]
    a = Lockstep("a", PROMPTS["a"])
    a.apply(executor.step([a.next_item()])[0])
    assert "a" in executor.runner.slots

    def broken(self: Any, rows: Any, stream: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(type(executor.runner), "launch_decode", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        executor.launch([a.next_item()])
    assert "a" not in executor.runner.slots and executor.num_live_requests() == 0
