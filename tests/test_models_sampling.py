"""The executors' building blocks: row sampling and the per-request KV pool."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.detokenizer import IncrementalDetokenizer
from omnirelay.models.kv import KVPool
from omnirelay.models.sampling import make_generator, sample_rows, suppress

# --------------------------------------------------------------------------- sampling


def test_greedy_rows_take_the_argmax_and_top_k_1_is_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=0.5),
    ]
    gens = [make_generator(p.seed) for p in params]
    out = sample_rows(logits, params, gens)
    argmax = logits.argmax(-1).tolist()
    assert out[:2] == argmax[:2]
    assert 0 <= out[2] < 50


def test_a_row_samples_the_same_alone_or_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    params = [
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=1.0, top_k=20, seed=6),
        SamplingParams(temperature=1.2, top_p=0.7, seed=7),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=8),
    ]

    def draws(rows: list[int], n: int = 5) -> dict[int, list[int]]:
        gens = {b: make_generator(params[b].seed) for b in rows}
        out: dict[int, list[int]] = {b: [] for b in rows}
        for _ in range(n):
            tokens = sample_rows(logits[rows], [params[b] for b in rows], [gens[b] for b in rows])
            for b, t in zip(rows, tokens):
                out[b].append(t)
        return out

    together = draws([0, 1, 2, 3])
    for b in range(4):
        assert draws([b])[b] == together[b]
    assert draws([3, 1])[1] == together[1]


def test_filters_keep_only_allowed_tokens_and_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        (t,) = sample_rows(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [gen])
        counts[t] += 1
    assert counts[2] == counts[3] == 0  # the mass before token 2 (0.8) already reaches 0.7
    assert abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.05
    both = {
        sample_rows(logits, [SamplingParams(temperature=1.0)], [gen], top_k=3, top_p=0.7)[0]
        for _ in range(200)
    }
    assert both == {0, 1}  # top-p applies inside top-k
    only_k = {sample_rows(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen])[0] for _ in range(200)}
    assert only_k == {0, 1}


def test_suppress_masks_a_range_but_keeps_listed_ids() -> None:
    logits = torch.zeros(2, 10)
    suppress(logits, 4, 10, keep=(7,))
    assert torch.isinf(logits[:, 4:7]).all() and torch.isinf(logits[:, 8:]).all()
    assert (logits[:, 7] == 0).all() and (logits[:, :4] == 0).all()


# --------------------------------------------------------------------------- KV pool


def _kv(length: int, value: float) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(2):
        k = torch.full((1, 2, length, 4), value + layer)
        cache.update(k, -k, layer)
    return cache


def test_kv_pool_stacks_left_padded_and_reuses_an_unchanged_group() -> None:
    pool = KVPool()
    for rid, n, v in (("a", 3, 1.0), ("b", 5, 10.0)):
        pool.prefill_cache(rid)
        pool.store(rid, _kv(n, v))
    cache, mask, positions = pool.decode_batch(["a", "b"])
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[3], [5]]
    keys = cache.layers[0].keys
    assert keys.shape == (2, 2, 5, 4) and keys[0, :, :2].eq(0).all() and keys[0, :, 2:].eq(1.0).all()
    for layer in range(2):  # the model appends one token per row
        cache.update(torch.full((2, 2, 1, 4), 7.0), torch.full((2, 2, 1, 4), 7.0), layer)
    pool.commit_decode(["a", "b"])
    again, mask2, positions2 = pool.decode_batch(["a", "b"])
    assert again is cache  # same requests, same order: no re-stacking
    assert mask2.shape == (2, 7) and positions2.tolist() == [[4], [6]]
    for layer in range(2):
        again.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), layer)
    pool.commit_decode(["a", "b"])
    # A different batch dissolves the group: each request keeps its own tokens, unpadded.
    single = pool.prefill_cache("a")
    assert pool.num_grouped == 0
    assert single.layers[0].keys.shape == (1, 2, 5, 4)
    assert single.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 7.0, 0.0]
    pool.store("a", single)
    assert (pool.length("a"), pool.length("b")) == (5, 7)


def test_kv_pool_drop_and_truncate() -> None:
    pool = KVPool()
    for rid in ("a", "b", "c"):
        pool.store(rid, _kv(4, 2.0))
    pool.decode_batch(["a", "b", "c"])
    pool.drop("b")  # dissolves the group; the others keep their caches
    assert "b" not in pool and len(pool) == 2 and pool.num_grouped == 0
    pool.truncate("a", 2)
    assert pool.length("a") == 2 and pool.prefill_cache("a").get_seq_length() == 2
    pool.drop("a")
    pool.drop("a")
    pool.drop("c")
    assert len(pool) == 0
    with pytest.raises(AssertionError):
        pool.commit_decode(["c"])


# --------------------------------------------------------------------------- detokenizer


class _BytesTokenizer:
    """Each id is one UTF-8 byte; invalid sequences decode to U+FFFD like a BPE would."""

    def decode(self, ids: list[int], **_: object) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_partial_characters() -> None:
    detok = IncrementalDetokenizer(_BytesTokenizer(), context=list(b"prompt: "))
    data = "aé😀b".encode()
    deltas = [detok.push([byte]) for byte in data]
    assert "".join(deltas) + detok.flush() == "aé😀b"
    assert deltas[1] == "" and deltas[2] == "é"  # é is two bytes: nothing until both are in
