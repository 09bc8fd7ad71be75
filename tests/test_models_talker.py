"""Talker executor: one frame of Q codebooks per step from Thinker payloads, batched decode
equals unbatched, streaming input equals a complete input, codec EOS stops it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from omnirelay.engine.interfaces import Executor, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.loader import ModelArgs
from omnirelay.models.qwen3_omni.talker import TalkerExecutor, TalkerSpec
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.runner import Buckets
from omnirelay.payload import OmniPayload
from omnirelay.processors import TalkerToCode2WavProcessor
from tests.test_models_support import item, run_thinker, single_thread, tiny_dir

EOS = 2150
Q = 16
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=50, seed=42)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint.open(tiny_dir())


#: Both runners must behave the same: the dynamic one (the CPU default) and the static one
#: (KV slots, padded batched launches; eager here, CUDA graphs on a GPU).
RUNNERS = ("dynamic", "static")


def make_talker(checkpoint: Checkpoint, runner: str) -> TalkerExecutor:
    args = ModelArgs(runner=runner, max_num_seqs=8, max_model_len=256)
    return TalkerExecutor.from_checkpoint(checkpoint, args=args)


@pytest.fixture(scope="module", params=RUNNERS)
def talker(checkpoint: Checkpoint, request: pytest.FixtureRequest) -> TalkerExecutor:
    return make_talker(checkpoint, request.param)


#: Every token id of each Thinker run below (prompt + generated), by request.
THINKER_IDS: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def payloads(checkpoint: Checkpoint) -> dict[str, list[OmniPayload]]:
    """Thinker → Talker payloads of three requests (6, 8 and 3 Thinker steps)."""
    thinker = ThinkerExecutor.from_checkpoint(checkpoint)
    tok = thinker.tokenizer
    out = {}
    for rid, text, steps in (
        ("a@s1.0", "Hello there!", 6),
        ("b@s1.1", "Tell me a story.", 8),
        ("c@s1.2", "Hi", 3),
    ):
        prompt = encode_chat_prompt(tok, text)
        accept = thinker.accept_hidden_layer
        stream = run_thinker(thinker, {rid: prompt}, steps, accept_hidden_layer=accept)[rid]
        assert stream.is_last[-1]  # each stream ends with its last payload
        out[rid] = stream.payloads
        THINKER_IDS[rid] = stream.all_ids
    return out


def talk(
    executor: TalkerExecutor,
    streams: dict[str, list[OmniPayload]],
    steps: int,
    sampling: SamplingParams = GREEDY,
    *,
    complete: bool = False,
    launched: bool = False,
) -> dict[str, list[Any]]:
    """Drive requests as the AR scheduler does: one committed chunk per step until the
    Thinker is exhausted, then free-running. ``complete``: the whole Thinker output as
    one forwarded input instead; ``launched``: each step split (``launch``, then its
    ``result``), as in a device group. Returns each request's results."""
    results: dict[str, list[Any]] = {rid: [] for rid in streams}
    for step in range(steps):
        batch = []
        for rid, chunks in streams.items():
            if results[rid] and results[rid][-1].finished:
                continue
            if complete:
                inputs = whole_input(chunks, THINKER_IDS[rid]) if step == 0 else None
                batch.append(item(rid, sampling=sampling, inputs=inputs))
            else:
                info = chunks[step] if step < len(chunks) else None
                # The last chunk is the Thinker's terminal: from its step on, no more input.
                batch.append(item(rid, sampling=sampling, info=info, exhausted=step >= len(chunks) - 1))
        if not batch:
            break
        stepped = executor.launch(batch).result() if launched else executor.step(batch)
        for it, res in zip(batch, stepped):
            results[it.internal_id].append(res)
    for rid in streams:
        executor.release(rid)
    return results


def whole_input(chunks: list[OmniPayload], all_ids: list[int]) -> OmniPayload:
    """The complete Thinker output in chunk 0's layout (what a full handoff carries)."""
    first = chunks[0]
    assert first.embed is not None and first.ids is not None
    rows = [first.embed["prefill"]] + [c.embed["decode"] for c in chunks[1:] if c.embed is not None]
    embed = {**first.embed, "prefill": torch.cat(rows)}
    return msgspec.structs.replace(first, embed=embed, ids={**first.ids, "all": all_ids})


def frames(results: list[Any]) -> torch.Tensor:
    return torch.cat([r.next_stage_output for r in results])


def test_is_an_executor(talker: TalkerExecutor) -> None:
    assert isinstance(talker, Executor)
    assert talker.execution_type == "ar" and talker.supports_batching and talker.num_codebooks == Q


def test_each_step_yields_one_frame_of_q_codebooks(talker: TalkerExecutor, payloads: dict[str, Any]) -> None:
    rid = "a@s1.0"
    results = talk(talker, {rid: payloads[rid]}, 12)[rid]
    assert len(results) == 12
    for res in results:
        frame = res.next_stage_output
        assert frame.shape == (1, Q) and frame.dtype == torch.int64 and frame.device.type == "cpu"
        assert res.token_ids == [int(frame[0, 0])]
        assert int(frame.min()) >= 0 and int(frame.max()) < 2048  # codec ids only
    assert len({tuple(r.next_stage_output[0].tolist()) for r in results}) > 1
    assert talker.num_live_requests() == 0


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_batched_decode_equals_unbatched(
    talker: TalkerExecutor, payloads: dict[str, Any], sampling: SamplingParams
) -> None:
    together = talk(talker, payloads, 14, sampling)
    for rid, chunks in payloads.items():
        alone = talk(talker, {rid: chunks}, 14, sampling)[rid]
        assert torch.equal(frames(together[rid]), frames(alone)), rid


def test_streaming_input_equals_one_complete_input(talker: TalkerExecutor, payloads: dict[str, Any]) -> None:
    streamed = talk(talker, payloads, 14)
    complete = talk(talker, payloads, 14, complete=True)
    for rid in payloads:
        assert torch.equal(frames(streamed[rid]), frames(complete[rid])), rid


def test_a_launched_step_speaks_what_the_step_speaks(
    talker: TalkerExecutor, payloads: dict[str, Any]
) -> None:
    stepped = talk(talker, payloads, 10, SAMPLED)
    launched = talk(talker, payloads, 10, SAMPLED, launched=True)
    for rid in payloads:
        assert torch.equal(frames(stepped[rid]), frames(launched[rid])), rid
    assert talker.num_live_requests() == 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_talker_stops_on_codec_eos(checkpoint: Checkpoint, payloads: dict[str, Any], runner: str) -> None:
    executor = make_talker(checkpoint, runner)
    rid = "b@s1.1"
    normal = talk(executor, {rid: payloads[rid]}, 8)[rid]
    first = [r.token_ids[0] for r in normal]
    k = 4
    assert first[k] not in first[:k]
    head = executor.model.codec_head.weight
    with torch.no_grad():
        head[EOS] = head[first[k]] * 1.5  # EOS now wins where first[k] would have
    stopped = talk(executor, {rid: payloads[rid]}, 20)[rid]
    assert len(stopped) == k + 1
    assert torch.equal(frames(stopped[:k]), frames(normal[:k]))
    last = stopped[-1]
    assert last.finished and last.token_ids == [EOS]
    assert last.next_stage_output.tolist() == [[EOS] + [0] * (Q - 1)]
    assert not any(r.finished for r in stopped[:-1])
    # The Talker → Code2Wav processor drops the EOS frame and flushes the rest.
    processor = TalkerToCode2WavProcessor()
    state = processor.new_state()
    sent = []
    for res in stopped:
        payload = processor.step(state, res.next_stage_output, chunk_id=len(sent), finished=res.finished)
        if payload is not None:
            sent.append((payload, res.finished))
    assert state.num_frames == k and sent[-1][1]  # the last payload goes out as the terminal
    assert executor.num_live_requests() == 0


def test_steps_without_a_chunk_before_the_thinker_ends_are_counted(
    talker: TalkerExecutor, payloads: dict[str, Any]
) -> None:
    rid = "a@s1.0"
    talker.step([item(rid, info=payloads[rid][0])])  # the Thinker is still running
    talker.step([item(rid)])  # the engine would not do this: no chunk, Thinker still running
    assert talker.num_starved_steps(rid) == 1
    talker.release(rid)
    assert talker.num_starved_steps(rid) == 0


def test_input_errors_name_the_problem(talker: TalkerExecutor, payloads: dict[str, Any]) -> None:
    chunks = payloads["a@s1.0"]
    with pytest.raises(ModelError, match="cannot be recomputed"):
        talker.step([item("x")])  # a first step without chunk 0 (e.g. after preemption)
    with pytest.raises(ModelError, match="must be the Thinker's chunk 0"):
        talker.step([item("x", info=chunks[1])])
    with pytest.raises(ModelError, match="unknown speaker"):
        talker.step([item("x", info=msgspec.structs.replace(chunks[0], speaker="Nobody"))])
    no_turn = msgspec.structs.replace(chunks[0], ids={"all": [1, 2, 3] * 20, "prompt": [1, 2, 3] * 5})
    with pytest.raises(ModelError, match="assistant"):
        talker.step([item("x", info=no_turn)])
    with pytest.raises(ModelError, match=r"embed\.tts_pad"):
        talker.step(
            [
                item(
                    "x",
                    info=msgspec.structs.replace(
                        chunks[0], embed={k: v for k, v in chunks[0].embed.items() if k != "tts_pad"}
                    ),
                )
            ]
        )
    talker.step([item("x", info=chunks[0])])
    with pytest.raises(ModelError, match="second chunk 0"):
        talker.step([item("x", info=chunks[0])])
    talker.release("x")
    assert talker.num_live_requests() == 0


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_static_runner_speaks_the_frames_of_the_dynamic_one(
    checkpoint: Checkpoint, payloads: dict[str, Any], sampling: SamplingParams
) -> None:
    """Same codes frame by frame, batched, with sampling drawn from the same generators."""
    dynamic = talk(make_talker(checkpoint, "dynamic"), payloads, 14, sampling)
    static_talker = make_talker(checkpoint, "static")
    static = talk(static_talker, payloads, 14, sampling)
    for rid in payloads:
        assert torch.equal(frames(static[rid]), frames(dynamic[rid])), rid
    assert static_talker.runner is not None and static_talker.runner.slots.num_free == 8


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_the_compiled_frame_tail_traces_whole_and_speaks_the_same_frames(
    checkpoint: Checkpoint, payloads: dict[str, Any], sampling: SamplingParams
) -> None:
    """The code-predictor tail as ``torch.compile`` sees it: each of its two bodies is one
    graph per batch size (``fullgraph``: no break), whatever the position or codebook,
    and it samples the frames of the eager tail. (A light backend here: the GPU tests
    compile with inductor.)"""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    _dynamo.reset()
    counters.clear()
    spec = TalkerSpec.from_config(checkpoint.config)
    buckets = Buckets(max_num_seqs=8, max_model_len=256)
    compiled = TalkerExecutor(
        checkpoint.load_talker(), spec, static=buckets, cuda_graphs=False, compile="aot_eager"
    )
    assert compiled.runner is not None and compiled.runner.predictor.compile_backend == "aot_eager"
    got = talk(compiled, payloads, 14, sampling)
    want = talk(make_talker(checkpoint, "static"), payloads, 14, sampling)
    for rid in payloads:
        assert torch.equal(frames(got[rid]), frames(want[rid])), rid
    # Rows ran in batches of 1, 2 and 4 (buckets 1, 2, 4): each body compiled for the first
    # size, then once more with the batch (and the head's vocabulary) symbolic.
    assert 2 <= counters["stats"]["unique_graphs"] <= 5
    assert not counters["graph_break"]
    _dynamo.reset()
