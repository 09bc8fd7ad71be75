"""Encoding: one walk over the object plans the header, then one copy per tensor writes it.

* :func:`plan_encode` ``(obj) -> EncodePlan`` — walk ``obj`` once, validate it, encode the
  header; tensors are only referenced. ``plan.nbytes`` is the exact encoded length.
* :meth:`EncodePlan.write_into` ``(buf) -> int`` — write the encoding into a writable
  buffer (a shared-memory slot), one copy per tensor, straight from the (possibly strided,
  possibly device) source.
* :func:`encode` ``(obj) -> bytes`` — plan + write into a fresh buffer.

``plan_encode(obj, place=...)`` is the GPU-direct form (docs/protocol.md §3.9): each tensor
is first offered to ``place``, which returns the bytes of a device reference once the
tensor is in a device pool (its region is then a "device" region holding them), or None
(the tensor's bytes travel as usual). Without ``place`` the walk is the plain one.

Every object takes the same walk (:class:`_Planner`); errors name the offending path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec
import numpy as np
import torch

from omnirelay.errors import PayloadEncodeError
from omnirelay.payload.dtypes import TORCH_BY_DTYPE, numpy_name
from omnirelay.payload.schema import StructSpec, struct_spec
from omnirelay.payload.wire import (
    ALIGNMENT,
    EXT_REGION,
    EXT_STRUCT,
    EXT_TUPLE,
    MAGIC,
    MAX_DIMS,
    PREFIX,
    PREFIX_SIZE,
    U32,
    WIRE_VERSION,
    align,
)

__all__ = ["EncodePlan", "Placer", "encode", "plan_encode"]

#: Regions up to this size are copied with a memoryview assignment (cheapest for small
#: ones, but it holds the GIL); larger ones with numpy, which releases the GIL while it
#: copies, so a large put never stalls the threads moving other requests' chunks
#: (docs/performance.md, "Figures behind choices in the code").
_SMALL_COPY: Final = 256 << 10
#: bytes at least this long travel as a region (one copy) rather than inside the header.
_BYTES_REGION_MIN: Final = 4096
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
_PLAIN_TYPES: Final = frozenset({str, int, float, bool, type(None)})
#: Above this many elements, a list of ints is type-checked by msgspec in C, which beats
#: the type scan below for a prompt's worth of token ids (docs/performance.md).
_LONG_LIST: Final = 64
_ZEROS: Final = bytes(ALIGNMENT)

_ENCODER = msgspec.msgpack.Encoder()
_astuple = msgspec.structs.astuple
_Ext = msgspec.msgpack.Ext
#: The reference values of the first regions, made once (a chunk has a handful).
_REGION_REFS: Final = tuple(_Ext(EXT_REGION, U32.pack(i)) for i in range(64))

#: ``place(tensor) -> bytes | None``: the encoded device reference of ``tensor`` once it is
#: in a device pool, or None for the host path (see the module docstring).
Placer = Callable[[torch.Tensor], bytes | None]

#: A region table entry as the header carries it: (kind, dtype, shape, offset, nbytes).
RegionEntry = tuple[str, str, tuple[int, ...], int, int]


class _PathError(Exception):
    """Raised at the offending leaf; each container on the way up prepends its segment."""

    def __init__(self, tail: str) -> None:
        super().__init__(tail)
        self.tail = tail
        self.segments: list[str] = []  # innermost first


def _type_name(tp: type) -> str:
    return tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


def _check_int(value: int) -> None:
    if not _INT_MIN <= value <= _INT_MAX:
        raise _PathError(f": int {value} does not fit in 64 bits (range -2**63 .. 2**64-1)")


def _dict_key(key: Any) -> str | int:
    """A dict key that is not a plain ``str``, as it travels (str or int), or _PathError."""
    kt = type(key)
    if kt is not int:
        if isinstance(key, str):
            return str.__str__(key)
        if not isinstance(key, int) or kt is bool:
            raise _PathError(f": dict key {key!r} has type {_type_name(kt)}; keys must be str or int")
        key = int.__index__(key)
    try:
        _check_int(key)
    except _PathError as exc:
        exc.segments.append(f"[{key}] (key)")
        raise
    return key


class _Planner:
    """One walk over the object: lowers it to msgpack-able values and collects regions.

    Lists of plain values are passed to msgpack as they are, so an int beyond 64 bits in
    one surfaces only when the header is encoded; with ``strict`` set every list item is
    walked instead, which is how :func:`plan_encode` names the path of such an int.
    """

    __slots__ = ("data_len", "regions", "sources", "strict")

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.regions: list[RegionEntry] = []
        self.sources: list[tuple[int, int, Any]] = []  # (offset, nbytes, ndarray | Tensor | bytes)
        self.data_len = 0

    def lower(self, obj: Any) -> Any:
        tp = type(obj)
        if tp is str or tp is float or tp is bool or obj is None:
            return obj
        if tp is int:
            _check_int(obj)
            return obj
        if tp is dict:
            return self._lower_dict(obj)
        if tp is torch.Tensor:
            return self._add_tensor(obj)
        spec = struct_spec(tp)
        if spec is not None:
            return self._lower_struct(obj, spec)
        if tp is list:
            return self._lower_items(obj)
        if tp is tuple:
            return _Ext(EXT_TUPLE, _ENCODER.encode(self._lower_items(obj)))
        if tp is bytes:
            if len(obj) >= _BYTES_REGION_MIN:
                return self._add_region("bytes", "uint8", (len(obj),), len(obj), obj)
            return obj
        if isinstance(obj, torch.Tensor):
            return self._add_tensor(obj)
        if tp is np.ndarray:
            return self._add_array(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, int):
            return self.lower(int.__index__(obj))
        if isinstance(obj, float):
            return float.__float__(obj)
        raise _PathError(f": {_unsupported(obj)}")

    def _lower_items(self, seq: list[Any] | tuple[Any, ...]) -> list[Any] | tuple[Any, ...]:
        if not self.strict:
            if len(seq) > _LONG_LIST and type(seq[0]) is int:
                try:  # token ids: checked in C; an out-of-range int surfaces at encode
                    return msgspec.convert(seq, list[int], strict=True)
                except msgspec.ValidationError:
                    pass
            if set(map(type, seq)) <= _PLAIN_TYPES:
                return seq  # msgpack encodes list and tuple alike
        out = []
        for i, item in enumerate(seq):
            try:
                out.append(self.lower(item))
            except _PathError as exc:
                exc.segments.append(f"[{i}]")
                raise
        return out

    def _lower_dict(self, d: dict[Any, Any]) -> dict[Any, Any]:
        # The common values are handled inline: every chunk's header comes through here.
        out = {}
        for key, value in d.items():
            if type(key) is not str:
                key = _dict_key(key)
            tv = type(value)
            if tv is str or tv is float or tv is bool or value is None:
                out[key] = value
                continue
            if tv is int and _INT_MIN <= value <= _INT_MAX:
                out[key] = value  # (one out of range takes self.lower, which names it)
                continue
            try:
                if tv is dict:
                    out[key] = self._lower_dict(value)
                elif tv is torch.Tensor:
                    out[key] = self._add_tensor(value)
                else:
                    out[key] = self.lower(value)
            except _PathError as exc:
                exc.segments.append(f"[{key!r}]")
                raise
        return out

    def _lower_struct(self, obj: Any, spec: StructSpec) -> msgspec.msgpack.Ext:
        # Every chunk is a struct: its fields are read in one call, a value of a type its
        # annotation takes as it is skips the checker, and the common values are lowered
        # inline: the walk is most of a small chunk's encode.
        fields = {}
        for field, value in zip(spec.fields, _astuple(obj)):
            if value is field.default:
                continue
            tv = type(value)
            try:
                exact = field.exact
                if exact is not None and tv not in exact:
                    err = field.check(value)
                    if err is not None:
                        raise _PathError(err)
                if tv is str or tv is float or tv is bool or (tv is int and _INT_MIN <= value <= _INT_MAX):
                    fields[field.name] = value  # (an int out of range takes self.lower, which names it)
                elif tv is torch.Tensor:
                    fields[field.name] = self._add_tensor(value)
                else:
                    sub = struct_spec(tv)
                    fields[field.name] = (
                        self._lower_struct(value, sub) if sub is not None else self.lower(value)
                    )
            except _PathError as exc:
                exc.segments.append(f".{field.name}")
                raise
        return _Ext(EXT_STRUCT, _ENCODER.encode((spec.name, fields)))

    def _add_tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        info = TORCH_BY_DTYPE.get(t.dtype)
        if info is None:
            raise _PathError(f": unsupported torch dtype {t.dtype}")
        if info.int_view is None and type(t) is torch.Tensor:
            # numpy() succeeds only for a plain dense CPU tensor without grad, lazy
            # conjugate or negation, which is exactly what may be read as it is.
            try:
                a = t.numpy()
            except (RuntimeError, TypeError):
                pass
            else:
                if a.ndim <= MAX_DIMS:
                    return self._add_region("torch", info.name, a.shape, a.nbytes, a)
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise _PathError(f": only dense tensors travel (got layout {t.layout}); use .to_dense()")
        if t.dim() > MAX_DIMS:
            raise _PathError(f": tensor has {t.dim()} dimensions, at most {MAX_DIMS} travel")
        if t.requires_grad:
            t = t.detach()
        if t.is_conj():  # a lazy conjugate has no memory of its own to copy from
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        shape = tuple(t.shape)
        nbytes = t.numel() * info.itemsize
        if t.is_cpu:
            try:
                src: Any = t.numpy() if info.int_view is None else t.view(info.int_view).numpy()
            except (RuntimeError, TypeError) as exc:
                raise _PathError(f": cannot read tensor memory: {exc}") from exc
        elif t.device.type == "meta":
            raise _PathError(": tensor on the meta device has no data")
        else:
            src = t  # device → host straight into the destination in write_into
        return self._add_region("torch", info.name, shape, nbytes, src)

    def _add_array(self, a: np.ndarray[Any, Any]) -> msgspec.msgpack.Ext:
        name = numpy_name(a.dtype)
        if name is None:
            raise _PathError(
                f": unsupported numpy dtype {a.dtype} (only bool, integer, float and complex arrays "
                "travel; object, string, void, structured and datetime arrays do not)"
            )
        if a.ndim > MAX_DIMS:
            raise _PathError(f": array has {a.ndim} dimensions, at most {MAX_DIMS} travel")
        return self._add_region("numpy", name, a.shape, a.nbytes, a)

    def _add_region(self, kind: str, dtype: str, shape: tuple[int, ...], nbytes: int, src: Any) -> Any:
        offset = (self.data_len + ALIGNMENT - 1) & ~(ALIGNMENT - 1)
        index = len(self.regions)
        self.regions.append((kind, dtype, shape, offset, nbytes))
        self.sources.append((offset, nbytes, src))
        self.data_len = offset + nbytes
        return _REGION_REFS[index] if index < len(_REGION_REFS) else _Ext(EXT_REGION, U32.pack(index))


class _DevicePlanner(_Planner):
    """The walk of a GPU-direct put: each tensor is offered to ``place`` first."""

    __slots__ = ("place",)

    def __init__(self, strict: bool, place: Placer) -> None:
        super().__init__(strict)
        self.place = place

    def _add_tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        info = TORCH_BY_DTYPE.get(t.dtype)
        if (
            info is not None
            and t.layout is torch.strided
            and t.dim() <= MAX_DIMS
            and not (t.is_quantized or t.is_nested)
        ):  # ``place`` tells whether the tensor is on its device at all
            ref = self.place(t)
            if ref is not None:
                return self._add_region("device", info.name, tuple(t.shape), len(ref), ref)
        return super()._add_tensor(t)


def _unsupported(obj: Any) -> str:
    tp = type(obj)
    name = _type_name(tp)
    if isinstance(obj, msgspec.Struct):
        return f"unsupported type {name} (a msgspec.Struct that is not registered; see register_struct)"
    if isinstance(obj, np.ndarray):
        return f"unsupported type {name} (an ndarray subclass; pass np.asarray(x))"
    if isinstance(obj, np.generic):
        return f"unsupported type {name} (a numpy scalar; pass .item() or a 0-d array)"
    if isinstance(obj, bytearray | memoryview):
        return f"unsupported type {name} (pass bytes(x))"
    for base in (dict, list, tuple):
        if isinstance(obj, base):
            return f"unsupported type {name} (a {base.__name__} subclass; pass {base.__name__}(x))"
    return f"unsupported type {name}"


class EncodePlan:
    """An encoding ready to be written: the header bytes plus references to tensor memory.

    Built by :func:`plan_encode`; copies no tensor data. The referenced tensors must not
    change until :meth:`write_into` has run. ``nbytes`` is the exact encoded length.
    """

    __slots__ = ("_data_start", "_head", "_sources", "nbytes")

    def __init__(self, head: bytes, data_start: int, sources: list[tuple[int, int, Any]], nbytes: int):
        self._head = head
        self._data_start = data_start
        self._sources = sources
        self.nbytes = nbytes

    @property
    def num_regions(self) -> int:
        return len(self._sources)

    def write_into(self, buf: Any) -> int:
        """Write bytes ``[0, nbytes)`` of the encoding into ``buf``; return ``nbytes``.

        ``buf`` is any writable buffer of at least ``nbytes`` bytes (a ``bytearray``, a
        ``memoryview`` of one, an ``mmap`` slice). Each tensor is copied once, from its
        own (possibly strided, possibly device) memory; padding is zeroed so that no
        earlier contents of a reused buffer leak. Safe to call more than once.
        """
        mv = memoryview(buf)
        if mv.readonly:
            raise PayloadEncodeError("write_into needs a writable buffer")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = self.nbytes
        if mv.nbytes < n:
            raise PayloadEncodeError(f"buffer of {mv.nbytes} bytes is too small for {n} bytes of payload")
        head = self._head
        pos = len(head)
        mv[:pos] = head
        dst = None  # a numpy view of the destination, made only for a copy that needs one
        for offset, nbytes, src in self._sources:
            start = self._data_start + offset
            if start > pos:
                mv[pos:start] = _ZEROS[: start - pos]
            end = start + nbytes
            if nbytes:
                if isinstance(src, np.ndarray):
                    if nbytes <= _SMALL_COPY and src.flags.c_contiguous:
                        mv[start:end] = src.data.cast("B")  # one memcpy, no array views
                    else:
                        if dst is None:
                            dst = np.frombuffer(mv, dtype=np.uint8, count=n)
                        np.copyto(dst[start:end].view(src.dtype).reshape(src.shape), src, casting="no")
                elif isinstance(src, torch.Tensor):
                    if dst is None:
                        dst = np.frombuffer(mv, dtype=np.uint8, count=n)
                    torch.from_numpy(dst[start:end]).view(src.dtype).view(src.shape).copy_(src)
                else:
                    mv[start:end] = src
            pos = end
        return n


def plan_encode(obj: Any, place: Placer | None = None) -> EncodePlan:
    """Validate ``obj`` and prepare its encoding. Raises :class:`PayloadEncodeError`.
    ``place``: offered every tensor that is not on the CPU (a GPU-direct edge)."""
    try:
        try:
            return _plan(obj, strict=False, place=place)
        except OverflowError:
            # An int beyond 64 bits in a list of plain values: walk again to name it (the
            # walk raises there, so nothing more is placed than the caller will release).
            return _plan(obj, strict=True, place=place)
    except _PathError as exc:
        raise PayloadEncodeError(f"payload{''.join(reversed(exc.segments))}{exc.tail}") from None
    except RecursionError:
        raise PayloadEncodeError(
            "payload: nested too deeply to encode (or it contains a reference cycle)"
        ) from None
    except OverflowError as exc:  # not expected: the strict walk names every oversized int
        raise PayloadEncodeError(f"payload: {exc}") from exc


def _plan(obj: Any, *, strict: bool, place: Placer | None = None) -> EncodePlan:
    planner = _Planner(strict) if place is None else _DevicePlanner(strict, place)
    tree = planner.lower(obj)
    header = _ENCODER.encode((planner.regions, tree))
    if len(header) > 0xFFFFFFFF:
        raise PayloadEncodeError(f"payload header of {len(header)} bytes exceeds the u32 header_len")
    head_end = PREFIX_SIZE + len(header)
    data_start = align(head_end)
    total = data_start + planner.data_len if planner.regions else head_end
    head = PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(header), total) + header
    return EncodePlan(head, data_start, planner.sources, total)


def encode(obj: Any) -> bytes:
    """Encode ``obj`` into a new ``bytes``. Raises :class:`PayloadEncodeError`."""
    plan = plan_encode(obj)
    out = bytearray(plan.nbytes)
    plan.write_into(out)
    return bytes(out)
