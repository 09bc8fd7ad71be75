"""The Qwen3-Omni Talker executor: one codec frame of Q codebooks per step.

* :class:`TalkerExecutor` — the :class:`~omnirelay.engine.interfaces.Executor` of the
  Talker stage (``execution_type = "ar"``). Each step of a request consumes what the
  engine committed from the Thinker (``BatchItem.additional_information``: a Thinker →
  Talker ``OmniPayload``, docs/protocol.md §5.1; ``is_upstream_exhausted`` once the Thinker's stream
  ended), runs the Talker decoder for the first codebook, then the code predictor for the
  other ``Q − 1``. ``release(id)`` frees the request.
* :func:`create_talker` — the registry factory: ``create_talker(**executor_args)``.

Step semantics (the reference model's ``generate``, split into steps):

* **first step** — needs chunk 0 (or a complete input in ``BatchItem.inputs`` with the
  same layout). Its prefill is the user turn (text embeddings projected, multimodal
  positions from the accept-layer hidden states) followed by the 9-row assistant
  bootstrap: the turn header, 4 × TTS pad, TTS BOS and the first text token, summed with
  the codec rows (no-think, think BOS/EOS, speaker, codec pad, codec BOS).
* **later steps** — input = sum of the previous frame's codec embeddings + the next
  text row: the next Thinker token of the queue, else TTS EOS once the Thinker has
  finished, else TTS pad. The engine runs one Talker step per committed chunk until the
  Thinker is exhausted (docs/protocol.md §4.9), which keeps text and codec in lockstep — then the
  steps equal the reference's one-shot ``generate`` exactly (tested). A step with an
  empty queue before the Thinker finished (an engine that does not keep lockstep) falls
  back to TTS pad and is counted in ``num_starved_steps``.
* **codes** — the first codebook is sampled with the request's sampling parameters from
  the codec ids ``[0, codebook_size)`` plus codec EOS; the residual codebooks come from
  the code predictor (greedy when the request is greedy, else top-k 50 / top-p 0.8 as
  the reference). Codec EOS finishes the request (``finished=True``).

``ItemResult.token_ids`` is ``[first codebook]``; ``next_stage_output`` is the frame
``[1, Q]`` (int64, CPU) for the Talker → Code2Wav processor — on the EOS step the frame
``[EOS, 0, …]``, which that processor's stop filter drops. Decode steps of all requests
run as one batched forward pass (:class:`~omnirelay.models.kv.KVPool`); the code
predictor runs batched over every request of the step. A preempted Talker request cannot
be recomputed (its Thinker input was consumed): that is an error, not a silent restart.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omnirelay.engine.interfaces import BatchItem, ItemResult, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.kv import KVPool, cache_keyword
from omnirelay.models.prepared import cache_root
from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.talker_input import (
    ThinkerChunk,
    assistant_start,
    parse_payload,
    user_positions,
)
from omnirelay.models.qwen3_omni.talker_text import TextConditioner
from omnirelay.models.runner import Buckets, TalkerRow, TalkerRunner
from omnirelay.models.runner.memory import provision_decoder
from omnirelay.models.runner.predictor import use_compile_cache
from omnirelay.models.runner.talker import launch_talker_step
from omnirelay.models.sampling import make_generator, sample_rows, suppress
from omnirelay.models.stepping import GuardedLaunch, guarded_step

__all__ = [
    "CODE_PREDICTOR_TOP_K",
    "CODE_PREDICTOR_TOP_P",
    "DEFAULT_SPEAKER",
    "TalkerExecutor",
    "TalkerSpec",
    "TextConditioner",
    "create_talker",
]

#: The reference samples the residual codebooks with these (when the Talker samples).
CODE_PREDICTOR_TOP_K = 50
CODE_PREDICTOR_TOP_P = 0.8
DEFAULT_SPEAKER = "ethan"


@dataclass(frozen=True, slots=True)
class TalkerSpec:
    """The token ids the Talker's input layout uses (from the checkpoint's config)."""

    im_start_token_id: int
    assistant_token_id: int
    user_token_id: int
    multimodal_token_ids: frozenset[int]
    codec_eos_token_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_ids: dict[str, int]
    num_code_groups: int
    codebook_size: int

    @classmethod
    def from_config(cls, config: Any) -> TalkerSpec:
        talker, thinker = config.talker_config, config.thinker_config
        return cls(
            im_start_token_id=int(config.im_start_token_id),
            assistant_token_id=int(config.assistant_token_id),
            user_token_id=int(config.user_token_id),
            multimodal_token_ids=frozenset(
                int(t) for t in (thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id)
            ),
            codec_eos_token_id=int(talker.codec_eos_token_id),
            codec_pad_id=int(talker.codec_pad_id),
            codec_bos_id=int(talker.codec_bos_id),
            codec_nothink_id=int(talker.codec_nothink_id),
            codec_think_bos_id=int(talker.codec_think_bos_id),
            codec_think_eos_id=int(talker.codec_think_eos_id),
            speaker_ids={str(k).lower(): int(v) for k, v in (talker.speaker_id or {}).items()},
            num_code_groups=int(talker.num_code_groups),
            codebook_size=int(talker.code_predictor_config.vocab_size),
        )


@dataclass(slots=True)
class _Sequence:
    generator: torch.Generator
    tts_eos: torch.Tensor  # [1, H] (Talker width)
    tts_pad: torch.Tensor
    text_rows: deque[torch.Tensor] = field(default_factory=deque)  # [1, H] each
    is_upstream_finished: bool = False
    is_eos_fed: bool = False
    is_finished: bool = False
    #: summed codec embeddings of the last frame [1, H]: the next step's input (plus text)
    codec_embed: torch.Tensor | None = None
    num_frames: int = 0
    num_starved_steps: int = 0


class TalkerExecutor:
    """Runs the Talker and its code predictor for a batch of requests."""

    execution_type = "ar"
    supports_batching = True

    def __init__(
        self,
        model: Any,
        spec: TalkerSpec,
        *,
        text_input: TextConditioner | None = None,
        static: Buckets | None = None,
        cuda_graphs: bool = True,
        compile: str | None = None,
        sized: bool = False,
    ) -> None:
        self.model = model  # Qwen3OmniMoeTalkerForConditionalGeneration
        self.spec = spec
        #: text mode (a TTS pipeline without a Thinker): chunk 0 from the request's own prompt
        self.text_input = text_input
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._decoder = model.model
        self._cache_kw = cache_keyword(self._decoder)
        self._predictor_cache_kw = cache_keyword(model.code_predictor.model)
        self._codec_embedding = model.get_input_embeddings()
        self._predictor = model.code_predictor
        self._vocab = int(model.config.text_config.vocab_size)
        if not spec.codebook_size <= spec.codec_eos_token_id < self._vocab:
            raise ModelError(
                f"codec EOS {spec.codec_eos_token_id} must lie in the Talker's special ids "
                f"[{spec.codebook_size}, {self._vocab})"
            )
        self._kv = KVPool()
        self._seqs: dict[str, _Sequence] = {}
        #: the static runner (None: the dynamic KVPool path)
        self.runner: TalkerRunner | None = None
        if static is not None:
            self._provision(static, cuda_graphs=cuda_graphs, compile=compile, sized=sized)

    def _provision(self, static: Buckets, *, cuda_graphs: bool, compile: str | None, sized: bool) -> None:
        """The static runner for ``static``'s slots, or (``sized``) for the slots that fit
        the memory the process's stages leave (:mod:`omnirelay.models.runner.memory`)."""

        def build(num_slots: int) -> None:
            self.runner = TalkerRunner(
                self.model,
                codebook_size=self.spec.codebook_size,
                codec_eos=self.spec.codec_eos_token_id,
                num_code_groups=self.spec.num_code_groups,
                buckets=dataclasses.replace(static, max_num_seqs=num_slots),
                cuda_graphs=cuda_graphs,
                compile=compile,
            )

        def capture() -> None:
            assert self.runner is not None
            self.runner.capture_graphs()

        config = self._decoder.config
        itemsize = self.dtype.itemsize
        provision_decoder(
            device=self.device,
            static=static,
            sized=sized,
            config=config,
            itemsize=itemsize,
            model=self.model,
            build=build,
            capture=capture,
            # per slot besides its KV: its last frame's codec embedding, its first codes seen so far
            extra_slot_bytes=int(config.hidden_size) * itemsize + int(config.vocab_size),
        )

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, *, text_input: bool = False, args: ModelArgs | None = None
    ) -> TalkerExecutor:
        spec = TalkerSpec.from_config(checkpoint.config)
        conditioner = TextConditioner.from_checkpoint(checkpoint, spec) if text_input else None
        static = None
        compile = None
        if args is not None and args.uses_static_runner():
            static = Buckets(max_num_seqs=args.num_slots, max_model_len=args.max_model_len)
            if args.compiles():
                use_compile_cache(cache_root())
                compile = "inductor"
        return cls(
            checkpoint.load_talker(),
            spec,
            text_input=conditioner,
            static=static,
            cuda_graphs=args.cuda_graphs if args is not None else False,
            compile=compile,
            sized=args is not None and args.max_num_seqs is None,
        )

    @property
    def num_codebooks(self) -> int:
        return self.spec.num_code_groups

    # ----------------------------------------------------------------- Executor

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """One codec frame per item (engine thread)."""
        return guarded_step(batch, self._step, self.release)

    def release(self, internal_id: str) -> None:
        """Free the request's KV cache and queued Thinker rows (idempotent)."""
        self._kv.drop(internal_id)
        if self.runner is not None:
            self.runner.slots.release(internal_id)
        self._seqs.pop(internal_id, None)

    def num_live_requests(self) -> int:
        return len(self._seqs)

    def num_starved_steps(self, internal_id: str) -> int:
        seq = self._seqs.get(internal_id)
        return 0 if seq is None else seq.num_starved_steps

    # ----------------------------------------------------------------- one step

    def _step(self, batch: list[BatchItem]) -> list[ItemResult]:
        if self.runner is not None:
            return self._step_static(batch)
        hidden: dict[str, torch.Tensor] = {}  # last hidden state [1, H]
        decodes: list[tuple[BatchItem, _Sequence]] = []
        for item in batch:
            seq = self._seqs.get(item.internal_id)
            if seq is None:
                hidden[item.internal_id] = self._prefill(item)
            else:
                if seq.is_finished:
                    raise ModelError(f"request {item.internal_id!r}: stepped after its codec EOS")
                self._absorb(item, seq)
                decodes.append((item, seq))
        if decodes:
            hidden.update(self._decode(decodes))

        seqs = [self._seqs[item.internal_id] for item in batch]
        last = torch.cat([hidden[item.internal_id] for item in batch], dim=0)  # [B, H]
        logits = self.model.codec_head(last).float()
        # Only codec ids and codec EOS are speech; the other special ids are input markers.
        suppress(logits, self.spec.codebook_size, self._vocab, keep=(self.spec.codec_eos_token_id,))
        params = [item.sampling for item in batch]
        gens = [seq.generator for seq in seqs]
        first = sample_rows(logits, params, gens)
        speaking = [b for b, token in enumerate(first) if token != self.spec.codec_eos_token_id]
        frames = torch.zeros((len(batch), self.num_codebooks), dtype=torch.long)
        frames[:, 0] = torch.tensor(first, dtype=torch.long)
        if speaking:
            idx = torch.tensor(speaking, device=self.device)
            codes, codec_embed = self._predict_residuals(
                last.index_select(0, idx),
                [first[b] for b in speaking],
                [params[b] for b in speaking],
                [gens[b] for b in speaking],
            )
            frames[speaking] = codes.cpu()
            for row, b in enumerate(speaking):
                seqs[b].codec_embed = codec_embed[row : row + 1]
                seqs[b].num_frames += 1

        return self._results(batch, seqs, frames)

    def _results(
        self, batch: list[BatchItem], seqs: list[_Sequence], frames: torch.Tensor
    ) -> list[ItemResult]:
        results = []
        for b, (item, seq) in enumerate(zip(batch, seqs)):
            first = int(frames[b, 0])
            is_eos = first == self.spec.codec_eos_token_id
            seq.is_finished = is_eos
            results.append(
                ItemResult(
                    internal_id=item.internal_id,
                    token_ids=[first],
                    finished=is_eos,
                    next_stage_output=frames[b : b + 1].clone(),
                )
            )
        return results

    def _step_static(self, batch: list[BatchItem]) -> list[ItemResult]:
        """One frame per item on the static runner: new requests' conditioning in one
        batched prefill, the others' Talker step in one frame graph per bucket, then one
        code-predictor tail for every row."""
        runner = self.runner
        assert runner is not None
        prefills, decodes, seqs = self._static_rows(batch)
        made = runner.step(prefills, decodes)  # one code-predictor tail for all rows
        return self._static_results(batch, seqs, [*prefills, *decodes], made)

    def launch(self, batch: list[BatchItem]) -> GuardedLaunch:
        """The step split in two (docs/design.md §12; as the Qwen3-TTS Talker's), on the
        static runner; the dynamic one steps at once."""
        if self.runner is None:
            return GuardedLaunch(batch, self.release, results=self.step(batch))
        return launch_talker_step(self.runner, batch, self._static_rows, self._static_results, self.release)

    def _static_rows(
        self, batch: list[BatchItem]
    ) -> tuple[list[TalkerRow], list[TalkerRow], list[_Sequence]]:
        """The prefill rows (slots acquired), the frame rows and each item's sequence."""
        runner = self.runner
        assert runner is not None
        seqs: list[_Sequence] = []
        prefills: list[TalkerRow] = []
        continuing: list[tuple[BatchItem, _Sequence]] = []
        for item in batch:
            rid = item.internal_id
            seq = self._seqs.get(rid)
            if seq is None:
                embeds, seq = self._prefill_input(item)
                runner.slots.acquire(rid)
                self._seqs[rid] = seq
                prefills.append(TalkerRow(rid, embeds[0], item.sampling, seq.generator))
            elif seq.is_finished:
                raise ModelError(f"request {rid!r}: stepped after its codec EOS")
            else:
                continuing.append((item, seq))
            seqs.append(seq)
        self._absorb_all(continuing)
        decodes = [
            TalkerRow(item.internal_id, self._next_text(seq), item.sampling, seq.generator)
            for item, seq in continuing
        ]
        return prefills, decodes, seqs

    def _static_results(
        self, batch: list[BatchItem], seqs: list[_Sequence], rows: list[TalkerRow], made: torch.Tensor
    ) -> list[ItemResult]:
        """The step's results from the runner's codes (``made`` in the order of ``rows``)."""
        codes = dict(zip((r.rid for r in rows), made))
        frames = torch.stack([codes[item.internal_id] for item in batch])
        eos = frames[:, 0] == self.spec.codec_eos_token_id
        frames[eos, 1:] = 0  # an EOS frame carries no residual codes
        for seq, is_eos in zip(seqs, eos.tolist()):
            seq.num_frames += 0 if is_eos else 1
        return self._results(batch, seqs, frames)

    # ----------------------------------------------------------------- prefill

    def _prefill(self, item: BatchItem) -> torch.Tensor:
        """First step of a request: build its conditioning and run the prefill."""
        rid = item.internal_id
        embeds, seq = self._prefill_input(item)
        cache = self._kv.prefill_cache(rid)
        n = embeds.shape[1]
        positions = torch.arange(n, device=self.device).view(1, 1, n).expand(4, 1, n)
        out = self._decoder(
            inputs_embeds=embeds, position_ids=positions, **{self._cache_kw: cache}, use_cache=True
        )
        self._kv.store(rid, cache)
        self._seqs[rid] = seq
        return out.last_hidden_state[:, -1]

    def _prefill_input(self, item: BatchItem) -> tuple[torch.Tensor, _Sequence]:
        """The conditioning of a request's first step ``[1, L, H]`` and its new state."""
        rid = item.internal_id
        payload = item.additional_information if item.additional_information is not None else item.inputs
        if payload is None and self.text_input is not None:
            chunk = self.text_input.chunk(item.all_token_ids, rid)
        elif payload is None:
            raise ModelError(
                f"request {rid!r}: the Talker's first step has no Thinker input (chunk 0); "
                "a Talker request cannot be recomputed after preemption — its Thinker chunks were consumed"
            )
        else:
            # A complete input forwarded by the orchestrator is the whole Thinker output.
            is_complete = item.additional_information is None
            chunk = parse_payload(payload, rid, is_finished=item.is_upstream_exhausted or is_complete)
        if not chunk.is_prefill:
            raise ModelError(
                f"request {rid!r}: the Talker's first input must be the Thinker's chunk 0 "
                "(embed.prefill, hidden_states.output, ids); got a decode chunk"
            )
        return self._conditioning(rid, chunk, item.sampling)

    def _conditioning(
        self, rid: str, chunk: ThinkerChunk, sampling: SamplingParams
    ) -> tuple[torch.Tensor, _Sequence]:
        """The prefill embeddings [1, L, H] and the request's state (trailing text queued)."""
        spec = self.spec
        assert chunk.prefill_embed is not None and chunk.prefill_hidden is not None
        assert chunk.tts_bos is not None and chunk.tts_eos is not None and chunk.tts_pad is not None
        embed = chunk.prefill_embed.to(self.device, self.dtype)
        hidden = chunk.prefill_hidden.to(self.device, self.dtype)
        prompt = chunk.prompt_ids
        rows = embed.shape[0]
        start = assistant_start(prompt, spec.im_start_token_id, spec.assistant_token_id)
        if start is None:
            raise ModelError(
                f"request {rid!r}: the Thinker prompt has no '<|im_start|>assistant' turn; the Talker needs the "
                "chat layout (see omnirelay.models.qwen3_omni.prompt.format_chat)"
            )
        speaker = (chunk.speaker or DEFAULT_SPEAKER).lower()
        if speaker not in spec.speaker_ids:
            raise ModelError(
                f"request {rid!r}: unknown speaker {speaker!r}; known: {sorted(spec.speaker_ids)}"
            )
        project = self.model.text_projection
        tts = project(torch.cat([chunk.tts_bos, chunk.tts_eos, chunk.tts_pad]).to(self.device, self.dtype))
        tts_bos, tts_eos, tts_pad = tts[0:1], tts[1:2], tts[2:3]

        # User turns: text positions from the embeddings, multimodal ones from the hidden states.
        users = [p for p in user_positions(prompt, spec.im_start_token_id, spec.user_token_id) if p < rows]
        parts = []
        if users:
            idx = torch.tensor(users, device=self.device)
            is_mm = torch.tensor([prompt[p] in spec.multimodal_token_ids for p in users], device=self.device)
            user_rows = project(embed.index_select(0, idx))
            if bool(is_mm.any()):
                mm_rows = self.model.hidden_projection(hidden.index_select(0, idx))
                user_rows = torch.where(is_mm.unsqueeze(-1), mm_rows, user_rows)
            parts.append(user_rows)

        # The assistant turn: header (3 rows), 4 × pad, BOS, first text token; + codec rows.
        assistant = project(embed[start:])
        seq = _Sequence(generator=make_generator(sampling.seed), tts_eos=tts_eos, tts_pad=tts_pad)
        if assistant.shape[0] >= 4:
            first_text = assistant[3:4]
            seq.text_rows.extend(assistant[r : r + 1] for r in range(4, assistant.shape[0]))
        else:
            # The Thinker ended before its first token was fed back: speak nothing but EOS.
            first_text, seq.is_eos_fed = tts_eos, True
        header = assistant[:3]
        if header.shape[0] < 3:
            header = torch.cat([header, tts_pad.expand(3 - header.shape[0], -1)])
        text_part = torch.cat([header, tts_pad.expand(4, -1), tts_bos, first_text])
        codec_ids = torch.tensor(
            [
                spec.codec_nothink_id,
                spec.codec_think_bos_id,
                spec.codec_think_eos_id,
                spec.speaker_ids[speaker],
                spec.codec_pad_id,
                spec.codec_bos_id,
            ],
            device=self.device,
        )
        codec_part = torch.cat([torch.zeros_like(header), self._codec_embedding(codec_ids)])
        parts.append(text_part + codec_part)
        if chunk.decode_embed is not None:
            self._queue_text(seq, chunk.decode_embed)
        seq.is_upstream_finished = chunk.is_finished
        return torch.cat(parts).unsqueeze(0), seq

    # ----------------------------------------------------------------- decode

    def _absorb(self, item: BatchItem, seq: _Sequence) -> None:
        """Queue the Thinker rows of the chunk committed for this step (if any)."""
        rows = self._chunk_rows(item, seq)
        if rows is not None:
            self._queue_text(seq, rows)

    def _chunk_rows(self, item: BatchItem, seq: _Sequence) -> torch.Tensor | None:
        """The Thinker rows ``[n, H]`` (unprojected) of the chunk committed for this step."""
        payload = item.additional_information
        rows = None
        if payload is not None:
            chunk = parse_payload(payload, item.internal_id, is_finished=item.is_upstream_exhausted)
            if chunk.is_prefill:
                raise ModelError(
                    f"request {item.internal_id!r}: a second chunk 0 arrived after the Talker started"
                )
            rows = chunk.decode_embed
        if item.is_upstream_exhausted:  # its last chunk may carry no body at all
            seq.is_upstream_finished = True
        return rows

    def _absorb_all(self, pairs: list[tuple[BatchItem, _Sequence]]) -> None:
        """:meth:`_absorb` for many requests with one projection of all their rows."""
        pending = [(seq, rows) for item, seq in pairs if (rows := self._chunk_rows(item, seq)) is not None]
        if not pending:
            return
        stacked = torch.cat([rows for _, rows in pending]).to(self.device, self.dtype)
        projected = self.model.text_projection(stacked)
        start = 0
        for seq, rows in pending:
            part = projected[start : start + rows.shape[0]]
            seq.text_rows.extend(part[r : r + 1] for r in range(part.shape[0]))
            start += rows.shape[0]

    def _queue_text(self, seq: _Sequence, rows: torch.Tensor) -> None:
        projected = self.model.text_projection(rows.to(self.device, self.dtype))
        seq.text_rows.extend(projected[r : r + 1] for r in range(projected.shape[0]))

    def _next_text(self, seq: _Sequence) -> torch.Tensor:
        if seq.text_rows:
            return seq.text_rows.popleft()
        if seq.is_upstream_finished and not seq.is_eos_fed:
            seq.is_eos_fed = True
            return seq.tts_eos
        if not seq.is_upstream_finished:
            seq.num_starved_steps += 1
        return seq.tts_pad

    def _decode(self, decodes: list[tuple[BatchItem, _Sequence]]) -> dict[str, torch.Tensor]:
        ids = [item.internal_id for item, _ in decodes]
        rows = []
        for _, seq in decodes:
            assert seq.codec_embed is not None
            rows.append(seq.codec_embed + self._next_text(seq))
        embeds = torch.cat(rows).unsqueeze(1)  # [B, 1, H]
        cache, mask, positions = self._kv.decode_batch(ids)
        b = len(ids)
        out = self._decoder(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions.view(1, b, 1).expand(4, b, 1),
            **{self._cache_kw: cache},
            use_cache=True,
        )
        self._kv.commit_decode(ids)
        last = out.last_hidden_state[:, -1]
        return {rid: last[r : r + 1] for r, rid in enumerate(ids)}

    # ----------------------------------------------------------------- code predictor

    def _predict_residuals(
        self,
        hidden: torch.Tensor,
        first: list[int],
        params: list[SamplingParams],
        gens: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codebooks 1..Q-1 for each row; returns the frames [B, Q] and the summed codec
        embeddings [B, H] of each frame (the next step's codec input)."""
        predictor = self._predictor
        first_t = torch.tensor(first, dtype=torch.long, device=self.device)
        first_embed = self._codec_embedding(first_t).unsqueeze(1)  # [B, 1, H]
        total = first_embed.squeeze(1).clone()
        codes = [first_t]
        step_input = torch.cat([hidden.unsqueeze(1), first_embed], dim=1)
        cache = DynamicCache()
        for group in range(self.num_codebooks - 1):
            out = predictor.model(
                inputs_embeds=step_input, **{self._predictor_cache_kw: cache}, use_cache=True
            )
            logits = predictor.lm_head[group](out.last_hidden_state[:, -1]).float()
            sampled = sample_rows(
                logits, params, gens, top_k=CODE_PREDICTOR_TOP_K, top_p=CODE_PREDICTOR_TOP_P, temperature=1.0
            )
            token = torch.tensor(sampled, dtype=torch.long, device=self.device)
            codes.append(token)
            step_input = predictor.model.codec_embedding[group](token).unsqueeze(1)
            total = total + step_input.squeeze(1)
        return torch.stack(codes, dim=1), total


def create_talker(**executor_args: Any) -> TalkerExecutor:
    """Registry factory of ``qwen3_omni.talker`` (keys: see :class:`ModelArgs`;
    ``text_input: true`` selects :class:`TextConditioner`'s text mode)."""
    args = ModelArgs.from_executor_args(executor_args)
    return TalkerExecutor.from_checkpoint(open_checkpoint(args), text_input=args.text_input, args=args)
