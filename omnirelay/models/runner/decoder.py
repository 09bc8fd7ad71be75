"""A ``transformers`` decoder stack run over a static, slot-indexed KV cache.

* :class:`SlotKV` — per layer, keys and values ``[num_slots + 1, max_len, kv_heads,
  head_dim]`` allocated once (row ``num_slots``: scratch for padding).
* :class:`StaticDecoder` — one forward pass of a block of ``B`` rows x ``T`` tokens:
  each row's slot, first position and real token count are tensors, so the same code
  runs eagerly or inside a CUDA graph (no host synchronization, no shape that depends on
  a value). New keys and values are written in place at their positions (no
  ``torch.cat``); padding tokens write to the scratch row.
* :func:`decoder_layer` — one decoder layer (norms, attention, MLP/MoE) using the
  layer's own modules, with its QKV and gate/up projections fused
  (:mod:`~omnirelay.models.runner.fused`); attention gets its keys and values from a ``kv_step`` callback,
  so the code predictor's per-frame cache uses the same layer code.

Attention: a *fresh* block (every row starts at position 0) attends to itself —
``scaled_dot_product_attention(is_causal=True)`` with grouped-query heads (flash kernel
on a GPU); padding sits after each row's tokens, so real tokens never see it. A block
that continues cached positions (decode, a continued prefill) attends to the first
``L`` positions of each row's slot and masks positions beyond each query; the query
heads of one key/value head share one matmul, so the keys are never repeated per head.

Where those keys come from: the cache is laid out ``[slot, kv_head, position, dim]``, so
the first ``L`` positions of a run of slots are a view that the attention's matmuls
read as they are (every key/value head's ``[L, D]`` block is contiguous). A launch whose
row ``i`` is slot ``i`` (``in_place``: a decode over the slots the runner keeps packed
from 0, see :class:`~omnirelay.models.runner.slots.SlotTable`) reads ``cache[:B, :, :L]``
in place — no copy per layer. Any other launch (a continued prefill; a decode whose rows
are a sparse subset of the slots) gathers its rows' slots, one copy of keys and one of
values per layer.

Compiled decode (:meth:`StaticDecoder.compile_decode`, the Talker's frame with
``OMNIRELAY_FRAME_COMPILE=1``): the same :meth:`StaticDecoder.forward` through
``torch.compile``, its per-layer norms, rotary, masking and residual adds fused by
inductor around the matmuls, inside the same CUDA graph; the cache writes stay in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from omnirelay.errors import ModelError
from omnirelay.models.runner.fused import attention_inputs, fuse_projections, run_mlp, run_norm

__all__ = [
    "KVStep",
    "SlotKV",
    "StaticDecoder",
    "decoder_layer",
    "experts_implementation",
    "grouped_attention",
]

#: ``kv_step(layer_index, keys, values) -> (keys, values, mask, is_causal)``: store this
#: step's keys/values ``[B, kv_heads, T, D]`` and return what the queries attend to.
KVStep = Callable[
    [int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]
]
#: Compiled graphs kept for :meth:`StaticDecoder.compile_decode`: shapes and in-place or not.
_RECOMPILE_LIMIT = 64


def _rotary_fn() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = modeling.apply_rotary_pos_emb
    return fn


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention, ``q [B, Hq, T, D]`` over ``k, v [B, Hk, L, D]`` (``Hq = g·Hk``),
    ``mask [B, 1, T, L]`` (True: attend). Scores and softmax in float32."""
    b, hq, t, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    g = hq // hk
    qg = q.reshape(b, hk, g * t, d)  # query head h uses key head h // g
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    allowed = mask.unsqueeze(2).expand(b, 1, g, t, length).reshape(b, 1, g * t, length)
    scores = torch.where(allowed, scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, hq, t, d)


def _attend(
    attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_step: KVStep, li: int, rotate: Any
) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = attention_inputs(attn, x, cos, sin, rotate)
    keys, values, mask, causal = kv_step(li, k, v)
    if mask is None:
        out = F.scaled_dot_product_attention(
            q, keys, values, is_causal=causal, scale=attn.scaling, enable_gqa=True
        )
    else:
        out = grouped_attention(q, keys, values, mask, attn.scaling)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def decoder_layer(
    layer: Any,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_step: KVStep,
    li: int,
    rotate: Any,
) -> torch.Tensor:
    """One pre-norm decoder layer of a Qwen3(-Omni) stack (attention + MLP or MoE).
    ``rotate``: the family's ``apply_rotary_pos_emb`` for a layer whose queries and keys
    are not fused (:func:`~omnirelay.models.runner.fused.attention_inputs`)."""
    h = h + _attend(layer.self_attn, run_norm(layer.input_layernorm, h), cos, sin, kv_step, li, rotate)
    out: torch.Tensor = h + run_mlp(layer.mlp, run_norm(layer.post_attention_layernorm, h))
    return out


@contextmanager
def experts_implementation(modules: Iterable[torch.nn.Module], name: str | None) -> Iterator[None]:
    """Run the MoE experts blocks of ``modules`` with ``transformers``' experts
    implementation ``name`` (``grouped_mm``, ``batched_mm``) for the duration; None: as is."""
    configs: dict[int, Any] = {
        id(m.config): m.config for m in modules if type(m).__name__.endswith("Experts")
    }
    if name is None or not configs:
        yield
        return
    saved = {key: c._experts_implementation_internal for key, c in configs.items()}
    for c in configs.values():
        c._experts_implementation_internal = name
    try:
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation_internal = saved[key]


class SlotKV:
    """Keys and values of every layer for ``num_slots`` requests (+1 scratch row), one
    tensor ``[2, layers, num_slots + 1, kv_heads, max_len, head_dim]``; :attr:`keys` and
    :attr:`values` are its per-layer views."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (2, num_layers, num_slots + 1, kv_heads, max_len, head_dim)
        self.nbytes = 2 * num_layers * (num_slots + 1) * max_len * kv_heads * head_dim * dtype.itemsize
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if self.nbytes > free:
                raise ModelError(
                    f"the KV cache needs {self.nbytes / 2**30:.1f} GiB ({num_slots} slots x {max_len} positions) but "
                    f"{device} has {free / 2**30:.1f} GiB free; lower executor_args.max_num_seqs or max_model_len, "
                    "or leave max_num_seqs out and give the stages on this device one process "
                    "(device_groups: auto) so their slots are sized from the memory left"
                )
        self.cache = torch.zeros(shape, dtype=dtype, device=device)
        self.keys = list(self.cache[0].unbind(0))
        self.values = list(self.cache[1].unbind(0))
        self.scratch = num_slots
        self.max_len = max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions of every layer to slot ``dst``
        (one copy: the slot table packs its holders when a request leaves)."""
        if length > 0:
            self.cache[:, :, dst, :, :length].copy_(self.cache[:, :, src, :, :length])


class StaticDecoder:
    """Runs ``model`` (a decoder with ``layers``, ``norm``, ``rotary_emb``) on a
    :class:`SlotKV`; see the module docstring."""

    def __init__(self, model: Any, kv: SlotKV) -> None:
        self.model = model
        self.layers = list(model.layers)
        fuse_projections(self.layers)
        # Resolved here, not per layer inside the pass: an import traced by torch.compile
        # can break its graph. Only a layer left unfused rotates through it.
        unfused = any(getattr(layer.self_attn, "omnirelay_qk_norm", None) is None for layer in self.layers)
        self._rotate = _rotary_fn() if unfused else None
        self.kv = kv
        #: :meth:`forward` as decode steps call it: compiled after :meth:`compile_decode`
        self.decode_forward: Callable[..., tuple[torch.Tensor, dict[int, torch.Tensor]]] = self.forward
        #: the ``torch.compile`` backend of :attr:`decode_forward` (None: eager)
        self.decode_backend: str | None = None

    def compile_decode(self, backend: str, options: dict[str, Any] | None = None) -> None:
        """Route :attr:`decode_forward` through ``torch.compile`` with ``backend``: the
        layers' norms, rotary and elementwise work fused around the matmuls. The step's
        key/value writes stay writes into the cache tensors themselves (inductor turns the
        functionalized ``index_put`` back into an in-place store on its input: no copy of a
        layer's cache; a test checks the generated code), so a CUDA graph that captures the
        compiled pass keeps writing where the uncompiled one does. Compiles on the first
        call per shape (graph capture at startup); a second batch size or attention length
        makes those dimensions symbolic, so a set of buckets costs a few compiles. Not
        ``fullgraph``: an MoE block whose fused experts dynamo cannot trace runs eagerly
        between compiled pieces instead of failing the stage."""
        from torch import _dynamo

        dynamo_config: Any = _dynamo.config
        dynamo_config.cache_size_limit = max(int(dynamo_config.cache_size_limit), _RECOMPILE_LIMIT)
        self.decode_forward = torch.compile(self.forward, backend=backend, options=options)
        self.decode_backend = backend

    def forward(
        self,
        embeds: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        *,
        attn_len: int | None,
        capture: tuple[int, ...] = (),
        in_place: bool = False,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``embeds [B, T, H]``; per row its slot, first position and real token count
        (``[B]`` int64; a padding row: the scratch slot, start 0, count 1). Returns the
        normed hidden state of each row's last real token ``[B, H]`` and the hidden states
        ``[B, T, H]`` entering the layers in ``capture`` (``len(layers)``: the normed output).
        ``in_place``: row ``i`` holds slot ``i`` or is padding, and attention reads the
        cache's first ``B`` slots where they are (see the module docstring)."""
        b, t, _ = embeds.shape
        device = embeds.device
        steps = torch.arange(t, device=device)
        positions = starts.unsqueeze(1) + steps.unsqueeze(0)  # [B, T]
        valid = steps.unsqueeze(0) < counts.unsqueeze(1)
        write_slots = torch.where(valid, slots.unsqueeze(1), self.kv.scratch)
        write_pos = torch.where(valid, positions, 0)
        cos, sin = self.model.rotary_emb(embeds, positions.unsqueeze(0).expand(3, b, t))
        mask = None
        if attn_len is not None:
            keys = torch.arange(attn_len, device=device).view(1, 1, attn_len)
            ends = (starts + counts).view(b, 1, 1)
            mask = ((keys <= positions.unsqueeze(2)) & (keys < ends)).unsqueeze(1)  # [B, 1, T, L]

        def kv_step(
            li: int, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
            cache_k, cache_v = self.kv.keys[li], self.kv.values[li]
            # The step's own keys and values, written at their rows' slots and positions
            # (a scatter of B x T positions: the only write a step makes to the cache).
            cache_k[write_slots, :, write_pos] = k.transpose(1, 2)
            cache_v[write_slots, :, write_pos] = v.transpose(1, 2)
            if attn_len is None:
                return k, v, None, t > 1
            if in_place:  # a view: rows 0..B-1 are slots 0..B-1
                return cache_k[:b, :, :attn_len], cache_v[:b, :, :attn_len], mask, False
            # Rows scattered over the slots: one gather of their keys and one of values.
            keys_ = cache_k[:, :, :attn_len].index_select(0, slots)
            values_ = cache_v[:, :, :attn_len].index_select(0, slots)
            return keys_, values_, mask, False

        captured: dict[int, torch.Tensor] = {}
        h = embeds
        for li, layer in enumerate(self.layers):
            if li in capture:
                captured[li] = h
            h = decoder_layer(layer, h, cos, sin, kv_step, li, self._rotate)
        h = run_norm(self.model.norm, h)
        if len(self.layers) in capture:
            captured[len(self.layers)] = h
        last = h[torch.arange(b, device=device), counts - 1]
        return last, captured
