"""The Qwen3-Omni Thinker executor: autoregressive text, plus what the Talker consumes.

* :class:`ThinkerExecutor` — the :class:`~omnirelay.engine.interfaces.Executor` of the
  Thinker stage (``execution_type = "ar"``). ``step(batch)`` runs every prefill item on
  its own and **all decode items in one batched forward pass**; ``release(id)`` frees a
  request's KV cache and sampler.
* :func:`create_thinker` — the registry factory: ``create_thinker(**executor_args)``.

Per step and request the result carries the sampled token, its text delta, ``finished``
on an end-of-turn token, and ``next_stage_output`` — exactly the keyword arguments of
:meth:`ThinkerToTalkerProcessor.step <omnirelay.processors.ThinkerToTalkerProcessor.step>`
besides ``chunk_id``/``finished``::

    {"hidden_layers": {0: embeddings [n, H], accept_hidden_layer: hidden states [n, H]},
     "token_ids": all ids so far, including the token sampled this step,
     "tts_bos": [1, H], "tts_eos": [1, H], "tts_pad": [1, H]}

for the ``n`` positions computed this step (the prompt on prefill, the last token on
decode), on the CPU. Two ways to run the model, chosen by ``executor_args.runner``:

* **dynamic** (the CPU default) — each request's KV lives in a
  :class:`~omnirelay.models.kv.KVPool`; a decode step stacks the requests' caches
  left-padded into one batch (reused as is while the batch is unchanged), so a request
  decodes the same tokens alone or batched.
* **static** (the CUDA default) — :class:`~omnirelay.models.runner.ThinkerRunner`: a KV
  slot per request allocated at startup, every prefill of a step in one padded launch,
  decode steps replayed from CUDA graphs captured at startup.

Audio input (docs/protocol.md §1.9): a request whose ``inputs`` carry audio clips
(:func:`~omnirelay.models.inputs.read_audio_inputs`) has them encoded once, on its first
prefill, by the Thinker's own audio tower (:class:`~omnirelay.models.qwen3_omni.audio.QwenAudioEncoder`);
the rows replace the embeddings of the prompt's ``<|audio_pad|>`` positions, in order,
the way Qwen3-Omni's processor lays them out (``<|audio_start|>`` n × ``<|audio_pad|>``
``<|audio_end|>``). Audio tokens take one text position each, as Qwen3-Omni's rope index
gives them. On the static runner a prefill launch that holds audio tokens runs eagerly
(its embeddings come from outside the captured graph).

Image input (docs/protocol.md §1.9, :mod:`omnirelay.models.qwen3_omni.vision`), on the dynamic
runner: a request whose ``inputs`` carry images has them encoded once, on its first
prefill, by the Thinker's own vision tower (:class:`~omnirelay.models.qwen3_omni.vision.QwenImageEncoder`).
As in ``transformers``' Qwen3-Omni Thinker, the merged vision rows replace the embeddings
of the ``<|image_pad|>`` positions in order, the tower's deepstack features are added to
those positions' hidden states after the first text layers, and the prompt takes 3-D
rotary positions (:func:`~omnirelay.models.qwen3_omni.vision.mrope_positions`): every later
position — the rest of a chunked prefill, each decode step — is its index plus the
request's rope delta. The static runner takes no image input (its captured decoder has
one position per token and no deepstack inputs): such a request fails with a message
that says so, and the server refuses it up front. Video input is not wired.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.detokenizer import IncrementalDetokenizer
from omnirelay.models.kv import KVPool, cache_keyword
from omnirelay.models.prepared import cache_root
from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.thinker_media import ThinkerMedia
from omnirelay.models.qwen3_omni.vision import (
    ImageEmbeds,
    VisionLayout,
    layout_of_checkpoint,
    mrope_positions,
)
from omnirelay.models.runner import Buckets, Row, ThinkerRunner
from omnirelay.models.runner.graphs import own_stream
from omnirelay.models.runner.memory import provision_decoder
from omnirelay.models.runner.predictor import use_compile_cache
from omnirelay.models.runner.thinker import decode_compile_backend
from omnirelay.models.sampling import make_generator, sample_rows, suppress
from omnirelay.models.stepping import GuardedLaunch, guarded_launch, guarded_step

__all__ = ["ThinkerExecutor", "create_thinker"]


@dataclass(slots=True)
class _Sequence:
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    #: the request's audio-token embeddings, in prompt order (None: no audio input)
    audio: torch.Tensor | None = None
    #: the request's image tokens through the vision tower (None: no image input)
    images: ImageEmbeds | None = None
    #: the prompt's 3-D rotary positions ``[3, L]`` (None: one position per token)
    mrope: torch.Tensor | None = None
    #: what positions past ``mrope`` add to their index
    rope_delta: int = 0
    #: a prompt prefilled in pieces (docs/design.md §12): the hidden rows of its earlier
    #: pieces, per layer, from position ``pending_from``; handed on with the last piece's
    pending: dict[int, torch.Tensor] | None = None
    pending_from: int = 0


class ThinkerExecutor:
    """Runs the Thinker's text model for a batch of requests; see the module docstring."""

    execution_type = "ar"
    supports_batching = True
    #: takes a prompt in pieces over several steps (a stage's ``max_prefill_piece_tokens``)
    supports_prefill_pieces = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        accept_hidden_layer: int,
        tts_token_ids: tuple[int, int, int],
        eos_token_ids: frozenset[int],
        static: Buckets | None = None,
        cuda_graphs: bool = True,
        vision: VisionLayout | None = None,
        sized: bool = False,
    ) -> None:
        self.model = model  # Qwen3OmniMoeThinkerForConditionalGeneration
        self.tokenizer = tokenizer
        # The text decoder: ``model.model.language_model`` (transformers >= 5.2x) or
        # ``model.model`` itself (earlier 5.x, where the encoders hang off the Thinker).
        self._text = getattr(model.model, "language_model", model.model)
        self._cache_kw = cache_keyword(self._text)
        self._lm_head = model.lm_head
        num_layers = int(self._text.config.num_hidden_layers)
        if not 0 <= accept_hidden_layer <= num_layers:
            raise ModelError(
                f"accept_hidden_layer {accept_hidden_layer} is outside the Thinker's hidden states 0..{num_layers}"
            )
        self.accept_hidden_layer = accept_hidden_layer
        self._layers = sorted({0, accept_hidden_layer})
        self.device = next(model.parameters()).device
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        vocab = int(self._text.config.vocab_size)
        # Rows past the tokenizer are padding of the embedding matrix, never text.
        self._num_text_ids = min(vocab, len(tokenizer))
        with torch.inference_mode():
            ids = torch.tensor(tts_token_ids, dtype=torch.long, device=self.device)
            self._tts_rows = self._text.embed_tokens(ids).detach()
        #: Where the rows handed to the Talker live: the host, or (on a GPU-direct edge,
        #: see keep_outputs_on_device) this device.
        self._out_device: torch.device | None = None
        self._tts = self._tts_on(torch.device("cpu"))
        self._kv = KVPool()
        self._seqs: dict[str, _Sequence] = {}
        #: the request's audio clips and images, encoded by the Thinker's own towers
        self.media = ThinkerMedia(model, vision)
        self.audio_token_id = self.media.audio_token_id
        self.image_token_id = self.media.image_token_id
        self.vision = vision
        #: the static runner (None: the dynamic KVPool path)
        self.runner: ThinkerRunner | None = None
        #: where :meth:`launch` enqueues a decode (created on its first CUDA launch)
        self._stream: Any | None = None
        if static is not None:
            self._provision(static, cuda_graphs=cuda_graphs, sized=sized)

    def _provision(self, static: Buckets, *, cuda_graphs: bool, sized: bool) -> None:
        """The static runner for ``static``'s slots, or (``sized``, in a process that sizes
        KV from memory: :mod:`omnirelay.models.runner.memory`) for the slots that fit,
        built once every stage of the process has its weights."""
        compile = decode_compile_backend(self.device, cuda_graphs)  # OMNIRELAY_THINKER_COMPILE
        if compile == "inductor":
            use_compile_cache(cache_root())

        def build(num_slots: int) -> None:
            self.runner = ThinkerRunner(
                self._text,
                self._lm_head,
                capture_layers=tuple(self._layers),
                num_text_ids=self._num_text_ids,
                buckets=dataclasses.replace(static, max_num_seqs=num_slots),
                cuda_graphs=cuda_graphs,
                compile=compile,
            )
            self.runner.keep_hidden_on_device = self._out_device is not None

        def capture() -> None:
            assert self.runner is not None
            self.runner.capture_graphs()

        provision_decoder(
            device=self.device,
            static=static,
            sized=sized,
            config=self._text.config,
            itemsize=self._lm_head.weight.element_size(),
            model=self.model,
            build=build,
            capture=capture,
        )

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, args: ModelArgs | None = None) -> ThinkerExecutor:
        """Load the Thinker part and the tokenizer of ``checkpoint``; ``args`` chooses the
        runner (default: the dynamic one)."""
        config = checkpoint.config
        tokenizer = checkpoint.load_tokenizer()
        model = checkpoint.load_thinker()
        eos = {int(config.im_end_token_id)}
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        if isinstance(endoftext, int) and endoftext >= 0 and endoftext != tokenizer.unk_token_id:
            eos.add(endoftext)
        return cls(
            model,
            tokenizer,
            accept_hidden_layer=int(config.talker_config.accept_hidden_layer),
            tts_token_ids=(
                int(config.tts_bos_token_id),
                int(config.tts_eos_token_id),
                int(config.tts_pad_token_id),
            ),
            eos_token_ids=frozenset(eos),
            static=_static_buckets(args),
            cuda_graphs=args.cuda_graphs if args is not None else False,
            vision=layout_of_checkpoint(config, checkpoint.path),
            sized=args is not None and args.max_num_seqs is None,
        )

    # ----------------------------------------------------------------- Executor

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """One step for every item (engine thread): prefills one by one, decodes batched."""
        return guarded_step(batch, self._step, self.release)

    def launch(self, batch: list[BatchItem]) -> GuardedLaunch:
        """The step split in two in a device group (docs/design.md §12): a batch of greedy
        decodes on the static runner is enqueued on this executor's own CUDA stream, its
        ids copied without blocking, and completed once its event has; anything else (a
        prefill, a sampled row, the dynamic path) runs now."""
        runner = self.runner
        if runner is None or not all(
            self._is_decode(item) and item.sampling.temperature <= 0 for item in batch
        ):
            return GuardedLaunch(batch, self.release, results=self.step(batch))
        if self.device.type == "cuda" and self._stream is None:
            self._stream = own_stream(self.device)  # not another stage's, nor a graph set's capture stream

        def launch(items: list[BatchItem]) -> GuardedLaunch:
            assert runner is not None
            seqs = [self._seqs[item.internal_id] for item in items]
            rows = [
                Row(item.internal_id, item.num_computed_tokens, item.input_token_ids[:1], item.sampling, None)
                for item in items
            ]
            run = runner.launch_decode(rows, self._stream)

            def finish() -> list[ItemResult]:
                results = []
                for item, seq, out in zip(items, seqs, run.outputs(), strict=True):
                    assert out.token is not None
                    results.append(self._result(item, seq, out.token, out.hidden))
                return results

            return GuardedLaunch(items, self.release, is_done=run.is_done, finish=finish)

        return guarded_launch(batch, launch, self.release)

    def _step(self, batch: list[BatchItem]) -> list[ItemResult]:
        results: dict[str, ItemResult] = {}
        decodes: list[BatchItem] = []
        prefills: list[BatchItem] = []
        for item in batch:
            if self._is_decode(item):
                decodes.append(item)
            elif self.runner is None:
                results[item.internal_id] = self._prefill(item)
            else:
                prefills.append(item)
        if prefills:
            results.update(self._prefill_static(prefills))
        if decodes:
            results.update(self._decode(decodes) if self.runner is None else self._decode_static(decodes))
        return [results[item.internal_id] for item in batch]

    @property
    def num_audio_clips(self) -> int:
        """Audio clips encoded so far (observable in tests and health)."""
        return self.media.num_audio_clips

    @property
    def num_images(self) -> int:
        """Images encoded so far (observable in tests and health)."""
        return self.media.num_images

    def release(self, internal_id: str) -> None:
        """Free the request's KV cache and sampler (idempotent)."""
        self._kv.drop(internal_id)
        if self.runner is not None:
            self.runner.slots.release(internal_id)
        self._seqs.pop(internal_id, None)

    def _cached(self, rid: str) -> int:
        return self._kv.length(rid) if self.runner is None else self.runner.slots.length(rid)

    def num_live_requests(self) -> int:
        """Requests holding state (for leak audits)."""
        return len(self._seqs)

    # ----------------------------------------------------------------- steps

    def _is_decode(self, item: BatchItem) -> bool:
        seq = self._seqs.get(item.internal_id)
        return (
            seq is not None
            and seq.pending is None  # else the next piece of a split prompt, one token or more
            and len(item.input_token_ids) == 1
            and item.num_computed_tokens > 0
            and self._cached(item.internal_id) == item.num_computed_tokens
        )

    def _sequence(self, item: BatchItem) -> _Sequence:
        """The request's sampler and detokenizer, made on its first prefill. A prefill
        from position 0 (a fresh start or a full recompute) first drops any old state; one
        from a later position keeps what was cached before it."""
        rid = item.internal_id
        past = item.num_computed_tokens
        if past == 0:
            self.release(rid)
        elif rid not in self._seqs or self._cached(rid) < past:
            raise ModelError(
                f"request {rid!r}: the engine reports {past} computed tokens but the Thinker "
                f"holds {self._cached(rid)}; it was released or never prefilled"
            )
        else:
            if self.runner is None:
                self._kv.truncate(rid, past)
            else:
                self.runner.slots.truncate(rid, past)
            _trim_pending(self._seqs[rid], past)
        if not item.input_token_ids:
            raise ModelError(f"request {rid!r}: nothing to compute (empty input_token_ids)")
        seq = self._seqs.get(rid)
        if seq is None:
            seq = _Sequence(
                generator=make_generator(item.sampling.seed),
                detokenizer=IncrementalDetokenizer(self.tokenizer, item.all_token_ids),
                audio=self.media.audio(item),
                images=self.media.images(item, static=self.runner is not None),
            )
            if seq.images is not None and self.image_token_id is not None and self.vision is not None:
                seq.mrope, seq.rope_delta = mrope_positions(
                    item.all_token_ids, self.image_token_id, seq.images.grids, self.vision.merge_size
                )
            self._seqs[rid] = seq
        return seq

    def _audio_rows(self, seq: _Sequence, item: BatchItem) -> tuple[list[int], torch.Tensor] | None:
        """The static runner's form of :meth:`_prompt_embeds`: the audio positions of this
        prefill piece and their rows."""
        audio_id = self.audio_token_id
        if seq.audio is None or audio_id is None:
            return None
        positions = [j for j, t in enumerate(item.input_token_ids) if t == audio_id]
        if not positions:
            return None
        first = item.all_token_ids[: item.num_computed_tokens].count(audio_id)
        return positions, seq.audio[first : first + len(positions)]

    def _prompt_embeds(self, seq: _Sequence, item: BatchItem, ids: torch.Tensor) -> dict[str, Any]:
        """The text model's inputs of this prefill piece: ``input_ids``, or
        ``inputs_embeds`` with its audio and image positions filled in, plus the deepstack
        inputs (``visual_pos_masks``, ``deepstack_visual_embeds``) when it holds image tokens."""
        if seq.audio is None and seq.images is None:
            return {"input_ids": ids}
        embeds = self._text.embed_tokens(ids)
        kwargs: dict[str, Any] = {"inputs_embeds": embeds}
        done = item.all_token_ids[: item.num_computed_tokens]
        for token, rows in ((self.audio_token_id, seq.audio), (self.image_token_id, seq.images)):
            if rows is None or token is None:
                continue
            mask = torch.eq(ids[0], token)
            count = int(mask.sum())
            if not count:
                continue
            first = done.count(token)
            if isinstance(rows, ImageEmbeds):
                piece = slice(first, first + count)
                embeds[0, mask] = rows.rows[piece].to(embeds.device, embeds.dtype)
                kwargs["visual_pos_masks"] = mask.view(1, -1)
                kwargs["deepstack_visual_embeds"] = [feat[piece] for feat in rows.deepstack]
            else:
                embeds[0, mask] = rows[first : first + count].to(embeds.device, embeds.dtype)
        return kwargs

    def _positions(self, seq: _Sequence, past: int, n: int) -> torch.Tensor:
        """``[4, 1, n]`` position ids of positions ``past .. past + n``: the text row (the
        causal mask's), then the temporal, height and width rows of the rotary embedding."""
        text = torch.arange(past, past + n, device=self.device)
        if seq.mrope is None:
            return text.view(1, 1, n).expand(4, 1, n)
        rope = (text + seq.rope_delta).view(1, n).repeat(3, 1)
        known = max(0, min(n, seq.mrope.shape[1] - past))
        rope[:, :known] = seq.mrope[:, past : past + known].to(self.device)
        return torch.cat([text.view(1, n), rope]).view(4, 1, n)

    def _prefill(self, item: BatchItem) -> ItemResult:
        """A prompt (or a recompute, or the rest of a chunked prefill) of one request."""
        rid = item.internal_id
        past = item.num_computed_tokens
        seq = self._sequence(item)
        ids = torch.tensor([item.input_token_ids], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        cache = self._kv.prefill_cache(rid)
        out = self._text(
            **self._prompt_embeds(seq, item, ids),
            position_ids=self._positions(seq, past, n),
            **{self._cache_kw: cache},
            use_cache=True,
            output_hidden_states=self._layers,
        )
        self._kv.store(rid, cache)
        layers = self._rows(out.hidden_states, 0)
        if past + n < len(item.all_token_ids):
            return _piece(item, seq, layers)
        logits = self._logits(out.last_hidden_state[:, -1])
        (token,) = sample_rows(logits, [item.sampling], [seq.generator])
        return self._result(item, seq, token, _with_pending(seq, layers))

    def _prefill_static(self, items: list[BatchItem]) -> dict[str, ItemResult]:
        """Every prefill of the step on the static runner (one or a few launches)."""
        assert self.runner is not None
        rows = []
        for item in items:
            seq = self._sequence(item)
            self.runner.slots.acquire(item.internal_id)
            past = item.num_computed_tokens
            is_complete = past + len(item.input_token_ids) >= len(item.all_token_ids)
            rows.append(
                Row(
                    rid=item.internal_id,
                    start=past,
                    token_ids=item.input_token_ids,
                    sampling=item.sampling,
                    generator=seq.generator if is_complete else None,
                    embeds=self._audio_rows(seq, item),
                )
            )
        outs = self.runner.run(rows, decode=False)
        results = {}
        for item, out in zip(items, outs):
            seq = self._seqs[item.internal_id]
            if out.token is None:  # a piece of a prompt split across steps: nothing sampled yet
                results[item.internal_id] = _piece(item, seq, out.hidden)
            else:
                results[item.internal_id] = self._result(item, seq, out.token, _with_pending(seq, out.hidden))
        return results

    def _decode_static(self, items: list[BatchItem]) -> dict[str, ItemResult]:
        assert self.runner is not None
        seqs = [self._seqs[item.internal_id] for item in items]
        rows = [
            Row(
                rid=item.internal_id,
                start=item.num_computed_tokens,
                token_ids=item.input_token_ids[:1],
                sampling=item.sampling,
                generator=seq.generator,
            )
            for item, seq in zip(items, seqs)
        ]
        outs = self.runner.run(rows, decode=True)
        results = {}
        for item, seq, out in zip(items, seqs, outs):
            assert out.token is not None
            results[item.internal_id] = self._result(item, seq, out.token, out.hidden)
        return results

    def _decode(self, items: list[BatchItem]) -> dict[str, ItemResult]:
        """One new token for each item, in one forward pass."""
        ids = [item.internal_id for item in items]
        tokens = torch.tensor(
            [[item.input_token_ids[0]] for item in items], dtype=torch.long, device=self.device
        )
        cache, mask, positions = self._kv.decode_batch(ids)
        b = len(items)
        # After an image the rotary positions run ahead of (or behind) the text position
        # by the request's rope delta; the text row stays the causal mask's.
        deltas = torch.tensor([self._seqs[i].rope_delta for i in ids], device=positions.device).view(b, 1)
        rope = (positions + deltas).view(1, b, 1).expand(3, b, 1)
        out = self._text(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=torch.cat([positions.view(1, b, 1), rope]),
            **{self._cache_kw: cache},
            use_cache=True,
            output_hidden_states=self._layers,
        )
        self._kv.commit_decode(ids)
        logits = self._logits(out.last_hidden_state[:, -1])
        seqs = [self._seqs[i] for i in ids]
        sampled = sample_rows(logits, [item.sampling for item in items], [s.generator for s in seqs])
        return {
            item.internal_id: self._result(item, seq, token, self._rows(out.hidden_states, row))
            for row, (item, seq, token) in enumerate(zip(items, seqs, sampled))
        }

    # ----------------------------------------------------------------- helpers

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(last_hidden).float()
        return suppress(logits, self._num_text_ids, logits.shape[-1])

    def _result(
        self, item: BatchItem, seq: _Sequence, token: int, layers: dict[int, torch.Tensor]
    ) -> ItemResult:
        finished = token in self.eos_token_ids
        text = seq.detokenizer.push([token])
        if finished:
            text += seq.detokenizer.flush()
        return ItemResult(
            internal_id=item.internal_id,
            token_ids=[token],
            finished=finished,
            text=text or None,
            next_stage_output=self._stage_output(layers, [*item.all_token_ids, token]),
        )

    def keep_outputs_on_device(self, enabled: bool) -> None:
        """Hand the Talker its rows on this device (the edge to it is GPU-direct: the
        connector moves them device to device, or straight from the device into its slot
        when they are small) instead of copying them to the host here. A no-op on the CPU."""
        self._out_device = self.device if enabled and self.device.type == "cuda" else None
        self._tts = self._tts_on(self._out_device or torch.device("cpu"))
        if self.runner is not None:
            self.runner.keep_hidden_on_device = self._out_device is not None

    def _tts_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        rows = self._tts_rows.to(device)
        return {"tts_bos": rows[0:1], "tts_eos": rows[1:2], "tts_pad": rows[2:3]}

    def _rows(self, hidden_states: tuple[torch.Tensor | None, ...], row: int) -> dict[int, torch.Tensor]:
        """Row ``row`` of the captured hidden states, per layer: on the CPU, or a copy on
        this device (the step's buffers are reused by the next step) on a GPU-direct edge."""
        layers: dict[int, torch.Tensor] = {}
        for layer in self._layers:
            rows = hidden_states[layer]
            assert rows is not None, f"hidden state {layer} was not captured"
            if self._out_device is None:
                layers[layer] = rows[row].detach().to("cpu")
            else:
                layers[layer] = rows[row].detach().clone()
        return layers

    def _stage_output(self, layers: dict[int, torch.Tensor], token_ids: list[int]) -> dict[str, Any]:
        return {"hidden_layers": dict(layers), "token_ids": token_ids, **self._tts}


def _piece(item: BatchItem, seq: _Sequence, layers: dict[int, torch.Tensor]) -> ItemResult:
    """A piece of a prompt that is not its last: its rows wait for the last piece's, and
    nothing is sampled or handed on (the Talker gets the prompt's rows at once, as after
    a prefill in one step)."""
    if seq.pending is None:
        seq.pending, seq.pending_from = dict(layers), item.num_computed_tokens
    else:
        seq.pending = {layer: torch.cat([seq.pending[layer], rows]) for layer, rows in layers.items()}
    return ItemResult(internal_id=item.internal_id, is_partial_prefill=True)


def _with_pending(seq: _Sequence, layers: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The last piece's rows after the earlier pieces' (and the buffer emptied)."""
    pending, seq.pending = seq.pending, None
    if pending is None:
        return layers
    return {layer: torch.cat([pending[layer], rows]) for layer, rows in layers.items()}


def _trim_pending(seq: _Sequence, past: int) -> None:
    """A step from position ``past``: the earlier pieces' rows past it are recomputed."""
    if seq.pending is None:
        return
    keep = past - seq.pending_from
    seq.pending = {layer: rows[:keep] for layer, rows in seq.pending.items()} if keep > 0 else None


def _static_buckets(args: ModelArgs | None) -> Buckets | None:
    if args is None or not args.uses_static_runner():
        return None
    return Buckets(max_num_seqs=args.num_slots, max_model_len=args.max_model_len)


def create_thinker(**executor_args: Any) -> ThinkerExecutor:
    """Registry factory of ``qwen3_omni.thinker`` (keys: see :class:`ModelArgs`)."""
    args = ModelArgs.from_executor_args(executor_args)
    return ThinkerExecutor.from_checkpoint(open_checkpoint(args), args)
