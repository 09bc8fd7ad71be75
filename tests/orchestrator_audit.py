"""Leak audits for the multi-process orchestrator tests.

* :func:`audit_running` — while the pipeline runs: every worker answers a leak-state
  request (the round trip also proves it processed every release sent before), the
  answers show no request state, and the namespace holds no transfer object (pooled
  slot files of live producers are reusable memory, not objects).
* :func:`audit_stopped` — after shutdown: nothing at all under /dev/shm for the
  namespace, no child process left, the control socket directory removed.
"""

from __future__ import annotations

import os
from typing import Any

from omnirelay.api import Pipeline
from omnirelay.connectors.shm import sweep
from omnirelay.worker import leak_paths


def processes() -> dict[int, tuple[int, str]]:
    """Every live process (zombies excluded): pid -> (parent pid, command line)."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        if fields[0] != "Z":
            out[int(entry)] = (int(fields[1]), cmdline)
    return out


def fork_servers(pid: int, procs: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The multiprocessing fork servers ``pid`` started (its stage workers' parent)."""
    procs = processes() if procs is None else procs
    return [p for p, (ppid, cmd) in procs.items() if ppid == pid and "multiprocessing.forkserver" in cmd]


def child_pids() -> list[int]:
    """Live children of this process — the stage workers its fork server forked included —
    except multiprocessing's own helpers (the resource tracker and the fork server)."""
    me = os.getpid()
    procs = processes()
    helpers = {
        p for p, (ppid, cmd) in procs.items() if ppid == me and "multiprocessing.resource_tracker" in cmd
    }
    helpers.update(fork_servers(me, procs))
    parents = helpers | {me}
    return sorted(p for p, (ppid, _) in procs.items() if ppid in parents and p not in helpers)


def pids_alive(pids: list[int | None]) -> list[int]:
    """The pids of ``pids`` that still exist (zombies count as gone)."""
    alive = []
    for pid in pids:
        if pid is None:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rindex(")") + 2 :].split()[0] != "Z":
            alive.append(pid)
    return alive


def transfer_objects(namespace: str) -> list[Any]:
    """Published objects and claims of the namespace (pooled slots excluded)."""
    return [o for o in sweep(namespace).objects if o.kind != "slot"]


def audit_running(pipe: Pipeline) -> None:
    states = pipe.leak_state()
    leaks = {sid: leak_paths(state) for sid, state in states.items()}
    assert not any(leaks.values()), f"request state left in stages: {leaks}"
    objs = transfer_objects(pipe.namespace)
    assert objs == [], f"transfer objects left: {[(o.name, o.key, o.owner_pid) for o in objs]}"
    assert pipe.num_active == 0


def audit_stopped(pipe: Pipeline, *, expect_reclaimed: bool = False) -> None:
    report = pipe.shutdown()
    assert sweep(pipe.namespace).objects == []
    assert report.num_objects_left == 0
    if not expect_reclaimed:
        assert report.num_reclaimed == 0, "shutdown had to reclaim objects a clean worker should have removed"
    assert report.num_killed == 0, report
    assert pids_alive(list(pipe.replica_pids().values())) == []
    assert not os.path.exists(pipe._orch._control.paths.directory if pipe._orch._control else "/nonexistent")
