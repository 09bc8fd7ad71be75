"""The static runner's device-free logic: buckets, launch plans, KV slots, on-device
sampling and grouped attention against their references (CPU)."""

from __future__ import annotations

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.runner import Buckets, SlotTable, plan_decode, plan_prefill
from omnirelay.models.runner.buckets import bucket, length_buckets
from omnirelay.models.runner.decoder import grouped_attention
from omnirelay.models.runner.sampler import sample
from omnirelay.models.sampling import make_generator, sample_rows


def test_bucket_is_the_smallest_size_that_fits() -> None:
    sizes = (1, 2, 4, 8)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert length_buckets(2048) == (256, 1024, 2048)
    assert length_buckets(4096) == (256, 1024, 4096)
    assert length_buckets(100) == (100,)


def test_buckets_are_clipped_to_the_slots_and_the_model_length() -> None:
    b = Buckets(max_num_seqs=20, max_model_len=200)
    assert b.batch_sizes == (1, 2, 4, 8, 16, 20)
    assert b.prefill_tokens == (16, 64)
    assert b.lengths == (200,)
    assert all(bb * t <= b.max_prefill_tokens for bb, t in b.prefill_shapes())
    assert len(b.decode_shapes()) == len(b.batch_sizes) * len(b.lengths)
    with pytest.raises(ConfigError):
        Buckets(max_num_seqs=4, max_model_len=64, batch_sizes=(2, 1))
    with pytest.raises(ModelError, match="max_model_len"):
        b.length(201)


def test_fresh_prompts_share_one_launch() -> None:
    b = Buckets(max_num_seqs=64, max_model_len=2048)
    launches = plan_prefill([(0, 30)] * 16, b)
    assert len(launches) == 1
    (launch,) = launches
    assert (launch.batch, launch.tokens, launch.attn_len) == (16, 64, None)
    assert sorted(p.row for p in launch.pieces) == list(range(16))
    assert all(p.is_last and p.start == 0 and p.count == 30 for p in launch.pieces)
    # 64 of them still fit one launch (64 x 64 = 4096 padded tokens).
    assert len(plan_prefill([(0, 30)] * 64, b)) == 1


def test_the_token_budget_splits_launches_and_long_prompts_become_pieces() -> None:
    b = Buckets(
        max_num_seqs=8,
        max_model_len=256,
        batch_sizes=(1, 2, 4, 8),
        prefill_tokens=(4, 8),
        max_prefill_tokens=16,
    )
    launches = plan_prefill([(0, 20), (0, 3), (5, 6)], b)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for launch in launches:
        assert launch.batch * launch.tokens <= 16 or launch.batch == 1
        for p in launch.pieces:
            assert p.count <= launch.tokens
            seen.setdefault(p.row, []).append((p.start, p.offset, p.count))
        if not launch.is_fresh:
            assert launch.attn_len is not None
            assert launch.attn_len >= max(p.start + p.count for p in launch.pieces)
    # Row 0: 20 tokens = 8 + 8 + 4, in order; the first piece is fresh, the rest continue.
    assert seen[0] == [(0, 0, 8), (8, 8, 8), (16, 16, 4)]
    assert seen[1] == [(0, 0, 3)]
    assert seen[2] == [(5, 0, 6)]  # continues cached positions: never fresh
    fresh = [launch for launch in launches if launch.is_fresh]
    assert {p.row for launch in fresh for p in launch.pieces} == {0, 1}
    # Each row's pieces come in launch order.
    order = [(p.row, p.offset) for launch in launches for p in launch.pieces]
    for row in seen:
        offsets = [o for r, o in order if r == row]
        assert offsets == sorted(offsets)
    with pytest.raises(ModelError, match="max_model_len"):
        plan_prefill([(250, 10)], b)
    with pytest.raises(ModelError, match="no tokens"):
        plan_prefill([(0, 0)], b)


def test_decode_launches_cover_the_rows_in_order() -> None:
    b = Buckets(max_num_seqs=32, max_model_len=2048)
    positions = [10] * 40 + [900]
    launches = plan_decode(positions, b)
    assert [(x.batch, x.attn_len) for x in launches] == [(32, 256), (16, 1024)]
    assert [p.row for x in launches for p in x.pieces] == list(range(41))
    with pytest.raises(ModelError, match="max_model_len"):
        plan_decode([2048], b)


def test_slot_table_hands_out_and_takes_back_slots() -> None:
    table = SlotTable(num_slots=2, max_len=16)
    assert table.scratch == 2
    a, b = table.acquire("a"), table.acquire("b")
    assert {a, b} == {0, 1} and table.acquire("a") == a and table.num_free == 0
    with pytest.raises(ModelError, match="max_num_seqs"):
        table.acquire("c")
    table.set_length("a", 10)
    table.truncate("a", 4)
    assert table.length("a") == 4
    table.truncate("a", 9)  # never grows
    assert table.length("a") == 4
    with pytest.raises(ModelError, match="max_model_len"):
        table.check_room("a", 10, 7)
    table.release("a")
    table.release("a")
    assert table.num_free == 1 and "a" not in table and table.length("a") == 0
    assert table.acquire("c") == 1 and table.slot("b") == 0  # b moved down to a's slot


def test_slot_table_keeps_its_holders_packed_from_zero() -> None:
    table = SlotTable(num_slots=4, max_len=16)
    moves: list[tuple[int, int, int]] = []
    table.on_move = lambda src, dst, length: moves.append((src, dst, length))
    for i, rid in enumerate("abcd"):
        assert table.acquire(rid) == i
        table.set_length(rid, 5 + i)
    table.release("b")  # d (slot 3, 8 positions) moves into slot 1
    assert moves == [(3, 1, 8)] and table.slot("d") == 1 and table.length("d") == 8
    table.release("c")  # the top holder leaves: nothing moves
    assert moves == [(3, 1, 8)]
    assert sorted(table.slot(r) for r in table.holders()) == [0, 1]
    assert table.acquire("e") == 2
    table.release("a")
    assert moves[-1] == (2, 0, 0) and table.slot("e") == 0
    assert sorted(table.slot(r) for r in table.holders()) == [0, 1] and table.num_free == 2


def test_a_decode_of_packed_slots_puts_each_row_at_its_slot() -> None:
    b = Buckets(max_num_seqs=8, max_model_len=512, batch_sizes=(1, 2, 4, 8))
    (launch,) = plan_decode([10, 300, 20], b, slots=[2, 0, 1])
    assert (launch.batch, launch.attn_len, launch.rows_at) == (4, 512, (2, 0, 1))
    assert [launch.row_of(i) for i in range(3)] == [2, 0, 1] and launch.in_place
    # A sparse subset (slot 5 needs a batch of 8 for 2 rows): gathered, in row order.
    (sparse,) = plan_decode([10, 20], b, slots=[0, 5])
    assert sparse.rows_at is None and sparse.batch == 2 and sparse.row_of(1) == 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=5, seed=2),
        SamplingParams(temperature=0.9, top_p=0.6, seed=3),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.8, seed=4),
    ],
    ids=["greedy", "temperature", "top-k", "top-p", "top-k+top-p"],
)
def test_device_sampler_draws_what_sample_rows_draws(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        logits = torch.randn(3, 300, generator=gen) * 3
        logits[:, 250:] = float("-inf")  # suppressed ids are never drawn
        rows = [params, SamplingParams(), params]
        want = sample_rows(logits, rows, [make_generator(p.seed) for p in rows])
        uniform = torch.cat([torch.rand(1, generator=make_generator(p.seed)) for p in rows])
        got = sample(
            logits,
            torch.tensor([p.temperature for p in rows]),
            torch.tensor([p.top_k for p in rows]),
            torch.tensor([p.top_p for p in rows]),
            uniform,
        )
        assert got.tolist() == want
        assert int(got.max()) < 250


def test_grouped_attention_matches_repeated_heads() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 3, 16, generator=gen)
    k = torch.randn(2, 2, 10, 16, generator=gen)
    v = torch.randn(2, 2, 10, 16, generator=gen)
    lengths = torch.tensor([6, 10])
    positions = torch.tensor([[3, 4, 5], [7, 8, 9]])
    keys = torch.arange(10)
    mask = (
        (keys.view(1, 1, 10) <= positions.unsqueeze(2)) & (keys.view(1, 1, 10) < lengths.view(2, 1, 1))
    ).unsqueeze(1)
    got = grouped_attention(q, k, v, mask, 0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), attn_mask=mask, scale=0.25
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
