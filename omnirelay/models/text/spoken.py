"""Written English → the words a speaker says: the text side of the voice and the aligner.

* :func:`spoken_tokens` — ``text`` → :class:`SpokenToken` s in order: each written word
  with the spoken words it stands for (``"1889"`` → ``eighteen eighty nine``,
  ``"$5.50"`` → ``five dollars and fifty cents``, ``"Dr."`` → ``doctor``, ``"3rd"`` →
  ``third``, ``"10:30"`` → ``ten thirty``), and the punctuation that shapes prosody
  (``, . ! ? ; :``) as tokens without words.
* :func:`number_words` / :func:`ordinal_words` / :func:`year_words` — the spelling rules.

The voice's phonemizer and the forced aligner both read text through here, so the
words the aligner looks for are the words the voice said, and every spoken word keeps
the index of the written word it came from (timestamps are reported per written word).
Spoken words are lower case ASCII letters and apostrophes; a written word that leaves
none (an emoji, a lone symbol) is dropped.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

__all__ = [
    "SpokenToken",
    "number_words",
    "ordinal_words",
    "spoken_tokens",
    "spoken_words",
    "year_words",
]

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_IRREGULAR = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}
_ABBREVIATIONS = {
    "mr.": "mister",
    "mrs.": "missus",
    "ms.": "miz",
    "dr.": "doctor",
    "prof.": "professor",
    "st.": "saint",
    "jr.": "junior",
    "sr.": "senior",
    "vs.": "versus",
    "etc.": "et cetera",
    "e.g.": "for example",
    "i.e.": "that is",
    "approx.": "approximately",
    "no.": "number",
}
_SYMBOLS = {"&": "and", "+": "plus", "=": "equals", "@": "at", "%": "percent", "#": "number"}
_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents")}
_CURRENCIES["£"] = ("pound", "pounds", "penny", "pence")
_PUNCTUATION = {",": ",", ";": ",", ":": ",", ".": ".", "!": "!", "?": "?", "…": "."}

_TOKEN = re.compile(
    r"[$€£](?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # money
    r"|\d{1,2}:\d{2}(?:\s?[aApP]\.?[mM]\.?)?"  # a time of day
    r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:st|nd|rd|th|%|s)?"  # numbers, ordinals, %, decades
    r"|[A-Za-z]\.(?:[A-Za-z]\.)+"  # dotted abbreviations: e.g. U.S.
    r"|[^\W\d_](?:[^\W\d_]|['’\-][^\W\d_])*\.?"  # words (with inner apostrophes and hyphens)
    r"|[,;:.!?…]+"
    r"|[&+=@%#]"
)


@dataclass(frozen=True, slots=True)
class SpokenToken:
    """One written token: its text, the spoken words it stands for, or its punctuation."""

    written: str
    #: spoken words, lower case (empty for punctuation)
    words: tuple[str, ...]
    #: ``, . ! ?`` for a punctuation token (``;`` and ``:`` read as ``,``); else ``""``
    punctuation: str = ""


def number_words(n: int) -> list[str]:
    """A cardinal number as words: ``1234`` → ``one thousand two hundred thirty four``."""
    if n < 0:
        return ["minus", *number_words(-n)]
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        tens, ones = divmod(n, 10)
        return [_TENS[tens]] + ([_ONES[ones]] if ones else [])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return [_ONES[hundreds], "hundred"] + (number_words(rest) if rest else [])
    for scale, name in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return [*number_words(high), name] + (number_words(rest) if rest else [])
    raise AssertionError(n)  # pragma: no cover - every n >= 1000 meets a scale


def ordinal_words(n: int) -> list[str]:
    """An ordinal as words: ``21`` → ``twenty first``; ``100`` → ``one hundredth``."""
    words = number_words(n)
    last = words[-1]
    if last in _ORDINAL_IRREGULAR:
        words[-1] = _ORDINAL_IRREGULAR[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return words


def year_words(n: int) -> list[str]:
    """A year as people say it: ``1889`` → ``eighteen eighty nine``, ``1900`` → ``nineteen
    hundred``, ``2005`` → ``two thousand five``, ``2024`` → ``twenty twenty four``."""
    high, low = divmod(n, 100)
    if n % 1000 < 10 and n >= 2000:
        return number_words(n)
    if low == 0:
        return [*number_words(high), "hundred"]
    if low < 10:
        return [*number_words(high), "oh", _ONES[low]]
    return [*number_words(high), *number_words(low)]


def _digits(text: str) -> list[str]:
    return [_ONES[int(c)] for c in text if c.isdigit()]


def _cardinal(text: str) -> list[str]:
    """``"1,234"`` or ``"1889"`` (a year when it looks like one) or ``"007"``."""
    plain = text.replace(",", "")
    if len(plain) > 1 and plain.startswith("0"):
        return _digits(plain)  # a code, not a quantity: "007"
    n = int(plain)
    if "," not in text and len(plain) == 4 and 1100 <= n <= 2099:
        return year_words(n)
    if n >= 10**15:
        return _digits(plain)
    return number_words(n)


def _decimal(text: str) -> list[str]:
    whole, _, frac = text.partition(".")
    return [*_cardinal(whole or "0"), "point", *_digits(frac)]


def _money(text: str) -> list[str]:
    one, many, cent, cents = _CURRENCIES[text[0]]
    whole, _, frac = text[1:].partition(".")
    units = int(whole.replace(",", "") or "0")
    words = [*number_words(units), one if units == 1 else many]
    if frac:
        sub = int((frac + "0")[:2])
        if sub:
            words += ["and", *number_words(sub), cent if sub == 1 else cents]
    return words


def _time(text: str) -> list[str]:
    """``"10:30"`` → ten thirty, ``"9:05 pm"`` → nine oh five p m, ``"10:00"`` → ten o'clock."""
    hours_text, _, rest = text.partition(":")
    hours, minutes = int(hours_text), int(rest[:2])
    suffix = [c for c in rest[2:].lower() if c.isalpha()]
    words = number_words(hours)
    if minutes == 0:
        words += [] if suffix else ["o'clock"]
    elif minutes < 10:
        words += ["oh", _ONES[minutes]]
    else:
        words += number_words(minutes)
    return words + suffix


def _number_token(text: str) -> list[str]:
    if text[0] in _CURRENCIES:
        return _money(text)
    if ":" in text:
        return _time(text)
    if text.endswith("%"):
        return [*_number_token(text[:-1]), "percent"]
    suffix = text.lstrip("0123456789,.")
    body = text[: len(text) - len(suffix)] if suffix else text
    if suffix in ("st", "nd", "rd", "th") and "." not in body:
        return ordinal_words(int(body.replace(",", "")))
    if suffix == "s":  # a decade: the 1990s -> nineteen nineties
        words = _cardinal(body)
        last = words[-1]
        words[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
        return words
    body = body.rstrip(".,")
    if "." in body:
        return _decimal(body)
    return _cardinal(body)


def _ascii_letters(word: str) -> str:
    decomposed = unicodedata.normalize("NFKD", word.replace("’", "'"))
    return "".join(c for c in decomposed if c.isascii() and (c.isalpha() or c == "'")).lower()


def _word_token(text: str) -> list[str]:
    lowered = text.lower()
    if lowered in _ABBREVIATIONS:
        return _ABBREVIATIONS[lowered].split()
    if re.fullmatch(r"(?:[A-Za-z]\.)+[A-Za-z]?\.?", text):  # U.S. -> u s
        return [c.lower() for c in text if c.isalpha()]
    words = []
    for part in text.rstrip(".").split("-"):
        spoken = _ascii_letters(part).strip("'")
        if spoken:
            words.append(spoken)
    return words


def spoken_tokens(text: str) -> list[SpokenToken]:
    """The written tokens of ``text`` with their spoken words (see the module docstring)."""
    out: list[SpokenToken] = []
    for match in _TOKEN.finditer(text):
        tok = match.group()
        first = tok[0]
        if first in ",;:.!?…":
            mark = "?" if "?" in tok else "!" if "!" in tok else _PUNCTUATION[first]
            out.append(SpokenToken(tok, (), mark))
        elif first in _SYMBOLS:
            out.append(SpokenToken(tok, tuple(_SYMBOLS[first].split())))
        elif first.isdigit() or first in _CURRENCIES:
            out.append(SpokenToken(tok, tuple(_number_token(tok))))
        else:
            words = _word_token(tok)
            if words:
                out.append(SpokenToken(tok, tuple(words)))
            # A word's final period that is not an abbreviation's ends a sentence.
            is_abbreviation = tok.lower() in _ABBREVIATIONS or re.fullmatch(r"(?:[A-Za-z]\.)+", tok)
            if tok.endswith(".") and len(tok) > 1 and not is_abbreviation:
                out.append(SpokenToken(".", (), "."))
    return out


def spoken_words(text: str) -> list[str]:
    """Just the spoken words of ``text``, in order."""
    return [w for tok in spoken_tokens(text) for w in tok.words]
