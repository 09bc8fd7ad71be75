"""Speech recognition and alignment: the PocketSphinx recognizer and aligner, and the
weight-free VAD aligner.

* ``recognizer`` — ``asr.pocketsphinx``: speech recognition in front of a Thinker (only
  requests with audio enter it).
* ``sphinx`` — ``aligner.pocketsphinx``: forced alignment of the voice's words; the
  recognizer itself and word error rate.
* ``vad_aligner`` — ``aligner.vad``: a forced aligner that needs no trained weights.
* ``speech_span`` — where a whole clip's speech starts and ends (weight-free): the
  recognizer hears that, between fixed silence.

None of them is a text model the front writes prompts for; :data:`FAMILY` only registers
their executors. Modules are imported when a factory is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.family import ModelFamily

if TYPE_CHECKING:
    from omnirelay.models.asr.recognizer import SphinxRecognizerExecutor
    from omnirelay.models.asr.sphinx import SphinxAlignerExecutor
    from omnirelay.models.asr.vad_aligner import VadAligner
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "ALIGNER_EXECUTOR",
    "FAMILY",
    "RECOGNIZER_EXECUTOR",
    "SPHINX_ALIGNER_EXECUTOR",
    "SpeechFamily",
    "create_aligner",
    "create_sphinx_aligner",
    "create_sphinx_recognizer",
]

RECOGNIZER_EXECUTOR = "asr.pocketsphinx"
SPHINX_ALIGNER_EXECUTOR = "aligner.pocketsphinx"
ALIGNER_EXECUTOR = "aligner.vad"


def create_aligner(**executor_args: Any) -> VadAligner:
    """``aligner.vad``."""
    from omnirelay.models.asr.vad_aligner import create_aligner as create

    return create(**executor_args)


def create_sphinx_aligner(**executor_args: Any) -> SphinxAlignerExecutor:
    """``aligner.pocketsphinx``."""
    from omnirelay.models.asr.sphinx import create_sphinx_aligner as create

    return create(**executor_args)


def create_sphinx_recognizer(**executor_args: Any) -> SphinxRecognizerExecutor:
    """``asr.pocketsphinx``: a speech-recognition stage in front of a Thinker."""
    from omnirelay.models.asr.recognizer import create_sphinx_recognizer as create

    return create(**executor_args)


class SpeechFamily(ModelFamily):
    """The recognizer and the two aligners: executors only."""

    name = "speech recognition and alignment"
    executors = (RECOGNIZER_EXECUTOR, SPHINX_ALIGNER_EXECUTOR, ALIGNER_EXECUTOR)
    worker_imports = (
        "torch",
        "pocketsphinx",
        "omnirelay.models.asr.recognizer",
        "omnirelay.models.asr.sphinx",
        "omnirelay.models.asr.vad_aligner",
    )

    def register_executors(self, executors: Registry[Any], *, replace: bool = False) -> None:
        executors.add(ALIGNER_EXECUTOR, create_aligner, replace=replace)
        executors.add(SPHINX_ALIGNER_EXECUTOR, create_sphinx_aligner, replace=replace)
        executors.add(RECOGNIZER_EXECUTOR, create_sphinx_recognizer, replace=replace)


FAMILY = SpeechFamily()
