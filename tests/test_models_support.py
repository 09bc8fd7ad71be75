"""Shared helpers of the ``test_models_*`` files (no tests here).

* :func:`tiny_dir` — the tiny checkpoint, built once per test session in a temporary
  cache directory (``OMNIRELAY_CACHE`` layout) and removed at exit.
* :func:`item` — a :class:`BatchItem` the way the engine builds one.
* :func:`run_thinker` — drive a Thinker executor (and optionally the Thinker → Talker
  processor) for a few requests in lockstep, as the AR scheduler does.
* :func:`single_thread` — a fixture body that runs tests on one torch thread (tiny
  models are fastest that way) and restores the setting.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult, SamplingParams
from omnirelay.models.qwen3_omni.tiny import CACHE_ENV, build_tiny
from omnirelay.payload import OmniPayload
from omnirelay.processors import ThinkerToTalkerProcessor

__all__ = ["CACHE_ENV", "Lockstep", "item", "run_thinker", "single_thread", "tiny_cache", "tiny_dir"]


@functools.cache
def tiny_cache() -> Path:
    """A session-wide cache directory holding the seed-0 tiny model."""
    root = Path(tempfile.mkdtemp(prefix="omnirelay-test-models-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def tiny_dir() -> Path:
    """The seed-0 tiny checkpoint inside :func:`tiny_cache` (built on first call)."""
    import os

    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tiny_cache())
    try:
        return build_tiny(None, seed=0)
    finally:
        if previous is None:
            del os.environ[CACHE_ENV]
        else:
            os.environ[CACHE_ENV] = previous


def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def item(
    rid: str,
    *,
    input_ids: Sequence[int] = (0,),
    all_ids: Sequence[int] | None = None,
    computed: int = 0,
    sampling: SamplingParams | None = None,
    info: Any = None,
    inputs: Any = None,
    exhausted: bool = False,
) -> BatchItem:
    return BatchItem(
        internal_id=rid,
        external_id=rid.split("@")[0],
        input_token_ids=list(input_ids),
        all_token_ids=list(all_ids if all_ids is not None else input_ids),
        num_computed_tokens=computed,
        is_prefill=computed == 0,
        sampling=sampling or SamplingParams(),
        additional_information=info,
        inputs=inputs,
        is_upstream_exhausted=exhausted,
    )


class Lockstep:
    """One request through a Thinker as the AR scheduler runs it: the prompt, then one
    token per step; optionally the Thinker → Talker payloads it produces."""

    def __init__(self, rid: str, prompt: list[int], *, accept_hidden_layer: int | None = None) -> None:
        self.rid = rid
        self.all_ids = list(prompt)
        self.computed = 0
        self.tokens: list[int] = []
        self.text = ""
        self.results: list[ItemResult] = []
        self.payloads: list[OmniPayload] = []
        #: The finish flag the adapter's envelope carries with each payload.
        self.is_last: list[bool] = []
        self.is_finished = False
        self._processor = (
            None if accept_hidden_layer is None else ThinkerToTalkerProcessor(accept_hidden_layer)
        )
        self._state = None if self._processor is None else self._processor.new_state(prompt, speaker="Ethan")

    def next_item(self, sampling: SamplingParams | None = None) -> BatchItem:
        return item(
            self.rid,
            input_ids=self.all_ids[self.computed :],
            all_ids=self.all_ids,
            computed=self.computed,
            sampling=sampling,
        )

    def apply(self, result: ItemResult, *, is_last: bool = False) -> None:
        assert result.internal_id == self.rid
        self.results.append(result)
        self.computed = len(self.all_ids)
        self.all_ids.extend(result.token_ids)
        self.tokens.extend(result.token_ids)
        self.text += result.text or ""
        self.is_finished = result.finished or is_last
        if self._processor is not None and self._state is not None:
            out = result.next_stage_output
            payload = self._processor.step(
                self._state, chunk_id=len(self.payloads), finished=self.is_finished, **out
            )
            if payload is not None:
                self.payloads.append(payload)
                self.is_last.append(self.is_finished)


def run_thinker(executor: Any, prompts: dict[str, list[int]], steps: int, **kw: Any) -> dict[str, Lockstep]:
    """Run ``prompts`` together (one batch per step) for ``steps`` steps, then release."""
    streams = {rid: Lockstep(rid, prompt, **kw) for rid, prompt in prompts.items()}
    for step in range(steps):
        live = [s for s in streams.values() if not s.is_finished]
        if not live:
            break
        results = executor.step([s.next_item() for s in live])
        for stream, result in zip(live, results):
            stream.apply(result, is_last=step == steps - 1)
    for rid in prompts:
        executor.release(rid)
    return streams
