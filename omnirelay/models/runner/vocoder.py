"""Qwen3-Omni's Code2Wav as a stateful streaming decoder: each chunk decodes only its new frames.

The decoder is causal except for one sample of look-ahead in each up-sampling transposed
convolution (kernel ``2r``, stride ``r``: an output block needs its input sample and the
next one) — which is where the 555 samples a window holds back at its end come from.
Everything it needs from the past fits in small per-stream state:

* the transformer (sliding window ``W``): the keys and values of the stream's last
  ``W − 1`` frames per layer, and how many frames it has seen (absolute positions);
* each causal convolution: its last ``(kernel − 1) · dilation`` input samples (zeros
  at the start of a stream: the whole-utterance decode's left zero padding);
* each look-ahead transposed convolution: its last input sample.

So a stream decoded chunk by chunk with its state is **the whole-utterance decode**,
sample for sample up to float rounding, whatever the chunk sizes — no left context is
re-sent or re-decoded, and a one-frame chunk costs one frame of compute. A chunk of
``n`` new frames yields ``n · U`` samples (the stream's first one ``n · U − holdback``:
the look-ahead's samples come with the next chunk), as the window decode's trim does
(docs/protocol.md §6.2).

Batches mix streams at any point: each row carries its own slot, frame count and
position, right-padded to the batch's frame bucket; the first chunk of a stream has an
invalid prefix after each look-ahead layer (the block that would need a sample before
the stream began), which is zeroed before every later state-bearing layer so it reads
as the zero history it stands for. A first chunk reads its history from a row of the state
kept at zero (its slot holds what the stream before it left). All of it — state gathers
and writes by slot, masks from positions — runs on the device without host
synchronization, so a step is captured as one CUDA graph per (batch, frames) bucket, like
the window decodes of :class:`~omnirelay.models.runner.code2wav.GraphedCode2Wav`.
A replayed step costs about one launch per operation whatever its batch: its rows' state is
read in one gather (:mod:`~omnirelay.models.runner.vocoder_state`), what its layers share is
made once, its element-wise chains run fused (:mod:`~omnirelay.models.runner.vocoder_ops`).

The same walk serves Qwen3-TTS's 12 Hz decoder, which differs in three places: its
front is a quantizer (the model's ``embed_codes(codes) -> [B, C, T]``, stateless per
frame) followed by causal convolutions at the frame rate (``frame_convs``, each with its
state like any other); its transformer has input and output projections; and its
up-sampling transposed convolutions trim their overlap at the right end only — fully
causal, no look-ahead, so it holds nothing back and a first chunk has no invalid prefix.
Each transposed convolution says which it is by its trim (``left_pad`` = ``r``: one
sample of look-ahead; 0: causal).

:class:`StreamingVocoder` holds the state in slots (:class:`SlotTable`, one per stream,
released with the request); ``decode(rows)`` runs one step and returns each row's new
samples.

On CUDA each SnakeBeta is one Triton kernel (:mod:`~omnirelay.models.runner.vocoder_kernels`).
With ``compile="inductor"`` the step goes through ``torch.compile`` before its graphs are
captured, the activations as torch operations: inductor fuses the element-wise work around
each convolution (activation, prefix mask, history concatenation, residual add) into one
kernel that writes the convolution's input, and the transformer's norms, rotary and mask
arithmetic likewise; the convolutions and matrix products stay library calls. The
compiled step is one function of the step's tensors (codes, slots, counts, positions; the
state buffers are updated in place inside it), so one compiled graph serves every bucket
with a batch and a frame count above one (the batch and frames dimensions turn symbolic
on the second size seen); its kernels are cached on disk like the code predictor's
(:func:`~omnirelay.models.runner.predictor.keyed_compile_cache`). Fused kernels round
differently: the compiled step equals the eager one within float rounding (the tests
bound the difference), not bit for bit. A stage compiles its stream steps when
``OMNIRELAY_CODE2WAV_COMPILE=1`` (:func:`stream_compile_backend`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from omnirelay.errors import ModelError
from omnirelay.models.runner import vocoder_ops as ops
from omnirelay.models.runner.buckets import bucket
from omnirelay.models.runner.code2wav import CODE2WAV_PRIORITY, GRAPH_MEMORY_KNOB
from omnirelay.models.runner.graphs import (
    GraphPool,
    GraphSet,
    Step,
    capture_order,
    graph_memory_errors,
    reserved_bytes,
    upload,
    uploaded,
)
from omnirelay.models.runner.predictor import keyed_compile_cache
from omnirelay.models.runner.slots import SlotTable
from omnirelay.models.runner.vocoder_state import StreamState

__all__ = [
    "COMPILE_ENV",
    "DEFAULT_STREAM_BATCHES",
    "DEFAULT_STREAM_FRAMES",
    "StreamRow",
    "StreamingVocoder",
    "stream_compile_backend",
]

DEFAULT_STREAM_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Frame buckets of a streaming step (chunks carry at most ``codec_chunk_frames``, 25).
DEFAULT_STREAM_FRAMES = (1, 2, 4, 8, 16, 32)
#: A stream's position is unbounded for the slots' purpose (rotary positions grow with it).
_MAX_FRAMES = 1 << 40
#: ``1``: a stage's stream steps are compiled with inductor (with CUDA graphs); unset or ``0``: not.
COMPILE_ENV = "OMNIRELAY_CODE2WAV_COMPILE"
#: ``1``: cuDNN times its convolution algorithms for each captured step shape (its
#: benchmark mode, on while the graphs are captured) instead of taking its heuristic's.
CONV_SEARCH_ENV = "OMNIRELAY_CODE2WAV_CONV_SEARCH"
#: Compiled graphs kept for the step: a handful cover every bucket, with room to spare.
_RECOMPILE_LIMIT = 64
#: Largest relative error (‖compiled − uncompiled‖ / ‖uncompiled‖) the compiled step may
#: show on the startup probe before the step goes back to uncompiled.
COMPILED_TOLERANCE = 5e-2


def stream_compile_backend(cuda_graphs: bool) -> str | None:
    """The ``torch.compile`` backend of a stage's stream steps as :data:`COMPILE_ENV`
    says: ``"inductor"`` when it is on and the steps are captured as CUDA graphs, else
    None (uncompiled: the default until the compiled step is measured on every card the
    stages run on, docs/performance.md)."""
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return None
    if value in ("1", "true", "on", "yes", "inductor"):
        return "inductor" if cuda_graphs else None
    raise ModelError(f"{COMPILE_ENV} must be 0 or 1 (or unset), got {value!r}")


@dataclass(frozen=True, slots=True)
class StreamRow:
    """One stream's chunk: ``codes [Q, n]`` of ``n`` new frames (context already removed)."""

    rid: str
    codes: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Conv:
    """A state-bearing causal convolution: its module, state width, and layer index."""

    module: Any
    width: int
    index: int


@dataclass(slots=True)
class _Walk:
    """What a step's layers share, made once per step: the slots the state is written to
    and read from (a first chunk reads the zero row) and the state read from them, the
    carried state's gather indices by up-sampling factor, the invalid-prefix masks by prefix."""

    slots: torch.Tensor
    read: torch.Tensor
    is_start: torch.Tensor
    counts: torch.Tensor
    state: torch.Tensor  # the rows' histories, read at the start
    carried: dict[int, torch.Tensor]  # each history's new state, written at the end
    ends: dict[int, torch.Tensor]
    masks: dict[int, torch.Tensor]


class StreamingVocoder:
    """Stateful streaming decodes of one Code2Wav model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        *,
        max_streams: int,
        cuda_graphs: bool,
        batch_sizes: tuple[int, ...] = DEFAULT_STREAM_BATCHES,
        frames: tuple[int, ...] = DEFAULT_STREAM_FRAMES,
        compile: str | None = None,
        buckets: Collection[tuple[int, int]] | None = None,
        pool: GraphPool | None = None,
    ) -> None:
        """``buckets``: the (batch, frames) pairs captured as graphs (None: every pair; a
        step never launches more rows of a frame bucket than its largest captured batch);
        ``pool``: the graphs' memory pool, shared with the stage's window graphs."""
        self.model = model
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        config = model.config
        self.q = int(config.num_quantizers)
        self.upsample = int(model.total_upsample)
        self.slots = SlotTable(max_streams, _MAX_FRAMES)
        self.slots.on_move = self._move  # a leaving stream's slot takes the top holder's state
        self.batch_sizes = tuple(b for b in batch_sizes if b <= max_streams) or (1,)
        self.frames = frames
        transformer = model.pre_transformer
        self.window = int(config.sliding_window)
        layer0 = transformer.layers[0].self_attn
        head_dim = int(layer0.head_dim)
        heads = int(layer0.k_proj.out_features) // head_dim
        # + the scratch row padding writes to, + a row of zeros a first chunk reads its history from
        rows = max_streams + 2
        self._zero_row = max_streams + 1
        self._shapes: list[tuple[int, int]] = []  # each convolution history's (channels, width)
        self._lookahead: list[int] = []  # the up-sampling factor of each look-ahead layer
        self._plan = self._walk(snake_kernel=compile is None and ops.snake_kernel_enabled(self.device))
        self.holdback = self._holdback()
        kv = (len(transformer.layers), 2, heads, self.window - 1, head_dim)
        self._state = StreamState(rows, self._shapes, kv, dtype=self.dtype, device=self.device)
        self._init_fused(head_dim)
        mb, mt = self.batch_sizes[-1], frames[-1]
        self._codes = torch.zeros((mb, self.q, mt), dtype=torch.long, device=self.device)
        self._slot_ids = torch.full((mb,), self.slots.scratch, dtype=torch.long, device=self.device)
        self._counts = torch.zeros(mb, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(mb, dtype=torch.long, device=self.device)
        self._buckets = None if buckets is None else frozenset(buckets)
        self._pool = pool
        self.graphs = GraphSet(
            "code2wav-stream", self.device, enabled=cuda_graphs, pool=pool, priority=CODE2WAV_PRIORITY
        )
        self._init_compile(compile)

    def _init_fused(self, head_dim: int) -> None:
        """The values the step's fused pieces read (:mod:`~omnirelay.models.runner.vocoder_ops`)."""
        front = getattr(self.model, "stream_front", None)
        self._embed: Callable[[torch.Tensor], torch.Tensor] | None = front() if front is not None else None
        self._sign = ops.rotary_sign(head_dim).to(self.device, self.dtype)
        layers = self.model.pre_transformer.layers
        self._qkv = [ops.fused_qkv(layer.self_attn) for layer in layers]  # a copy of those weights
        attn = layers[0].self_attn
        self._heads = (attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim)
        # the offsets of a carried state's samples from its end, and of the cached frames
        widest = max([self.window - 1, *(w for _, w in self._shapes)])
        self._steps = torch.arange(widest, device=self.device).view(1, 1, widest)

    def _init_compile(self, backend: str | None) -> None:
        #: the ``torch.compile`` backend of the step (None: eager)
        self.compile_backend = backend
        #: inductor's on-disk cache for this decoder (None: not compiling with inductor)
        self.compile_cache = None
        #: the compiled step's relative error on the startup probe (None: not checked)
        self.compile_error: float | None = None
        self._step_fn: Callable[..., torch.Tensor] = self._forward
        if backend is None:
            return
        if backend == "inductor":
            self.compile_cache = keyed_compile_cache(self.model.config, self.device, self.dtype)
        from torch import _dynamo

        dynamo_config: Any = _dynamo.config
        dynamo_config.cache_size_limit = max(int(dynamo_config.cache_size_limit), _RECOMPILE_LIMIT)
        self._step_fn = torch.compile(self._forward, backend=backend, fullgraph=True)

    # ----------------------------------------------------------------- layout

    def _history_index(self, channels: int, width: int) -> int:
        self._shapes.append((channels, width))
        return len(self._shapes) - 1

    def _conv(self, module: Any) -> _Conv:
        name = type(module).__name__
        if not name.endswith("CausalConvNet") or module.stride != 1:
            raise ModelError(f"streaming Code2Wav: expected a stride-1 causal convolution, got {name}")
        width = int(module.padding)
        index = self._history_index(int(module.conv.in_channels), width) if width else -1
        return _Conv(module, width, index)

    def _walk(self, snake_kernel: bool) -> list[tuple[str, Any, Any]]:
        """The decoder after its stateless front as a list of (kind, module, state);
        ``snake_kernel``: its SnakeBeta activations as one Triton launch each."""
        model = self.model
        plan: list[tuple[str, Any, Any]] = []
        for conv in getattr(model, "frame_convs", ()):
            plan.append(("conv", conv, self._conv(conv)))
        plan.append(("transformer", model.pre_transformer, None))
        for up, convnext in model.upsample:
            if up.conv.kernel_size[0] != up.conv.stride[0]:
                raise ModelError("streaming Code2Wav: the first up-sampling layers must not overlap")
            plan.append(("upsample", up, int(up.conv.stride[0])))
            plan.append(("convnext", convnext, self._conv(convnext.dwconv)))
        blocks = list(model.decoder)  # its activations fused, their parameters' exponentials made now
        snake = functools.partial(ops.snake, kernel=snake_kernel)
        plan.append(("conv", blocks[0], self._conv(blocks[0])))
        for block in blocks[1:-2]:
            activation, trans, *units = block.block
            r = int(trans.conv.stride[0])
            trim = (int(trans.left_pad), int(trans.right_pad))
            if trans.conv.kernel_size[0] != 2 * r or trim not in ((r, r), (0, r)):
                raise ModelError("streaming Code2Wav: a decoder block's transposed convolution is not 2r/r")
            plan.append(("act", snake(activation), None))
            index = self._history_index(int(trans.conv.in_channels), 1)
            looks_ahead = trim == (r, r)
            if looks_ahead:
                self._lookahead.append(r)
            plan.append(("transposed", trans, (r, looks_ahead, index)))
            for unit in units:
                convs = (self._conv(unit.conv1), self._conv(unit.conv2))
                plan.append(("unit", unit, (*convs, snake(unit.act1), snake(unit.act2))))
        plan.append(("act", snake(blocks[-2]), None))
        plan.append(("conv", blocks[-1], self._conv(blocks[-1])))
        return plan

    def _holdback(self) -> int:
        """Samples a stream's first chunk is short of ``n · U`` (the look-ahead's)."""
        total, after = 0, 1
        for r in reversed(self._lookahead):
            after *= r
            total += after
        return total

    # ----------------------------------------------------------------- the step

    def _step(self, b: int, t: int) -> Step:
        def step() -> dict[str, torch.Tensor]:
            return {
                "wav": self._step_fn(
                    self._codes[:b, :, :t], self._slot_ids[:b], self._counts[:b], self._positions[:b]
                )
            }

        return step

    def _forward(
        self, codes: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``codes [B, Q, T]`` (right-padded), each row's slot, new-frame count and frames
        decoded before → ``[B, 1, T · U]``; row ``i``'s new samples are
        ``[holdback if positions[i] == 0 else 0, counts[i] · U)``."""
        model = self.model
        is_start = positions == 0
        read = torch.where(is_start, self._zero_row, slots)
        walk = _Walk(slots, read, is_start, counts, self._state.read(read), {}, {}, {})
        if self._embed is not None:
            x = self._embed(codes)
        elif hasattr(model, "embed_codes"):
            x = model.embed_codes(codes)
        else:  # Qwen3-Omni: one embedding table, the codebooks averaged
            x = model.code_embedding(codes + model.code_offset).mean(1).permute(0, 2, 1)
        factor, prefix = 1, 0  # samples per frame so far; a first chunk's invalid prefix length
        for kind, module, state in self._plan:
            if kind == "transformer":
                x = self._transformer(x.permute(0, 2, 1), walk, positions).permute(0, 2, 1)
            elif kind == "upsample":
                x = module(x)
                factor *= state
                prefix *= state
            elif kind == "act":
                x = module(x)
            elif kind == "convnext":
                y = self._causal(state, x, walk, factor, prefix)
                y = y.permute(0, 2, 1)
                y = module.pwconv2(module.act(module.pwconv1(module.norm(y))))
                x = torch.addcmul(x, module.gamma.view(1, -1, 1), y.permute(0, 2, 1))
            elif kind == "conv":
                x = self._causal(state, x, walk, factor, prefix)
            elif kind == "unit":
                conv1, conv2, act1, act2 = state
                y = self._causal(conv1, act1(x), walk, factor, prefix)
                x = x + self._causal(conv2, act2(y), walk, factor, prefix)
            else:  # transposed
                r, looks_ahead, index = state
                x = self._transposed(module, r, index, x, walk, factor, prefix)
                factor *= r
                prefix = (prefix + 1) * r if looks_ahead else prefix * r
        if walk.carried:
            self._state.write_histories(slots, [walk.carried[i] for i in range(len(walk.carried))])
        return x.clamp(min=-1, max=1)

    def _masked(self, x: torch.Tensor, walk: _Walk, prefix: int) -> torch.Tensor:
        """A first chunk's invalid prefix zeroed (it stands for the zero history). One
        prefix length belongs to one stretch of equal lengths between two look-ahead
        layers, so its mask is made once per step."""
        if prefix == 0:
            return x
        invalid = walk.masks.get(prefix)
        if invalid is None:
            before = torch.arange(x.shape[-1], device=x.device) < prefix
            invalid = walk.masks[prefix] = (before.unsqueeze(0) & walk.is_start.unsqueeze(1)).unsqueeze(1)
        return x.masked_fill(invalid, 0)

    def _history(self, index: int, x: torch.Tensor, walk: _Walk, factor: int, prefix: int) -> torch.Tensor:
        """``[state, x]`` (``x`` masked); each row's last ``width`` samples of it ending at its
        real end (``counts · factor`` in its coordinates) are its new state, written with the
        others at the step's end. The gather index is made once per factor, then cut."""
        xin = torch.cat([self._state.history(walk.state, index), self._masked(x, walk, prefix)], dim=-1)
        (b, c, _), width = xin.shape, self._state.shapes[index][1]
        ends = walk.ends.get(factor)
        if ends is None:
            ends = walk.ends[factor] = torch.add(self._steps, walk.counts.view(b, 1, 1), alpha=factor)
        walk.carried[index] = xin.gather(2, ends[..., :width].expand(b, c, width))
        return xin

    def _causal(self, conv: _Conv, x: torch.Tensor, walk: _Walk, factor: int, prefix: int) -> torch.Tensor:
        # a pointwise convolution keeps the invalid prefix where it is: no mask, no state
        xin = x if conv.width == 0 else self._history(conv.index, x, walk, factor, prefix)
        out: torch.Tensor = conv.module.conv(xin)
        return out

    def _transposed(
        self, module: Any, r: int, index: int, x: torch.Tensor, walk: _Walk, factor: int, prefix: int
    ) -> torch.Tensor:
        """``[last input, x]`` through the layer: block ``j`` pairs input ``j − 1`` (the
        state for ``j = 0``) with input ``j``, so ``T`` inputs give ``T · r`` outputs (the
        untrimmed convolution's blocks ``1 .. T``, whichever end the layer trims)."""
        xin = self._history(index, x, walk, factor, prefix)
        out: torch.Tensor = module.conv(xin)[..., r : (x.shape[-1] + 1) * r]
        return out

    def _transformer(self, hidden: torch.Tensor, walk: _Walk, positions: torch.Tensor) -> torch.Tensor:
        """The sliding-window transformer over the new frames, with the cached keys and
        values of each stream's last ``W − 1`` frames (right-aligned)."""
        transformer = self.model.pre_transformer
        b, t, _ = hidden.shape
        device = hidden.device
        past = self.window - 1
        steps = torch.arange(t, device=device)
        cos, sin = transformer.rotary_emb(hidden, positions.view(b, 1) + steps.view(1, t))
        heads, kv_heads = self._heads
        cos, sin = ops.head_tables(cos, sin, self._sign, heads + kv_heads, kv_heads)
        bias = ops.window_bias(steps, positions, past, self.window, cos.dtype)  # [B, 1, T, past + T]
        ends = (walk.counts.view(b, 1) + self._steps[0, :, :past]).view(b, 1, 1, past, 1)
        project_in = getattr(transformer, "input_proj", None)
        h = hidden if project_in is None else project_in(hidden)
        for li, layer in enumerate(transformer.layers):
            attn = layer.self_attn
            d = attn.head_dim
            weight, qkv_bias = self._qkv[li]
            y = ops.rms_norm(layer.input_layernorm, h)
            # queries, keys and values in one product, rotated at once (the values' tables: 1, 0)
            qkv = ops.rotary(F.linear(y, weight, qkv_bias).view(b, t, -1, d), cos, sin).transpose(1, 2)
            new = qkv[:, heads:].view(b, 2, kv_heads, t, d)
            # [B, 2, kv heads, past + T, D]: the cached frames, then the new ones
            kv = torch.cat([self._state.read_kv(li, walk.read), new], dim=3)
            out = F.scaled_dot_product_attention(
                qkv[:, :heads], kv[:, 0], kv[:, 1], attn_mask=bias, scale=attn.scaling, enable_gqa=True
            )
            h = ops.scaled_residual(
                h, layer.self_attn_layer_scale, attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            )
            h = ops.scaled_residual(
                h, layer.mlp_layer_scale, layer.mlp(ops.rms_norm(layer.post_attention_layernorm, h))
            )
            self._state.write_kv(li, walk.slots, kv.gather(3, ends.expand(b, 2, kv_heads, past, d)))
        out_h = ops.rms_norm(transformer.norm, h)
        project_out = getattr(transformer, "output_proj", None)
        return out_h if project_out is None else project_out(out_h)

    # ----------------------------------------------------------------- startup and use

    def capture_graphs(self) -> None:
        if not self.graphs.enabled:
            return
        if self.compile_backend is not None:
            cache = self.compile_cache
            where = f"kernels cached in {cache}" if cache is not None else "no on-disk cache"
            print(
                f"omnirelay: code2wav-stream: compiling the stream step with {self.compile_backend} ({where})",
                file=sys.stderr,
                flush=True,
            )
        start = time.monotonic()
        before = reserved_bytes(self.device)
        cudnn = torch.backends.cudnn
        benchmark = cudnn.benchmark
        cudnn.benchmark = benchmark or os.environ.get(CONV_SEARCH_ENV) == "1"
        try:
            with torch.inference_mode(), graph_memory_errors(self.graphs, GRAPH_MEMORY_KNOB):
                for b, t in capture_order(self.batch_sizes, self.frames, self._buckets):
                    self.graphs.capture((b, t), self._step(b, t))
        finally:
            cudnn.benchmark = benchmark
        self.graphs.report.seconds = time.monotonic() - start
        self.graphs.report.pool_bytes = reserved_bytes(self.device) - before
        how = f" (step compiled with {self.compile_backend})" if self.compile_backend else ""
        print(f"omnirelay: {self.graphs.report}{how}", file=sys.stderr, flush=True)
        if self.compile_backend == "inductor":
            from torch._inductor import async_compile

            # Every graph is captured: the compile worker processes would only idle.
            async_compile.shutdown_compile_workers()
        self.check_compiled()

    def check_compiled(self) -> float | None:
        """The compiled step against the uncompiled one on probe streams (two chunks of up
        to two new streams, released after): their largest relative error. Above
        :data:`COMPILED_TOLERANCE` the step goes back to uncompiled (its graphs captured
        again), with a warning. None: the step is not compiled (or every slot is taken)."""
        if self.compile_backend is None or self.slots.num_free == 0:
            return None
        gen = torch.Generator().manual_seed(0)
        size = int(self.model.config.codebook_size)
        codes = [
            torch.randint(0, size, (self.q, 3), generator=gen) for _ in range(min(2, self.slots.num_free))
        ]
        compiled = self._probe(codes, "compiled")
        step_fn, bypass = self._step_fn, self.graphs.bypass
        self._step_fn, self.graphs.bypass = self._forward, True
        try:
            eager = self._probe(codes, "uncompiled")
        finally:
            self._step_fn, self.graphs.bypass = step_fn, bypass
        error = max(float((c - e).norm() / e.norm().clamp_min(1e-12)) for c, e in zip(compiled, eager))
        self.compile_error = error
        if error > COMPILED_TOLERANCE:
            print(
                f"omnirelay: warning: the compiled Code2Wav stream step decodes differently from the "
                f"uncompiled one (relative error {error:.2g}); it runs uncompiled",
                file=sys.stderr,
                flush=True,
            )
            self.compile_backend, self._step_fn = None, self._forward
            if self.graphs.enabled:
                self.graphs = GraphSet(
                    "code2wav-stream", self.device, enabled=True, pool=self._pool, priority=CODE2WAV_PRIORITY
                )
                self.capture_graphs()
        return error

    def _probe(self, codes: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        rows = [StreamRow(f"probe-{name}-{i}", c) for i, c in enumerate(codes)]
        with torch.inference_mode():
            pieces = [piece.float() for _ in range(2) for piece in self.decode(rows)]
        for row in rows:
            self.release(row.rid)
        return pieces

    def release(self, rid: str) -> None:
        """Forget the stream's state (idempotent); its slot is free for another. The table
        keeps its holders packed from slot 0, so the stream in the highest slot may move
        into the freed one: its state moves with it (copies enqueued on the current
        stream, after any step launched on it)."""
        self.slots.release(rid)

    def _move(self, src: int, dst: int, length: int) -> None:
        del length  # the state is a fixed window whatever the stream's length
        self._state.move(src, dst)

    def decode(self, rows: Sequence[StreamRow]) -> list[torch.Tensor]:
        """One step: each row's new frames decoded with its stream's state → its new
        samples (1-D, on the device), in ``rows``' order. A row's stream takes a slot on
        its first chunk. Rows are launched in groups of one frame bucket each, so a
        stream's long chunk does not pad every other stream's one-frame chunk to its
        length."""
        if len({r.rid for r in rows}) != len(rows):
            raise ModelError("a streaming Code2Wav step lists one stream twice")
        by_bucket: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            t = int(row.codes.shape[-1])
            by_bucket.setdefault(bucket(t, self.frames) or t, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for t, members in sorted(by_bucket.items()):
            step = self.max_rows(t)
            for first in range(0, len(members), step):
                group = members[first : first + step]
                for i, piece in zip(group, self._decode_group([rows[i] for i in group])):
                    out[i] = piece
        assert all(piece is not None for piece in out)
        return [piece for piece in out if piece is not None]

    def max_rows(self, frames: int) -> int:
        """The most rows one launch of the frame bucket takes: its largest captured batch
        (no buckets given: the largest batch; frames past every bucket: the smallest)."""
        if self._buckets is None:
            return self.batch_sizes[-1]
        fits = [b for b in self.batch_sizes if (b, frames) in self._buckets]
        return max(fits) if fits else self.batch_sizes[0]

    def _decode_group(self, rows: Sequence[StreamRow]) -> list[torch.Tensor]:
        n = len(rows)
        counts = [int(r.codes.shape[-1]) for r in rows]
        positions = [self.slots.length(r.rid) for r in rows]
        slots = [self.slots.acquire(r.rid) for r in rows]
        longest = max(counts)
        b, t = bucket(n, self.batch_sizes), bucket(longest, self.frames)
        graphed = b is not None and t is not None and (b, t) in self.graphs
        if not graphed:
            b, t = n, longest
        assert b is not None and t is not None
        block = torch.zeros((b, self.q, t), dtype=torch.long)
        for i, row in enumerate(rows):
            block[i, :, : counts[i]] = row.codes
        pad = b - n
        slot_ids = torch.tensor(slots + [self.slots.scratch] * pad, dtype=torch.long)
        frame_counts = torch.tensor(counts + [0] * pad, dtype=torch.long)
        starts = torch.tensor(positions + [1] * pad, dtype=torch.long)
        # Host tensors copied without blocking (from pinned memory): a pageable copy waits
        # for the stream, and the loop of a device group never waits for the device.
        if graphed:
            upload(self._codes[:b, :, :t], block)
            upload(self._slot_ids[:b], slot_ids)
            upload(self._counts[:b], frame_counts)
            upload(self._positions[:b], starts)
            wav = self.graphs.run((b, t), self._step(b, t))["wav"]
        else:  # no bucket: the same computation without a graph, on tensors of its own
            wav = self._step_fn(*(uploaded(x, self.device) for x in (block, slot_ids, frame_counts, starts)))
        pieces = []
        wav = wav[:n].clone()  # one copy for every row: the graph's output memory is the next replay's
        for i, row in enumerate(rows):
            start = self.holdback if positions[i] == 0 else 0
            pieces.append(wav[i, 0, start : counts[i] * self.upsample])
            self.slots.set_length(row.rid, positions[i] + counts[i])
        return pieces
