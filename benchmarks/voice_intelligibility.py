"""How intelligible the voice is, by phonemizer: ``python -m benchmarks.voice_intelligibility``.

Synthesizes fixed sentences (the first Harvard list and five everyday sentences) with the
Piper voice of the default pipeline, several noise seeds each, and transcribes them with
PocketSphinx; prints the mean word error rate per sentence and overall for

* ``cmudict`` — the shipped, permissive phonemizer (:mod:`omnirelay.models.text.phonemizer`);
* ``cmudict-nostress`` — the same without stress marks (why stress is kept);
* ``espeak`` — espeak-ng's own phonemes, the ones the voice was trained on, when an
  ``espeak-ng`` program is on the PATH. espeak-ng is GPL and never part of omnirelay;
  it is only run here, as a reference, from the system's package.

The recognizer is the limit, not the voice: some words come back wrong on every path
(names, rare words). Compare the paths with each other, on the same sentences and seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omnirelay.models.asr.sphinx import Recognizer, word_error_rate
from omnirelay.models.text.spoken import spoken_words
from omnirelay.models.voice.piper import PiperVoice

SENTENCES = (
    "The capital of France is Paris.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "I would like to book a table for two people at seven o'clock tonight.",
    "The weather today is sunny with a light breeze from the west.",
    "Good morning to you all, the train leaves at nine o'clock sharp.",
)


def _espeak(text: str) -> str:
    out = subprocess.run(
        ["espeak-ng", "-q", "--ipa", "-v", "en-us", text], capture_output=True, text=True, check=True
    ).stdout
    clauses = [line.strip() for line in out.splitlines() if line.strip()]
    end = text.rstrip()[-1] if text.rstrip()[-1:] in ".!?" else "."
    return ", ".join(clauses) + end


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.voice_intelligibility", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seeds", type=int, default=3, help="noise seeds per sentence (default 3)")
    p.add_argument("--json", metavar="PATH", default=None)
    args = p.parse_args(argv)
    voice = PiperVoice()
    recognizer = Recognizer()
    paths: dict[str, Callable[[str], list[int]]] = {
        "cmudict": voice.phoneme_ids,
        "cmudict-nostress": lambda s: voice.ids_of_phonemes(
            voice.phonemizer.phonemes(s).replace("ˈ", "").replace("ˌ", "")
        ),
    }
    if shutil.which("espeak-ng"):
        paths["espeak"] = lambda s: voice.ids_of_phonemes(_espeak(s))
    results: dict[str, list[float]] = {name: [] for name in paths}
    rows = []
    for sentence in SENTENCES:
        row: dict[str, Any] = {"sentence": sentence}
        for name, ids_of in paths.items():
            ids = ids_of(sentence)
            wers = [
                word_error_rate(
                    spoken_words(sentence), recognizer.words(voice.synthesize(ids, seed), voice.sample_rate)
                )
                for seed in range(args.seeds)
            ]
            row[name] = float(np.mean(wers))
            results[name].append(row[name])
        rows.append(row)
        print("  ".join(f"{row[n]:6.1%}" for n in paths) + f"  {sentence}", flush=True)
    summary = {name: float(np.mean(v)) for name, v in results.items()}
    print("mean    " + "  ".join(f"{name} {v:.1%}" for name, v in summary.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "mean": summary, "seeds": args.seeds}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
