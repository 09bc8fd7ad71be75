"""Triton kernels of the fused experts path (:mod:`omnirelay.models.runner.moe`).

Imported only where ``triton`` is (the CUDA machines; the tests under the Triton
interpreter). Shapes: ``S = tokens x top_k`` token-expert pairs, ``E`` experts, hidden
``H``, expert intermediate ``I``; weights in ``transformers``' layout, ``gate_up
[E, 2I, H]`` (gate rows first) and ``down [E, H, I]``.

* :func:`count_pairs` — pairs per expert of each chunk of ``CHUNK`` pairs.
* :func:`place_pairs` — each expert's padded run (a multiple of ``BM`` rows) and each
  pair's position in it; stable (pairs keep their order inside an expert), no atomics.
* :func:`route` — the router's softmax, top-k and renormalization, a block of tokens
  per program (a prefill's many tokens, placed by the two steps above).
* :func:`route_place` — for a decode's few tokens, :func:`route`'s work and both steps
  above, in one program.
* :func:`gate_up_silu` — per block of ``BM`` positions (one expert), ``silu(x W_gate^T) ·
  (x W_up^T)`` for a ``BN`` slice of ``I``.
* :func:`down_weighted` — per block, ``h W_down^T`` times the pair's routing weight,
  written at the pair's own row (token-major, so the top-k sum is one reduction).

A block finds its expert from the experts' padded ends; positions past an expert's pair
count are masked, so no buffer needs filling first and blocks past the last run return
at once (the grid is sized for the worst case, a static shape for CUDA graphs).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def count_pairs(ids_ptr, partial_ptr, S, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(partial_ptr + c * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit
def place_pairs(
    ids_ptr,
    partial_ptr,
    sorted_ptr,
    meta_ptr,
    S,
    E,
    num_chunks,
    BM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    live = experts < E
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j in range(0, num_chunks):
        row = tl.load(partial_ptr + j * E + experts, mask=live, other=0)
        totals += row
        before += tl.where(j < c, row, 0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if c == 0:
        # meta rows: run starts, pair counts, run ends
        tl.store(meta_ptr + experts, starts, mask=live)
        tl.store(meta_ptr + E + experts, totals, mask=live)
        tl.store(meta_ptr + 2 * E + experts, ends, mask=live)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < S
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1) - 1
    base = tl.sum(onehot * (starts + before)[None, :], axis=1)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)


@triton.jit
def _route_rows(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    t,
    M,
    E,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Softmax over the router logits of tokens ``t`` (float32), the top-k (largest
    first, the lower expert on a tie), renormalized when ``NORM``; each token's pairs
    stored in ``ids``/``weights`` at ``t·K + j``. Returns (chosen ``[T, E]``, pair index
    ``[T, E]``): where token ``t`` picked expert ``e``, and as which pair."""
    e = tl.arange(0, BLOCK_E)
    tok_ok = t < M
    e_ok = e[None, :] < E
    x = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=tok_ok[:, None] & e_ok, other=0.0)
    x = tl.where(e_ok, x.to(tl.float32), float("-inf"))
    x = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = x / tl.sum(x, axis=1)[:, None]
    remaining = tl.where(e_ok, p, -1.0)
    slot = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)  # j + 1 where expert e is pick j
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        pick = tl.min(tl.where(remaining == best[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == pick[:, None]
        slot = tl.where(hit, j + 1, slot)
        total += best
        remaining = tl.where(hit, -1.0, remaining)
    if NORM:
        p = p / total[:, None]
    chosen = (slot > 0) & tok_ok[:, None]
    pair = t[:, None] * TOP_K + slot - 1
    tl.store(ids_ptr + pair, (e[None, :] + tl.zeros_like(slot)).to(ids_ptr.dtype.element_ty), mask=chosen)
    tl.store(weights_ptr + pair, p.to(weights_ptr.dtype.element_ty), mask=chosen)
    return chosen, pair


@triton.jit
def route(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    M,
    E,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The router's softmax, top-k and renormalization for ``BLOCK_T`` tokens per
    program (a prefill's many tokens; :func:`count_pairs` and :func:`place_pairs` then
    place the pairs)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, ids_ptr, weights_ptr, t, M, E, TOP_K, NORM, BLOCK_T, BLOCK_E)


@triton.jit
def route_place(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    sorted_ptr,
    meta_ptr,
    M,
    E,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Routing (:func:`route`) and placement of up to ``BLOCK_T`` tokens in one
    program, the pairs placed per expert as :func:`place_pairs` does."""
    t = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    chosen, pair = _route_rows(logits_ptr, ids_ptr, weights_ptr, t, M, E, TOP_K, NORM, BLOCK_T, BLOCK_E)
    picked = chosen.to(tl.int32)
    totals = tl.sum(picked, axis=0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    live = e < E
    tl.store(meta_ptr + e, starts, mask=live)
    tl.store(meta_ptr + E + e, totals, mask=live)
    tl.store(meta_ptr + 2 * E + e, ends, mask=live)
    # a token holds an expert at most once: its rank in the expert's run is the count of
    # earlier tokens that picked it, so pairs keep their order (token-major)
    rank = tl.cumsum(picked, axis=0) - picked
    tl.store(sorted_ptr + starts[None, :] + rank, pair, mask=chosen)


@triton.jit
def _block_rows(meta_ptr, sorted_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, positions, valid, pair ids) of this program's block; expert ``E``: none."""
    block = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(meta_ptr + 2 * E + experts, mask=experts < E, other=2147483647)
    first = block * BM
    expert = tl.sum((ends <= first).to(tl.int32), axis=0)
    safe = tl.minimum(expert, E - 1)
    start = tl.load(meta_ptr + safe)
    count = tl.load(meta_ptr + E + safe)
    pos = first + tl.arange(0, BM)
    valid = pos < start + count  # false throughout past the last run
    pairs = tl.load(sorted_ptr + pos, mask=valid, other=0)
    return expert, pos, valid, pairs


@triton.jit
def gate_up_silu(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    meta_ptr,
    E,
    H,
    INTER,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert, pos, valid, pairs = _block_rows(meta_ptr, sorted_ptr, E, BM, BLOCK_E)
    if expert >= E:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    tokens = (pairs // TOP_K).to(tl.int64)
    a_ptrs = x_ptr + tokens[:, None] * H + k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * (2 * INTER) * H
    g_ptrs = w_base + n[None, :].to(tl.int64) * H + k[:, None]
    u_ptrs = g_ptrs + INTER * H
    n_ok = n[None, :] < INTER
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = (k0 + k) < H
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        gate = tl.dot(a, wg, gate)
        up = tl.dot(a, wu, up)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = gate / (1.0 + tl.exp(-gate)) * up
    o_ptrs = out_ptr + pos[:, None].to(tl.int64) * INTER + n[None, :]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok)


@triton.jit
def down_weighted(
    h_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    sorted_ptr,
    meta_ptr,
    E,
    H,
    INTER,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert, pos, valid, pairs = _block_rows(meta_ptr, sorted_ptr, E, BM, BLOCK_E)
    if expert >= E:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    a_ptrs = h_ptr + pos[:, None].to(tl.int64) * INTER + k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * H * INTER + n[None, :].to(tl.int64) * INTER + k[:, None]
    n_ok = n[None, :] < H
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        k_ok = (k0 + k) < INTER
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BK
        w_ptrs += BK
    scale = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    o_ptrs = out_ptr + pairs[:, None].to(tl.int64) * H + n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok)
