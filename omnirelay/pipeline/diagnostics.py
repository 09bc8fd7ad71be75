"""How the pipeline package reports problems: warnings and error messages.

* :class:`OmniRelayWarning` — base of every warning omnirelay emits on purpose (the
  exception tree in :mod:`omnirelay.errors` holds errors only).
* :class:`PipelineConfigWarning` — a pipeline file that loads but is probably not what
  was meant (for example ``input_wait_timeout_s: 0`` disables the input deadline).
* :func:`config_error` — the one place that formats a :class:`PipelineConfigError`, so
  every message names the file, the place (stage, connector or edge), the key, what is
  wrong, and how to fix it.
"""

from __future__ import annotations

from omnirelay.errors import PipelineConfigError

__all__ = ["OmniRelayWarning", "PipelineConfigWarning", "config_error"]


class OmniRelayWarning(UserWarning):
    """Base class of warnings omnirelay emits on purpose."""


class PipelineConfigWarning(OmniRelayWarning):
    """A pipeline file validates but has a setting that is likely a mistake."""


def config_error(
    source: str, where: str | None, key: str | None, problem: str, fix: str
) -> PipelineConfigError:
    """Build the error for one bad setting.

    ``source`` is the file (or ``<dict>``), ``where`` the place inside it (``"stage 1
    (talker)"``, ``"connector 'codec'"``, ``"edge 0 -> 1 (thinker -> talker)"``; ``None``
    for the top level), ``key`` the offending key, ``problem`` what is wrong and ``fix``
    what to write instead.
    """
    place = source if where is None else f"{source}, {where}"
    if key is not None:
        place = f"{place}, key '{key}'"
    return PipelineConfigError(f"{place}: {problem}. Fix: {fix}")
