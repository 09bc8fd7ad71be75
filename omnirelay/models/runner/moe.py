"""The MoE experts as one fused Triton path (CUDA, half precision).

Registered with ``transformers``' experts interface as :data:`FUSED_EXPERTS`, so an
experts module of the usual layout (``gate_up_proj [E, 2I, H]``, gate rows first;
``down_proj [E, H, I]``; SiLU; no bias) runs, per call, five launches
(:mod:`~omnirelay.models.runner.moe_kernels`):

1. count the token-expert pairs per expert (per chunk of pairs);
2. place every pair in its expert's run of positions, each run padded to a multiple of
   the block height ``BM`` (stable and without atomics, so a step's result does not
   depend on scheduling);
3. one grouped GEMM over those blocks for gate and up together, ``silu(gate) · up``
   applied before anything leaves the registers;
4. one grouped GEMM for down, each pair's row scaled by its routing weight and written
   at the pair's own index;
5. the top-k sum of each token's rows (float32 accumulation, one rounding).

Steps 1 and 2 take the model's routing (its router's softmax, top-k and renormalization)
as given. For a whole MoE block, :func:`fused_moe_block` also takes the routing in: the
router's matmul, then softmax, top-k and renormalization in Triton — for a decode's few
tokens together with the placement in one program, so the routed part of such a block
is five launches in all (router, routing, two GEMMs, sum), and seven for a prefill's.
No step reads a value back to the host and every buffer has a size fixed by the token count,
so the path records into a CUDA graph. Under ``torch.compile`` (a compiled decode or
frame) each path is one opaque operator (``omnirelay::fused_moe_routed``,
``omnirelay::fused_experts``): dynamo traces no Triton launch, so the compiled pass has
no graph break at an MoE block. Block sizes are fixed per pair count (decode's few
rows: thin blocks that spread the weight reads over many programs; a prefill's thousands:
square tiles for the tensor cores), not autotuned, so nothing is measured at startup.

Anything else (another layout, float32, a CPU tensor) falls back to ``transformers``'
``grouped_mm`` / ``batched_mm``, said once per reason on stderr; ``OMNIRELAY_FUSED_MOE=0``
turns the path off. Whether a module fits is judged by what it holds, so every
``transformers`` release with this experts layout runs fused, whichever flags it sets.
:data:`CALLS` counts the calls each path took, so a benchmark (``omnirelay bench
runner``) can show which one ran.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CALLS",
    "FUSED_EXPERTS",
    "ROUTED_TOKENS",
    "fused_experts",
    "fused_experts_enabled",
    "fused_moe_block",
]

#: The name the path is registered under in ``transformers``' experts interface.
FUSED_EXPERTS = "omnirelay_fused"

#: Pairs per program of the two placement kernels.
_CHUNK = 256

#: Most tokens :func:`fused_moe_block` routes and places in one program (a decode's rows).
ROUTED_TOKENS = 64

#: Tokens per program of a prefill's routing.
_ROUTE_BLOCK = 16

_registered = False
_noted: set[str] = set()

#: Calls per path since the process started: ``block`` (a whole MoE block through
#: :func:`fused_moe_block`), ``experts`` (an experts module's call through
#: :func:`fused_experts`), ``fallback`` (an experts module's call handed back to
#: ``transformers``). Counted where the Python runs: an eager call or a CUDA graph's
#: capture, not its replays, nor a call ``torch.compile`` traced.
CALLS: Counter[str] = Counter()


@dataclass(frozen=True, slots=True)
class _Tiles:
    bm: int
    bn_up: int
    bk_up: int
    bn_down: int
    bk_down: int
    warps: int
    stages: int


def _tiles(pairs: int) -> _Tiles:
    """Block sizes for ``pairs`` token-expert pairs."""
    if pairs <= 64:  # decode of a few rows: one or two pairs per expert
        return _Tiles(bm=16, bn_up=32, bk_up=128, bn_down=64, bk_down=128, warps=4, stages=4)
    if pairs <= 1024:  # decode of up to 128 rows: a handful of pairs per expert
        return _Tiles(bm=16, bn_up=64, bk_up=128, bn_down=64, bk_down=128, warps=4, stages=4)
    if pairs <= 8192:
        return _Tiles(bm=32, bn_up=64, bk_up=64, bn_down=128, bk_down=64, warps=4, stages=3)
    return _Tiles(bm=64, bn_up=128, bk_up=64, bn_down=128, bk_down=64, warps=8, stages=3)


def _kernels() -> Any:
    return importlib.import_module("omnirelay.models.runner.moe_kernels")


def fused_experts_enabled(dtype: torch.dtype) -> bool:
    """Whether a CUDA launch in ``dtype`` runs the fused path (registering it on first use):
    half precision, ``triton`` importable, ``OMNIRELAY_FUSED_MOE`` not ``0``."""
    global _registered
    if dtype not in (torch.bfloat16, torch.float16) or os.environ.get("OMNIRELAY_FUSED_MOE") == "0":
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    if not _registered:
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(FUSED_EXPERTS, _experts_forward)
        _registered = True
    return True


def _unsupported(module: Any, x: torch.Tensor) -> str | None:
    """Why the fused path cannot run ``module`` on ``x`` (None: it can). Judged by what
    the module holds, not by a ``transformers`` version: a flag a version does not set
    means that version lacks the feature (``has_post_expert_norm``,
    ``_is_expert_parallel``), and a post-expert norm or a bank holding only a shard of
    the experts is seen on the module itself."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no gate_up_proj/down_proj tensors"
    if not (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "gate_up_proj_bias", None) is None
        and getattr(module, "down_proj_bias", None) is None
    ):
        return "not the [gate; up] layout without bias"
    if (
        getattr(module, "has_post_expert_norm", False)
        or getattr(module, "post_expert_norm", None) is not None
    ):
        return "a norm after each expert"
    experts = gate_up.shape[0]
    if getattr(module, "_is_expert_parallel", False) or getattr(module, "num_experts", experts) != experts:
        return "experts split across devices"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return f"activation {type(act).__name__}, not SiLU"
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return f"a {x.device.type} tensor"
    if not (x.dtype in (torch.bfloat16, torch.float16) and gate_up.dtype == x.dtype == down.dtype):
        return f"dtypes {x.dtype}/{gate_up.dtype}/{down.dtype}, not one half precision"
    if not (
        gate_up.dim() == 3
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1] == x.shape[-1]
    ):
        return f"shapes {tuple(gate_up.shape)}/{tuple(down.shape)} for hidden {x.shape[-1]}"
    return None


def _count(path: str) -> None:
    """One call of ``path`` in :data:`CALLS`; not while ``torch.compile`` traces (a
    compiled step's calls are not counted: the count is a Python side effect that would
    only cost the trace a break)."""
    if not torch.compiler.is_compiling():
        CALLS[path] += 1


def _fallback_note(module: Any, reason: str) -> None:
    """Say once per module class and reason that calls fall back (on stderr)."""
    key = f"{type(module).__name__}: {reason}"
    if key not in _noted:
        _noted.add(key)
        print(
            f"omnirelay: fused experts off for {key}; transformers' own path runs",
            file=sys.stderr,
            flush=True,
        )


def _experts_forward(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    reason = _unsupported(module, hidden_states)
    if reason is not None:
        _count("fallback")
        _fallback_note(module, reason)
        from transformers.integrations.moe import (
            batched_mm_experts_forward,
            grouped_mm_experts_forward,
        )

        half = hidden_states.dtype in (torch.bfloat16, torch.float16)
        fallback = grouped_mm_experts_forward if half else batched_mm_experts_forward
        out: torch.Tensor = fallback(module, hidden_states, top_k_index, top_k_weights)
        return out
    _count("experts")
    run = _experts_op if torch.compiler.is_compiling() else fused_experts
    out = run(hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights)
    return out


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``sum_k w[t, k] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = top_k_index[t, k]``;
    ``x [N, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``, ``top_k_* [N, K]``."""
    n, k = x.shape[0], top_k_index.shape[-1]
    if n * k == 0:
        return torch.zeros_like(x)
    order, meta, tiles = _place(top_k_index.reshape(-1).contiguous(), n * k, gate_up.shape[0], x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    return _grouped(x, gate_up, down, k, weights, order, meta, tiles)


def _place(
    ids: torch.Tensor, pairs: int, experts: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, _Tiles]:
    """The pairs of ``ids [pairs]`` placed per expert (two launches): positions, meta and
    the tiles they are padded for."""
    kernels = _kernels()
    tiles = _tiles(pairs)
    block_e = _pow2(experts)
    chunks = -(-pairs // _CHUNK)
    order, meta = _placement(pairs, experts, tiles, device)
    partial = torch.empty((chunks, experts), dtype=torch.int32, device=device)
    kernels.count_pairs[(chunks,)](ids, partial, pairs, experts, CHUNK=_CHUNK, BLOCK_E=block_e, num_warps=8)
    kernels.place_pairs[(chunks,)](
        ids,
        partial,
        order,
        meta,
        pairs,
        experts,
        chunks,
        BM=tiles.bm,
        CHUNK=_CHUNK,
        BLOCK_E=block_e,
        num_warps=8,
    )
    return order, meta, tiles


def fused_moe_block(block: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """``block(hidden)`` for an MoE block while its experts run the fused path: the
    router's logits (one matmul), then the router's softmax, top-k and renormalization in
    Triton — for up to :data:`ROUTED_TOKENS` tokens (a decode) in one program with the
    pairs' placement (:func:`~omnirelay.models.runner.moe_kernels.route_place`), for more
    (a prefill) a block of tokens per program
    (:func:`~omnirelay.models.runner.moe_kernels.route`) and the two placement launches —
    instead of the router's five launches. Then the two grouped GEMMs and the top-k sum:
    five launches for a decode's block, seven for a prefill's. A block with a gated shared
    expert (the Qwen3-Omni Talker's) adds it as the model does, ``routed +
    sigmoid(shared_gate(x)) · shared(x)``. None where that does not apply (the caller
    runs the block as is), also while a hook observes the router or the experts, so what
    they see is the model's own routing."""
    experts: Any = getattr(block, "experts", None)
    gate: Any = getattr(block, "gate", None)
    shared: Any = getattr(block, "shared_expert", None)
    shared_gate: Any = getattr(block, "shared_expert_gate", None)
    config = getattr(experts, "config", None)
    if config is None or getattr(config, "_experts_implementation", None) != FUSED_EXPERTS:
        return None
    if gate is None or (shared is None) != (shared_gate is None):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (gate, experts)):
        return None
    router = getattr(gate, "weight", None)
    top_k, norm = getattr(gate, "top_k", None), getattr(gate, "norm_topk_prob", None)
    x = hidden.reshape(-1, hidden.shape[-1])
    n = x.shape[0]
    if n == 0 or not isinstance(router, torch.Tensor) or not isinstance(top_k, int) or norm is None:
        return None
    if _unsupported(experts, x) is not None:
        return None  # the experts' own call then falls back and says why
    k, e = top_k, int(experts.gate_up_proj.shape[0])
    if router.shape != (e, x.shape[-1]):
        return None
    routed = _routed_op if torch.compiler.is_compiling() else _routed
    out = routed(x, router, experts.gate_up_proj, experts.down_proj, k, bool(norm))
    if shared is not None:
        out = out + torch.sigmoid(shared_gate(x)) * shared(x)
    return out.view_as(hidden)


def _routed(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int, norm: bool
) -> torch.Tensor:
    """The routed part of :func:`fused_moe_block` for ``x [N, H]``: ``[N, H]``."""
    n, e = x.shape[0], gate_up.shape[0]
    logits = F.linear(x, router)
    ids = torch.empty((n, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((n, k), dtype=x.dtype, device=x.device)
    kernels = _kernels()
    if n <= ROUTED_TOKENS:
        tiles = _tiles(n * k)
        order, meta = _placement(n * k, e, tiles, x.device)
        kernels.route_place[(1,)](
            logits,
            ids,
            weights,
            order,
            meta,
            n,
            e,
            TOP_K=k,
            NORM=norm,
            BM=tiles.bm,
            BLOCK_T=_pow2(n),
            BLOCK_E=_pow2(e),
            num_warps=8,
        )
    else:
        kernels.route[(-(-n // _ROUTE_BLOCK),)](
            logits, ids, weights, n, e, TOP_K=k, NORM=norm, BLOCK_T=_ROUTE_BLOCK, BLOCK_E=_pow2(e)
        )
        order, meta, tiles = _place(ids.view(-1), n * k, e, x.device)
    out = _grouped(x, gate_up, down, k, weights.view(-1), order, meta, tiles)
    _count("block")
    return out


# Under ``torch.compile`` the fused path is one opaque operator each (its Triton launches
# run as they do eagerly, inside a compiled graph and its CUDA graph): dynamo traces no
# Triton launch and the pass keeps one graph instead of breaking at every MoE block, and
# the calls are counted where they run.


@torch.library.custom_op("omnirelay::fused_moe_routed", mutates_args=())
def _routed_op(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int, norm: bool
) -> torch.Tensor:
    return _routed(x, router, gate_up, down, k, norm)


@_routed_op.register_fake
def _routed_shape(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int, norm: bool
) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("omnirelay::fused_experts", mutates_args=())
def _experts_op(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    return fused_experts(x, gate_up, down, top_k_index, top_k_weights)


@_experts_op.register_fake
def _experts_shape(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    return x.new_empty(x.shape)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _placement(
    pairs: int, experts: int, tiles: _Tiles, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index per position, meta ``[3, E]``: run starts, pair counts, run ends);
    positions for the most blocks ``pairs`` can fill, runs padded to ``BM``."""
    blocks = _blocks(pairs, experts, tiles)
    order = torch.empty(blocks * tiles.bm, dtype=torch.int32, device=device)
    meta = torch.empty((3, experts), dtype=torch.int32, device=device)
    return order, meta


def _blocks(pairs: int, experts: int, tiles: _Tiles) -> int:
    return -(-pairs // tiles.bm) + min(experts, pairs)


def _grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    k: int,
    weights: torch.Tensor,
    order: torch.Tensor,
    meta: torch.Tensor,
    tiles: _Tiles,
) -> torch.Tensor:
    """The two grouped GEMMs over placed pairs and the top-k sum."""
    kernels = _kernels()
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    n, h = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    blocks = _blocks(n * k, e, tiles)
    block_e = _pow2(e)
    hidden = torch.empty((blocks * tiles.bm, inter), dtype=x.dtype, device=x.device)
    kernels.gate_up_silu[(blocks, -(-inter // tiles.bn_up))](
        x,
        gate_up,
        hidden,
        order,
        meta,
        e,
        h,
        inter,
        TOP_K=k,
        BM=tiles.bm,
        BN=tiles.bn_up,
        BK=tiles.bk_up,
        BLOCK_E=block_e,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    rows = torch.empty((n * k, h), dtype=x.dtype, device=x.device)
    kernels.down_weighted[(blocks, -(-h // tiles.bn_down))](
        hidden,
        down,
        weights,
        rows,
        order,
        meta,
        e,
        h,
        inter,
        BM=tiles.bm,
        BN=tiles.bn_down,
        BK=tiles.bk_down,
        BLOCK_E=block_e,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return rows.view(n, k, h).sum(dim=1)
