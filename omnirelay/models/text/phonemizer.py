"""English text → the phonemes a Piper voice was trained on (espeak-style IPA), without espeak.

Piper voices learn from espeak-ng's phonemes, and espeak-ng is GPL; this module makes
phonemes of the same shape from permissive data: the CMU Pronouncing Dictionary (BSD,
``data/cmudict.dict.gz``) with its stress digits, mapped symbol by symbol to the IPA that
espeak writes for US English.

* :class:`Phonemizer` — ``phonemes(text)`` (the IPA string, words separated by spaces,
  ``, . ! ?`` kept) and ``arpabet(word)`` (one word's ARPAbet with stress digits; the
  forced aligner reads pronunciations of words its own dictionary lacks from here).
* :func:`load_cmudict` — the vendored dictionary, parsed once per process.

How a sentence becomes phonemes:

1. :func:`~omnirelay.models.text.spoken.spoken_tokens` spells out numbers, money, times and
   abbreviations.
2. Each word: a weak form for short function words (``the`` → ``ðə``, ``of`` → ``ʌv``,
   unstressed, as espeak reads them in a sentence); else its dictionary entry; else its
   possessive or hyphen parts, a known stem plus a suffix, two dictionary words, and last
   small letter-to-sound rules.
3. ARPAbet → IPA: the stress mark goes right before the vowel (``kˈæpɪɾəl``), secondary
   stress after the main one is dropped, stressed ``ER`` is ``ɜː`` and unstressed ``ɚ``,
   long vowels carry ``ː`` as a symbol of its own, ``t`` between a vowel and an
   unstressed vowel is the flap ``ɾ``, ``-ed``/``-es`` endings use ``ᵻ``, ``-tton`` is
   ``ʔn̩``.

Without the stress marks the voice mumbles (docs/performance.md has the word error
rates); with them it is as intelligible as through espeak.
"""

from __future__ import annotations

import functools
import gzip
import re
from collections.abc import Mapping
from pathlib import Path

from omnirelay.models.text.spoken import spoken_tokens

__all__ = ["CMUDICT_PATH", "Phonemizer", "load_cmudict"]

CMUDICT_PATH = Path(__file__).with_name("data") / "cmudict.dict.gz"

_VOWELS = frozenset(
    ["AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW"]
)
_IPA = {
    "AA": "ɑː",
    "AE": "æ",
    "AO": "ɔː",
    "AW": "aʊ",
    "AY": "aɪ",
    "EH": "ɛ",
    "EY": "eɪ",
    "IH": "ɪ",
    "IY": "iː",
    "OW": "oʊ",
    "OY": "ɔɪ",
    "UH": "ʊ",
    "UW": "uː",
    "B": "b",
    "CH": "tʃ",
    "D": "d",
    "DH": "ð",
    "F": "f",
    "G": "ɡ",
    "HH": "h",
    "JH": "dʒ",
    "K": "k",
    "L": "l",
    "M": "m",
    "N": "n",
    "NG": "ŋ",
    "P": "p",
    "R": "ɹ",
    "S": "s",
    "SH": "ʃ",
    "T": "t",
    "TH": "θ",
    "V": "v",
    "W": "w",
    "Y": "j",
    "Z": "z",
    "ZH": "ʒ",
}
#: Vowels before R that espeak writes differently (``near`` nˈɪɹ, ``tour`` tˈʊɹ).
_BEFORE_R = {"IY": "ɪ", "IH": "ɪ", "UW": "ʊ", "UH": "ʊ", "EY": "ɛ"}
_SIBILANTS = frozenset({"S", "Z", "SH", "ZH", "CH", "JH"})
_VOICELESS = frozenset({"P", "T", "K", "F", "TH", "S", "SH", "CH", "HH"})

#: Short function words as espeak reads them inside a sentence: unstressed, weak forms.
_WEAK = {
    "a": "ɐ",
    "an": "ɐn",
    "the": "ðə",
    "and": "ænd",
    "as": "æz",
    "at": "æt",
    "be": "biː",
    "been": "bɪn",
    "but": "bʌt",
    "by": "baɪ",
    "can": "kæn",
    "could": "kʊd",
    "for": "fɔːɹ",
    "from": "fɹʌm",
    "had": "hæd",
    "has": "hæz",
    "have": "hɐv",
    "he": "hiː",
    "her": "hɜː",
    "his": "hɪz",
    "i": "aɪ",
    "if": "ɪf",
    "in": "ɪn",
    "is": "ɪz",
    "it": "ɪt",
    "its": "ɪts",
    "me": "miː",
    "my": "maɪ",
    "of": "ʌv",
    "on": "ɔn",
    "or": "ɔːɹ",
    "our": "aʊɚ",
    "she": "ʃiː",
    "should": "ʃʊd",
    "than": "ðæn",
    "that": "ðæt",
    "their": "ðɛɹ",
    "them": "ðɛm",
    "there": "ðɛɹ",
    "they": "ðeɪ",
    "to": "tə",
    "us": "ʌs",
    "was": "wʌz",
    "we": "wiː",
    "were": "wɜː",
    "will": "wɪl",
    "with": "wɪð",
    "would": "wʊd",
    "you": "juː",
    "your": "jʊɹ",
    "are": "ɑːɹ",
    "am": "æm",
}
#: Suffixes tried on a word the dictionary lacks: (spelling, ARPAbet appended to the stem).
_SUFFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ingly", ("IH0", "NG", "L", "IY0")),
    ("ness", ("N", "AH0", "S")),
    ("less", ("L", "AH0", "S")),
    ("ments", ("M", "AH0", "N", "T", "S")),
    ("ment", ("M", "AH0", "N", "T")),
    ("ful", ("F", "AH0", "L")),
    ("able", ("AH0", "B", "AH0", "L")),
    ("ing", ("IH0", "NG")),
    ("ers", ("ER0", "Z")),
    ("er", ("ER0",)),
    ("est", ("AH0", "S", "T")),
    ("ly", ("L", "IY0")),
    ("ism", ("IH2", "Z", "AH0", "M")),
    ("ist", ("IH0", "S", "T")),
)


@functools.lru_cache(maxsize=1)
def load_cmudict(path: Path = CMUDICT_PATH) -> Mapping[str, tuple[str, ...]]:
    """``word → ARPAbet phones`` (first pronunciation) of the vendored CMUdict."""
    entries: dict[str, tuple[str, ...]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "(" in head:  # an alternative pronunciation: the first one is kept
                continue
            phones = rest.split("#", 1)[0].split()
            if phones:
                entries[head] = tuple(phones)
    return entries


def _plural(stem: tuple[str, ...]) -> tuple[str, ...]:
    last = stem[-1].rstrip("012") if stem else ""
    if last in _SIBILANTS:
        return (*stem, "IH0", "Z")
    return (*stem, "S" if last in _VOICELESS else "Z")


def _past(stem: tuple[str, ...]) -> tuple[str, ...]:
    last = stem[-1].rstrip("012") if stem else ""
    if last in ("T", "D"):
        return (*stem, "IH0", "D")
    return (*stem, "T" if last in _VOICELESS else "D")


class Phonemizer:
    """Text → espeak-style IPA for a Piper voice; see the module docstring.

    ``lexicon``: ``word → ARPAbet`` (default: the vendored CMUdict, loaded on first use).
    """

    def __init__(self, lexicon: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self._lexicon = lexicon

    @property
    def lexicon(self) -> Mapping[str, tuple[str, ...]]:
        if self._lexicon is None:
            self._lexicon = load_cmudict()
        return self._lexicon

    def phonemes(self, text: str) -> str:
        """The IPA of ``text``: words separated by spaces, punctuation after its word."""
        out: list[str] = []
        for tok in spoken_tokens(text):
            if tok.punctuation:
                if out:
                    out[-1] += tok.punctuation
                continue
            out.extend(self.word_ipa(w) for w in tok.words)
        return " ".join(p for p in out if p)

    def word_ipa(self, word: str) -> str:
        """One spoken word (lower case) as IPA."""
        weak = _WEAK.get(word)
        if weak is not None:
            return weak
        return arpabet_to_ipa(self.arpabet(word))

    def arpabet(self, word: str) -> tuple[str, ...]:
        """One word's ARPAbet with stress digits: the dictionary's, or made (see the module
        docstring). Never empty for a word with a letter in it."""
        word = word.lower().strip("'")
        lex = self.lexicon
        found = lex.get(word)
        if found is not None:
            return found
        if not word:
            return ()
        if word.endswith("'s") and word[:-2]:
            return _plural(self.arpabet(word[:-2]))
        if "'" in word:
            return self.arpabet(word.replace("'", ""))
        return self._derived(word) or self._compound(word) or letters_to_sound(word)

    def _derived(self, word: str) -> tuple[str, ...] | None:
        lex = self.lexicon
        if word.endswith("s") and len(word) > 3:
            for stem in (word[:-1], word[:-2] if word.endswith("es") else ""):
                if stem in lex:
                    return _plural(lex[stem])
        if word.endswith("ed") and len(word) > 4:
            for stem in (word[:-2], word[:-1], word[:-3] if word[-3] == word[-4] else ""):
                if stem in lex:
                    return _past(lex[stem])
        for suffix, phones in _SUFFIXES:
            if word.endswith(suffix) and len(word) - len(suffix) >= 3:
                base = word[: -len(suffix)]
                for stem in (base, base + "e", base[:-1] if base[-1] == base[-2] else "", base[:-1] + "y"):
                    if stem and stem in lex:
                        return (*lex[stem], *phones)
        return None

    def _compound(self, word: str) -> tuple[str, ...] | None:
        lex = self.lexicon
        for cut in range(len(word) - 3, 2, -1):
            left, right = word[:cut], word[cut:]
            if left in lex and right in lex:
                return (*lex[left], *_destress(lex[right]))
        return None


def _destress(phones: tuple[str, ...]) -> tuple[str, ...]:
    """The second part of a compound: its main stress becomes secondary."""
    return tuple(p[:-1] + "2" if p.endswith("1") else p for p in phones)


def arpabet_to_ipa(phones: tuple[str, ...]) -> str:
    """One word's ARPAbet (with stress digits) as espeak-style IPA."""
    tail = ""
    if len(phones) >= 4 and phones[-3:] == ("T", "AH0", "N") and phones[-4].rstrip("012") in _VOWELS:
        phones, tail = phones[:-3], "ʔn̩"  # button: bˈʌʔn̩
    out: list[str] = []
    has_primary = False
    for i, phone in enumerate(phones):
        base = phone.rstrip("012")
        stress = phone[len(base) :]
        if base not in _VOWELS:
            out.append(_consonant(phones, i, base))
            continue
        mark = ""
        if stress == "1":
            mark, has_primary = "ˈ", True
        elif stress == "2" and not has_primary:
            mark = "ˌ"
        out.append(mark + _vowel(phones, i, base, stress))
    return "".join(out) + tail


def _vowel(phones: tuple[str, ...], i: int, base: str, stress: str) -> str:
    nxt = phones[i + 1].rstrip("012") if i + 1 < len(phones) else ""
    if base == "ER":
        return "ɜː" if stress in ("1", "2") else "ɚ"
    if base in ("IH", "AH") and stress == "0" and i == len(phones) - 2 and i > 0:
        # -ed after t/d and -es after a sibilant: espeak's reduced ᵻ
        prev = phones[i - 1].rstrip("012")
        if (nxt == "D" and prev in ("T", "D")) or (nxt == "Z" and prev in _SIBILANTS):
            return "ᵻ"
    if base == "AH":
        return "ʌ" if stress in ("1", "2") else "ə"
    if base == "IY" and stress == "0":
        return "i"
    if nxt == "R" and base in _BEFORE_R:
        return _BEFORE_R[base]
    return _IPA[base]


def _consonant(phones: tuple[str, ...], i: int, base: str) -> str:
    """A consonant; ``t`` after a vowel (or r) and before an unstressed vowel is a flap."""
    if base == "T" and 0 < i < len(phones) - 1:
        prev = phones[i - 1].rstrip("012")
        if (prev in _VOWELS or prev == "R") and phones[i + 1].endswith("0"):
            return "ɾ"
    return _IPA[base]


# ----------------------------------------------------------------------- letter to sound

#: Graphemes, longest first, with their ARPAbet (vowels without stress; stress is added).
_GRAPHEMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tch", ("CH",)),
    ("sch", ("S", "K")),
    ("igh", ("AY",)),
    ("ough", ("OW",)),
    ("augh", ("AO",)),
    ("tion", ("SH", "AH", "N")),
    ("sion", ("ZH", "AH", "N")),
    ("th", ("TH",)),
    ("sh", ("SH",)),
    ("ch", ("CH",)),
    ("ph", ("F",)),
    ("wh", ("W",)),
    ("ck", ("K",)),
    ("ng", ("NG",)),
    ("qu", ("K", "W")),
    ("gh", ("G",)),
    ("ee", ("IY",)),
    ("ea", ("IY",)),
    ("oo", ("UW",)),
    ("ou", ("AW",)),
    ("ow", ("OW",)),
    ("ai", ("EY",)),
    ("ay", ("EY",)),
    ("oa", ("OW",)),
    ("oi", ("OY",)),
    ("oy", ("OY",)),
    ("au", ("AO",)),
    ("aw", ("AO",)),
    ("ew", ("UW",)),
    ("ie", ("IY",)),
    ("ei", ("EY",)),
    ("ar", ("AA", "R")),
    ("er", ("ER",)),
    ("ir", ("ER",)),
    ("ur", ("ER",)),
    ("or", ("AO", "R")),
    ("x", ("K", "S")),
    ("j", ("JH",)),
    ("y", ("IY",)),
    ("a", ("AE",)),
    ("e", ("EH",)),
    ("i", ("IH",)),
    ("o", ("AA",)),
    ("u", ("AH",)),
)
_SINGLE = {g: p for g, p in _GRAPHEMES if len(g) == 1}
_LONG = {"a": "EY", "e": "IY", "i": "AY", "o": "OW", "u": "UW"}
_PLAIN = {
    "b": "B",
    "d": "D",
    "f": "F",
    "h": "HH",
    "k": "K",
    "l": "L",
    "m": "M",
    "n": "N",
    "p": "P",
    "r": "R",
    "s": "S",
    "t": "T",
    "v": "V",
    "w": "W",
    "z": "Z",
}
_MAGIC_E = re.compile(r"[aeiou][bcdfgklmnprstvz]e$")


def letters_to_sound(word: str) -> tuple[str, ...]:
    """A guess at an unknown word's ARPAbet from its spelling (a last resort): a silent
    final ``e`` lengthens the vowel before it, ``c``/``g`` soften before ``e i y``, doubled
    letters sound once, and the first vowel carries the stress."""
    word = "".join(c for c in word.lower() if "a" <= c <= "z")
    if not word:
        return ()
    magic = _MAGIC_E.search(word) is not None and len(word) > 3
    body = word[:-1] if magic or (word.endswith("e") and len(word) > 2) else word
    phones: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if i and ch == body[i - 1] and ch not in "aeiou":
            i += 1  # a doubled consonant sounds once
            continue
        graph = next((g for g, _ in _GRAPHEMES if len(g) > 1 and body.startswith(g, i)), None)
        if graph is not None:
            phones.extend(dict(_GRAPHEMES)[graph])
            i += len(graph)
            continue
        nxt = body[i + 1] if i + 1 < len(body) else ""
        if magic and i == len(body) - 2 and ch in _LONG:
            phones.append(_LONG[ch])
        elif ch == "c":
            phones.append("S" if nxt in ("e", "i", "y") else "K")
        elif ch == "g":
            phones.append("JH" if nxt in ("e", "i", "y") and i > 0 else "G")
        elif ch == "y" and i == 0:
            phones.append("Y")
        elif ch in _SINGLE:
            phones.extend(_SINGLE[ch])
        elif ch in _PLAIN:
            phones.append(_PLAIN[ch])
        i += 1
    return _stress_first_vowel(phones)


def _stress_first_vowel(phones: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    has_stress = False
    for p in phones:
        if p in _VOWELS:
            out.append(p + ("0" if has_stress else "1"))
            has_stress = True
        else:
            out.append(p)
    return tuple(out)
