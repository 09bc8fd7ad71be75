"""The three executors chained in one process through the real processors, two requests
at once, stepped the way the schedulers step them: text comes out of the Thinker, codec
frames out of the Talker, and the streamed audio is the whole-utterance decode of those
frames, sample for sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models import register_executors
from omnirelay.models.code2wav import Code2WavExecutor, measure_receptive_field
from omnirelay.models.qwen3_omni import EXECUTOR_NAMES, Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.code2wav import open_code2wav
from omnirelay.models.qwen3_omni.talker import TalkerExecutor
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.payload import OmniPayload
from omnirelay.pipeline import ComponentRegistry
from omnirelay.processors import TalkerToCode2WavConfig, TalkerToCode2WavProcessor
from tests.test_models_support import (
    CACHE_ENV,
    Lockstep,
    item,
    run_thinker,
    single_thread,
    tiny_cache,
    tiny_dir,
)

THINKER_STEPS = 6
TALKER_STEPS = 40
U = 1920


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


class Request:
    """One request's path: Thinker lockstep, its payloads, Talker frames, Code2Wav chunks."""

    def __init__(self, rid: str, prompt: list[int], accept: int) -> None:
        self.rid = rid
        self.thinker = Lockstep(rid, prompt, accept_hidden_layer=accept)
        self.talker_results: list[Any] = []
        self.codec = TalkerToCode2WavProcessor(
            TalkerToCode2WavConfig(
                initial_codec_chunk_frames=4, codec_chunk_frames=25, codec_left_context_frames=25
            )
        )
        self.codec_state = self.codec.new_state()
        self.codec_payloads: list[OmniPayload] = []
        self.codec_is_last: list[bool] = []
        self.audio: list[torch.Tensor] = []

    @property
    def talker_done(self) -> bool:
        return bool(self.talker_results) and (
            self.talker_results[-1].finished or len(self.talker_results) >= TALKER_STEPS
        )

    def talker_input(self) -> Any:
        """The chunk the engine would commit for the next Talker step (None once exhausted)."""
        k = len(self.talker_results)
        return self.thinker.payloads[k] if k < len(self.thinker.payloads) else None

    def talker_exhausted(self) -> bool:
        """The Thinker's last chunk is committed by the next Talker step (or before)."""
        k = len(self.talker_results)
        return bool(self.thinker.is_last) and self.thinker.is_last[-1] and k >= len(self.thinker.payloads) - 1

    def talker_ready(self) -> bool:
        # Until the Thinker is exhausted the Talker steps once per committed chunk.
        k = len(self.talker_results)
        exhausted = bool(self.thinker.is_last) and self.thinker.is_last[-1]
        return not self.talker_done and (k < len(self.thinker.payloads) or (exhausted and k > 0))

    def push_frame(self, result: Any) -> None:
        self.talker_results.append(result)
        finished = self.talker_done
        payload = self.codec.step(
            self.codec_state, result.next_stage_output, chunk_id=len(self.codec_payloads), finished=finished
        )
        if payload is not None:
            self.codec_payloads.append(payload)
            self.codec_is_last.append(finished)


def test_thinker_talker_code2wav_stream_two_requests() -> None:
    checkpoint = Checkpoint.open(tiny_dir())
    thinker = ThinkerExecutor.from_checkpoint(checkpoint)
    talker = TalkerExecutor.from_checkpoint(checkpoint)
    code2wav = open_code2wav(checkpoint)
    tok = thinker.tokenizer
    requests = [
        Request(f"{name}@s0", encode_chat_prompt(tok, text), thinker.accept_hidden_layer)
        for name, text in (("a", "Say something nice."), ("b", "Count to three"))
    ]
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=42)
    decoded = {r.rid: 0 for r in requests}
    # Interleave the three stages tick by tick, as three stage processes would.
    for tick in range(THINKER_STEPS + TALKER_STEPS + 10):
        live = [r for r in requests if not r.thinker.is_finished]
        if live:
            for r, res in zip(live, thinker.step([r.thinker.next_item() for r in live])):
                r.thinker.apply(res, is_last=len(r.thinker.tokens) + 1 >= THINKER_STEPS)
        ready = [r for r in requests if r.talker_ready()]
        if ready:
            batch = [
                item(r.rid, sampling=sampled, info=r.talker_input(), exhausted=r.talker_exhausted())
                for r in ready
            ]
            for r, res in zip(ready, talker.step(batch)):
                r.push_frame(res)
        chunks = [(r, p) for r in requests for p in r.codec_payloads[decoded[r.rid] :] if p.codes is not None]
        for r in requests:
            decoded[r.rid] = len(r.codec_payloads)
        if chunks:
            # Each window as the generation scheduler reads it (Code2Wav's chunk reader).
            reads = [(r, *code2wav.read_chunk(None, p)) for r, p in chunks]
            items = [item(r.rid, input_ids=ids, info=info) for r, ids, info in reads]
            for (r, _), res in zip(chunks, code2wav.step(items)):
                r.audio.append(res.audio)
        if all(r.talker_done for r in requests) and tick > THINKER_STEPS:
            break
    _, holdback = measure_receptive_field(code2wav.model)
    for r in requests:
        assert r.thinker.text and len(r.thinker.tokens) == THINKER_STEPS
        assert r.talker_done and r.codec_is_last[-1]
        frames = torch.cat([res.next_stage_output for res in r.talker_results])
        num_frames = r.codec_state.num_frames
        assert num_frames == len(r.talker_results) - int(r.talker_results[-1].finished)
        audio = torch.cat(r.audio)
        assert audio.dtype == torch.float32 and audio.shape == (num_frames * U - holdback,)
        whole = code2wav.decode(frames[:num_frames].T.unsqueeze(0))[0, 0]
        assert float((audio - whole).abs().max()) < 1e-5
    for executor in (thinker, talker, code2wav):
        for r in requests:
            executor.release(r.rid)
        assert executor.num_live_requests() == 0


def test_registered_factories_build_the_tiny_executors(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_dir()  # built once for the session; the factories find it through the cache dir
    monkeypatch.setenv(CACHE_ENV, str(tiny_cache()))
    registry = ComponentRegistry()
    register_executors(registry.executors)
    made = [registry.executors.get(name)(tiny=True, seed=0) for name in EXECUTOR_NAMES]
    assert [type(e) for e in made] == [ThinkerExecutor, TalkerExecutor, Code2WavExecutor]
    assert [e.execution_type for e in made] == ["ar", "ar", "generation"]


def test_executors_reproduce_the_reference_generate() -> None:
    """Stepping the three executors reproduces transformers' own end-to-end ``generate``
    (greedy): the same Thinker tokens, and the same waveform from the Talker's frames."""
    from omnirelay.models.hf import quiet_transformers
    from omnirelay.models.qwen3_omni.tiny import make_tiny_model

    model, tok = make_tiny_model(seed=0)
    prompt = encode_chat_prompt(tok, "Hello there, how are you?")
    num_text, num_codec = 6, 12
    with quiet_transformers(), torch.inference_mode():
        sequences, reference_wav = model.generate(
            input_ids=torch.tensor([prompt]),
            speaker="Ethan",
            thinker_max_new_tokens=num_text,
            thinker_eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            thinker_do_sample=False,
            talker_max_new_tokens=num_codec,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
        )
    checkpoint = Checkpoint.open(tiny_dir())
    thinker = ThinkerExecutor.from_checkpoint(checkpoint)
    text = run_thinker(thinker, {"r": prompt}, num_text, accept_hidden_layer=thinker.accept_hidden_layer)["r"]
    assert text.tokens == sequences[0, len(prompt) :].tolist()

    talker = TalkerExecutor.from_checkpoint(checkpoint)
    frames = []
    for step in range(num_codec):
        info = text.payloads[step] if step < len(text.payloads) else None
        (res,) = talker.step([item("r", info=info, exhausted=step >= len(text.payloads) - 1)])
        frames.append(res.next_stage_output)
    talker.release("r")
    # generate() decodes the frames whose residual codebooks it computed: all but the last.
    codes = torch.cat(frames)[: num_codec - 1]
    wav = open_code2wav(checkpoint).decode(codes.T.unsqueeze(0))
    assert wav.shape == reference_wav.shape
    assert float((wav - reference_wav).abs().max()) < 1e-5
