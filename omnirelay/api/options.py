"""How a pipeline is started: the user's settings, and the runtime's internals apart.

* :class:`PipelineOptions` — what a user sets: the namespace, the tokenizer of
  ``submit(text=...)``, the restart policy, the startup timeout, ``async_chunk``, step
  tracing and the stage-output observer. ``Pipeline.start(name, tokenizer=...)`` builds
  one from its keywords.
* :class:`RuntimeHooks` — what tests and benchmarks swap in the runtime: the engine
  factory of the workers, the orchestrator's input builders, the component registry
  the pipeline file is checked against, and the workers' wait slices.

Both are validated when they are built: a wrong value is a
:class:`~omnirelay.errors.ConfigError` that names the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from omnirelay.errors import ConfigError
from omnirelay.worker.spec import DEFAULT_ENGINE_FACTORY

if TYPE_CHECKING:
    from omnirelay.engine.interfaces import StageOutput
    from omnirelay.orchestrator.requests import InputBuilder
    from omnirelay.pipeline import ComponentRegistry, RestartPolicy

__all__ = ["PipelineOptions", "RuntimeHooks"]


def _positive(owner: str, name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{owner}.{name} must be a number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    """The user's settings of :meth:`Pipeline.start <omnirelay.api.Pipeline.start>`.

    ``namespace``: the /dev/shm namespace (default: the pipeline file's, else a fresh
    one); objects of dead owners in it are reclaimed first. ``tokenizer``: turns
    ``submit(text=...)`` into ids (:func:`~omnirelay.api.chat_tokenizer`). ``restart``:
    the restart policy of dead stage workers (default: the pipeline file's ``restart:``,
    else 5 restarts in 300 s; :data:`~omnirelay.pipeline.NO_RESTARTS` to fail fast).
    ``startup_timeout_s``: how long every stage may take to build its engine.
    ``async_chunk``: overrides the pipeline file's ``async_chunk`` (None: the file's).
    ``trace_steps``: every stage records its steps' times into the metrics of the
    outputs they make (what a :class:`~omnirelay.timeline.StageTrace` reads); off, no
    timing work is done. ``on_stage_output``: called on the front thread with every
    stage's outputs, intermediate stages included, before they are routed (timelines,
    benchmarks); it must be quick and must not raise or block. ``on_stage_ready``:
    called on the front thread with a stage's id when its worker is up during the
    start (a server's ``/health`` shows the start's progress); the same rules.
    ``audio_input``: False starts the pipeline without the stage only requests with audio
    input enter (an ``entry_input: audio`` stage, a speech recognizer): one process less
    for text-only work; a request with audio is then refused.
    """

    namespace: str | None = None
    tokenizer: Callable[[str], list[int]] | None = None
    restart: RestartPolicy | None = None
    startup_timeout_s: float = 120.0
    async_chunk: bool | None = None
    trace_steps: bool = False
    on_stage_output: Callable[[StageOutput], None] | None = None
    on_stage_ready: Callable[[int], None] | None = None
    audio_input: bool = True

    def __post_init__(self) -> None:
        _positive("PipelineOptions", "startup_timeout_s", self.startup_timeout_s)
        if not isinstance(self.audio_input, bool):
            raise ConfigError(f"PipelineOptions.audio_input must be True or False, got {self.audio_input!r}")
        for name in ("async_chunk",):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"PipelineOptions.{name} must be True, False or None, got {value!r}")
        if not isinstance(self.trace_steps, bool):
            raise ConfigError(f"PipelineOptions.trace_steps must be True or False, got {self.trace_steps!r}")
        for name in ("tokenizer", "on_stage_output", "on_stage_ready"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"PipelineOptions.{name} must be callable, got {value!r}")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> PipelineOptions:
        """Options from ``Pipeline.start``'s keywords; a runtime hook or an unknown name
        is a :class:`ConfigError` that says where it goes."""
        fields = {f.name for f in dataclasses.fields(cls)}
        hooks = {f.name for f in dataclasses.fields(RuntimeHooks)}
        for name in settings:
            if name in hooks:
                raise ConfigError(
                    f"{name} is a runtime hook, not a setting: pass runtime=RuntimeHooks({name}=...)"
                )
            if name not in fields:
                raise ConfigError(
                    f"unknown pipeline option {name!r}; the options are {', '.join(sorted(fields))}"
                )
        return cls(**settings)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeHooks:
    """Runtime internals that tests and benchmarks replace; users leave them alone.

    ``engine_factory``: ``"module:function"`` building a stage engine in a worker
    (default: the real one, which also prepares models first, in the starting process).
    ``input_builders``: per stage id, the orchestrator-side builder of a forwarded input
    (default: :func:`omnirelay.orchestrator.input_builders.build_input_builders`).
    ``registry``: the components the pipeline file's names are checked against (default:
    the shipped ones). ``idle_wait_s``: an idle worker's longest wait (it ticks its
    engine once after each, for stall timeouts); ``wait_slice_s``: the wait slices of an
    engine without ``wake()``.
    """

    engine_factory: str = DEFAULT_ENGINE_FACTORY
    input_builders: Mapping[int, InputBuilder] | None = None
    registry: ComponentRegistry | None = None
    idle_wait_s: float = 1.0
    wait_slice_s: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.engine_factory, str):
            raise ConfigError(
                f"RuntimeHooks.engine_factory must be a 'module:function' str, got {self.engine_factory!r}"
            )
        _positive("RuntimeHooks", "idle_wait_s", self.idle_wait_s)
        _positive("RuntimeHooks", "wait_slice_s", self.wait_slice_s)
