"""Shared fixtures: a fresh namespace per test and the leak audit every test ends with."""

from __future__ import annotations

import gc
import itertools
import os
import sys
from collections.abc import Iterator

import pytest

_COUNTER = itertools.count()


def shm_entries(namespace: str) -> list[str]:
    prefix = f"omnirelay-{namespace}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def assert_no_shm_leaks(namespace: str) -> None:
    left = shm_entries(namespace)
    assert not left, f"/dev/shm objects left in namespace {namespace!r}: {left[:10]}"


@pytest.fixture
def namespace() -> str:
    """A namespace unique to this test; audited for leaks when the test ends."""
    ns = f"t{os.getpid()}x{next(_COUNTER)}"
    yield ns
    assert_no_shm_leaks(ns)


@pytest.fixture(autouse=True)
def _cuda_objects_end_with_their_test() -> Iterator[None]:
    """On a GPU, what a test built (CUDA graphs, their pools, streams, pinned buffers) is
    freed when it ends, while torch and the driver are whole: left to the collection at
    interpreter exit, their destructors ran after CUDA's teardown and the process faulted
    after every test had passed. Nothing to do where CUDA was never started."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.synchronize()


def pytest_configure(config: pytest.Config) -> None:
    """Stage workers of every test start from one fork server that has imported what every
    model family's workers need (a process's first pipeline would otherwise choose, and
    the suite's first pipeline is a toy): each worker then starts without importing torch
    or transformers again (docs/design.md §10)."""
    from omnirelay.models import FAMILIES
    from omnirelay.worker.processes import worker_context

    worker_context(m for family in FAMILIES for m in family.worker_imports)
