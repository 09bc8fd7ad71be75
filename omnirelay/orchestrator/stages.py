"""The stage worker processes as the front sees them, and what it reports about them.

* :class:`StageProcess` — one stage's worker: its process, readiness, exit and death
  reason, the event socket the loop watches (the orchestrator's books, one per stage);
* :class:`StageHealth` / :class:`PipelineHealth` — ``Orchestrator.health()``'s answer;
* :class:`ShutdownReport` — what shutdown found;
* :func:`describe_exit` — an exit code in words.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from typing import Any

import msgspec

__all__ = ["PipelineHealth", "ShutdownReport", "StageHealth", "StageProcess", "describe_exit"]


class StageHealth(msgspec.Struct, kw_only=True):
    """One stage as the front sees it (and as its worker reports, when alive)."""

    stage_id: int
    name: str
    is_alive: bool
    pid: int | None
    exitcode: int | None = None
    #: requests the stage holds, by the router's books
    num_requests: int = 0
    #: requests the worker's engine holds, by the worker (None: no reply)
    queue_depth: int | None = None
    engine: dict[str, Any] | None = None
    error: str | None = None


class PipelineHealth(msgspec.Struct, kw_only=True):
    is_healthy: bool
    namespace: str
    num_requests: int
    stages: list[StageHealth]


class ShutdownReport(msgspec.Struct, kw_only=True):
    """What shutdown found: exit codes, and objects the final sweep had to reclaim."""

    exitcodes: dict[int, int | None]
    num_killed: int = 0
    num_reclaimed: int = 0
    num_objects_left: int = 0


def describe_exit(exitcode: int | None) -> str:
    """``killed by SIGKILL`` / ``exit code 1`` / ``still running``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass
class StageProcess:
    """One stage's worker process as the front tracks it (the orchestrator's thread only)."""

    stage_id: int
    label: str
    name: str
    process: SpawnProcess | None = None
    pid: int | None = None
    exitcode: int | None = None
    is_ready: bool = False
    is_exited: bool = False
    is_dead: bool = False  # failed, as far as requests are concerned
    death_reason: str | None = None
    said_goodbye: bool = False
    hello: asyncio.Future[None] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    #: the event socket's descriptor the loop watches (None: not watched)
    reader_fd: int | None = None
