"""Pipeline YAML (or an in-memory mapping) → a validated :class:`PipelineConfig`.

* :func:`load_pipeline` — a file path or a shipped name → config.
* :func:`parse_pipeline` — already-parsed data (a mapping) → config.

This module checks the *shape* of user input: unknown keys (with a "did you mean"),
types, strict booleans (``true``/``false`` only: not ``0``/``1``, not ``"false"``, not
``yes``), and the ``async_chunk`` tri-state. Values and topology are checked when the
:class:`PipelineConfig` is constructed (:mod:`omnirelay.pipeline.validate`); executor
and processor names only against a registry, when one is given. Every error is a
:class:`PipelineConfigError` naming the file, the stage (id and name) and the key.
"""

from __future__ import annotations

import difflib
import enum
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from omnirelay.errors import ConfigError
from omnirelay.pipeline.config import (
    DEFAULT_INPUT_WAIT_TIMEOUT_S,
    ConnectorRole,
    ConnectorSpec,
    DeviceGroups,
    EntryInput,
    ExecutionType,
    FinalOutputType,
    FlagOrigin,
    GpuPriority,
    PipelineConfig,
    SamplingConfig,
    StageConfig,
)
from omnirelay.pipeline.diagnostics import PipelineConfigWarning, config_error
from omnirelay.pipeline.placement import parse_placement, parse_resources
from omnirelay.pipeline.registry import ComponentRegistry
from omnirelay.pipeline.reproducible import check_reproducible
from omnirelay.pipeline.restart import RESTART_KEYS, RestartPolicy, restart_policy_problem
from omnirelay.pipeline.validate import ENV_NAME_PATTERN
from omnirelay.pipeline.yamlfile import parse_yaml, read_pipeline_text

__all__ = ["PIPELINE_KEYS", "SAMPLING_KEYS", "STAGE_KEYS", "load_pipeline", "parse_pipeline"]

E = TypeVar("E", bound=enum.Enum)


def load_pipeline(
    path_or_name: str | os.PathLike[str],
    *,
    async_chunk_override: bool | None = None,
    registry: ComponentRegistry | None = None,
) -> PipelineConfig:
    """Load and validate a pipeline file, or a shipped pipeline by name (``qwen3-omni-tiny``).

    ``async_chunk_override`` replaces the file's pipeline ``async_chunk`` flag before
    validation (the CLI's ``--async-chunk``). With ``registry``, executor and processor
    names must be registered in it. Emits :class:`PipelineConfigWarning` for settings
    that load but are likely mistakes.
    """
    source, text = read_pipeline_text(path_or_name)
    data = parse_yaml(text, source)
    return parse_pipeline(data, source=source, async_chunk_override=async_chunk_override, registry=registry)


def parse_pipeline(
    data: object,
    *,
    source: str = "<dict>",
    async_chunk_override: bool | None = None,
    registry: ComponentRegistry | None = None,
) -> PipelineConfig:
    """Validate already-parsed pipeline data (see :func:`load_pipeline`)."""
    if async_chunk_override is not None and type(async_chunk_override) is not bool:
        raise ConfigError(
            f"the async_chunk override must be True, False or None, got {async_chunk_override!r}"
        )
    if data is None:
        raise config_error(
            source, None, None, "the file is empty", "write a mapping with at least 'name' and 'stages'"
        )
    if not isinstance(data, Mapping):
        raise config_error(
            source,
            None,
            None,
            f"the top level must be a mapping (key: value), got {_describe(data)}",
            "start the file with 'name: ...' and 'stages:' at the top level",
        )
    ctx = _Ctx(source, None)
    ctx.check_keys(data, PIPELINE_KEYS, "pipeline")
    pending_warnings: list[str] = []

    kwargs: dict[str, Any] = {"source": source}
    kwargs["name"] = ctx.string(data, "name")
    if "description" in data:
        kwargs["description"] = ctx.string(data, "description")
    if "namespace" in data:
        kwargs["namespace"] = ctx.optional_string(data, "namespace")
    if "default_connector" in data:
        kwargs["default_connector"] = ctx.string(data, "default_connector")
    if async_chunk_override is not None:
        kwargs["async_chunk"] = async_chunk_override
        kwargs["async_chunk_origin"] = FlagOrigin.OVERRIDE
        if "async_chunk" in data:
            ctx.strict_bool(data, "async_chunk")  # still reject a malformed file value
    elif "async_chunk" in data:
        kwargs["async_chunk"] = ctx.strict_bool(data, "async_chunk")
        kwargs["async_chunk_origin"] = FlagOrigin.FILE
    kwargs.update(_parse_limits(ctx, data, pending_warnings))
    if "connectors" in data:
        kwargs["connectors"] = _parse_connectors(ctx, data["connectors"])
    if "openai_voices" in data:
        kwargs["openai_voices"] = _parse_openai_voices(ctx, data["openai_voices"])
    if "restart" in data:
        kwargs["restart"] = _parse_restart(ctx, data["restart"])
    if "placement" in data:
        kwargs["placement"] = parse_placement(source, data["placement"])
    stages_raw = data.get("stages")
    if "stages" not in data:
        ctx.fail("stages", "the key is missing", "list the stages under 'stages:'")
    if not isinstance(stages_raw, list):
        ctx.fail(
            "stages",
            f"expected a list of stages, got {_describe(stages_raw)}",
            "write 'stages:' then '- id: 0' …",
        )
    kwargs["stages"] = tuple(_parse_stage(source, index, raw) for index, raw in enumerate(stages_raw))

    cfg = PipelineConfig(**kwargs)
    check_reproducible(cfg)
    if registry is not None:
        registry.check_pipeline(cfg)
    for message in pending_warnings:
        warnings.warn(PipelineConfigWarning(message), stacklevel=3)
    return cfg


def _parse_limits(ctx: _Ctx, data: Mapping[str, Any], pending_warnings: list[str]) -> dict[str, Any]:
    """The pipeline's request limits and modes: the input deadline, default modalities,
    audio streams at once, holding audio while dry, device groups (a warning for a
    disabled deadline goes to ``pending_warnings``)."""
    limits: dict[str, Any] = {}
    if "input_wait_timeout_s" in data:
        timeout = ctx.number(data, "input_wait_timeout_s", fix="use seconds, e.g. 600, or 0 to disable")
        limits["input_wait_timeout_s"] = timeout
        if timeout == 0:
            pending_warnings.append(
                f"{ctx.source}: input_wait_timeout_s is 0, which disables the input deadline: a request "
                "whose input never arrives waits forever (default: "
                f"{DEFAULT_INPUT_WAIT_TIMEOUT_S:g} s)"
            )
    if "default_modalities" in data:
        limits["default_modalities"] = tuple(ctx.string_list(data, "default_modalities"))
    if "max_audio_streams" in data:
        limit = ctx.integer(data, "max_audio_streams", optional=True)
        if limit is not None and limit < 1:
            ctx.fail(
                "max_audio_streams",
                f"expected an int >= 1 or null, got {limit}",
                "write max_audio_streams: <streams one machine keeps real-time>, or null for no fixed limit",
            )
        limits["max_audio_streams"] = limit
    if "hold_audio_while_dry" in data:
        limits["hold_audio_while_dry"] = ctx.strict_bool(data, "hold_audio_while_dry")
    if "device_groups" in data:
        limits["device_groups"] = ctx.choice(data, "device_groups", DeviceGroups)
    if "reproducible" in data:
        limits["reproducible"] = ctx.strict_bool(data, "reproducible")
    if "gpu_memory_utilization" in data:
        limits["gpu_memory_utilization"] = ctx.number(
            data, "gpu_memory_utilization", fix="use a share of the device's memory, e.g. 0.9"
        )
    return limits


def _parse_restart(ctx: _Ctx, raw: object) -> RestartPolicy:
    fix = "write e.g. 'restart: {max_restarts: 5, window_s: 300, backoff_s: 0.5, max_backoff_s: 10}'"
    if not isinstance(raw, Mapping):
        ctx.fail("restart", f"expected a mapping, got {_describe(raw)}", fix)
    sub = _Ctx(ctx.source, ctx.where, prefix="restart.")
    sub.check_keys(raw, RESTART_KEYS, "restart")
    kw: dict[str, Any] = {}
    if "max_restarts" in raw:
        kw["max_restarts"] = sub.integer(raw, "max_restarts")
    for key in ("window_s", "backoff_s", "max_backoff_s"):
        if key in raw:
            kw[key] = sub.number(raw, key, fix="use seconds, e.g. 0.5")
    problem = restart_policy_problem(**kw)
    if problem is not None:
        sub.fail(problem.split(" ", 1)[0], problem, fix)
    return RestartPolicy(**kw)


def _parse_connectors(ctx: _Ctx, raw: object) -> dict[str, ConnectorSpec]:
    if not isinstance(raw, Mapping):
        ctx.fail(
            "connectors",
            f"expected a mapping of connector names to specs, got {_describe(raw)}",
            "write 'connectors:' then 'name: {backend: shm, extra: {...}}'",
        )
    out: dict[str, ConnectorSpec] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name:
            ctx.fail(
                "connectors", f"connector names must be non-empty strings, got {name!r}", "use a plain name"
            )
        sub = _Ctx(ctx.source, f"connector {name!r}")
        if not isinstance(spec, Mapping):
            sub.fail(
                None,
                f"expected a mapping, got {_describe(spec)}",
                "write 'backend: shm' and optional 'extra:'",
            )
        sub.check_keys(spec, CONNECTOR_KEYS, "connector")
        kwargs: dict[str, Any] = {}
        if "backend" in spec:
            kwargs["backend"] = sub.string(spec, "backend")
        if "extra" in spec:
            kwargs["extra"] = sub.plain_mapping(spec, "extra")
        out[name] = ConnectorSpec(**kwargs)
    return out


def _parse_openai_voices(ctx: _Ctx, raw: object) -> dict[str, str]:
    fix = "write 'openai_voices:' then 'alloy: <one of the pipeline's voices>' per OpenAI name"
    if not isinstance(raw, Mapping):
        ctx.fail("openai_voices", f"expected a mapping of voice names, got {_describe(raw)}", fix)
    for name, voice in raw.items():
        if not isinstance(name, str) or not isinstance(voice, str):
            bad = name if not isinstance(name, str) else voice
            ctx.fail("openai_voices", f"names and voices must be strings, got {_describe(bad)}", fix)
    return dict(raw)


def _parse_stage(source: str, index: int, raw: object) -> StageConfig:
    ctx = _Ctx(source, _stage_label(index, raw))
    if not isinstance(raw, Mapping):
        ctx.fail(
            None, f"expected a mapping, got {_describe(raw)}", "write each stage as '- id: N' with its keys"
        )
    ctx.check_keys(raw, STAGE_KEYS, "stage")
    kw: dict[str, Any] = {
        "id": ctx.integer(raw, "id"),
        "name": ctx.string(raw, "name"),
        "execution_type": ctx.choice(raw, "execution_type", ExecutionType),
        "executor": ctx.string(raw, "executor"),
    }
    readers: dict[str, Callable[[Mapping[Any, Any], str], Any]] = {
        "executor_args": ctx.plain_mapping,
        "input_sources": lambda m, k: tuple(ctx.int_list(m, k)),
        "final_output": ctx.strict_bool,
        "final_output_type": lambda m, k: ctx.choice(m, k, FinalOutputType, optional=True),
        "async_chunk": ctx.tri_bool,
        "chunk_processor": ctx.optional_string,
        "full_processor": ctx.optional_string,
        "input_builder": ctx.optional_string,
        "sync_input_builder": ctx.optional_string,
        "connector": ctx.optional_string,
        "connector_role": lambda m, k: ctx.choice(m, k, ConnectorRole, optional=True),
        "max_num_seqs": ctx.integer,
        "max_num_batched_tokens": lambda m, k: ctx.integer(m, k, optional=True),
        "max_prefill_piece_tokens": lambda m, k: ctx.integer(m, k, optional=True),
        "async_scheduling": ctx.strict_bool,
        "sampling": lambda m, k: _parse_sampling(ctx, m[k]),
        "devices": ctx.optional_string,  # or one per replica: read below
        "async_chunk_prewarm_prompt_len": lambda m, k: ctx.integer(m, k, optional=True),
        "env": ctx.env_mapping,
        "gpu_share": lambda m, k: ctx.integer(m, k, optional=True),
        "gpu_priority": lambda m, k: ctx.choice(m, k, GpuPriority, optional=True),
        "entry_input": lambda m, k: ctx.choice(m, k, EntryInput, optional=True),
        "resources": lambda m, k: parse_resources(source, ctx.where or "", m[k]),
        "replicas": ctx.integer,
        "own_process": ctx.strict_bool,
    }
    per_replica = {k: raw[k] for k in ("devices", "resources") if isinstance(raw.get(k), list)}
    for key, read in readers.items():
        if key in raw and key not in per_replica:
            kw[key] = read(raw, key)
    _parse_per_replica(ctx, source, per_replica, kw)
    return StageConfig(**kw)


def _parse_per_replica(ctx: _Ctx, source: str, lists: Mapping[str, list[Any]], kw: dict[str, Any]) -> None:
    """``devices`` and ``resources`` written as one entry per replica: each list holds
    ``replicas`` entries; replica 0's goes in the stage's own key."""
    replicas = kw.get("replicas", 1)
    for key, items in lists.items():
        example = "devices: [cuda:0, cuda:1]" if key == "devices" else "resources: [{hostA: 1}, {hostB: 1}]"
        if type(replicas) is not int or len(items) != replicas:
            ctx.fail(
                key,
                f"lists {len(items)} entries but the stage has replicas: {replicas}",
                f"give one entry per replica (e.g. 'replicas: 2' and '{example}'), or one value for all",
            )
        if key == "devices":
            values = [ctx.optional_string({key: v}, key) for v in items]
            kw["replica_devices"], kw["devices"] = tuple(values), values[0]
        else:
            maps = [parse_resources(source, ctx.where or "", v) for v in items]
            kw["replica_resources"], kw["resources"] = tuple(maps), maps[0]


def _parse_sampling(ctx: _Ctx, raw: object) -> SamplingConfig:
    if not isinstance(raw, Mapping):
        ctx.fail(
            "sampling",
            f"expected a mapping, got {_describe(raw)}",
            "write e.g. 'sampling: {temperature: 0.9}'",
        )
    sub = _Ctx(ctx.source, ctx.where, prefix="sampling.")
    sub.check_keys(raw, SAMPLING_KEYS, "sampling")
    kw: dict[str, Any] = {}
    if "temperature" in raw:
        kw["temperature"] = sub.number(raw, "temperature", optional=True, fix="use e.g. 0.9")
    if "top_p" in raw:
        kw["top_p"] = sub.number(raw, "top_p", optional=True, fix="use e.g. 0.95")
    for key in ("top_k", "seed", "max_tokens"):
        if key in raw:
            kw[key] = sub.integer(raw, key, optional=True)
    if "stop_token_ids" in raw:
        kw["stop_token_ids"] = tuple(sub.int_list(raw, "stop_token_ids"))
    return SamplingConfig(**kw)


#: Keys a pipeline file may use at each level (unknown keys are errors).
PIPELINE_KEYS = (
    "name",
    "description",
    "async_chunk",
    "namespace",
    "input_wait_timeout_s",
    "default_connector",
    "connectors",
    "openai_voices",
    "placement",
    "restart",
    "stages",
    "default_modalities",
    "max_audio_streams",
    "hold_audio_while_dry",
    "device_groups",
    "reproducible",
    "gpu_memory_utilization",
)
#: What a worker's view of a stage adds (never written in a file).
_DERIVED_STAGE_FIELDS = ("replica_devices", "replica_resources", "replica")
STAGE_KEYS = tuple(k for k in StageConfig.__struct_fields__ if k not in _DERIVED_STAGE_FIELDS)
SAMPLING_KEYS = tuple(SamplingConfig.__struct_fields__)
CONNECTOR_KEYS = tuple(ConnectorSpec.__struct_fields__)


class _Ctx:
    """Typed readers for one place in the file; every failure names file, place and key."""

    def __init__(self, source: str, where: str | None, prefix: str = "") -> None:
        self.source = source
        self.where = where
        self.prefix = prefix

    def fail(self, key: str | None, problem: str, fix: str) -> NoReturn:
        raise config_error(self.source, self.where, None if key is None else self.prefix + key, problem, fix)

    def check_keys(self, mapping: Mapping[Any, Any], known: tuple[str, ...], what: str) -> None:
        for key in mapping:
            if not isinstance(key, str):
                self.fail(
                    str(key),
                    f"keys must be strings, got {_describe(key)}",
                    f"use the {what} keys: {', '.join(known)}",
                )
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                self.fail(key, f"unknown {what} key", f"{hint}known {what} keys: {', '.join(known)}")

    def _missing(self, key: str, what: str) -> NoReturn:
        self.fail(key, "the key is missing", f"add '{key}:' ({what})")

    def string(self, m: Mapping[Any, Any], key: str) -> str:
        if key not in m:
            self._missing(key, "a string")
        value = m[key]
        if not isinstance(value, str) or not value:
            self.fail(
                key,
                f"expected a non-empty string, got {_describe(value)}",
                f"write {key}: <text>, quoted if needed",
            )
        return value

    def optional_string(self, m: Mapping[Any, Any], key: str) -> str | None:
        value = m[key]
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.fail(
                key,
                f"expected a non-empty string or null, got {_describe(value)}",
                f'write {key}: "<text>" (quote numbers), or remove the key',
            )
        return value

    def strict_bool(self, m: Mapping[Any, Any], key: str) -> bool:
        value = m[key]
        if type(value) is not bool:
            self.fail(
                key, f"expected true or false, got {_describe(value)}", _bool_fix(key, value, tri=False)
            )
        return value

    def tri_bool(self, m: Mapping[Any, Any], key: str) -> bool | None:
        value = m[key]
        if value is not None and type(value) is not bool:
            self.fail(
                key, f"expected true, false or null, got {_describe(value)}", _bool_fix(key, value, tri=True)
            )
        return value

    def integer(self, m: Mapping[Any, Any], key: str, *, optional: bool = False) -> Any:
        if key not in m:
            self._missing(key, "an int")
        value = m[key]
        if value is None and optional:
            return None
        if type(value) is not int:
            self.fail(
                key,
                f"expected an int, got {_describe(value)}",
                f"write {key}: <int> (no quotes, no decimal point)",
            )
        return value

    def number(self, m: Mapping[Any, Any], key: str, *, fix: str, optional: bool = False) -> Any:
        value = m[key]
        if value is None and optional:
            return None
        if type(value) not in (int, float):
            self.fail(key, f"expected a number, got {_describe(value)}", fix)
        return float(value)

    def int_list(self, m: Mapping[Any, Any], key: str) -> list[int]:
        value = m[key]
        if not isinstance(value, list) or any(type(v) is not int for v in value):
            self.fail(key, f"expected a list of ints, got {_describe(value)}", f"write {key}: [1, 2]")
        return list(value)

    def string_list(self, m: Mapping[Any, Any], key: str) -> list[str]:
        value = m[key]
        if not isinstance(value, list) or any(not isinstance(v, str) or not v for v in value):
            self.fail(
                key, f"expected a list of strings, got {_describe(value)}", f"write {key}: [text, audio]"
            )
        return list(value)

    def choice(
        self,
        m: Mapping[Any, Any],
        key: str,
        enum_cls: type[E],
        *,
        optional: bool = False,
    ) -> Any:
        if key not in m:
            self._missing(key, " | ".join(str(e.value) for e in enum_cls))
        value = m[key]
        if value is None and optional:
            return None
        choices = [str(e.value) for e in enum_cls]
        if not isinstance(value, str) or value not in choices:
            self.fail(
                key,
                f"expected one of {', '.join(choices)}, got {_describe(value)}",
                f"write {key}: {choices[0]}",
            )
        return enum_cls(value)

    def env_mapping(self, m: Mapping[Any, Any], key: str) -> dict[str, str]:
        """Environment variables: names as the shell writes them, scalar values as strings."""
        value = self.plain_mapping(m, key)
        out = {}
        for name, v in value.items():
            if not ENV_NAME_PATTERN.fullmatch(name):
                self.fail(
                    key,
                    f"{name!r} is not an environment variable name",
                    "use letters, digits and '_', not starting with a digit",
                )
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                self.fail(
                    key,
                    f"{name}: expected a string or a number, got {_describe(v)}",
                    f'write {name}: "<text>"',
                )
            out[name] = str(v)
        return out

    def plain_mapping(self, m: Mapping[Any, Any], key: str) -> dict[str, Any]:
        value = m[key]
        if not isinstance(value, Mapping):
            self.fail(key, f"expected a mapping, got {_describe(value)}", f"write {key}: {{name: value}}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            self.fail(key, f"keys must be strings, got {bad[0]!r}", "quote the key or rename it")
        return dict(value)


def _stage_label(index: int, raw: object) -> str:
    """``stage 1 (talker)`` when id and name read well, else ``stages[1] (…)``."""
    sid = raw.get("id") if isinstance(raw, Mapping) else None
    name = raw.get("name") if isinstance(raw, Mapping) else None
    head = f"stage {sid}" if type(sid) is int else f"stages[{index}]"
    return f"{head} ({name})" if isinstance(name, str) and name else f"{head} (unnamed)"


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int):
        return f"the int {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, list):
        return f"a list ({_short(value)})"
    if isinstance(value, Mapping):
        return f"a mapping ({_short(value)})"
    return f"a {type(value).__name__} ({_short(value)})"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TRUTHY = {"true", "yes", "on", "y", "1"}
_FALSY = {"false", "no", "off", "n", "0"}


def _bool_fix(key: str, value: object, *, tri: bool) -> str:
    inherit = ", or null / no key to inherit the pipeline flag" if tri else ""
    guess = str(value).strip().lower() if isinstance(value, str | int) else ""
    if guess in _TRUTHY or guess in _FALSY:
        word = "true" if guess in _TRUTHY else "false"
        return f"write {key}: {word} (a YAML boolean, no quotes){inherit}"
    return f"write {key}: true or {key}: false (YAML booleans, no quotes){inherit}"
