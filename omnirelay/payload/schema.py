"""The typed stage-edge payload and the registry of structs the wire codec may carry.

Interface:

* :class:`OmniPayload` — what one chunk carries from one stage to the next (docs/protocol.md §5):
  ``codes`` (:class:`Codes`), ``meta`` (:class:`Meta`), ``embed``, ``hidden_states``,
  ``ids``, ``speaker``, ``language``, ``request_id`` and free-form ``extras`` for other
  model families. Every field defaults to ``None``; ``None`` fields are omitted on the wire.
  The processors of :mod:`omnirelay.processors` build it; the consuming stage's executor
  reads it (docs/protocol.md §5). Whether a chunk ends its stream is not the payload's business: the transfer
  adapter carries that in its own envelope (:class:`omnirelay.transfer.ChunkEnvelope`).
* :func:`register_struct` — make a ``msgspec.Struct`` type encodable by the codec. The
  three structs here are registered at import.
* :func:`struct_spec` / :func:`lookup_struct` — the codec's view of a registered struct:
  its wire name and, per field, its default and a checker compiled from the annotation.

"Tensor" in a field means :data:`TensorLike`: a ``torch.Tensor`` or a ``numpy.ndarray``.
msgspec never decodes these structs itself (it cannot type tensors); the codec builds
them and validates every field with the compiled checkers, on both ends.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, TypeAlias, Union

import msgspec
import numpy as np
import torch

__all__ = [
    "Codes",
    "FieldSpec",
    "Meta",
    "OmniPayload",
    "StructSpec",
    "TensorLike",
    "lookup_struct",
    "register_struct",
    "struct_spec",
]

TensorLike: TypeAlias = torch.Tensor | np.ndarray

#: A compiled field checker: ``None`` when the value fits, else ``"<sub-path>: <reason>"``
#: where the sub-path is relative to the field (empty, or like ``"['all'][3]"``).
Checker = Callable[[Any], str | None]


class Codes(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Codec tokens. ``audio`` is the flat codebook-major codes of this chunk (docs/protocol.md §5.2)."""

    audio: TensorLike | None = None
    ref: TensorLike | None = None


class Meta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-chunk control data for the consuming model.

    ``left_context_size``: frames of already-sent context at the start of ``codes.audio``
    (docs/protocol.md §5.2, §6.2). ``first_audio``: an upstream marker, on chunk 0 only.
    ``codec_frame_valid``: which of a step's codec frames carry audio (§5.2).
    ``replace_runtime_additional_information``: a generation consumer starts its runtime
    info afresh from this chunk instead of merging it into the earlier ones (§4.8).
    """

    left_context_size: int | None = None
    first_audio: bool | None = None
    codec_frame_valid: TensorLike | None = None
    replace_runtime_additional_information: bool | None = None


class OmniPayload(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One stage-edge chunk's body. The receiver decodes exactly this type (docs/protocol.md §3.7)."""

    codes: Codes | None = None
    meta: Meta | None = None
    embed: dict[str, TensorLike] | None = None
    hidden_states: dict[str, TensorLike] | None = None
    ids: dict[str, TensorLike | list[int]] | None = None
    speaker: str | None = None
    language: str | None = None
    request_id: str | None = None
    extras: dict[str, Any] | None = None


# --------------------------------------------------------------------------- registry


class FieldSpec(msgspec.Struct, frozen=True):
    """One field of a registered struct, as the codec sees it."""

    name: str
    #: The default object, or ``msgspec.NODEFAULT``. A value that *is* the default is
    #: omitted on the wire.
    default: Any
    check: Checker
    #: Types whose every value passes ``check`` (a value of exactly such a type needs no
    #: call to it): the leaf types of the annotation; ``None`` for ``Any`` (all pass).
    exact: frozenset[type] | None = frozenset()


class StructSpec(msgspec.Struct, frozen=True):
    """A registered struct type: its wire name and its fields."""

    name: str
    cls: type[msgspec.Struct]
    fields: tuple[FieldSpec, ...]
    by_name: dict[str, FieldSpec]


_BY_NAME: dict[str, StructSpec] = {}
_BY_CLS: dict[type, StructSpec] = {}


def register_struct(cls: type[msgspec.Struct], *, name: str | None = None) -> type[msgspec.Struct]:
    """Allow ``cls`` on the wire under ``name`` (default: the class name).

    Called once per type at import time of the module that defines it. Each field's
    annotation is compiled to a checker now, so an annotation the codec cannot check is a
    ``TypeError`` here rather than a surprise at run time. Supported annotations: ``None``,
    ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``Any``, ``torch.Tensor``,
    ``numpy.ndarray``, registered structs, ``list[T]``, ``dict[K, V]`` and unions of these.
    """
    wire_name = cls.__name__ if name is None else name
    if wire_name in _BY_NAME and _BY_NAME[wire_name].cls is not cls:
        raise ValueError(f"struct name {wire_name!r} is already registered for {_BY_NAME[wire_name].cls!r}")
    hints = typing.get_type_hints(cls)
    fields = tuple(
        FieldSpec(f.name, f.default, _compile(hints[f.name], {cls}), _exact_types(hints[f.name]))
        for f in msgspec.structs.fields(cls)
    )
    spec = StructSpec(wire_name, cls, fields, {f.name: f for f in fields})
    _BY_NAME[wire_name] = spec
    _BY_CLS[cls] = spec
    return cls


def struct_spec(cls: type) -> StructSpec | None:
    """The registration of ``cls`` (exact type), or ``None``."""
    return _BY_CLS.get(cls)


def lookup_struct(name: str) -> StructSpec | None:
    """The registration under wire name ``name``, or ``None``."""
    return _BY_NAME.get(name)


# --------------------------------------------------------------------------- checkers


def _ok(value: Any) -> str | None:
    return None


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if isinstance(tp, type):
        return tp.__name__
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_describe(a) for a in typing.get_args(tp))}]"
    return repr(tp)


def _exact_types(tp: Any) -> frozenset[type] | None:
    """The types whose every value the checker of annotation ``tp`` accepts (see
    :attr:`FieldSpec.exact`); containers are left to the checker."""
    if tp is Any:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        out: set[type] = set()
        for arg in typing.get_args(tp):
            sub = _exact_types(arg)
            if sub is None:
                return None
            out |= sub
        return frozenset(out)
    if not isinstance(tp, type) or origin is not None:
        return frozenset()
    if tp is float:
        return frozenset({float, int})
    return frozenset({tp})


def _compile(tp: Any, registering: set[type]) -> Checker:
    """Compile annotation ``tp`` into a :data:`Checker`."""
    if tp is Any:
        return _ok
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _compile_union(tp, registering)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        return _compile_list(item_tp, registering)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return _compile_dict(key_tp, value_tp, registering)
    if isinstance(tp, type):
        accepts = _leaf_predicate(tp, registering)
        expected = _describe(tp)

        def check_leaf(value: Any) -> str | None:
            return None if accepts(value) else f": expected {expected}, got {type(value).__name__}"

        return check_leaf
    raise TypeError(f"the payload codec cannot check annotation {tp!r}")


def _leaf_predicate(tp: type, registering: set[type]) -> Callable[[Any], bool]:
    if tp is type(None):
        return lambda v: v is None
    if tp is bool:
        return lambda v: type(v) is bool
    if tp is int:
        return lambda v: isinstance(v, int) and type(v) is not bool
    if tp is float:
        return lambda v: isinstance(v, int | float) and type(v) is not bool
    if tp is str:
        return lambda v: isinstance(v, str)
    if tp is bytes:
        return lambda v: type(v) is bytes
    if issubclass(tp, msgspec.Struct):
        if tp not in _BY_CLS and tp not in registering:
            raise TypeError(f"struct {tp.__name__} must be registered before structs that contain it")
        return lambda v: type(v) is tp
    if tp is torch.Tensor or tp is np.ndarray:
        return lambda v: isinstance(v, tp)
    raise TypeError(f"the payload codec cannot check annotation {tp!r}")


def _compile_union(tp: Any, registering: set[type]) -> Checker:
    args = typing.get_args(tp)
    expected = _describe(tp)
    if all(isinstance(a, type) for a in args):
        # Only leaf types: one predicate pass, no sub-paths to report.
        preds = tuple(_leaf_predicate(a, registering) for a in args)

        def check_leaves(value: Any) -> str | None:
            for pred in preds:
                if pred(value):
                    return None
            return f": expected {expected}, got {type(value).__name__}"

        return check_leaves
    # A union with containers: pick the branch by the container type, report its error.
    leaves = tuple(_leaf_predicate(a, registering) for a in args if isinstance(a, type))
    containers = {typing.get_origin(a): _compile(a, registering) for a in args if not isinstance(a, type)}

    def check_union(value: Any) -> str | None:
        for pred in leaves:
            if pred(value):
                return None
        branch = containers.get(type(value))
        if branch is not None:
            return branch(value)
        return f": expected {expected}, got {type(value).__name__}"

    return check_union


def _compile_list(item_tp: Any, registering: set[type]) -> Checker:
    check_item = _compile(item_tp, registering)
    # A list[int] of token ids can be long: test element types in C before walking.
    fast = {int} if item_tp is int else None

    def check_list(value: Any) -> str | None:
        if type(value) is not list:
            return f": expected list, got {type(value).__name__}"
        if fast is not None and set(map(type, value)) <= fast:
            return None
        for i, item in enumerate(value):
            err = check_item(item)
            if err is not None:
                return f"[{i}]{err}"
        return None

    return check_list


def _compile_dict(key_tp: Any, value_tp: Any, registering: set[type]) -> Checker:
    check_key = _compile(key_tp, registering)
    check_value = _compile(value_tp, registering)

    def check_dict(value: Any) -> str | None:
        if type(value) is not dict:
            return f": expected dict, got {type(value).__name__}"
        for k, v in value.items():
            err = check_key(k)
            if err is not None:
                return f"[{k!r}] (key){err}"
            err = check_value(v)
            if err is not None:
                return f"[{k!r}]{err}"
        return None

    return check_dict


register_struct(Codes)
register_struct(Meta)
register_struct(OmniPayload)
