"""The text side of the CPU voice pipeline, without models: spoken words, phonemes, the
sentence-chunked text edge, the serving codec's verbatim speech prompt, word error rate."""

from __future__ import annotations

import json
import re
import unicodedata

import pytest

from omnirelay.errors import PayloadEncodeError
from omnirelay.models.asr.sphinx import resample, word_error_rate
from omnirelay.models.text.phonemizer import Phonemizer, arpabet_to_ipa, letters_to_sound
from omnirelay.models.text.spoken import number_words, ordinal_words, spoken_tokens, spoken_words, year_words
from omnirelay.payload.codec import decode, encode
from omnirelay.pipeline import load_pipeline
from omnirelay.processors.thinker_to_voice import TextChunk, ThinkerToVoiceStage, split_ready, split_sentences
from omnirelay.transfer import BuildRequest, ReleaseScope

# --------------------------------------------------------------------------- spoken words


def test_numbers_are_spelled_as_people_say_them() -> None:
    assert number_words(0) == ["zero"]
    assert number_words(330) == ["three", "hundred", "thirty"]
    assert number_words(2_500_017) == ["two", "million", "five", "hundred", "thousand", "seventeen"]
    assert ordinal_words(21) == ["twenty", "first"] and ordinal_words(12) == ["twelfth"]
    assert ordinal_words(40) == ["fortieth"]
    assert year_words(1889) == ["eighteen", "eighty", "nine"]
    assert year_words(1900) == ["nineteen", "hundred"] and year_words(2005) == ["two", "thousand", "five"]
    assert year_words(1905) == ["nineteen", "oh", "five"]


def test_spoken_tokens_keep_written_words_and_prosody_marks() -> None:
    toks = spoken_tokens("Dr. Smith paid $5.50 at 10:05 pm, on the 3rd; in 1889 it was 2,500 km.")
    words = [(t.written, t.words) for t in toks if t.words]
    assert words[:4] == [
        ("Dr.", ("doctor",)),
        ("Smith", ("smith",)),
        ("paid", ("paid",)),
        ("$5.50", ("five", "dollars", "and", "fifty", "cents")),
    ]
    assert ("10:05 pm", ("ten", "oh", "five", "p", "m")) in words
    assert ("3rd", ("third",)) in words and ("1889", ("eighteen", "eighty", "nine")) in words
    assert ("2,500", ("two", "thousand", "five", "hundred")) in words
    assert [t.punctuation for t in toks if t.punctuation] == [",", ",", "."]
    assert spoken_words("It's 50% of U.S. homes.") == ["it's", "fifty", "percent", "of", "u", "s", "homes"]
    assert spoken_words("🙂 — ") == []


# --------------------------------------------------------------------------- phonemes


@pytest.fixture(scope="module")
def phonemizer() -> Phonemizer:
    return Phonemizer()


def test_phonemes_follow_espeak_conventions(phonemizer: Phonemizer) -> None:
    # Stress before the vowel, flap, weak forms of function words, punctuation kept.
    assert phonemizer.phonemes("The capital of France is Paris.") == "ðə kˈæpəɾəl ʌv fɹˈæns ɪz pˈɛɹɪs."
    assert phonemizer.word_ipa("water") == "wˈɔːɾɚ"  # flap, unstressed ER
    assert phonemizer.word_ipa("button") == "bˈʌʔn̩"  # glottal stop + syllabic n
    assert phonemizer.word_ipa("horses") == "hˈɔːɹsᵻz" and phonemizer.word_ipa("wanted").endswith("ᵻd")
    assert phonemizer.word_ipa("bird") == "bˈɜːd"  # stressed ER, long mark as its own symbol
    assert phonemizer.word_ipa("happy") == "hˈæpi"  # final unstressed IY


def test_unknown_words_get_a_pronunciation(phonemizer: Phonemizer) -> None:
    assert "omnirelay" not in phonemizer.lexicon
    assert phonemizer.arpabet("vocoders") and phonemizer.arpabet("omnirelay")
    assert phonemizer.arpabet("blorfing")[-2:] == ("IH0", "NG")  # suffix rule or letter to sound
    assert phonemizer.arpabet("dogs") == phonemizer.lexicon["dogs"]
    assert phonemizer.arpabet("smith's")[-1] == "S"  # possessive on a voiceless ending
    assert letters_to_sound("bake") == ("B", "EY1", "K")  # silent e lengthens the vowel
    assert letters_to_sound("chip") == ("CH", "IH1", "P") and letters_to_sound("") == ()
    assert arpabet_to_ipa(("K", "AE1", "T")) == "kˈæt"


def test_phonemes_use_only_symbols_the_voice_knows(phonemizer: Phonemizer) -> None:
    from omnirelay.models.voice.piper import voice_files

    known = set(json.loads(voice_files("en_US-joe-medium")[1].read_text())["phoneme_id_map"])
    text = "Hello! Numbers 1, 22nd and $3; quirky xylophones, judges' rhythm?"
    used = set(unicodedata.normalize("NFD", phonemizer.phonemes(text)))
    assert used <= known, used - known


# --------------------------------------------------------------------------- the text edge


def test_sentences_cut_the_same_streamed_or_whole() -> None:
    text = (
        "The capital of France is Paris. Dr. Smith lives in the U.S. and says: hello there my good "
        "friend, how are you today? I am fine, thanks! It costs 3.50 dollars.\nA last line"
    )
    whole = split_sentences(text)
    assert whole == [
        "The capital of France is Paris.",
        "Dr. Smith lives in the U.S. and says:",
        "hello there my good friend, how are you today?",
        "I am fine, thanks!",
        "It costs 3.50 dollars.",
        "A last line",
    ]
    pending, streamed = "", []
    for token in re.findall(r"\s*\S+|\s+", text):
        pending += token
        pieces, pending = split_ready(pending, final=False)
        streamed += pieces
    streamed += split_ready(pending, final=True)[0]
    assert streamed == whole
    assert split_ready("no end yet", final=False) == ([], "no end yet")
    long = "word " * 100
    pieces, rest = split_ready(long, final=False)
    assert pieces and all(len(p) <= 240 for p in pieces) and len(rest) <= 240


def _req(rid: str, delta: str | None, chunk_id: int, finished: bool = False) -> BuildRequest:
    return BuildRequest(
        internal_id=rid,
        external_id=rid,
        output=delta,
        context=None,
        is_finished=finished,
        is_request_finished=finished,
        is_segment_finished=False,
        chunk_id=chunk_id,
    )


def test_the_processor_sends_one_chunk_per_completed_sentence() -> None:
    cfg = load_pipeline("voice-cpu")
    proc = ThinkerToVoiceStage(cfg.stages[cfg.prompt_stage_id], cfg)
    deltas = ["Paris", " is", " big.", " It", " is", " old", None]
    built = []
    for i, delta in enumerate(deltas):
        chunk = proc.build(_req("r", delta, chunk_id=len(built), finished=i == len(deltas) - 1))
        if chunk is not None:
            built.append(chunk)
    assert built == [TextChunk(text="Paris is big.", index=0), TextChunk(text="It is old", index=1)]
    with pytest.raises(PayloadEncodeError, match="chunk_id 5 does not match"):
        proc.build(_req("r", " x", chunk_id=5))
    with pytest.raises(PayloadEncodeError, match="text delta"):
        proc.build(_req("q", 7, chunk_id=0))  # type: ignore[arg-type]
    assert proc.leak_state()
    proc.release("r", ReleaseScope.REQUEST)
    proc.release("q", ReleaseScope.REQUEST)
    assert proc.leak_state() == {}


def test_a_text_chunk_crosses_the_payload_codec() -> None:
    chunk = TextChunk(text="Héllo, wörld.", index=3)
    assert decode(encode(chunk)) == chunk


# --------------------------------------------------------------------------- helpers


def test_word_error_rate() -> None:
    assert word_error_rate(["a", "b", "c", "d"], ["a", "b", "c", "d"]) == 0.0
    assert word_error_rate(["a", "b", "c", "d"], ["a", "x", "c"]) == 0.5  # one substitution, one deletion
    assert word_error_rate([], []) == 0.0 and word_error_rate([], ["a"]) == 1.0


def test_resample_keeps_a_tone() -> None:
    import numpy as np

    t = np.arange(22050) / 22050
    y = resample(np.sin(2 * np.pi * 440 * t), 22050, 16000)
    assert y.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(int(spectrum.argmax()) - 440) <= 1
