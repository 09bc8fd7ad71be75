"""One flat, validated configuration of the chunk transfer adapter (docs/design.md §7).

:class:`TransferConfig` is checked when it is built: a wrong value raises
:class:`~omnirelay.errors.ConfigError` naming the field and how to fix it. A stall timeout
of ``0`` disables the last-resort deadline and warns with
:class:`StallTimeoutDisabledWarning` (docs/protocol.md §4.10).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

from omnirelay.errors import ConfigError

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "StallTimeoutDisabledWarning",
    "TransferConfig",
    "TransferConfigWarning",
]

DEFAULT_STALL_TIMEOUT_S = 600.0


class TransferConfigWarning(UserWarning):
    """A transfer configuration value is legal but probably not what you want."""


class StallTimeoutDisabledWarning(TransferConfigWarning):
    """``stall_timeout_s = 0``: a request whose chunk never comes waits forever."""


def _number(name: str, value: object, *, minimum: float, allow_equal: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"transfer config {name!r} must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ConfigError(f"transfer config {name!r} must be finite, got {value!r}")
    if v < minimum or (not allow_equal and v == minimum):
        op = ">=" if allow_equal else ">"
        raise ConfigError(f"transfer config {name!r} must be {op} {minimum:g}, got {value!r}")
    return v


def _integer(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"transfer config {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"transfer config {name!r} must be >= {minimum}, got {value!r}")
    return value


def _stage(name: str, value: object) -> int | None:
    if value is None:
        return None
    return _integer(name, value, minimum=0)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferConfig:
    """Everything the adapter of one stage process needs; validated at construction.

    Roles: a stage sends when ``send_to_stage`` is set and receives when
    ``receive_from_stage`` is set (both for a middle stage). Keys carry the source stage:
    the sender puts ``{ext}_{stage_id}_{n}``, the receiver gets ``{ext}_{receive_from_stage}_{n}``.
    """

    stage_id: int
    send_to_stage: int | None = None
    receive_from_stage: int | None = None
    #: Last-resort deadline on a waiting request's stall time; 0 disables it (warns).
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    #: Unconsumed bytes one edge may hold before a sender waits (backpressure).
    edge_budget_bytes: int = 1 << 30
    #: How long a sender waits for budget before the request fails (FailureKind.BACKPRESSURE).
    backpressure_wait_s: float = 30.0
    #: Send worker threads; one request's big payload occupies one of them only.
    num_send_workers: int = 4
    #: Receive worker threads doing get + decode + commit, so one big decode does not hold
    #: up other requests' chunks (the arrival thread only dispatches).
    num_recv_workers: int = 2
    #: Longest block in ``connector.wait_arrivals`` (bounds shutdown latency too).
    arrival_wait_s: float = 0.1
    #: Period of the slow poll of every registered entry that covers lost notices.
    fallback_poll_s: float = 2.0
    #: Period of the idle send loop's reap pass (docs/protocol.md §3.5: reap also when idle).
    reap_interval_s: float = 0.1
    #: Failures kept for the orchestrator until drained; the oldest are dropped (counted) past it.
    max_undrained_failures: int = 10_000
    #: How long ``shutdown`` waits for each thread to stop.
    shutdown_join_s: float = 5.0

    def __post_init__(self) -> None:
        _integer("stage_id", self.stage_id, minimum=0)
        send_to = _stage("send_to_stage", self.send_to_stage)
        recv_from = _stage("receive_from_stage", self.receive_from_stage)
        if send_to is not None and send_to == self.stage_id:
            raise ConfigError(f"transfer config 'send_to_stage' must differ from stage_id {self.stage_id}")
        if recv_from is not None and recv_from == self.stage_id:
            raise ConfigError(
                f"transfer config 'receive_from_stage' must differ from stage_id {self.stage_id}"
            )
        stall = _number("stall_timeout_s", self.stall_timeout_s, minimum=0.0)
        if stall == 0.0:
            warnings.warn(
                "transfer config 'stall_timeout_s' is 0: the stall timeout is disabled, so a request "
                "whose upstream chunk never arrives waits forever (set a positive number of seconds)",
                StallTimeoutDisabledWarning,
                stacklevel=3,
            )
        _integer("edge_budget_bytes", self.edge_budget_bytes, minimum=1)
        _number("backpressure_wait_s", self.backpressure_wait_s, minimum=0.0)
        _integer("num_send_workers", self.num_send_workers, minimum=1)
        _integer("num_recv_workers", self.num_recv_workers, minimum=1)
        _number("arrival_wait_s", self.arrival_wait_s, minimum=0.0, allow_equal=False)
        _number("fallback_poll_s", self.fallback_poll_s, minimum=0.0, allow_equal=False)
        _number("reap_interval_s", self.reap_interval_s, minimum=0.0, allow_equal=False)
        _integer("max_undrained_failures", self.max_undrained_failures, minimum=1)
        _number("shutdown_join_s", self.shutdown_join_s, minimum=0.0)

    @property
    def is_sender(self) -> bool:
        return self.send_to_stage is not None

    @property
    def is_receiver(self) -> bool:
        return self.receive_from_stage is not None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TransferConfig:
        """Build from plain data (YAML, CLI); unknown keys are rejected by name."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"transfer config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown transfer config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
            )
        if "stage_id" not in data:
            raise ConfigError("transfer config needs 'stage_id'")
        return cls(**dict(data))
