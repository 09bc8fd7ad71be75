"""The tail of a Talker frame: codec head, first codebook, then the code predictor's ``Q − 1``.

After the Talker's decoder step, a frame needs ``Q`` more codebooks: the codec head
samples the first, then the code predictor (a small transformer over a per-frame cache)
samples one codebook per pass. Eagerly that is ~6,000 small kernels a frame. This module
lays the tail out so it compiles into few, fused kernels:

* **an opening pass of two tokens, then one pass per position**: the codec head samples
  the first codebook from the Talker's hidden state, then one pass
  (:meth:`CodePredictor._opening`) takes that hidden state and the first codebook's
  embedding at positions 0 and 1 (causal, as the reference's own first call does), and
  each later pass one token, the last sampled codebook's embedding — ``Q − 2`` passes
  of the same shape over a fixed ``Q``-position cache, attention masked to the positions
  filled so far. Every such pass is one call of the same function
  (:meth:`CodePredictor._pass`), and every residual codebook's sampling one call of
  another (:meth:`CodePredictor._residual_head`): position, mask and weights are tensor
  arguments, not Python values, so ``torch.compile`` makes one graph of each per batch
  size instead of one per position and layer;
* **functional inside, one write outside**: a pass reads the cache and returns the new
  keys and values of all layers in one tensor; one copy stores them at the pass's
  position.

With ``compile="inductor"`` both functions go through ``torch.compile`` (static shapes;
a test uses a lighter backend to check that they trace whole); compilation happens on the first call per batch size — at startup, when the
runner warms its graphs up — and the compiled kernels are then captured inside the CUDA
graphs like any others. Inductor keeps its compiled kernels in an on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``): omnirelay points it under its own cache directory, in a
folder per code-predictor config, torch version, device and dtype
(:func:`keyed_compile_cache`), so a restarted stage on the same machine reuses the
kernels instead of compiling them again, and a changed model, torch or card never reads
another's. Fused kernels round differently in bf16, so a
compiled tail samples the same codes as the eager one only up to ties: equivalence is
judged on logits within tolerance.

Sampling is :func:`~omnirelay.models.runner.sampler.sample` with the request's
parameters for the first codebook and
:func:`~omnirelay.models.runner.sampler.sample_top_k` with the model family's for the
others (:class:`ResidualSampling`: Qwen3-Omni's reference uses temperature 1, top-k 50,
top-p 0.8; Qwen3-TTS's 0.9, 50, 1.0) — one ``torch.topk`` of a few dozen ids per
codebook instead of a sort of the whole vocabulary — each with the uniform number drawn
for it on the host. The
first codebook's logits may carry a per-row repetition penalty over the codes the
request already produced (``seen``: one flag per vocabulary id, divided when positive,
multiplied when negative — the ``transformers`` rule) and a per-row bias (the codec
vocabulary, and a blocked EOS while a request is shorter than its minimum length); with
penalty 1 and no block they leave the logits exactly as they were.

A family whose code predictor is narrower than its Talker projects each pass's input
first (``projection``: Qwen3-TTS 1.7B's ``small_to_mtp_projection``).

Four environment switches, read when the predictor is built, let one run compare the
tail's variants on a GPU: ``OMNIRELAY_TAIL_SORT=1`` samples the residual codebooks with
:func:`~omnirelay.models.runner.sampler.sample` (a full sort each, the former way);
``OMNIRELAY_TAIL_SDPA=1`` attends with one ``scaled_dot_product_attention`` per layer
instead of two matmuls around a softmax; ``OMNIRELAY_TAIL_AUTOTUNE=1`` compiles with
the options of inductor's ``max-autotune-no-cudagraphs`` mode (its own matmul kernels,
longer compiles); ``OMNIRELAY_TAIL_COMBO=1`` turns on inductor's combo kernels
(independent small kernels of a graph launched as one).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omnirelay.models.runner.decoder import grouped_attention
from omnirelay.models.runner.fused import attention_inputs, fuse_projections, run_mlp, run_norm
from omnirelay.models.runner.sampler import sample, sample_top_k

__all__ = [
    "AUTOTUNE_ENV",
    "COMBO_ENV",
    "DEFAULT_RESIDUAL",
    "PREDICTOR_TOP_K",
    "PREDICTOR_TOP_P",
    "SDPA_ENV",
    "SORT_ENV",
    "CodePredictor",
    "ResidualSampling",
    "compile_plan",
    "keyed_compile_cache",
    "use_compile_cache",
]

#: The code predictor's sampling when the request samples (the reference's values).
PREDICTOR_TOP_K = 50
PREDICTOR_TOP_P = 0.8
#: "1": residual codebooks sampled with a sort of the whole vocabulary (the former way)
SORT_ENV = "OMNIRELAY_TAIL_SORT"
#: "1": one ``scaled_dot_product_attention`` per layer
SDPA_ENV = "OMNIRELAY_TAIL_SDPA"
#: "1": inductor's ``max-autotune-no-cudagraphs`` mode
AUTOTUNE_ENV = "OMNIRELAY_TAIL_AUTOTUNE"
#: "1": inductor's combo kernels (independent small kernels launched as one)
COMBO_ENV = "OMNIRELAY_TAIL_COMBO"
#: Compiled graphs kept per function: one per batch bucket, with room to spare.
_RECOMPILE_LIMIT = 64


@dataclass(frozen=True, slots=True)
class ResidualSampling:
    """How codebooks ``1 .. Q−1`` are sampled when the request samples (greedy when it
    does not): the model family's reference values."""

    temperature: float = 1.0
    top_k: int = PREDICTOR_TOP_K
    top_p: float = PREDICTOR_TOP_P


#: Qwen3-Omni's residual sampling (the default).
DEFAULT_RESIDUAL = ResidualSampling()


#: the directory :func:`use_compile_cache` chose (None: it chose none, or the
#: environment had already named one, which is then left as it is)
_OWN_CACHE: Path | None = None


def _chosen_cache() -> str | None:
    """The inductor cache folder the environment chose, if any. Torch writes its default
    folder into ``TORCHINDUCTOR_CACHE_DIR`` the first time anything in the process asks
    inductor for it (another stage of a device group, built first, may have): that one
    was chosen by nobody."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(chosen) == os.path.abspath(default_cache_dir()) else chosen


def use_compile_cache(root: Path) -> Path:
    """Point inductor's on-disk cache at ``root / "inductor"`` unless the environment
    already chose one; returns the directory in use."""
    global _OWN_CACHE
    if _OWN_CACHE is not None:
        return _OWN_CACHE
    chosen = _chosen_cache()
    if chosen:
        return Path(chosen)
    path = root / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    _OWN_CACHE = path
    return path


def _config_text(config: Any) -> str:
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return json.dumps(to_dict(), sort_keys=True, default=str)
    return repr(config)


def keyed_compile_cache(config: Any, device: torch.device, dtype: torch.dtype) -> Path | None:
    """Inductor's cache folder for a model ``config`` on ``device`` in ``dtype`` with this
    torch: ``<the folder use_compile_cache chose>/<hash of all four>`` (made the cache in
    use); the environment's own folder, untouched, when it named one; None: no cache set."""
    if _OWN_CACHE is None:
        chosen = _chosen_cache()
        return Path(chosen) if chosen else None
    card = "cpu"
    if device.type == "cuda":
        card = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    recipe = f"{_config_text(config)}|torch {torch.__version__}|{card}|{dtype}"
    path = _OWN_CACHE / hashlib.sha256(recipe.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def compile_plan(what: str, cache: Path | None) -> str:
    """A startup line's account of a compile: ``what`` it compiles, and whether the
    on-disk ``cache`` (None: none) already holds kernels for it."""
    if cache is None:
        return f"{what} (no on-disk cache: every start compiles again)"
    if any(cache.iterdir()):
        return f"{what}, reusing the kernels cached in {cache}"
    return f"{what}; first start on this machine: this takes minutes, later starts reuse {cache}"


def _rotary() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = modeling.apply_rotary_pos_emb
    return fn


def _switch(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`grouped_attention` as one ``scaled_dot_product_attention``. The key/value
    heads are repeated per query head first (a copy a compiled pass folds into the kernel
    that picks the cache's keys): the memory-efficient kernel, the one that takes a mask,
    does not group query heads itself."""
    b, hq, _, _ = q.shape
    hk, length, d = k.shape[1], k.shape[2], k.shape[3]
    k = k.unsqueeze(2).expand(b, hk, hq // hk, length, d).reshape(b, hq, length, d)
    v = v.unsqueeze(2).expand(b, hk, hq // hk, length, d).reshape(b, hq, length, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class CodePredictor:
    """``__call__(last, b) -> codes [b, Q]`` for the first ``b`` rows of the runner's
    sampling buffers; see the module docstring."""

    def __init__(
        self,
        talker: Any,
        *,
        max_batch: int,
        num_code_groups: int,
        codec_bias: torch.Tensor,
        compile: str | None = None,
        residual: ResidualSampling = DEFAULT_RESIDUAL,
        projection: torch.nn.Module | None = None,
    ) -> None:
        predictor = talker.code_predictor
        self.residual = residual
        self.projection = projection
        self.model = predictor.model
        self.layers = list(self.model.layers)
        fuse_projections(self.layers)  # one matmul for QKV, one for gate/up, per layer
        # Resolved here: a compiled body cannot import (transformers' modules load lazily).
        self._rotate = _rotary()
        weight = talker.model.codec_embedding.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.q = num_code_groups
        config = self.model.config
        kv_heads, head_dim = int(config.num_key_value_heads), int(config.head_dim)
        #: keys and values of every layer for the frame's Q positions
        self._cache = torch.zeros(
            (len(self.layers), 2, max_batch, kv_heads, self.q, head_dim), dtype=self.dtype, device=self.device
        )
        positions = torch.arange(self.q, device=self.device)
        probe = torch.zeros((1, self.q, int(config.hidden_size)), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.model.rotary_emb(probe, positions.unsqueeze(0))
        # One tensor of each per position (own storage: a compiled call sees the same layout).
        self._cos = [cos[:, p : p + 1].clone() for p in range(self.q)]
        self._sin = [sin[:, p : p + 1].clone() for p in range(self.q)]
        self._mask = [(positions <= p).view(1, 1, 1, self.q).clone() for p in range(self.q)]
        self._slot = [(positions == p).view(1, 1, self.q, 1).clone() for p in range(self.q)]
        # the opening pass: positions 0 and 1, each attending to itself and those before
        self._opening_rotary = (cos[:, :2].clone(), sin[:, :2].clone())
        self._causal = torch.ones((2, 2), dtype=torch.bool, device=self.device).tril().view(1, 1, 2, 2)
        self._attention = _sdpa if _switch(SDPA_ENV) else grouped_attention
        self._sort = _switch(SORT_ENV)
        self._first = (talker.codec_head.weight, codec_bias, weight)
        vocab = int(config.vocab_size)
        no_bias = torch.zeros(vocab, device=self.device)
        heads = [m.weight for m in predictor.lm_head]
        embeds = [e.weight for e in self.model.codec_embedding]
        self._groups = [(heads[g], no_bias, embeds[g]) for g in range(self.q - 1)]
        #: the ``torch.compile`` backend of both bodies (None: eager)
        self.compile_backend = compile
        #: inductor's on-disk cache for this predictor (None: not compiling with inductor)
        self.compile_cache: Path | None = None
        if compile == "inductor":
            self.compile_cache = keyed_compile_cache(config, self.device, self.dtype)
        self.opening_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._opening
        self.pass_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._pass
        self.head_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._head
        self.first_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._first_head
        self.residual_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._residual_head
        if compile is not None:
            self._compile_bodies(compile)

    def _compile_bodies(self, backend: str) -> None:
        from torch import _dynamo

        dynamo_config: Any = _dynamo.config
        dynamo_config.cache_size_limit = max(int(dynamo_config.cache_size_limit), _RECOMPILE_LIMIT)
        options: dict[str, Any] = {}
        if backend == "inductor" and _switch(AUTOTUNE_ENV):
            options.update(max_autotune=True, coordinate_descent_tuning=True)  # the mode's options
        if backend == "inductor" and _switch(COMBO_ENV):
            options["combo_kernels"] = True
        # dynamic=None: the first batch size compiles static, the next one turns the batch
        # dimension symbolic, and every later size reuses that graph (about two compiles
        # of each body for a whole set of buckets instead of one per bucket).
        for name in ("opening_fn", "pass_fn", "head_fn", "first_fn", "residual_fn"):
            body = getattr(self, name)
            setattr(self, name, torch.compile(body, backend=backend, fullgraph=True, options=options or None))

    def finish_compiling(self) -> None:
        """Every graph is compiled (and captured): stop inductor's pool of compile worker
        processes, which would otherwise idle beside the stage for its whole life."""
        if self.compile_backend == "inductor":
            from torch._inductor import async_compile

            async_compile.shutdown_compile_workers()

    # ----------------------------------------------------------------- the two bodies

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        cache: torch.Tensor | None,
        slot: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [b, T, H]`` through every layer, attending where ``allowed [b, 1, T, L]``:
        to the pass's own keys and values (``cache`` None, ``L = T``) or to the cache with
        this position's (``slot``) taken from the pass. Returns the last token's normed
        hidden state ``[b, H]`` and the new keys and values ``[layers, 2, b, kv_heads, T,
        head_dim]``."""
        b, t = x.shape[0], x.shape[1]
        rotate = self._rotate
        h = x if self.projection is None else self.projection(x)
        new = []
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            y = run_norm(layer.input_layernorm, h)
            q, k, v = attention_inputs(attn, y, cos, sin, rotate)
            keys, values = k, v
            if cache is not None and slot is not None:
                keys = torch.where(slot, k, cache[li, 0])
                values = torch.where(slot, v, cache[li, 1])
            out = self._attention(q, keys, values, allowed, attn.scaling)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            h = h + run_mlp(layer.mlp, run_norm(layer.post_attention_layernorm, h))
            new.append(torch.stack([k, v]))
        return run_norm(self.model.norm, h)[:, -1], torch.stack(new)

    def _opening(
        self, last: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0 and 1 (the Talker's hidden state ``last [b, H]``, the first
        codebook's embedding ``x [b, 1, H]``), causal over themselves: see :meth:`_layers`."""
        b = x.shape[0]
        both = torch.cat([last.unsqueeze(1), x], dim=1)
        return self._layers(both, cos, sin, causal.expand(b, 1, 2, 2), None, None)

    def _pass(
        self,
        x: torch.Tensor,
        cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        slot: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (``x [b, 1, H]``) attending to the cache's positions up to
        this one (``mask``), this position's keys and values taken from the pass itself
        (``slot``): see :meth:`_layers`."""
        b = x.shape[0]
        return self._layers(x, cos, sin, mask.expand(b, 1, 1, mask.shape[-1]), cache, slot)

    def _residual_head(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        embedding: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
        total: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_head` of a residual codebook: no bias, the family's sampling for every
        row that samples (``temperature`` > 0: the request's), without a sort of the whole
        vocabulary."""
        residual = self.residual
        logits = F.linear(h, weight)
        temperature = torch.where(temperature > 0, residual.temperature, 0.0)
        top_p = torch.full_like(temperature, residual.top_p)
        token = sample_top_k(logits, temperature, residual.top_k, top_p, uniform)
        embed = F.embedding(token, embedding)
        return token, embed.unsqueeze(1), total + embed

    @staticmethod
    def _head(
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        embedding: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
        total: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits of one codebook, a sampled id per row, its embedding ``[b, 1, H]`` and
        the running sum of the frame's codec embeddings."""
        logits = F.linear(h, weight).float() + bias
        token = sample(logits, temperature, top_k, top_p, uniform)
        embed = F.embedding(token, embedding)
        return token, embed.unsqueeze(1), total + embed

    @staticmethod
    def _first_head(
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        embedding: torch.Tensor,
        seen: torch.Tensor,
        penalty: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
        total: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_head` of the first codebook: the repetition penalty over ``seen [b, V]``
        (``penalty [b]``), then the per-row ``bias [b, V]``."""
        logits = F.linear(h, weight).float()
        scale = penalty.unsqueeze(1)
        penalized = torch.where(logits < 0, logits * scale, logits / scale)
        logits = torch.where(seen, penalized, logits) + bias
        token = sample(logits, temperature, top_k, top_p, uniform)
        embed = F.embedding(token, embedding)
        return token, embed.unsqueeze(1), total + embed

    # ----------------------------------------------------------------- one frame's tail

    def __call__(
        self,
        last: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
        *,
        seen: torch.Tensor | None = None,
        penalty: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's ``Q`` codes ``[b, Q]`` and the sum of their embeddings ``[b, H]``
        (the next frame's codec input), from the Talker's last hidden states ``[b, H]``
        and ``[b]`` sampling tensors (``uniform [b, Q]``). ``seen [b, V]``, ``penalty [b]``
        and ``bias [b, V]`` (default: the codec bias) shape the first codebook's logits."""
        b = last.shape[0]
        cache = self._cache[:, :, :b]
        total = torch.zeros_like(last)
        weight, codec_bias, embedding = self._first
        if seen is None or penalty is None:
            first, x, total = self.head_fn(
                last,
                weight,
                codec_bias if bias is None else bias,
                embedding,
                temperature,
                top_k,
                top_p,
                uniform[:, 0],
                total,
            )
        else:
            first, x, total = self.first_fn(
                last,
                weight,
                codec_bias if bias is None else bias,
                embedding,
                seen,
                penalty,
                temperature,
                top_k,
                top_p,
                uniform[:, 0],
                total,
            )
        codes = [first]
        if self._sort:
            residual = self.residual
            pred_temperature = torch.where(temperature > 0, residual.temperature, 0.0)
            pred_top_k = torch.full_like(top_k, residual.top_k)
            pred_top_p = torch.full_like(top_p, residual.top_p)
        h, new = self.opening_fn(last, x, *self._opening_rotary, self._causal)
        cache[..., :2, :].copy_(new)
        for p in range(1, self.q):
            if p > 1:
                h, new = self.pass_fn(x, cache, self._cos[p], self._sin[p], self._mask[p], self._slot[p])
                cache[..., p : p + 1, :].copy_(new)
            weight, bias, embedding = self._groups[p - 1]
            if self._sort:
                token, x, total = self.head_fn(
                    h, weight, bias, embedding, pred_temperature, pred_top_k, pred_top_p, uniform[:, p], total
                )
            else:
                token, x, total = self.residual_fn(h, weight, embedding, temperature, uniform[:, p], total)
            codes.append(token)
        return torch.stack(codes, dim=1), total
