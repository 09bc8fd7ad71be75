"""How the front starts stage worker processes: from a fork server with the heavy imports done.

A stage worker needs ``torch`` and its model family's modules, seconds of CPU to import
(docs/performance.md, "Figures behind choices in the code"). Under the ``spawn`` start
method every worker — the first of each stage, each replica, each restart after a
crash — imports them again. Instead the front starts one fork server per process
(:mod:`multiprocessing.forkserver`) that imports them once (:func:`worker_context`'s
``preload``), and each worker is forked from it:

* the server is a fresh interpreter started by the front, not a fork of it: whatever the
  front holds (threads, a CUDA context, sockets) never reaches a worker;
* the server imports but runs nothing: no CUDA context, no thread pool, so forking it is
  safe; every worker creates its own CUDA context after the fork;
* a forked worker inherits the server's environment, not the front's current one: the
  front therefore sends its environment in the worker's spec
  (:attr:`~omnirelay.worker.spec.WorkerSpec.environ`) and the worker takes it first, so a
  variable set in the front after the server started reaches the worker as under spawn;
* the worker's parent is the server, not the front: a worker watches the front itself
  (:func:`watch_parent`), and once the front and its workers are gone the server exits
  too.

The preload list is fixed by the first pipeline a process starts (one fork server per
process); a later pipeline of another family imports what is missing in each worker, as
under spawn. ``OMNIRELAY_WORKER_START=spawn`` starts every worker with ``spawn`` instead.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable
from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["START_ENV", "watch_parent", "worker_context"]

#: ``forkserver`` (the default) or ``spawn``.
START_ENV = "OMNIRELAY_WORKER_START"

#: Imported by the fork server whatever the pipeline (the worker's own modules).
_BASE_PRELOAD = ("omnirelay.worker.main", "omnirelay.worker.factory")

_lock = threading.Lock()
_preload: tuple[str, ...] | None = None


def worker_context(preload: Iterable[str] = ()) -> ForkServerContext | SpawnContext:
    """The multiprocessing context stage workers start from; the first call of a process
    fixes the fork server's imports: the worker's own modules and ``preload``."""
    global _preload
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV} must be forkserver or spawn, got {method!r}")
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        if _preload is None:
            _preload = tuple(dict.fromkeys((*_BASE_PRELOAD, *preload)))
            ctx.set_forkserver_preload(list(_preload))
    return ctx


def watch_parent(front_pid: int) -> Callable[[], bool]:
    """``is_front_alive()`` for a worker of ``front_pid``.

    A spawned worker's parent is the front: alive while it still is. A worker forked from
    the fork server watches the front itself — by its start time in ``/proc`` (a reused
    pid is another process), a zombie counting as gone. (The fork server outlives the
    front while any worker lives: each worker holds a copy of the pipe it waits on.)"""
    parent = os.getppid()
    if parent == front_pid:
        return lambda: os.getppid() == parent
    born = _start_time(front_pid)
    if parent == 1 or born is None:
        return lambda: False  # the front was gone before this worker began
    return lambda: _start_time(front_pid) == born


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat``'s 22nd field); None once it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else fields[19]
