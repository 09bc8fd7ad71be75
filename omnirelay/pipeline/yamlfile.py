"""Finding and reading pipeline YAML: shipped names, strict YAML, syntax errors.

* :func:`shipped_pipeline_names` — the files in ``omnirelay/pipelines/`` (found beside this
  package's own files, whatever else answers to the name ``omnirelay`` on ``sys.path``).
* :func:`read_pipeline_text` — ``path_or_name`` → ``(source, text)``: a path, or a bare
  shipped name such as ``qwen3-omni-tiny``.
* :func:`parse_yaml` — text → plain data with a *strict* loader: only ``true``/``false``
  are booleans (YAML 1.1 would turn ``yes``, ``no``, ``on`` and ``off`` into booleans
  silently), and a key repeated in one mapping is an error instead of the last one
  winning. Syntax errors name the file, line and column.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from omnirelay.errors import ConfigError, PipelineConfigError

__all__ = ["parse_yaml", "read_pipeline_text", "shipped_pipeline_names"]

#: ``omnirelay/pipelines/``, from this file (``omnirelay/pipeline/yamlfile.py``): not from
#: what ``import omnirelay`` finds, which run from a checkout's parent folder can be the
#: checkout itself taken for a namespace package.
_SHIPPED = Path(__file__).parent.parent / "pipelines"
_YAML_SUFFIXES = (".yaml", ".yml")
_BOOL_TAG = "tag:yaml.org,2002:bool"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and duplicate-key detection."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue  # keys merged from an anchor may be overridden: not duplicates
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: SafeLoader reports it below
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str, source: str) -> object:
    """Parse one YAML document; :class:`PipelineConfigError` with file and line on bad syntax."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        fix = "keep one of the two keys" if "duplicate key" in problem else "fix the syntax at that line"
        raise PipelineConfigError(f"{where}: invalid YAML: {problem}. Fix: {fix}") from exc
    except yaml.YAMLError as exc:
        raise PipelineConfigError(f"{source}: invalid YAML: {exc}") from exc


def shipped_pipeline_names() -> tuple[str, ...]:
    """Names of the pipelines shipped with omnirelay (file stems), sorted."""
    if not _SHIPPED.is_dir():
        return ()
    return tuple(
        sorted(
            entry.name.rsplit(".", 1)[0]
            for entry in _SHIPPED.iterdir()
            if entry.is_file() and entry.name.endswith(_YAML_SUFFIXES)
        )
    )


def read_pipeline_text(path_or_name: str | os.PathLike[str]) -> tuple[str, str]:
    """``(source, text)`` of a pipeline given as a path or a shipped name.

    A value with a ``.yaml``/``.yml`` suffix or a directory part is a path. Otherwise it
    is a shipped name when one matches, else a path (so a local file without a suffix
    still loads).
    """
    raw = os.fspath(path_or_name)
    if not raw:
        raise ConfigError(_missing_message("''", "the pipeline name is empty"))
    looks_like_path = raw.endswith(_YAML_SUFFIXES) or os.sep in raw or "/" in raw
    if not looks_like_path:
        shipped = _SHIPPED / f"{raw}.yaml"
        if shipped.is_file():
            return str(shipped), _read_text(str(shipped), shipped.read_text)
    path = Path(raw)
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(
            _missing_message(repr(raw), f"no pipeline file or shipped pipeline: the path {problem}")
        )
    return str(path), _read_text(str(path), path.read_text)


def _read_text(source: str, read: Any) -> str:
    try:
        text: str = read(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc}); save the pipeline file as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the pipeline file: {exc.strerror or exc}") from exc
    return text


def _missing_message(what: str, problem: str) -> str:
    names = ", ".join(shipped_pipeline_names()) or "none"
    return f"pipeline {what}: {problem}. Give a path to a YAML file or a shipped pipeline name ({names})"
