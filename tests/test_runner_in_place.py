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


def _tts_runner() -> Any:
    from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
    from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor

    args = TTSModelArgs(load_format="tiny", device="cpu", max_num_seqs=4, max_model_len=128)
    return TTSTalkerExecutor.from_checkpoint(TTSCheckpoint.open(args), args).runner


def test_talker_frames_keep_their_codes_when_a_stream_leaves_and_its_slot_is_refilled() -> None:
    """A leaving stream's slot takes the top holder's cache, its last frame's codec input
    and its repetition-penalty history: the moved stream's codes stay those it gets alone."""
    from omnirelay.models.runner import TalkerRow

    runner = _tts_runner()
    gen = torch.Generator().manual_seed(3)
    conditioning = [
        (torch.randn(6 + i, runner.hidden, generator=gen) * 0.5).to(runner.dtype) for i in range(3)
    ]
    texts = [(torch.randn(10, 1, runner.hidden, generator=gen) * 0.5).to(runner.dtype) for _ in range(3)]

    def row(i: int, embeds: torch.Tensor) -> TalkerRow:
        return TalkerRow(f"s{i}", embeds, SamplingParams(), torch.Generator(), repetition_penalty=1.3)

    frames = 8
    with torch.inference_mode():
        alone = {}
        for i in range(3):
            runner.slots.acquire(f"s{i}")
            codes = [runner.prefill([row(i, conditioning[i])])]
            codes += [runner.decode([row(i, texts[i][f])]) for f in range(frames - 1)]
            alone[i] = torch.cat(codes)
            runner.slots.release(f"s{i}")
        together: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
        for i in range(3):
            runner.slots.acquire(f"s{i}")
        for i, codes in enumerate(runner.prefill([row(i, conditioning[i]) for i in range(3)])):
            together[i].append(codes.unsqueeze(0))
        live = [0, 1, 2]
        for f in range(frames - 1):
            if f == 2:  # s0 leaves: s2 moves from slot 2 into slot 0
                runner.slots.release("s0")
                live.remove(0)
                assert runner.slots.slot("s2") == 0
            out = runner.decode([row(i, texts[i][f]) for i in live])
            for i, codes in zip(live, out):
                together[i].append(codes.unsqueeze(0))
        for i in live:
            runner.slots.release(f"s{i}")
    assert torch.equal(torch.cat(together[0]), alone[0][:3])
    for i in (1, 2):
        assert torch.equal(torch.cat(together[i]), alone[i]), i
    assert runner.slots.holders() == []
