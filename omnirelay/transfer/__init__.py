"""Chunk transfer adapter: per-request chunk streams over one connector (docs/protocol.md §4).

Files, one role each:

* ``transfer_config.py`` — :class:`TransferConfig` (flat, validated) and its warnings.
* ``keys.py`` — transfer keys and the internal↔external id map.
* ``envelope.py`` — :class:`ChunkEnvelope`: the finish flags around the processor's
  body, which the adapter never reads (the transfer layer knows no model field).
* ``generation.py`` — :class:`SenderGeneration`, the sender token and its transitions.
* ``lanes.py`` — :class:`LaneExecutor`: FIFO per lane, parallel across lanes.
* ``budget.py`` — :class:`ByteBudget`: unconsumed bytes per edge (backpressure).
* ``events.py`` — plain data for the scheduler/orchestrator and the event mailbox.
* ``processor.py`` — :class:`ChunkProcessor`, what the send side asks of the processor
  that builds each chunk, and :class:`ReleaseScope`.
* ``sender.py`` / ``receiver.py`` — the two roles.
* ``adapter.py`` — :class:`TransferAdapter`, the facade that owns the threads.
"""

from __future__ import annotations

from omnirelay.transfer.adapter import TransferAdapter
from omnirelay.transfer.budget import ByteBudget
from omnirelay.transfer.envelope import ChunkEnvelope
from omnirelay.transfer.events import ChunkInput, FailureKind, SaveResult, TransferEvents, TransferFailure
from omnirelay.transfer.generation import CancelAction, SenderGeneration
from omnirelay.transfer.keys import IdMap, key_prefix, make_key
from omnirelay.transfer.lanes import LaneExecutor
from omnirelay.transfer.processor import BuildRequest, ChunkProcessor, ReleaseScope, StatelessProcessor
from omnirelay.transfer.transfer_config import (
    DEFAULT_STALL_TIMEOUT_S,
    StallTimeoutDisabledWarning,
    TransferConfig,
    TransferConfigWarning,
)

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "BuildRequest",
    "ByteBudget",
    "CancelAction",
    "ChunkEnvelope",
    "ChunkInput",
    "ChunkProcessor",
    "FailureKind",
    "IdMap",
    "LaneExecutor",
    "ReleaseScope",
    "SaveResult",
    "SenderGeneration",
    "StallTimeoutDisabledWarning",
    "StatelessProcessor",
    "TransferAdapter",
    "TransferConfig",
    "TransferConfigWarning",
    "TransferEvents",
    "TransferFailure",
    "key_prefix",
    "make_key",
]
