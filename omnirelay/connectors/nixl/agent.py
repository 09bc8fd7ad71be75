"""NIXL underneath the ``nixl`` connector: loading it, one agent per connector, registered buffers.

NIXL ships as ``nixl-cu12`` (module ``nixl_cu12``; the ``nixl`` meta-package re-exports it as
``nixl._api``). Both are tried. On a CPU-only machine the wheel needs nothing else: install it
with ``pip install --no-deps nixl-cu12`` (its declared requirements pull a CUDA build of torch)
beside numpy; its bundled UCX backend moves CPU memory over TCP (``UCX_TLS=tcp``) or, on one
host, over shared memory. Its CUDA transport plug-ins stay unloaded without a GPU driver.

**The progress thread is required.** Over TCP, UCX emulates a one-sided READ with active
messages that the *target's* worker must serve, so the producer's agent runs NIXL's progress
thread; without it a reader's READ never completes. NIXL's Python API starts that thread with
no pause between polls: an idle agent then burns a core, and spinning agents fight over
the cores their READs need. :class:`Agent` sets the pause to ``progress_delay_us``
(default 100 µs; docs/performance.md has what each costs).

:class:`Agent` serializes every call into NIXL with one lock (the agent is shared by the put
thread, the claim server thread and readers), and keeps the buffers it registered
(:class:`Buffer`), pooled by size so that a steady stream registers nothing new.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnirelay.errors import ConnectorError

__all__ = ["Agent", "Buffer", "BufferPool", "load_nixl", "unavailable_reason"]

_MODULES = ("nixl_cu12", "nixl._api", "nixl")
_MIN_BUFFER = 16 << 10
_MiB = 1 << 20
_BUFFER_IDS = itertools.count(1)
#: agents are built one at a time (the progress-thread pause is set on NIXL's bindings)
_BUILD_LOCK = threading.Lock()


def load_nixl() -> Any:
    """The NIXL Python API module; :class:`ConnectorError` saying how to install it when absent."""
    # NIXL's Python logger writes INFO lines to stdout, where `omnirelay run` prints its JSON.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            if not os.environ.get("NIXL_LOG_LEVEL") or os.environ["NIXL_LOG_LEVEL"] == "WARN":
                logging.getLogger("nixl").setLevel(logging.WARNING)  # imported before we could say
            return module
    raise ConnectorError(
        "the nixl connector needs NIXL: pip install --no-deps 'nixl-cu12>=1.5,<2' (the wheel's own "
        "requirements would pull a CUDA build of torch; the 'multihost' extra holds Ray only); "
        f"import failed: {'; '.join(errors)}"
    )


def unavailable_reason() -> str | None:
    """None when NIXL imports, else why not (for ``omnirelay doctor`` and skips)."""
    try:
        load_nixl()
    except ConnectorError as exc:
        return str(exc)
    return None


def buffer_size(need: int) -> int:
    """Power-of-two sizes up to 1 MiB, whole MiB above: few sizes, so buffers are reused."""
    if need <= _MiB:
        size = _MIN_BUFFER
        while size < need:
            size <<= 1
        return size
    return (need + _MiB - 1) & ~(_MiB - 1)


@dataclass(eq=False)
class Buffer:
    """One registered region of this agent's memory."""

    id: int
    array: np.ndarray
    descs: Any  # the registration (nixlRegDList)
    #: remote agents that were sent this buffer's registration metadata
    known_by: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return int(self.array.nbytes)

    def view(self) -> memoryview:
        return memoryview(self.array.data)

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)


class _PausedBindings:
    """NIXL's bindings, except that a new agent's progress thread pauses between polls."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's own name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def _new_nixl_agent(nixl: Any, name: str, delay_us: int) -> Any:
    config = nixl.nixl_agent_config(
        enable_prog_thread=True,
        backends=["UCX"],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    api: Any = sys.modules[nixl.nixl_agent.__module__]
    with _BUILD_LOCK:
        bindings = api.nixlBind
        api.nixlBind = _PausedBindings(bindings, delay_us)
        try:
            return nixl.nixl_agent(name, config)
        finally:
            api.nixlBind = bindings


class Agent:
    """One NIXL agent (UCX backend, progress thread on) and the calls the connector makes."""

    def __init__(self, name: str, progress_delay_us: int = 100) -> None:
        nixl = load_nixl()
        self.name = name
        self.lock = threading.Lock()
        try:
            self._agent = _new_nixl_agent(nixl, name, progress_delay_us)
        except Exception as exc:
            raise ConnectorError(f"cannot start a NIXL agent: {exc!r}") from exc
        if "UCX" not in self._agent.backends:
            raise ConnectorError("NIXL's UCX backend did not start (plug-in missing from the wheel?)")
        self._remotes: set[str] = set()

    def register(self, size: int) -> Buffer:
        """A fresh zeroed buffer of ``size`` bytes, registered with UCX."""
        array = np.zeros(size, dtype=np.uint8)
        with self.lock:
            descs = self._agent.register_memory([(int(array.ctypes.data), size, 0, "")], "DRAM")
        return Buffer(next(_BUFFER_IDS), array, descs)

    def deregister(self, buf: Buffer) -> None:
        with self.lock:
            self._agent.deregister_memory(buf.descs)

    def metadata_for(self, buf: Buffer, peer: str) -> bytes | None:
        """Registration metadata of ``buf`` for ``peer`` (with connection info the first
        time), or None when ``peer`` was already sent it."""
        if peer in buf.known_by:
            return None
        with self.lock:
            md = self._agent.get_partial_agent_metadata(buf.descs, inc_conn_info=True)
        buf.known_by.add(peer)
        return bytes(md)

    def learn(self, metadata: bytes) -> str:
        """Load a peer's (partial) metadata; returns the peer's agent name."""
        with self.lock:
            name = self._agent.add_remote_agent(metadata)
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(peer)
        return peer

    def forget(self, peer: str) -> None:
        """Drop a peer (it died or closed); a later contact loads it again."""
        if peer not in self._remotes:
            return
        self._remotes.discard(peer)
        with self.lock:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass

    def read(self, peer: str, remote_addr: int, dst: Buffer, nbytes: int, timeout_s: float) -> str | None:
        """READ ``nbytes`` at ``remote_addr`` of ``peer`` into ``dst``; None on success, else why.

        NIXL cannot cancel a transfer: on a timeout the handle is abandoned (released
        with the agent) and the caller must never reuse ``dst``.
        """
        agent = self._agent
        try:
            with self.lock:
                local = agent.get_xfer_descs([(dst.addr, nbytes, 0)], "DRAM")
                remote = agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
                handle = agent.initialize_xfer("READ", local, remote, peer)
                state = agent.transfer(handle)
        except Exception as exc:
            return f"NIXL READ from {peer} could not start: {exc!r}"
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                agent._leaked_xfer_handles.append(handle._handle)
                handle._released = True  # released with the agent: NIXL cannot cancel it
                return f"NIXL READ from {peer} did not finish within {timeout_s:g} s"
            if pause:
                time.sleep(pause)
            pause = min(0.001, pause * 2 or 0.00005)
            with self.lock:
                state = agent.check_xfer_state(handle)
        with self.lock:
            handle.release()
        return None if state == "DONE" else f"NIXL READ from {peer} failed ({state})"

    def close(self) -> None:
        """Forget every peer and stop the agent (its progress thread serves no READ after
        this, so the memory it registered may be freed)."""
        for peer in list(self._remotes):
            self.forget(peer)
        with self.lock:
            self._agent = None


class BufferPool:
    """Registered buffers kept for reuse: best fit, bounded in count and bytes."""

    def __init__(self, agent: Agent, max_slots: int, max_bytes: int) -> None:
        self.agent = agent
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self._free: list[Buffer] = []
        self._lock = threading.Lock()
        #: every buffer registered and not yet deregistered (in use or free)
        self.num_registered = 0
        self.registered_bytes = 0

    def take(self, need: int) -> Buffer:
        size = buffer_size(need)
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                if (
                    buf.size >= size
                    and buf.size <= 2 * size
                    and (best is None or buf.size < self._free[best].size)
                ):
                    best = i
            if best is not None:
                return self._free.pop(best)
        buf = self.agent.register(size)
        with self._lock:
            self.num_registered += 1
            self.registered_bytes += buf.size
        return buf

    def give(self, buf: Buffer) -> None:
        """Back to the pool, or deregistered when the pool is full."""
        with self._lock:
            pooled = sum(b.size for b in self._free)
            if len(self._free) < self.max_slots and pooled + buf.size <= self.max_bytes:
                self._free.append(buf)
                return
        self.drop(buf)

    def drop(self, buf: Buffer) -> None:
        self.agent.deregister(buf)
        with self._lock:
            self.num_registered -= 1
            self.registered_bytes -= buf.size

    def free_stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._free), sum(b.size for b in self._free)

    def clear(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            self.drop(buf)
