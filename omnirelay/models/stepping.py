"""The guard around one step of an AR text or codec executor, shared by every family.

:func:`guarded_step` — refuse a batch that lists a request twice, run the step without
autograd, and when it fails release every request of the batch before re-raising: a
failed step fails its requests, and none of them is left half-updated (a KV cache one
token ahead, a sequence without its last token).

:class:`GuardedLaunch` — the same guard around a step split in launch and completion
(:class:`~omnirelay.engine.interfaces.PendingStep`): :func:`guarded_launch` runs the
launch, the completion builds the results; either failing releases the batch.
"""

from __future__ import annotations

from collections.abc import Callable

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError

__all__ = ["GuardedLaunch", "guarded_launch", "guarded_step"]


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


class GuardedLaunch:
    """A launched step: ``is_done`` polls its work, ``finish`` builds its results once
    it ended (or, when ``finish`` is None, ``results`` are already there)."""

    def __init__(
        self,
        batch: list[BatchItem],
        release: Callable[[str], None],
        *,
        is_done: Callable[[], bool] | None = None,
        finish: Callable[[], list[ItemResult]] | None = None,
        results: list[ItemResult] | None = None,
    ) -> None:
        self._batch = batch
        self._release = release
        self._is_done = is_done
        self._finish = finish
        self._results = results

    def is_done(self) -> bool:
        return self._is_done is None or self._is_done()

    def result(self) -> list[ItemResult]:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._results = guarded_step(self._batch, lambda _: finish(), self._release)
        assert self._results is not None
        return self._results


def guarded_launch(
    batch: list[BatchItem],
    launch: Callable[[list[BatchItem]], GuardedLaunch],
    release: Callable[[str], None],
) -> GuardedLaunch:
    """``launch(batch)`` under the guard of :func:`guarded_step`."""
    pending: list[GuardedLaunch] = []

    def run(items: list[BatchItem]) -> list[ItemResult]:
        pending.append(launch(items))
        return []

    guarded_step(batch, run, release)
    return pending[0]
