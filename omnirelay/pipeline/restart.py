"""A pipeline's restart policy for its stage worker processes (docs/design.md §10).

:class:`RestartPolicy` is the ``restart:`` mapping of a pipeline file::

    restart: {max_restarts: 5, window_s: 300, backoff_s: 0.5, max_backoff_s: 10}

A stage whose process dies is started again after ``backoff_s``, doubling with each of its
restarts still inside the window, up to ``max_backoff_s``. More than ``max_restarts``
restarts within ``window_s`` seconds, counted for the whole pipeline (all its stages and
replicas together), and the orchestrator gives up: the stage that died then stays
``failed`` and ``/health`` says why. ``max_restarts: 0`` turns restarts off (what
``omnirelay run`` uses: a one-shot command fails fast instead of waiting for a stage).
"""

from __future__ import annotations

import math

import msgspec

from omnirelay.errors import ConfigError

__all__ = ["NO_RESTARTS", "RESTART_KEYS", "RestartPolicy", "restart_policy_problem"]


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How often and how soon a dead stage is started again; see the module docstring."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        problem = restart_policy_problem(
            max_restarts=self.max_restarts,
            window_s=self.window_s,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
        )
        if problem is not None:
            raise ConfigError(f"restart policy: {problem}")

    @property
    def is_enabled(self) -> bool:
        return self.max_restarts > 0

    def backoff(self, num_recent: int) -> float:
        """The wait before a restart when ``num_recent`` restarts already happened in the
        window: ``backoff_s``, doubled per earlier restart, at most ``max_backoff_s``."""
        if num_recent <= 0:
            return min(self.backoff_s, self.max_backoff_s)
        # 2**64 is already past any sane bound; capping the exponent keeps it a float.
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(num_recent, 64))

    def describe(self) -> str:
        if not self.is_enabled:
            return "restarts are off (max_restarts: 0)"
        return (
            f"at most {self.max_restarts} restarts in {self.window_s:g} s (all stages together), "
            f"backoff {self.backoff_s:g} s doubling up to {self.max_backoff_s:g} s"
        )


RESTART_KEYS = tuple(RestartPolicy.__struct_fields__)


def restart_policy_problem(**values: object) -> str | None:
    """What is wrong with these policy values (the message starts with the key), or None.
    Keys not given take the defaults."""
    n = values.get("max_restarts", 5)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return f"max_restarts must be an int >= 0 (0 turns restarts off), got {n!r}"
    seconds: dict[str, float] = {}
    for key, default in (("window_s", 300.0), ("backoff_s", 0.5), ("max_backoff_s", 10.0)):
        value = values.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"{key} must be a finite number of seconds, got {value!r}"
        seconds[key] = float(value)
    if seconds["window_s"] <= 0:
        return f"window_s must be > 0 seconds, got {seconds['window_s']:g}"
    if seconds["backoff_s"] < 0:
        return f"backoff_s must be >= 0 seconds, got {seconds['backoff_s']:g}"
    if seconds["max_backoff_s"] < seconds["backoff_s"]:
        return (
            f"max_backoff_s must be >= backoff_s ({seconds['max_backoff_s']:g} < {seconds['backoff_s']:g}): "
            "the backoff doubles from backoff_s up to max_backoff_s"
        )
    return None


#: The policy of a one-shot run: a dead stage fails the run at once.
NO_RESTARTS = RestartPolicy(max_restarts=0)
