"""The Talker on the static runner: a codec frame in two CUDA graph replays.

One Talker frame is the Talker decoder's step (first codebook from ``codec_head``) and
then ``Q − 1`` code-predictor steps, each a small transformer pass over a per-frame cache,
sampling the next codebook — ~6,700 kernel launches eagerly. :class:`TalkerRunner`
captures all of it, sampling included (:func:`~omnirelay.models.runner.sampler.sample`),
as graphs per batch bucket (and attention length); the tail after the decoder step is
:class:`~omnirelay.models.runner.predictor.CodePredictor`, compiled into fused kernels
with ``compile="inductor"``. A step (:meth:`TalkerRunner.step`) runs:

* **prefill** — the conditioning rows of the step's new requests, batched and padded
  like the Thinker's; keeps each row's last hidden state;
* **frame** — the Talker's decoder step for every continuing request. Input: each row's
  slot, position and the text row of this step; the codec part of the input (the summed
  embeddings of the row's previous frame) is read from a per-slot buffer that the
  previous frame's tail wrote. Keeps each row's last hidden state;
* **tail** — codec head, sampling and the code predictor over *all* those hidden states
  at once, new rows and continuing ones: ``[B, Q]`` codes. The tail is the frame's
  kernel-count-bound part (the ``Q`` passes cost about the same at 1 row as at 64), so a
  step that admits requests runs it once, not once for the new rows and again for the
  others.

The host's part per step: the text rows, the sampling parameters as ``[B]`` tensors and
``Q`` uniform numbers per sampling row drawn from the request's own generator (the same
draws, in the same order, as the dynamic path), and one device→host copy of the codes.

With ``row_controls`` (Qwen3-TTS) the first codebook also honours each row's repetition
penalty over the first codes its slot produced (a per-slot flag per vocabulary id, set
inside the graph, cleared at the slot's prefill) and a row that may not stop yet (its
minimum length) has codec EOS blocked; ``residual`` and ``projection`` are the family's
code-predictor sampling and input projection (:class:`~omnirelay.models.runner.predictor.CodePredictor`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult, SamplingParams
from omnirelay.models.runner.buckets import Buckets, Launch, plan_decode, plan_prefill
from omnirelay.models.runner.decoder import SlotKV, StaticDecoder, experts_implementation
from omnirelay.models.runner.graphs import GraphSet, Step, own_stream, to_device, upload
from omnirelay.models.runner.predictor import DEFAULT_RESIDUAL, CodePredictor, ResidualSampling, compile_plan
from omnirelay.models.runner.slots import SlotTable
from omnirelay.models.runner.thinker import experts_for
from omnirelay.models.stepping import GuardedLaunch, guarded_launch

__all__ = ["FRAME_COMPILE_ENV", "LaunchedFrames", "TalkerRow", "TalkerRunner", "launch_talker_step"]

#: "1": with a compiled tail, the frame's decoder step compiled too, with the same backend
#: (:meth:`~omnirelay.models.runner.decoder.StaticDecoder.compile_decode`)
FRAME_COMPILE_ENV = "OMNIRELAY_FRAME_COMPILE"


@dataclass(frozen=True, slots=True)
class TalkerRow:
    """A prefill row (``embeds [L, H]``, the conditioning) or a frame row (``embeds
    [1, H]``, this step's text row), on the device. ``repetition_penalty`` and
    ``may_stop`` apply on a runner with ``row_controls``."""

    rid: str
    embeds: torch.Tensor
    sampling: SamplingParams
    generator: torch.Generator
    repetition_penalty: float = 1.0
    may_stop: bool = True


class TalkerRunner:
    """See the module docstring."""

    def __init__(
        self,
        talker: Any,
        *,
        codebook_size: int,
        codec_eos: int,
        num_code_groups: int,
        buckets: Buckets,
        cuda_graphs: bool,
        compile: str | None = None,
        row_controls: bool = False,
        residual: ResidualSampling = DEFAULT_RESIDUAL,
        projection: torch.nn.Module | None = None,
    ) -> None:
        self.talker = talker
        self.row_controls = row_controls
        self.codec_eos = codec_eos
        decoder = talker.model
        weight = decoder.codec_embedding.weight
        self.device, self.dtype = weight.device, weight.dtype
        config = decoder.config
        self.hidden = int(config.hidden_size)
        self.q = num_code_groups
        self.buckets = buckets
        self.slots = SlotTable(buckets.max_num_seqs, buckets.max_model_len)
        self.kv = SlotKV(
            num_layers=int(config.num_hidden_layers),
            num_slots=buckets.max_num_seqs,
            max_len=buckets.max_model_len,
            kv_heads=int(config.num_key_value_heads),
            head_dim=int(config.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.decoder = StaticDecoder(decoder, self.kv)
        self.slots.on_move = self._move_slot
        self.graphs = GraphSet("talker", self.device, enabled=cuda_graphs)
        self._experts = [m for m in decoder.modules() if type(m).__name__.endswith("Experts")]
        vocab = int(config.vocab_size)
        bias = torch.full((vocab,), float("-inf"), device=self.device)
        bias[:codebook_size] = 0.0
        bias[codec_eos] = 0.0  # only codec ids and codec EOS are speech
        self._codec_bias = bias
        mb, mt, dev = buckets.max_batch, buckets.max_piece, self.device
        self._embeds = torch.zeros((mb, mt, self.hidden), dtype=self.dtype, device=dev)
        self._last = torch.zeros((mb, self.hidden), dtype=self.dtype, device=dev)
        self._slot_ids = torch.full((mb,), self.kv.scratch, dtype=torch.long, device=dev)
        self._starts = torch.zeros(mb, dtype=torch.long, device=dev)
        self._counts = torch.ones(mb, dtype=torch.long, device=dev)
        self._temperature = torch.zeros(mb, device=dev)
        self._top_k = torch.zeros(mb, dtype=torch.long, device=dev)
        self._top_p = torch.ones(mb, device=dev)
        self._uniform = torch.zeros((mb, self.q), device=dev)
        #: the summed codec embeddings of each slot's last frame (the next frame's input)
        self._codec_embed = torch.zeros((buckets.max_num_seqs + 1, self.hidden), dtype=self.dtype, device=dev)
        #: which first codes each slot produced (the repetition penalty's history)
        self._seen = torch.zeros((buckets.max_num_seqs + 1, vocab), dtype=torch.bool, device=dev)
        self._penalty = torch.ones(mb, device=dev)
        self._eos_bias = torch.zeros(mb, device=dev)  # -inf: the row may not stop yet
        self.predictor = CodePredictor(
            talker,
            max_batch=mb,
            num_code_groups=self.q,
            codec_bias=bias,
            compile=compile,
            residual=residual,
            projection=projection,
        )
        if compile is not None and os.environ.get(FRAME_COMPILE_ENV, "") == "1":
            self.decoder.compile_decode(compile)
        #: the stream launched steps run on (:meth:`launch`; made on first use)
        self._stream: torch.cuda.Stream | None = None

    # ----------------------------------------------------------------- startup

    def capture_graphs(self) -> None:
        if not self.graphs.enabled:
            return
        if self.predictor.compile_backend is not None:
            print(f"omnirelay: talker: {self._compile_plan()}", file=sys.stderr, flush=True)
        start = time.monotonic()
        with torch.inference_mode():
            for b, t in self.buckets.prefill_shapes():
                self.graphs.capture(("prefill", b, t, None), self._prefill_step(b, t, None))
            for b in self.buckets.batch_sizes:
                self.graphs.capture(("tail", b), self._tail_step(b))
            for b, length in self.buckets.decode_shapes():
                self.graphs.capture(("frame", b, length), self._frame_step(b, length))
                self.graphs.capture(
                    ("frame", b, length, "in_place"), self._frame_step(b, length, in_place=True)
                )
        self.graphs.report.seconds = time.monotonic() - start
        how = ""
        if self.predictor.compile_backend is not None:
            self.predictor.finish_compiling()
            how = f" (code-predictor tail compiled with {self.predictor.compile_backend}"
            how += ", frame's decoder step too)" if self.decoder.decode_backend is not None else ")"
        print(f"omnirelay: {self.graphs.report}{how}", file=sys.stderr, flush=True)

    def _compile_plan(self) -> str:
        """What the capture is about to compile, and whether a cache already holds it."""
        sizes = ", ".join(map(str, self.buckets.batch_sizes))
        what = f"compiling the code-predictor tail with {self.predictor.compile_backend} for batches {sizes}"
        if self.decoder.decode_backend is not None:
            what += (
                f", and the frame's decoder step with {self.decoder.decode_backend} ({FRAME_COMPILE_ENV}=1)"
            )
        return compile_plan(what, self.predictor.compile_cache)

    def _move_slot(self, src: int, dst: int, length: int) -> None:
        """A holder moves from slot ``src`` to ``dst`` (the slot table packs its holders):
        its cached positions, its last frame's codec input and its first-code history.
        The copies go on the current stream, after every step launched on this runner's
        (by stream order, not only because the caller saw the step's event)."""
        if self._stream is not None and torch.cuda.current_stream(self.device) != self._stream:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self.kv.move(src, dst, length)
        self._codec_embed[dst].copy_(self._codec_embed[src])
        self._seen[dst].copy_(self._seen[src])

    # ----------------------------------------------------------------- graph bodies

    def _tail(self, last: torch.Tensor, b: int) -> torch.Tensor:
        """Codec head, first codebook, then the code predictor's ``Q − 1`` codebooks;
        writes each row's summed frame embedding to its slot. Returns ``[B, Q]``."""
        sampling = (self._temperature[:b], self._top_k[:b], self._top_p[:b], self._uniform[:b])
        slots = self._slot_ids[:b]
        if not self.row_controls:
            codes, total = self.predictor(last, *sampling)
        else:
            # Copies kept, each one small ([B, V] of one step): the per-row bias (the codec
            # vocabulary, EOS blocked for a row too short to stop) and the rows' first-code
            # histories, gathered because the tail's rows (new requests and continuing
            # ones, in step order) are not a run of slots.
            bias = self._codec_bias.unsqueeze(0).expand(b, -1).clone()
            bias[:, self.codec_eos] += self._eos_bias[:b]
            seen = self._seen.index_select(0, slots)
            codes, total = self.predictor(last, *sampling, seen=seen, penalty=self._penalty[:b], bias=bias)
            self._seen.index_put_((slots, codes[:, 0]), torch.ones(b, dtype=torch.bool, device=slots.device))
        self._codec_embed.index_copy_(0, slots, total)
        return codes

    def _prefill_step(self, b: int, t: int, attn_len: int | None) -> Step:
        def step() -> dict[str, torch.Tensor]:
            with experts_implementation(self._experts, experts_for(self.device, self.dtype, b, t)):
                last, _ = self.decoder.forward(
                    self._embeds[:b, :t],
                    self._slot_ids[:b],
                    self._starts[:b],
                    self._counts[:b],
                    attn_len=attn_len,
                )
            return {"last": last}

        return step

    def _tail_step(self, b: int) -> Step:
        def step() -> dict[str, torch.Tensor]:
            return {"codes": self._tail(self._last[:b], b)}

        return step

    def _frame_step(self, b: int, attn_len: int, *, in_place: bool = False) -> Step:
        def step() -> dict[str, torch.Tensor]:
            slots = self._slot_ids[:b]
            # Row i holds slot i when in place: its codec input is a view, not a gather.
            codec = self._codec_embed[:b] if in_place else self._codec_embed.index_select(0, slots)
            embeds = (codec + self._embeds[:b, 0]).unsqueeze(1)
            with experts_implementation(self._experts, experts_for(self.device, self.dtype, b, 1)):
                last, _ = self.decoder.decode_forward(
                    embeds, slots, self._starts[:b], self._counts[:b], attn_len=attn_len, in_place=in_place
                )
            return {"last": last}

        return step

    # ----------------------------------------------------------------- host side

    def _set_rows(
        self,
        b: int,
        rows: Sequence[TalkerRow],
        slots: list[int],
        starts: list[int],
        counts: list[int],
        at: Sequence[int] | None = None,
    ) -> None:
        """Row ``at[i]`` (default ``i``) of a ``b``-row launch gets ``slots[i]``,
        ``starts[i]``, ``counts[i]``; the other rows pad (scratch slot, start 0, count 1)."""
        n = len(slots)
        if at is None:
            at = range(n)
        slot_ids, starts_, counts_ = [self.kv.scratch] * b, [0] * b, [1] * b
        for i, row in enumerate(at):
            slot_ids[row], starts_[row], counts_[row] = slots[i], starts[i], counts[i]
        upload(self._slot_ids[:b], torch.tensor(slot_ids, dtype=torch.long))
        upload(self._starts[:b], torch.tensor(starts_, dtype=torch.long))
        upload(self._counts[:b], torch.tensor(counts_, dtype=torch.long))

    def _set_sampling(self, b: int, rows: Sequence[TalkerRow]) -> None:
        """Each row's sampling parameters and ``Q`` uniform numbers (drawn from the row's
        own generator when it samples); padding rows are greedy. Built as lists and copied
        once per buffer: per-element tensor writes cost microseconds each, per row."""
        pad = b - len(rows)
        temperature, top_k, top_p, draws = [], [], [], []
        greedy = torch.zeros(self.q)
        for row in rows:
            params = row.sampling
            sampled = params.temperature > 0
            temperature.append(params.temperature if sampled else 0.0)
            top_k.append(params.top_k if sampled else 0)
            top_p.append(params.top_p if sampled else 1.0)
            draws.append(torch.rand(self.q, generator=row.generator) if sampled else greedy)
        draws += [greedy] * pad
        upload(self._temperature[:b], torch.tensor(temperature + [0.0] * pad))
        upload(self._top_k[:b], torch.tensor(top_k + [0] * pad, dtype=torch.long))
        upload(self._top_p[:b], torch.tensor(top_p + [1.0] * pad))
        upload(self._uniform[:b], torch.stack(draws))
        if self.row_controls:
            penalty = [row.repetition_penalty for row in rows] + [1.0] * pad
            eos_bias = [0.0 if row.may_stop else float("-inf") for row in rows] + [0.0] * pad
            upload(self._penalty[:b], torch.tensor(penalty))
            upload(self._eos_bias[:b], torch.tensor(eos_bias))

    def _prefill_launch(self, launch: Launch, rows: Sequence[TalkerRow]) -> torch.Tensor:
        b, t = launch.batch, launch.tokens
        block = torch.zeros((b, t, self.hidden), dtype=self.dtype, device=self.device)
        for i, piece in enumerate(launch.pieces):
            block[i, : piece.count] = rows[piece.row].embeds[piece.offset : piece.offset + piece.count]
        self._embeds[:b, :t].copy_(block)
        self._set_rows(
            b,
            rows,
            [self.slots.slot(rows[p.row].rid) for p in launch.pieces],
            [p.start for p in launch.pieces],
            [p.count for p in launch.pieces],
        )
        out = self.graphs.run(("prefill", b, t, launch.attn_len), self._prefill_step(b, t, launch.attn_len))
        return out["last"][: len(launch.pieces)]  # the graph's own output: copy it before the next replay

    def _prefill_lasts(self, rows: Sequence[TalkerRow], into: torch.Tensor) -> None:
        """Prefill new requests' conditioning (slots acquired); each row's last hidden
        state goes to ``into[row]``."""
        for row in rows:
            self.slots.check_room(row.rid, 0, row.embeds.shape[0])
            if self.row_controls:
                self._seen[self.slots.slot(row.rid)].zero_()
        for launch in plan_prefill([(0, row.embeds.shape[0]) for row in rows], self.buckets):
            last = self._prefill_launch(launch, rows)
            for i, piece in enumerate(launch.pieces):
                if piece.is_last:
                    into[piece.row].copy_(last[i])
        for row in rows:
            self.slots.set_length(row.rid, row.embeds.shape[0])

    def _frame_lasts(self, rows: Sequence[TalkerRow], into: torch.Tensor) -> list[int]:
        """The Talker step of one frame for each row (prefilled before); each row's last
        hidden state goes to ``into[row]``. Returns the rows' positions."""
        positions = [self.slots.length(row.rid) for row in rows]
        slots = [self.slots.slot(row.rid) for row in rows]
        for launch in plan_decode(positions, self.buckets, slots):
            group = [rows[p.row] for p in launch.pieces]
            b, n = launch.batch, len(group)
            first = launch.pieces[0].row  # a launch holds consecutive rows
            text = torch.cat([row.embeds.reshape(1, -1) for row in group])
            length = int(launch.attn_len or 0)
            at = launch.rows_at
            self._set_rows(
                b, group, [slots[p.row] for p in launch.pieces], [p.start for p in launch.pieces], [1] * n, at
            )
            if at is None:
                self._embeds[:n, 0].copy_(text)
                out = self.graphs.run(("frame", b, launch.attn_len), self._frame_step(b, length))
                into[first : first + n].copy_(out["last"][:n])
            else:  # each row in the launch row of its slot (attention reads the cache in place)
                order = to_device(list(at), self.device)
                self._embeds[:b, 0].index_copy_(0, order, text)
                out = self.graphs.run(
                    ("frame", b, launch.attn_len, "in_place"), self._frame_step(b, length, in_place=True)
                )
                into[first : first + n].copy_(out["last"].index_select(0, order))
        return positions

    def step(self, prefills: Sequence[TalkerRow], decodes: Sequence[TalkerRow]) -> torch.Tensor:
        """New requests' first frames and one more frame of each continuing request:
        ``[len(prefills) + len(decodes), Q]`` codes (CPU), in that order.

        The Talker runs per launch (the new rows' prefill, the continuing rows' frame
        step), then **one** tail samples every row's frame: a step that admits new
        requests costs one code-predictor tail, not one for them and one for the rest."""
        return _cat(self._enqueue(prefills, decodes, _to_host), self.q)

    def launch(self, prefills: Sequence[TalkerRow], decodes: Sequence[TalkerRow]) -> LaunchedFrames:
        """:meth:`step` split in two (docs/design.md §12): on CUDA its work is enqueued on
        this runner's own stream (after what the current stream holds: the rows'
        embeddings, slot moves), the codes copied non-blocking into pinned host memory
        and an event recorded after them; :meth:`LaunchedFrames.codes` reads them once
        the event completed. Nothing here waits for the device. Elsewhere the step runs now."""
        stream = self.stream()
        if stream is None:
            return LaunchedFrames(self.step(prefills, decodes))
        stream.wait_stream(torch.cuda.default_stream(self.device))  # slot moves of releases
        current = torch.cuda.current_stream(self.device)
        if current != stream:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            pieces = self._enqueue(prefills, decodes, _to_pinned_host)
            done = torch.cuda.Event()
            done.record(stream)
        # The rows' device tensors stay referenced until the event completed.
        return LaunchedFrames(pieces, done, (prefills, decodes), self.q)

    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream launched steps run on (made on first use); None off CUDA. The
        caller may prepare a step's rows on it too, so they need not wait for other
        stages' work on the default stream."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = own_stream(self.device)  # not another stage's, nor a capture stream
        return self._stream

    def _enqueue(
        self,
        prefills: Sequence[TalkerRow],
        decodes: Sequence[TalkerRow],
        to_host: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """The step's work on the current stream; its codes in pieces brought to the host
        by ``to_host`` (one per tail launch)."""
        rows = [*prefills, *decodes]
        if not rows:
            return []
        lasts = torch.empty((len(rows), self.hidden), dtype=self.dtype, device=self.device)
        if prefills:
            self._prefill_lasts(prefills, lasts[: len(prefills)])
        positions = self._frame_lasts(decodes, lasts[len(prefills) :]) if decodes else []
        codes = []
        step = self.buckets.max_batch
        for first in range(0, len(rows), step):
            group = rows[first : first + step]
            n = len(group)
            b = self.buckets.batch(n)
            # The tail's input buffer (the graph reads it): [n, H], the frames' last states.
            self._last[:n].copy_(lasts[first : first + n])
            self._set_rows(b, group, [self.slots.slot(r.rid) for r in group], [0] * n, [1] * n)
            self._set_sampling(b, group)
            out = self.graphs.run(("tail", b), self._tail_step(b))
            codes.append(to_host(out["codes"][:n]))
        for row, position in zip(decodes, positions):
            self.slots.set_length(row.rid, position + 1)
        return codes

    def prefill(self, rows: Sequence[TalkerRow]) -> torch.Tensor:
        """Conditioning of new requests (slots acquired) → their first frames ``[n, Q]`` (CPU)."""
        return self.step(rows, [])

    def decode(self, rows: Sequence[TalkerRow]) -> torch.Tensor:
        """One frame for each row (prefilled before) → ``[n, Q]`` codes (CPU)."""
        return self.step([], rows)


def _to_host(codes: torch.Tensor) -> torch.Tensor:
    return codes.to("cpu")


def _to_pinned_host(codes: torch.Tensor) -> torch.Tensor:
    """A copy into pinned host memory, enqueued on the current stream (not waited for)."""
    host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
    host.copy_(codes, non_blocking=True)
    return host


def _cat(pieces: list[torch.Tensor], q: int) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.zeros((0, q), dtype=torch.long)


class LaunchedFrames:
    """A launched Talker step (:meth:`TalkerRunner.launch`): its codes, complete once
    ``done`` (a CUDA event; None: already) completed."""

    def __init__(
        self, codes: torch.Tensor | list[torch.Tensor], done: Any = None, keep: Any = None, q: int = 0
    ) -> None:
        self._pieces = [codes] if isinstance(codes, torch.Tensor) else codes
        self._done = done
        self._keep = keep
        self._q = q

    def is_done(self) -> bool:
        """Has the step's work ended? Polls the event; never blocks."""
        if self._done is None or self._done.query():
            self._done = self._keep = None
            return True
        return False

    def codes(self) -> torch.Tensor:
        """``[rows, Q]`` codes on the host (waits for the event when asked before it ended:
        a step outside a device group)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = self._keep = None
        return _cat(self._pieces, self._q)


#: An executor's rows of a step: ``(prefills, decodes, its own state of the step)``.
Rows = tuple[Sequence[TalkerRow], Sequence[TalkerRow], Any]
#: An executor's results from the runner's codes: ``(batch, state, rows in order, codes)``.
Results = Callable[[list[BatchItem], Any, list[TalkerRow], torch.Tensor], list[ItemResult]]


def launch_talker_step(
    runner: TalkerRunner,
    batch: list[BatchItem],
    rows: Callable[[list[BatchItem]], Rows],
    results: Results,
    release: Callable[[str], None],
) -> GuardedLaunch:
    """A Talker executor's ``launch`` (docs/design.md §12): ``rows(batch)`` prepared and
    the runner's step launched, both on the runner's stream (a new request's conditioning
    then waits for nothing another stage put on the default stream); ``results`` made
    once its event completed. Off CUDA the step runs now. A failure releases the batch,
    as a failing step does (:func:`~omnirelay.models.stepping.guarded_step`)."""

    def start(items: list[BatchItem]) -> GuardedLaunch:
        prefills, decodes, state = rows(items)
        ordered = [*prefills, *decodes]
        frames = runner.launch(prefills, decodes)
        return GuardedLaunch(
            items,
            release,
            is_done=frames.is_done,
            finish=lambda: results(items, state, ordered, frames.codes()),
        )

    stream = runner.stream()
    if stream is None:
        return guarded_launch(batch, start, release)
    with torch.cuda.stream(stream):
        return guarded_launch(batch, start, release)
