"""Thinker executor: batched decode equals unbatched, what the Talker needs, EOS, state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omnirelay.engine.interfaces import Executor, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.loader import ModelArgs
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.runner import Buckets
from tests.test_models_support import Lockstep, item, run_thinker, single_thread, tiny_dir

STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


#: Both runners must behave the same: the dynamic one (the CPU default) and the static one
#: (KV slots, padded batched launches; eager here, CUDA graphs on a GPU).
RUNNERS = ("dynamic", "static")


def make_thinker(runner: str) -> ThinkerExecutor:
    args = ModelArgs(runner=runner, max_num_seqs=8, max_model_len=256)
    return ThinkerExecutor.from_checkpoint(Checkpoint.open(tiny_dir()), args)


@pytest.fixture(scope="module", params=RUNNERS)
def thinker(request: pytest.FixtureRequest) -> ThinkerExecutor:
    return make_thinker(request.param)


@pytest.fixture(scope="module")
def prompts(thinker: ThinkerExecutor) -> dict[str, list[int]]:
    tok = thinker.tokenizer
    return {
        "a@s0.0": encode_chat_prompt(tok, "Hello there, how are you today?"),
        "b@s0.1": encode_chat_prompt(tok, "Tell me a story."),
        "c@s0.2": encode_chat_prompt(tok, "Hi", system="Be brief."),
    }


def test_is_an_executor(thinker: ThinkerExecutor) -> None:
    assert isinstance(thinker, Executor)
    assert thinker.execution_type == "ar" and thinker.supports_batching


def test_batched_decode_gives_the_same_tokens_as_unbatched(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    together = run_thinker(thinker, prompts, STEPS)
    for rid, prompt in prompts.items():
        alone = run_thinker(thinker, {rid: prompt}, STEPS)
        assert together[rid].tokens == alone[rid].tokens, rid
        assert len(together[rid].tokens) == STEPS
    assert thinker.num_live_requests() == 0


def test_requests_joining_mid_batch_decode_as_if_alone(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    (a, pa), (b, pb), _ = prompts.items()
    alone = {rid: run_thinker(thinker, {rid: p}, STEPS)[rid].tokens for rid, p in ((a, pa), (b, pb))}
    # b joins at step 3 (its prefill beside a's decode); a leaves first, b goes on alone.
    sa, sb = Lockstep(a, pa), Lockstep(b, pb)
    for step in range(STEPS + 3):
        live = [s for s in (sa, sb) if len(s.tokens) < STEPS and (s is sa or step >= 3)]
        for stream, result in zip(live, thinker.step([s.next_item() for s in live])):
            stream.apply(result)
        if step == 5:
            thinker.release("nobody")  # unknown ids are fine
    assert sa.tokens == alone[a] and sb.tokens == alone[b]
    thinker.release(a)
    thinker.release(b)
    assert thinker.num_live_requests() == 0


def test_next_stage_output_is_what_the_talker_processor_takes(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    rid, prompt = next(iter(prompts.items()))
    streams = run_thinker(thinker, {rid: prompt}, 4, accept_hidden_layer=thinker.accept_hidden_layer)
    stream = streams[rid]
    first = stream.results[0].next_stage_output
    layers = first["hidden_layers"]
    assert sorted(layers) == [0, thinker.accept_hidden_layer]
    assert all(rows.shape == (len(prompt), 64) and rows.device.type == "cpu" for rows in layers.values())
    assert first["token_ids"] == [*prompt, stream.tokens[0]]
    assert all(first[k].shape == (1, 64) for k in ("tts_bos", "tts_eos", "tts_pad"))
    # Layer 0 is the embedding of the step's input tokens.
    embed = thinker.model.get_input_embeddings()
    with torch.inference_mode():
        assert torch.equal(layers[0], embed(torch.tensor(prompt)))
    later = stream.results[1].next_stage_output["hidden_layers"]
    assert all(rows.shape == (1, 64) for rows in later.values())
    # The processor released chunk 0 (prompt + 1 generated row), then one row per step.
    assert [p.embed.get("prefill", p.embed.get("decode")).shape[0] for p in stream.payloads] == [
        len(prompt) + 1,
        1,
        1,
    ]
    assert stream.is_last == [False, False, True]


def test_text_deltas_add_up_to_the_decoded_output(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    for rid, stream in run_thinker(thinker, prompts, STEPS).items():
        assert stream.text == thinker.tokenizer.decode(stream.tokens, skip_special_tokens=True), rid
        assert stream.text.isascii() and stream.text.isprintable()  # the tiny head writes ASCII


@pytest.mark.parametrize("runner", RUNNERS)
def test_end_of_turn_token_finishes_the_request(prompts: dict[str, list[int]], runner: str) -> None:
    executor = make_thinker(runner)
    rid, prompt = next(iter(prompts.items()))
    normal = run_thinker(executor, {rid: prompt}, 4)[rid].tokens
    im_end = executor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in executor.eos_token_ids
    head = executor.model.lm_head.weight
    with torch.no_grad():
        head[im_end] = head[normal[2]] * 1.5  # wins exactly where normal[2] would have
    stream = run_thinker(executor, {rid: prompt}, 10)[rid]
    assert stream.tokens == [*normal[:2], im_end]
    assert stream.results[-1].finished and not any(r.finished for r in stream.results[:-1])


def test_seeded_sampling_is_reproducible_and_batch_invariant(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    rid, prompt = next(iter(prompts.items()))

    def run(batch: dict[str, list[int]]) -> list[int]:
        streams = [Lockstep(r, p) for r, p in batch.items()]
        for _ in range(6):
            for s, res in zip(streams, thinker.step([s.next_item(sampling) for s in streams])):
                s.apply(res)
        for r in batch:
            thinker.release(r)
        return streams[0].tokens

    alone = run({rid: prompt})
    assert run({rid: prompt}) == alone
    assert run({rid: prompt, "other": prompts["b@s0.1"]}) == alone


def test_recompute_from_an_earlier_point_and_errors(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    rid, prompt = next(iter(prompts.items()))
    tokens = run_thinker(thinker, {rid: prompt}, 5)[rid].tokens
    # Preempted and readmitted: everything so far is recomputed in one prefill.
    all_ids = [*prompt, *tokens[:3]]
    (res,) = thinker.step([item(rid, input_ids=all_ids, all_ids=all_ids)])
    assert res.token_ids == [tokens[3]]
    # A recompute of the last two tokens only (the KV of the rest is kept).
    (res,) = thinker.step([item(rid, input_ids=all_ids[-2:], all_ids=all_ids, computed=len(all_ids) - 2)])
    assert res.token_ids == [tokens[3]]
    with pytest.raises(ModelError, match="computed tokens"):
        # A failed step fails every request in it: none is left half-updated.
        thinker.step([item("ok", input_ids=prompt), item("ghost", input_ids=[1], all_ids=[5, 1], computed=1)])
    assert thinker.num_live_requests() == 1  # only rid, from before
    with pytest.raises(ModelError, match="twice"):
        thinker.step([item(rid, input_ids=[1]), item(rid, input_ids=[1])])
    thinker.release(rid)
    thinker.release(rid)
    assert thinker.num_live_requests() == 0


def _hidden(stream: Lockstep) -> list[dict[int, torch.Tensor]]:
    return [r.next_stage_output["hidden_layers"] for r in stream.results]


@pytest.mark.parametrize(
    "buckets",
    [
        Buckets(max_num_seqs=8, max_model_len=256),
        # Prompts longer than the largest piece: each is cut, later pieces continue the
        # cached positions; a tight token budget splits the batch into several launches.
        Buckets(
            max_num_seqs=8,
            max_model_len=256,
            batch_sizes=(1, 2, 8),
            prefill_tokens=(4, 8),
            max_prefill_tokens=16,
        ),
    ],
    ids=["one-launch", "pieces"],
)
def test_static_runner_gives_the_tokens_and_hidden_states_of_the_dynamic_one(
    prompts: dict[str, list[int]], buckets: Buckets
) -> None:
    dynamic_thinker = ThinkerExecutor.from_checkpoint(Checkpoint.open(tiny_dir()))
    dynamic = run_thinker(dynamic_thinker, prompts, STEPS, accept_hidden_layer=1)
    static_thinker = ThinkerExecutor(  # the same weights on the static runner
        dynamic_thinker.model,
        dynamic_thinker.tokenizer,
        accept_hidden_layer=dynamic_thinker.accept_hidden_layer,
        tts_token_ids=(0, 1, 2),
        eos_token_ids=dynamic_thinker.eos_token_ids,
        static=buckets,
        cuda_graphs=False,
    )
    static = run_thinker(static_thinker, prompts, STEPS, accept_hidden_layer=1)
    for rid in prompts:
        assert static[rid].tokens == dynamic[rid].tokens, rid
        for got, want in zip(_hidden(static[rid]), _hidden(dynamic[rid]), strict=True):
            assert got.keys() == want.keys()
            for layer in got:
                assert got[layer].shape == want[layer].shape
                torch.testing.assert_close(got[layer], want[layer], rtol=1e-4, atol=1e-5)
    assert static_thinker.runner is not None and static_thinker.runner.slots.num_free == 8


def test_keeping_outputs_on_device_changes_nothing_on_the_cpu(
    thinker: ThinkerExecutor, prompts: dict[str, list[int]]
) -> None:
    """A GPU-direct edge asks the Thinker to keep its rows on its device; on the CPU they
    are the same host tensors as before."""
    rid, prompt = next(iter(prompts.items()))
    before = run_thinker(thinker, {rid: prompt}, 2, accept_hidden_layer=thinker.accept_hidden_layer)[rid]
    thinker.keep_outputs_on_device(True)
    try:
        after = run_thinker(thinker, {rid: prompt}, 2, accept_hidden_layer=thinker.accept_hidden_layer)[rid]
    finally:
        thinker.keep_outputs_on_device(False)
    for old, new in zip(before.results, after.results):
        a, b = old.next_stage_output, new.next_stage_output
        assert all(b["hidden_layers"][k].device.type == "cpu" for k in b["hidden_layers"])
        assert all(torch.equal(a["hidden_layers"][k], b["hidden_layers"][k]) for k in a["hidden_layers"])
        assert torch.equal(a["tts_pad"], b["tts_pad"]) and b["tts_pad"].device.type == "cpu"
