"""The Qwen3-TTS Talker executor: one codec frame of ``Q`` codebooks per step, on the static runner.

* :class:`TTSTalkerExecutor` — the :class:`~omnirelay.engine.interfaces.Executor` of the
  Talker stage (``execution_type = "ar"``), the first stage of a TTS pipeline: a
  request's prompt is the speech prompt of :mod:`omnirelay.models.qwen3_tts.prompt` and
  its ``inputs`` the voice (speaker, language, instruction ids). ``release(id)`` frees it.
* :func:`create_talker` — the registry factory: ``create_talker(**executor_args)``.

Steps, as the reference's ``generate`` splits into them:

* **first step** — the request's conditioning
  (:func:`~omnirelay.models.qwen3_tts.conditioning.build_conditioning`) is prefilled
  (new requests of a step in one batched prefill), and the codec head samples the first
  codebook of frame 0; the code predictor samples the other ``Q − 1``;
* **later steps** — the input is the sum of the previous frame's ``Q`` codec embeddings
  plus the frame's text row (the next text token in text-streaming mode, then TTS EOS,
  then TTS pad); one frame per request per step, batched.
* **codes** — the first codebook is sampled with the request's sampling parameters over
  the codec ids and EOS, with the checkpoint's repetition penalty (1.05) over the first
  codes the request produced, and EOS blocked before ``min_new_tokens`` (2) frames; the
  residual codebooks with the checkpoint's ``subtalker_*`` sampling (greedy when the
  request is greedy). Codec EOS finishes the request.

Every step runs on :class:`~omnirelay.models.runner.TalkerRunner` — slot KV caches
allocated at startup, and on CUDA a few graph replays per step (the new requests'
prefill, the Talker's step for the others, then one compiled code-predictor tail for
every row of the step) — on the CPU too, eagerly: there is one path.
``ItemResult.token_ids`` is ``[first codebook]``; ``next_stage_output`` the frame
``[1, Q]`` (int64, CPU) for the Talker → Code2Wav processor (an EOS frame ``[EOS, 0 …]``,
which that processor drops). A Talker request cannot be recomputed after a preemption.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.prepared import cache_root
from omnirelay.models.qwen3_tts.conditioning import Conditioning, Voice, build_conditioning
from omnirelay.models.qwen3_tts.loader import GenerationDefaults, TTSCheckpoint, TTSModelArgs
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.prompt import default_speaker
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.models.runner import Buckets, TalkerRow, TalkerRunner
from omnirelay.models.runner.predictor import ResidualSampling, use_compile_cache
from omnirelay.models.runner.talker import launch_talker_step
from omnirelay.models.sampling import make_generator
from omnirelay.models.stepping import GuardedLaunch, guarded_step

__all__ = ["TTSTalkerExecutor", "create_talker", "voice_of_inputs"]


@dataclass(slots=True)
class _Sequence:
    conditioning: Conditioning
    generator: torch.Generator
    num_frames: int = 0
    is_finished: bool = False


def voice_of_inputs(inputs: Any, default_speaker: str | None) -> Voice:
    """The :class:`Voice` a request's ``inputs`` name (the prompt side's
    ``{"speaker", "language", "instruct_ids"}``; None: the default speaker, ``auto``)."""
    if inputs is None:
        return Voice(speaker=default_speaker)
    if not isinstance(inputs, Mapping):
        raise ModelError(f"a Qwen3-TTS request's inputs must be a mapping, got {type(inputs).__name__}")
    speaker = inputs.get("speaker", default_speaker)
    language = inputs.get("language") or "auto"
    ids = inputs.get("instruct_ids")
    if speaker is not None and not isinstance(speaker, str):
        raise ModelError(f"inputs.speaker must be a string, got {speaker!r}")
    if not isinstance(language, str):
        raise ModelError(f"inputs.language must be a string, got {language!r}")
    if ids is not None and (not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids)):
        raise ModelError("inputs.instruct_ids must be a list of token ids")
    return Voice(speaker=speaker, language=language, instruct_ids=tuple(ids) if ids else None)


class TTSTalkerExecutor:
    """Runs the Qwen3-TTS Talker and its code predictor for a batch of requests."""

    execution_type = "ar"
    supports_batching = True

    def __init__(
        self,
        talker: TTSTalker,
        config: TTSConfig,
        *,
        buckets: Buckets,
        cuda_graphs: bool = False,
        compile: str | None = None,
        generation: GenerationDefaults | None = None,
        text_streaming: bool = False,
        speaker: str | None = None,
    ) -> None:
        self.talker = talker
        self.config = config
        self.generation = generation or GenerationDefaults()
        self.text_streaming = text_streaming
        speakers = config.talker_config.speakers
        if speaker is not None and speaker.lower() not in speakers:
            raise ModelError(
                f"executor_args.speaker {speaker!r} is not one of the model's speakers {list(speakers)}"
            )
        #: the speaker of a request that names none (None: the model has no speakers)
        self.default_speaker = default_speaker(config, speaker)
        tc = config.talker_config
        gen = self.generation
        projection = talker.code_predictor.small_to_mtp_projection
        self.runner = TalkerRunner(
            talker,
            codebook_size=tc.codebook_size,
            codec_eos=tc.codec_eos_token_id,
            num_code_groups=tc.num_code_groups,
            buckets=buckets,
            cuda_graphs=cuda_graphs,
            compile=compile,
            row_controls=True,
            residual=ResidualSampling(gen.subtalker_temperature, gen.subtalker_top_k, gen.subtalker_top_p),
            projection=None if isinstance(projection, torch.nn.Identity) else projection,
        )
        self.runner.capture_graphs()
        self._seqs: dict[str, _Sequence] = {}

    @classmethod
    def from_checkpoint(cls, checkpoint: TTSCheckpoint, args: TTSModelArgs) -> TTSTalkerExecutor:
        compile = None
        if args.compiles():
            use_compile_cache(cache_root())
            compile = "inductor"
        return cls(
            checkpoint.load_talker(),
            checkpoint.config,
            buckets=Buckets(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len),
            cuda_graphs=args.uses_cuda_graphs(),
            compile=compile,
            generation=checkpoint.generation,
            text_streaming=args.text_streaming,
            speaker=args.speaker,
        )

    @property
    def num_codebooks(self) -> int:
        return self.config.talker_config.num_code_groups

    # ----------------------------------------------------------------- Executor

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """One codec frame per item (engine thread)."""
        return guarded_step(batch, self._step, self.release)

    def release(self, internal_id: str) -> None:
        """Free the request's KV slot and state (idempotent)."""
        self.runner.slots.release(internal_id)
        self._seqs.pop(internal_id, None)

    def num_live_requests(self) -> int:
        return len(self._seqs)

    def leak_state(self) -> dict[str, Any]:
        held = self.runner.slots.holders()
        return {"talker_slots": held} if held else {}

    # ----------------------------------------------------------------- one step

    def launch(self, batch: list[BatchItem]) -> GuardedLaunch:
        """The step split in two (docs/design.md §12): the rows prepared and the runner's
        work enqueued on its stream; the codes become results once its event completed
        (:func:`~omnirelay.models.runner.talker.launch_talker_step`)."""
        return launch_talker_step(self.runner, batch, self._rows, self._results, self.release)

    def _step(self, batch: list[BatchItem]) -> list[ItemResult]:
        prefills, decodes, seqs = self._rows(batch)
        return self._results(batch, seqs, [*prefills, *decodes], self.runner.step(prefills, decodes))

    def _rows(self, batch: list[BatchItem]) -> tuple[list[TalkerRow], list[TalkerRow], list[_Sequence]]:
        """The step's prefill rows (new requests, their slots acquired), frame rows and
        each item's sequence."""
        gen = self.generation
        prefills: list[TalkerRow] = []
        decodes: list[TalkerRow] = []
        seqs: list[_Sequence] = []
        for item in batch:
            rid = item.internal_id
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._start(item)
                self.runner.slots.acquire(rid)
                self._seqs[rid] = seq
                prefills.append(
                    TalkerRow(
                        rid,
                        seq.conditioning.prefill,
                        item.sampling,
                        seq.generator,
                        gen.repetition_penalty,
                        False,
                    )
                )
            elif seq.is_finished:
                raise ModelError(f"request {rid!r}: stepped after its codec EOS")
            else:
                text = seq.conditioning.text_row(seq.num_frames - 1)
                may_stop = seq.num_frames >= gen.min_new_tokens
                decodes.append(
                    TalkerRow(rid, text, item.sampling, seq.generator, gen.repetition_penalty, may_stop)
                )
            seqs.append(seq)
        return prefills, decodes, seqs

    def _results(
        self, batch: list[BatchItem], seqs: list[_Sequence], rows: Sequence[TalkerRow], frames: torch.Tensor
    ) -> list[ItemResult]:
        """Each item's frame as its result (``frames`` in the order of the runner's
        ``rows``: the prefills, then the decodes)."""
        order = {row.rid: i for i, row in enumerate(rows)}
        eos = self.config.talker_config.codec_eos_token_id
        results = []
        for item, seq in zip(batch, seqs):
            frame = frames[order[item.internal_id]].reshape(1, -1).clone()
            first = int(frame[0, 0])
            is_eos = first == eos
            if is_eos:
                frame[0, 1:] = 0  # an EOS frame carries no residual codes
                seq.is_finished = True
            else:
                seq.num_frames += 1
            results.append(
                ItemResult(
                    internal_id=item.internal_id, token_ids=[first], finished=is_eos, next_stage_output=frame
                )
            )
        return results

    def _start(self, item: BatchItem) -> _Sequence:
        rid = item.internal_id
        prompt = item.all_token_ids
        voice = voice_of_inputs(item.inputs, self.default_speaker)
        try:
            with torch.inference_mode():
                conditioning = build_conditioning(
                    self.talker, self.config, prompt, voice, text_streaming=self.text_streaming
                )
        except ModelError as exc:
            raise ModelError(f"request {rid!r}: {exc}") from exc
        return _Sequence(conditioning=conditioning, generator=make_generator(item.sampling.seed))


def create_talker(**executor_args: Any) -> TTSTalkerExecutor:
    """Registry factory of ``qwen3_tts.talker`` (keys: :class:`TTSModelArgs`)."""
    args = TTSModelArgs.from_executor_args(executor_args)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    return TTSTalkerExecutor.from_checkpoint(TTSCheckpoint.open(args), args)
