"""Shared fixtures: a fresh namespace per test and the leak audit every test ends with."""

from __future__ import annotations

import itertools
import os
import sys

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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A run that started CUDA (the GPU tests) ends as a stage worker does, with
    ``os._exit`` once every report is written: after the tests had passed, the collection
    at interpreter exit faulted in the destructors of what their CUDA graph sets left
    (the driver already torn down). Runs that never started CUDA (CI) exit normally."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1] if _EXIT_STATUS else 0)


def pytest_configure(config: pytest.Config) -> None:
    """Stage workers of every test start from one fork server that has imported what every
    model family's workers need (a process's first pipeline would otherwise choose, and
    the suite's first pipeline is a toy): each worker then starts without importing torch
    or transformers again (docs/design.md §10)."""
    from omnirelay.models import FAMILIES
    from omnirelay.worker.processes import worker_context

    worker_context(m for family in FAMILIES for m in family.worker_imports)
