"""How stage workers start and watch the front (omnirelay/worker/processes.py).

A worker forked from the front's fork server is not the front's child: it watches the
front by its start time, so a killed front — a zombie until reaped, then gone — ends
the watch, and a reused pid does not revive it. The start method is a setting with a
clear error.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from omnirelay.worker.processes import START_ENV, watch_parent, worker_context


def test_a_front_that_is_the_parent_is_watched_as_the_parent() -> None:
    assert watch_parent(os.getppid())()


def test_a_front_that_is_not_the_parent_is_watched_until_it_dies() -> None:
    front = subprocess.Popen(["sleep", "60"])
    try:
        is_alive = watch_parent(front.pid)
        assert is_alive()
        front.kill()
        os.waitid(os.P_PID, front.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
        assert not is_alive()
    finally:
        front.kill()
        front.wait()
    assert not is_alive()  # reaped: gone


def test_a_front_gone_before_the_worker_began_is_never_alive() -> None:
    front = subprocess.Popen(["true"])
    front.wait()
    assert not watch_parent(front.pid)()


def test_the_start_method_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_ENV, "spawn")
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ValueError, match="forkserver or spawn"):
        worker_context()
    monkeypatch.delenv(START_ENV)
    assert worker_context() is multiprocessing.get_context("forkserver")
