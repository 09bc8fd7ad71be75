"""English text as a speaker says it, shared by the voice and the speech aligner.

* :mod:`~omnirelay.models.text.spoken` — written words → the words spoken for them
  (numbers, money, times, abbreviations), each keeping the index of its written word;
* :mod:`~omnirelay.models.text.phonemizer` — text → the espeak-style IPA a Piper voice
  was trained on, from the vendored CMU Pronouncing Dictionary (``data/``), and one
  word's ARPAbet for the aligner.

The voice speaks through these and the aligner listens through them, so the words it
looks for are the words the voice said.
"""
