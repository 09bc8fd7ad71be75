"""Waking a blocked thread with the GIL released: :class:`Parker`.

A thread woken by a ``threading.Lock.release``, a ``Condition.notify`` or a
``queue.SimpleQueue.put`` is woken while its waker holds the GIL. On a CPU the two share, the
woken thread preempts its waker, finds the GIL taken, sleeps on it and is switched out
again; it runs only at the waker's next GIL release, whenever that comes. A
:class:`Parker` is woken by one ``eventfd_write`` system call, which CPython makes with the
GIL released: the woken thread takes the GIL at once and runs, and the waker resumes when
it blocks (on a shared CPU) or goes on in parallel (on another one). The waker pays for it
in wall time on a shared CPU — the woken thread runs first — which is the order a streaming
pipeline wants: what it wakes is the chunk's next step. The measured difference is in
``docs/performance.md``.

Rules for users: call :meth:`Parker.wake` outside every lock (a thread woken inside one
would block on that lock, which is the futile switch again), and wake a parker once per
park — a waiter parks itself under the user's lock, a waker pops it under the same lock
before waking it, and a waiter that times out removes itself under that lock or, if a
waker got there first, takes the wake-up that is on its way (:meth:`Parker.wait` with
``None``).
"""

from __future__ import annotations

import math
import os
import select
from collections.abc import Iterable

__all__ = ["Parker", "wake_all"]

_HAS_EVENTFD = hasattr(os, "eventfd")


class Parker:
    """Where one thread blocks: its own eventfd (a pipe where there is none)."""

    __slots__ = ("_poller", "_read_fd", "_write_fd")

    def __init__(self) -> None:
        if _HAS_EVENTFD:
            self._read_fd = self._write_fd = os.eventfd(0, os.EFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            self._read_fd, self._write_fd = os.pipe()
        self._poller: select.poll | None = None

    def wake(self) -> None:
        """Wake the thread parked here (or make its next wait return at once)."""
        if _HAS_EVENTFD:
            os.eventfd_write(self._write_fd, 1)
        else:  # pragma: no cover - not Linux
            os.write(self._write_fd, b"\0")

    def wait(self, timeout: float | None) -> bool:
        """Block until woken (True) or ``timeout`` seconds passed (False)."""
        if timeout is not None:
            if self._poller is None:
                self._poller = select.poll()
                self._poller.register(self._read_fd, select.POLLIN)
            if not self._poller.poll(max(0, math.ceil(timeout * 1000.0))):
                return False
        if _HAS_EVENTFD:
            os.eventfd_read(self._read_fd)  # resets the count (one wake per park)
        else:  # pragma: no cover - not Linux
            os.read(self._read_fd, 1)
        return True

    def close(self) -> None:
        """Release the descriptors; only once no thread waits here or will wake it."""
        fds, self._read_fd, self._write_fd = {self._read_fd, self._write_fd}, -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_read_fd", -1) >= 0:
            self.close()


def wake_all(parkers: Iterable[Parker]) -> None:
    """Wake each parker (the caller holds no lock)."""
    for p in parkers:
        p.wake()
