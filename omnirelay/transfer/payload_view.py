"""The adapter's only view into payloads: flags, fields and the finish stamp.

The adapter treats payloads as opaque objects built by a processor. It reads and writes
them only here, and accepts both shapes a payload can have (SPEC §3.7): a typed struct
(``payload.meta.finished``) and plain data (``payload["meta"]["finished"]``). Flags may be
a ``bool``, an ``int`` or a 1-element tensor / ndarray.

* :func:`read_flag` — ``meta.<name>`` as a bool (missing → False).
* :func:`field` — one field of a struct or mapping, with a default.
* :func:`as_mapping` — a shallow ``dict`` view (``None`` struct fields omitted, as on the wire).
* :func:`stamp_flags` — write ``meta.finished`` / ``meta.is_segment_finished`` (SPEC §4.4 step 5).
* :func:`default_empty_payload` — the payload sent at a boundary when the processor built none.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping, MutableMapping
from typing import Any

import msgspec

__all__ = [
    "as_mapping",
    "default_empty_payload",
    "field",
    "flag_value",
    "is_empty_payload",
    "read_flag",
    "stamp_flags",
]


def field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise; ``default`` when absent or None."""
    # A plain dict first: an ABC isinstance check costs more than the lookup (hot path).
    if type(obj) is dict or isinstance(obj, Mapping):
        value = obj.get(name, default)
    else:
        value = getattr(obj, name, default)
    return default if value is None else value


def flag_value(value: Any) -> bool:
    """A flag's truth: bool/int as is, a 1-element tensor or array by its element.

    Raises ValueError for anything else (a flag with several elements is a contract violation).
    """
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, bool | int):
        return bool(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return bool(item())
        except (ValueError, RuntimeError) as exc:
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"a flag must hold exactly one element, got shape {shape}") from exc
    raise ValueError(f"a flag must be a bool or a 1-element tensor, got {type(value).__name__}")


def read_flag(payload: Any, name: str) -> bool:
    """``payload.meta.<name>`` (struct) or ``payload["meta"][name]`` (mapping) as a bool."""
    if payload is None:
        return False
    meta = field(payload, "meta")
    if meta is None:
        return False
    return flag_value(field(meta, name))


def is_empty_payload(payload: Any) -> bool:
    """SPEC §4.8: an empty or falsy payload is never committed."""
    if payload is None:
        return True
    if type(payload) is dict:
        return not payload
    if isinstance(payload, msgspec.Struct):
        return all(getattr(payload, f) is None for f in payload.__struct_fields__)
    try:
        return not bool(payload)
    except (ValueError, RuntimeError):  # a multi-element tensor has no truth value
        return False


def as_mapping(obj: Any) -> dict[str, Any]:
    """A shallow dict of a mapping, msgspec struct or dataclass (None struct fields omitted)."""
    if type(obj) is dict or isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, msgspec.Struct):
        return {f: v for f in obj.__struct_fields__ if (v := getattr(obj, f)) is not None}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: v for f in dataclasses.fields(obj) if (v := getattr(obj, f.name)) is not None}
    raise TypeError(f"payload part of type {type(obj).__name__} is not a mapping or a struct")


@functools.lru_cache(maxsize=64)
def _meta_factory(struct_type: type) -> type | None:
    """The struct class of ``struct_type.meta`` (``Meta | None`` → ``Meta``), if there is one."""
    try:
        hints = typing.get_type_hints(struct_type)
    except Exception:  # unresolvable annotations: no factory
        return None
    hint = hints.get("meta")
    candidates = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    for c in candidates:
        if isinstance(c, type) and issubclass(c, msgspec.Struct):
            return c
    return None


def _set(obj: Any, name: str, value: Any) -> None:
    if type(obj) is dict or isinstance(obj, MutableMapping):
        obj[name] = value
    else:
        setattr(obj, name, value)


def stamp_flags(payload: Any, *, finished: bool, segment_finished: bool) -> Any:
    """Stamp the finish flags on a freshly built payload (mutates it) and return it.

    ``meta.finished`` is set to ``finished`` unless the processor set it itself and marked
    ``meta.codec_streaming``; ``meta.is_segment_finished`` is set only when absent. A
    payload without a meta gets one (a dict, or the struct's annotated meta type).
    Raises TypeError when no meta can be attached.
    """
    if type(payload) is dict:  # the common shape, without the generic accessors
        meta = payload.get("meta")
        if meta is None:
            payload["meta"] = {"finished": bool(finished), "is_segment_finished": bool(segment_finished)}
            return payload
        if type(meta) is dict:
            if meta.get("finished") is None or not flag_value(meta.get("codec_streaming")):
                meta["finished"] = bool(finished)
            if meta.get("is_segment_finished") is None:
                meta["is_segment_finished"] = bool(segment_finished)
            return payload
    meta = field(payload, "meta")
    if meta is None:
        if type(payload) is dict or isinstance(payload, MutableMapping):
            meta = payload["meta"] = {}
        else:
            factory = _meta_factory(type(payload)) if isinstance(payload, msgspec.Struct) else None
            if factory is None:
                raise TypeError(f"cannot stamp finish flags on a {type(payload).__name__} without a meta")
            meta = factory()
            payload.meta = meta
    keep_finished = field(meta, "finished") is not None and flag_value(field(meta, "codec_streaming"))
    if not keep_finished:
        _set(meta, "finished", bool(finished))
    if field(meta, "is_segment_finished") is None:
        _set(meta, "is_segment_finished", bool(segment_finished))
    return payload


def default_empty_payload(finished: bool, segment_finished: bool) -> Any:
    """What goes out at a boundary when the processor built nothing: finish markers only."""
    return {"meta": {"finished": bool(finished), "is_segment_finished": bool(segment_finished)}}
