"""The guard around one step of an AR text or codec executor, shared by every family.

:func:`guarded_step` — refuse a batch that lists a request twice, run the step without
autograd, and when it fails release every request of the batch before re-raising: a
failed step fails its requests, and none of them is left half-updated (a KV cache one
token ahead, a sequence without its last token).
"""

from __future__ import annotations

from collections.abc import Callable

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError

__all__ = ["guarded_step"]


def guarded_step(
    batch: list[BatchItem],
    step: Callable[[list[BatchItem]], list[ItemResult]],
    release: Callable[[str], None],
) -> list[ItemResult]:
    """``step(batch)`` under ``torch.inference_mode()``; on any exception, ``release`` of
    each item's internal id, then the exception again (see the module docstring)."""
    import torch

    if len({item.internal_id for item in batch}) != len(batch):
        raise ModelError("a batch lists the same request twice")
    try:
        with torch.inference_mode():
            return step(batch)
    except BaseException:
        for item in batch:
            release(item.internal_id)
        raise
