"""The static model runner: KV slots allocated at startup, padded launches, CUDA graphs.

* ``buckets`` — the bucket shapes and how a step's rows become launches (pure).
* ``slots`` — which KV slot each request holds (pure).
* ``decoder`` — a ``transformers`` decoder stack over the slot KV cache.
* ``graphs`` — CUDA graphs captured at startup, replayed per step (eager off CUDA).
* ``sampler`` — token sampling on the device with per-row parameters.
* ``thinker`` / ``talker`` / ``code2wav`` — the three stages on it.

The executors in :mod:`omnirelay.models` use it when ``executor_args.runner`` says so
(the default on CUDA); the CPU default stays the dynamic ``transformers`` path.
"""

from omnirelay.models.runner.buckets import Buckets, Launch, Piece, plan_decode, plan_prefill
from omnirelay.models.runner.slots import SlotTable
from omnirelay.models.runner.talker import TalkerRow, TalkerRunner
from omnirelay.models.runner.thinker import Row, RowOutput, ThinkerRunner

__all__ = [
    "Buckets",
    "Launch",
    "Piece",
    "Row",
    "RowOutput",
    "SlotTable",
    "TalkerRow",
    "TalkerRunner",
    "ThinkerRunner",
    "plan_decode",
    "plan_prefill",
]
