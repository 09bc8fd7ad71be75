"""Reproducible mode: a request's answer does not depend on what runs beside it.

With ``reproducible: true`` in a pipeline file (or ``--reproducible`` on ``serve`` and
``run``) the same request with the same seed and sampling gives the same text and the same
audio sample for sample, alone or inside a crowd, on every run of the pipeline
(docs/usage.md, "Reproducible answers"):

* every stage steps each request's rows on their own (the scheduler's one call per item,
  :mod:`omnirelay.engine.scheduler`): float sums of a batched step depend on the batch's
  makeup, and a sampled draw near a tie flips with them;
* a codec edge cuts its chunks on a fixed frame schedule, never by timing
  (docs/protocol.md §5.3), so Code2Wav decodes the same windows on every run.

* :func:`with_reproducible` — the pipeline in reproducible mode, checked;
* :func:`check_reproducible` — a :class:`ConfigError` for an edge that cannot be
  reproducible (one that asks for the adaptive schedule explicitly).
"""

from __future__ import annotations

import msgspec

from omnirelay.errors import ConfigError
from omnirelay.pipeline.config import PipelineConfig

__all__ = ["check_reproducible", "with_reproducible"]


def check_reproducible(cfg: PipelineConfig) -> None:
    """Raise :class:`~omnirelay.errors.ConfigError` when a codec edge of ``cfg`` keeps a
    schedule driven by timing although ``cfg`` is reproducible."""
    if not cfg.reproducible:
        return
    for edge in cfg.edges():
        # The processor reads the rest of the edge's codec options when the stage starts
        # (``TalkerToCode2WavConfig.from_extra``); only this one can be refused here.
        if edge.processor == "talker_to_code2wav" and edge.extra.get("codec_chunk_adaptive") is True:
            raise ConfigError(
                "reproducible: true needs a fixed chunk schedule, but this edge sets "
                "codec_chunk_adaptive: true (chunks sized by timing); drop it or set it to false"
            )


def with_reproducible(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` in reproducible mode (itself when it already is)."""
    if cfg.reproducible:
        return cfg
    out = msgspec.structs.replace(cfg, reproducible=True)
    check_reproducible(out)
    return out
