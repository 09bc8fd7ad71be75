"""The Thinker's text decoder on the static runner: slot KV, padded launches, CUDA graphs.

:class:`ThinkerRunner` runs a step's prefill rows and decode rows as few padded launches
(:func:`~omnirelay.models.runner.buckets.plan_prefill`,
:func:`~omnirelay.models.runner.buckets.plan_decode`): N new prompts cost one forward pass
(or a few, by the token budget), not N. Each launch embeds the ids, runs the decoder,
computes the logits of each row's last real token (ids past the tokenizer masked), the
greedy ids, and keeps the hidden states the Talker needs. One device→host copy per
launch brings back the greedy ids and those hidden rows; rows that sample (temperature >
0) are sampled on the device from the launch's logits with the request's own generator
(:func:`omnirelay.models.sampling.sample_rows`), so a request draws the same tokens in
any batch.

Compiled decode (``OMNIRELAY_THINKER_COMPILE=1``, :data:`THINKER_COMPILE_ENV`; off by
default): on CUDA the decode launches (one token per row over cached positions) run
:meth:`StaticDecoder.compile_decode <omnirelay.models.runner.decoder.StaticDecoder.compile_decode>`'s
pass with inductor, compiled while the graphs are captured, so each decode graph replays
the fused kernels; prefill launches stay uncompiled. The kernels are cached on disk per
model config, torch, card and dtype
(:func:`~omnirelay.models.runner.predictor.keyed_compile_cache`), so a restart reuses them.

Experts implementation: in half precision where ``triton`` is, the fused Triton path
(:mod:`~omnirelay.models.runner.moe`); otherwise per phase ``batched_mm`` for a decode of
one row, ``grouped_mm`` for everything else (``batched_mm`` copies every selected
expert's weights per token); the timings that chose it are in docs/performance.md,
"Figures behind choices in the code".
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.runner.buckets import Buckets, Launch, plan_decode, plan_prefill
from omnirelay.models.runner.decoder import SlotKV, StaticDecoder, experts_implementation
from omnirelay.models.runner.graphs import GraphSet, Step, to_device, upload
from omnirelay.models.runner.moe import FUSED_EXPERTS, fused_experts_enabled
from omnirelay.models.runner.predictor import compile_plan, keyed_compile_cache
from omnirelay.models.runner.slots import SlotTable
from omnirelay.models.sampling import sample_rows

__all__ = [
    "THINKER_COMPILE_ENV",
    "LaunchedRun",
    "RowOutput",
    "ThinkerRunner",
    "decode_compile_backend",
    "experts_for",
]

#: ``1``: the Thinker's decode launches compiled with inductor (on CUDA); unset or ``0``: not.
THINKER_COMPILE_ENV = "OMNIRELAY_THINKER_COMPILE"


def decode_compile_backend(device: torch.device, cuda_graphs: bool) -> str | None:
    """The ``torch.compile`` backend of the Thinker's decode launches as
    :data:`THINKER_COMPILE_ENV` says: ``"inductor"`` when it is ``1`` on a CUDA device
    whose steps are captured as graphs (every shape then compiles at startup, none while
    serving), else None (uncompiled: the default until the compiled step is measured on
    the cards the stages run on, docs/performance.md)."""
    value = os.environ.get(THINKER_COMPILE_ENV, "").strip()
    if value in ("", "0"):
        return None
    if value == "1":
        return "inductor" if device.type == "cuda" and cuda_graphs else None
    raise ModelError(f"{THINKER_COMPILE_ENV} must be 0 or 1 (or unset), got {value!r}")


def experts_for(device: torch.device, dtype: torch.dtype, batch: int, tokens: int) -> str | None:
    """The experts implementation of a launch (None: the model's own, off CUDA). Half
    precision: the fused Triton path (:mod:`~omnirelay.models.runner.moe`) where it is on,
    else ``transformers``' own as below. ``grouped_mm`` runs in half precision only (float32 weights fall
    back to a path that copies to the host, which a CUDA graph cannot capture): float32
    uses ``batched_mm``."""
    if device.type != "cuda":
        return None
    if fused_experts_enabled(dtype):
        return FUSED_EXPERTS
    if batch * tokens == 1 or dtype not in (torch.bfloat16, torch.float16):
        return "batched_mm"
    return "grouped_mm"


@dataclass(slots=True)
class RowOutput:
    """One row's result: the sampled id (None when not asked) and, per captured layer,
    the hidden states of the row's tokens this step ``[n, H]`` on the CPU."""

    token: int | None
    hidden: dict[int, torch.Tensor]
    #: the float32 logits of the row's last token (only when asked: ``keep_logits``)
    logits: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Row:
    rid: str
    start: int
    token_ids: Sequence[int]
    sampling: SamplingParams
    generator: torch.Generator | None  # None: do not sample (a partial prefill)
    #: embeddings that replace the token embeddings at these indices of ``token_ids`` (a
    #: prompt's audio tokens): (indices, rows [len(indices), H]); None: none
    embeds: tuple[Sequence[int], torch.Tensor] | None = None


#: (batch indices, token indices, rows) of embeddings a launch replaces
_Overrides = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ThinkerRunner:
    """See the module docstring. ``capture_layers``: hidden-state indices to return
    (0 = the embeddings; ``i`` = the input of layer ``i``). ``compile``: the
    ``torch.compile`` backend of the decode launches (None: uncompiled; a stage passes
    :func:`decode_compile_backend`)."""

    def __init__(
        self,
        text_model: Any,
        lm_head: Any,
        *,
        capture_layers: tuple[int, ...],
        num_text_ids: int,
        buckets: Buckets,
        cuda_graphs: bool,
        compile: str | None = None,
    ) -> None:
        self.text = text_model
        self.lm_head = lm_head
        weight = text_model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        config = text_model.config
        self.buckets = buckets
        self.capture_layers = capture_layers
        #: Hand the captured rows on the device (copies of the launch's reused buffers) for
        #: a GPU-direct edge to the Talker, instead of copying them to the host.
        self.keep_hidden_on_device = False
        self.num_text_ids = num_text_ids
        self.slots = SlotTable(buckets.max_num_seqs, buckets.max_model_len)
        self.kv = SlotKV(
            num_layers=int(config.num_hidden_layers),
            num_slots=buckets.max_num_seqs,
            max_len=buckets.max_model_len,
            kv_heads=int(config.num_key_value_heads),
            head_dim=int(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)),
            dtype=self.dtype,
            device=self.device,
        )
        self.decoder = StaticDecoder(text_model, self.kv)
        self.slots.on_move = self.kv.move
        self.graphs = GraphSet("thinker", self.device, enabled=cuda_graphs)
        self._experts = [m for m in text_model.modules() if type(m).__name__.endswith("Experts")]
        mb, mt = buckets.max_batch, buckets.max_piece
        self._ids = torch.zeros((mb, mt), dtype=torch.long, device=self.device)
        self._slot_ids = torch.full((mb,), self.kv.scratch, dtype=torch.long, device=self.device)
        self._starts = torch.zeros(mb, dtype=torch.long, device=self.device)
        self._counts = torch.ones(mb, dtype=torch.long, device=self.device)
        self._init_compile(compile)

    def _init_compile(self, backend: str | None) -> None:
        #: inductor's on-disk cache of the compiled decode (None: not compiling with inductor)
        self.compile_cache: Path | None = None
        if backend is None:
            return
        self.decoder.compile_decode(backend)
        if backend == "inductor":
            self.compile_cache = keyed_compile_cache(self.text.config, self.device, self.dtype)

    # ----------------------------------------------------------------- startup

    def capture_graphs(self) -> None:
        """Capture every prefill and decode bucket (startup; a no-op without CUDA graphs)."""
        if not self.graphs.enabled:
            return
        backend = self.decoder.decode_backend
        if backend is not None:
            print(f"omnirelay: thinker: {self._compile_plan()}", file=sys.stderr, flush=True)
        start = time.monotonic()
        with torch.inference_mode(), self._compiling():
            for b, t in self.buckets.prefill_shapes():
                self.graphs.capture((b, t, None), self._step(b, t, None))
            for b, length in self.buckets.decode_shapes():
                self.graphs.capture((b, 1, length), self._step(b, 1, length))
                self.graphs.capture((b, 1, length, "in_place"), self._step(b, 1, length, in_place=True))
        self.graphs.report.seconds = time.monotonic() - start
        how = f" (decode compiled with {backend})" if backend is not None else ""
        print(f"omnirelay: {self.graphs.report}{how}", file=sys.stderr, flush=True)

    def _compile_plan(self) -> str:
        """What the capture is about to compile, and whether a cache already holds it."""
        sizes = ", ".join(map(str, self.buckets.batch_sizes))
        what = (
            f"compiling the decode step with {self.decoder.decode_backend} for batches {sizes} "
            f"({THINKER_COMPILE_ENV}=1)"
        )
        return compile_plan(what, self.compile_cache)

    @contextmanager
    def _compiling(self) -> Iterator[None]:
        """Inductor reads and writes this runner's cache folder while the graphs capture
        (and compile) the decode, whichever stage of the process chose the folder last;
        its compile workers stop afterwards instead of idling beside the stage."""
        if self.compile_cache is None:
            yield
            return
        from torch._inductor import async_compile
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        try:
            with temporary_cache_dir(str(self.compile_cache)):  # and inductor's in-memory caches reset
                yield
        finally:
            async_compile.shutdown_compile_workers()

    # ----------------------------------------------------------------- steps

    def _step(
        self,
        b: int,
        t: int,
        attn_len: int | None,
        overrides: _Overrides | None = None,
        *,
        in_place: bool = False,
    ) -> Step:
        # A decode launch (one token a row over cached positions) runs the compiled pass
        # when there is one; a prefill, or one with embeddings from outside, never does.
        decode = t == 1 and attn_len is not None and overrides is None
        forward = self.decoder.decode_forward if decode else self.decoder.forward

        def step() -> dict[str, torch.Tensor]:
            with experts_implementation(self._experts, experts_for(self.device, self.dtype, b, t)):
                embeds = self.text.embed_tokens(self._ids[:b, :t])
                if overrides is not None:
                    batch_idx, token_idx, rows = overrides
                    embeds = embeds.index_put((batch_idx, token_idx), rows.to(embeds.dtype))
                last, captured = forward(
                    embeds,
                    self._slot_ids[:b],
                    self._starts[:b],
                    self._counts[:b],
                    attn_len=attn_len,
                    capture=self.capture_layers,
                    in_place=in_place,
                )
                logits = self.lm_head(last).float()
                logits[:, self.num_text_ids :] = float("-inf")
                out = {"logits": logits, "greedy": logits.argmax(dim=-1)}
                out.update({f"h{layer}": captured[layer] for layer in self.capture_layers})
                return out

        return step

    def _launch(self, launch: Launch, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        b, t = launch.batch, launch.tokens
        ids = torch.zeros((b, t), dtype=torch.long)
        slots = torch.full((b,), self.kv.scratch, dtype=torch.long)
        starts = torch.zeros(b, dtype=torch.long)
        counts = torch.ones(b, dtype=torch.long)
        for i, piece in enumerate(launch.pieces):
            row, at = rows[piece.row], launch.row_of(i)
            ids[at, : piece.count] = torch.as_tensor(row.token_ids[piece.offset : piece.offset + piece.count])
            slots[at] = self.slots.slot(row.rid)
            starts[at] = piece.start
            counts[at] = piece.count
        upload(self._ids[:b, :t], ids)
        upload(self._slot_ids[:b], slots)
        upload(self._starts[:b], starts)
        upload(self._counts[:b], counts)
        overrides = self._overrides(launch, rows)
        if overrides is not None:
            # Embeddings from outside the graph (audio tokens): this launch runs eagerly.
            return self.graphs.run(
                ("embeds", b, t, launch.attn_len), self._step(b, t, launch.attn_len, overrides)
            )
        if launch.in_place:
            key: tuple[Any, ...] = (b, t, launch.attn_len, "in_place")
            return self.graphs.run(key, self._step(b, t, launch.attn_len, in_place=True))
        return self.graphs.run((b, t, launch.attn_len), self._step(b, t, launch.attn_len))

    def _overrides(self, launch: Launch, rows: Sequence[Row]) -> _Overrides | None:
        """The launch's replaced embeddings as (batch indices, token indices, rows)."""
        batch_idx: list[int] = []
        token_idx: list[int] = []
        parts = []
        for i, piece in enumerate(launch.pieces):
            given = rows[piece.row].embeds
            if given is None:
                continue
            indices, values = given
            for j, index in enumerate(indices):
                if piece.offset <= index < piece.offset + piece.count:
                    batch_idx.append(launch.row_of(i))
                    token_idx.append(index - piece.offset)
                    parts.append(values[j])
        if not parts:
            return None
        device = self.device
        return (
            torch.tensor(batch_idx, device=device),
            torch.tensor(token_idx, device=device),
            torch.stack(parts).to(device),
        )

    def _collect(
        self,
        launch: Launch,
        rows: Sequence[Row],
        out: dict[str, torch.Tensor],
        results: list[RowOutput],
        keep_logits: bool,
    ) -> None:
        n = len(launch.pieces)
        order = None if launch.rows_at is None else to_device(list(launch.rows_at), self.device)

        def pick(x: torch.Tensor) -> torch.Tensor:
            """The pieces' rows of a launch output, in piece order (a view when they are
            rows 0..n-1, else a gather from their slots' rows)."""
            return x[:n] if order is None else x.index_select(0, order)

        greedy = pick(out["greedy"]).tolist()
        if self.keep_hidden_on_device:  # own copies: the outputs are the graph's buffers
            hidden = {layer: pick(out[f"h{layer}"]).clone() for layer in self.capture_layers}
        else:
            hidden = {layer: pick(out[f"h{layer}"]).to("cpu") for layer in self.capture_layers}
        sampled = [
            i
            for i, p in enumerate(launch.pieces)
            if p.is_last and rows[p.row].generator is not None and rows[p.row].sampling.temperature > 0
        ]
        if sampled:
            idx = torch.tensor([launch.row_of(i) for i in sampled], device=self.device)
            drawn = sample_rows(
                out["logits"].index_select(0, idx),
                [rows[launch.pieces[i].row].sampling for i in sampled],
                [rows[launch.pieces[i].row].generator for i in sampled],  # type: ignore[misc]
            )
            for i, token in zip(sampled, drawn):
                greedy[i] = token
        for i, piece in enumerate(launch.pieces):
            row = rows[piece.row]
            result = results[piece.row]
            for layer in self.capture_layers:
                part = hidden[layer][i, : piece.count]
                prev = result.hidden.get(layer)
                result.hidden[layer] = part if prev is None else torch.cat([prev, part])
            if piece.is_last and row.generator is not None:
                result.token = int(greedy[i])
            if piece.is_last and keep_logits:
                result.logits = out["logits"][launch.row_of(i)].clone()

    def run(self, rows: Sequence[Row], *, decode: bool, keep_logits: bool = False) -> list[RowOutput]:
        """One step of ``rows`` (all prefill or all decode); results in row order. Each
        row's slot must be acquired; its cached length becomes ``start + len(token_ids)``.
        ``keep_logits``: also return each row's last logits (for checks)."""
        for row in rows:
            self.slots.check_room(row.rid, row.start, len(row.token_ids))
        if decode:
            slots = [self.slots.slot(row.rid) for row in rows]
            launches = plan_decode([row.start for row in rows], self.buckets, slots)
        else:
            launches = plan_prefill([(row.start, len(row.token_ids)) for row in rows], self.buckets)
        results = [RowOutput(token=None, hidden={}) for _ in rows]
        for launch in launches:
            out = self._launch(launch, rows)
            self._collect(launch, rows, out, results, keep_logits)
        for row in rows:
            self.slots.set_length(row.rid, row.start + len(row.token_ids))
        return results

    def launch_decode(self, rows: Sequence[Row], stream: Any | None) -> LaunchedRun:
        """A decode of greedy ``rows`` (each row's generator None or its temperature 0),
        enqueued and not waited for: on ``stream`` (a CUDA stream; None: run now), its
        ids and hidden rows copied without blocking (into pinned host memory, or device
        copies when :attr:`keep_hidden_on_device`), an event recorded after them. The
        rows' cached lengths count the step at once: the next step on this runner is
        ordered after it on the stream."""
        for row in rows:
            self.slots.check_room(row.rid, row.start, len(row.token_ids))
            assert row.generator is None or row.sampling.temperature <= 0, "launch_decode is greedy only"
        slots = [self.slots.slot(row.rid) for row in rows]
        launches = plan_decode([row.start for row in rows], self.buckets, slots)
        done = None
        if stream is None:
            parts = [self._copy_out(launch, self._launch(launch, rows)) for launch in launches]
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the caches' last writes
            with torch.cuda.stream(stream):
                parts = [self._copy_out(launch, self._launch(launch, rows)) for launch in launches]
                done = torch.cuda.Event()
                done.record(stream)
        for row in rows:
            self.slots.set_length(row.rid, row.start + len(row.token_ids))
        return LaunchedRun(len(rows), parts, done, self.device)

    def _copy_out(self, launch: Launch, out: dict[str, torch.Tensor]) -> _Copied:
        """What a launch's rows keep of its outputs (the graph's buffers are reused by the
        next replay), copied on the current stream without blocking the host."""
        n = len(launch.pieces)
        order = None if launch.rows_at is None else to_device(list(launch.rows_at), self.device)

        def pick(x: torch.Tensor) -> torch.Tensor:
            return x[:n] if order is None else x.index_select(0, order)

        greedy = _to_host(pick(out["greedy"]))
        if self.keep_hidden_on_device:
            hidden = {layer: pick(out[f"h{layer}"]).clone() for layer in self.capture_layers}
        else:
            hidden = {layer: _to_host(pick(out[f"h{layer}"])) for layer in self.capture_layers}
        return _Copied(launch, greedy, hidden)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: a non-blocking copy into pinned memory from a CUDA device."""
    if x.device.type != "cuda":
        return x.to("cpu")
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


@dataclass(slots=True)
class _Copied:
    launch: Launch
    greedy: torch.Tensor  # [n] on the host
    hidden: dict[int, torch.Tensor]  # per captured layer [n, T, H]: host, or device copies


class LaunchedRun:
    """A decode enqueued by :meth:`ThinkerRunner.launch_decode`; its outputs are complete
    once ``done`` (a CUDA event; None: already) completed."""

    def __init__(self, num_rows: int, parts: list[_Copied], done: Any | None, device: torch.device) -> None:
        self._num_rows = num_rows
        self._parts = parts
        self._done = done
        self._device = device

    def is_done(self) -> bool:
        """Has the decode ended? Never blocks."""
        return self._done is None or bool(self._done.query())

    def outputs(self) -> list[RowOutput]:
        """Each row's id and hidden rows, in row order (waits only when asked before
        :meth:`is_done`). Device copies are handed to the current stream: it waits for
        the decode, and their memory is not reused before its work on them."""
        if self._done is not None:
            self._done.synchronize()
            current = torch.cuda.current_stream(self._device)
            current.wait_event(self._done)
            for part in self._parts:
                for rows in part.hidden.values():
                    if rows.device.type == "cuda":
                        rows.record_stream(current)
            self._done = None
        results = [RowOutput(token=None, hidden={}) for _ in range(self._num_rows)]
        for part in self._parts:
            greedy = part.greedy.tolist()
            for i, piece in enumerate(part.launch.pieces):
                result = results[piece.row]
                for layer, rows in part.hidden.items():
                    chunk = rows[i, : piece.count]
                    prev = result.hidden.get(layer)
                    result.hidden[layer] = chunk if prev is None else torch.cat([prev, chunk])
                if piece.is_last:
                    result.token = int(greedy[i])
        return results
