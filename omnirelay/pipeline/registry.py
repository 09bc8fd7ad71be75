"""Processors and executors by name: how models and processors plug into the engine.

A pipeline file names its executors (``executor: qwen3_omni.talker``) and processor
hooks (``chunk_processor: talker_to_code2wav``); a :class:`ComponentRegistry` maps
those names to the objects that implement them. Registries are plain objects passed
to whoever needs them (no module global): a model package exposes a function that
registers its executors into a registry it is given, and tests build their own with
fakes::

    registry = ComponentRegistry()

    @registry.executors.register("counting_lm")
    class CountingLM: ...

    cfg = load_pipeline("my.yaml", registry=registry)   # names checked at load time

:meth:`ComponentRegistry.check_pipeline` reports a name the registry does not know
with the file, the stage and the key, and the names it does know.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from omnirelay.errors import ConfigError
from omnirelay.pipeline.diagnostics import config_error

if TYPE_CHECKING:
    from omnirelay.pipeline.config import PipelineConfig

__all__ = ["ComponentRegistry", "Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named objects of one kind (``"executor"``, ``"processor"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T, *, replace: bool = False) -> T:
        """Register ``obj`` under ``name``; a second registration of a name is an error
        unless ``replace`` is true. Returns ``obj``."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and not replace:
            raise ConfigError(
                f"{self.kind} {name!r} is already registered; pick another name or pass replace=True"
            )
        self._items[name] = obj
        return obj

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """Decorator form of :meth:`add`: ``@registry.register("name")``."""

        def decorate(obj: T) -> T:
            return self.add(name, obj, replace=replace)

        return decorate

    def get(self, name: str) -> T:
        """The object named ``name``; :class:`ConfigError` listing the known names otherwise."""
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(self.unknown_message(name)) from None

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._items))

    def unknown_message(self, name: str) -> str:
        """``unknown executor 'x' (did you mean 'y'?); known executors: …``."""
        close = difflib.get_close_matches(name, self._items, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(self.names()) or "none registered"
        return f"unknown {self.kind} {name!r}{hint}; known {self.kind}s: {known}"

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


class ComponentRegistry:
    """The two registries a pipeline's names resolve against."""

    def __init__(
        self,
        executors: Registry[Any] | None = None,
        processors: Registry[Any] | None = None,
    ) -> None:
        # Any: the executor and processor protocols live in the engine and processors
        # packages, above this one; they narrow what they get.
        self.executors: Registry[Any] = executors if executors is not None else Registry("executor")
        self.processors: Registry[Any] = processors if processors is not None else Registry("processor")

    def check_pipeline(self, cfg: PipelineConfig) -> None:
        """Every executor and processor name ``cfg`` uses must be registered.

        Processor names are looked up for ``chunk_processor``, ``full_processor``,
        ``input_builder`` and ``sync_input_builder``.
        """
        for stage in cfg.stages:
            if stage.executor not in self.executors:
                raise config_error(
                    cfg.source,
                    stage.label,
                    "executor",
                    self.executors.unknown_message(stage.executor),
                    "name a registered executor, or register this one before loading the pipeline",
                )
            for key in ("chunk_processor", "full_processor", "input_builder", "sync_input_builder"):
                name = getattr(stage, key)
                if name is not None and name not in self.processors:
                    raise config_error(
                        cfg.source,
                        stage.label,
                        key,
                        self.processors.unknown_message(name),
                        "name a registered processor, or register this one before loading the pipeline",
                    )
