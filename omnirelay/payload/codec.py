"""The payload wire codec: a msgpack header describing the object tree, then raw tensor regions.

Interface (the connectors are written against exactly this):

* :func:`plan_encode` ``(obj) -> EncodePlan`` — walk ``obj`` once, validate it, encode the
  header; tensors are only referenced. ``plan.nbytes`` is the exact encoded length.
* :meth:`EncodePlan.write_into` ``(buf) -> int`` — write the encoding into a writable buffer
  (a shared-memory slot), one copy per tensor, straight from the (possibly strided) source.
* :func:`encode` ``(obj) -> bytes`` — plan + write into a fresh buffer.
* :func:`decode` ``(buf, *, copy=True)`` — rebuild the object; the same struct types come back.
* :func:`peek_total_size` ``(buf) -> int`` — the encoded length, from the prefix alone.
* :class:`DecodeHint` — per-stream state a connector passes to ``decode(hint=)``: outputs
  for a repeated header are made while the next object is still being written.

Wire layout (version 1, little endian)::

    offset 0   prefix, 20 bytes: magic b"ORLY" | u16 version | u16 flags (0) | u32 header_len | u64 total_len
    offset 20  header: msgpack array [regions, tree]
                 regions: [[kind, dtype, shape, offset, nbytes], ...]
                   kind "torch" (dtype = torch name, e.g. "bfloat16"), "numpy" (dtype = numpy
                   dtype.str, e.g. "<f4") or "bytes" (dtype "uint8"); offset is relative to
                   data_start, a multiple of 64, increasing; nbytes = prod(shape) * itemsize
                 tree: the object, in msgpack, with msgpack extension values for what
                   msgpack cannot say:
                   ext 1 = region reference (u32 index into regions),
                   ext 2 = tuple (msgpack array of its items),
                   ext 3 = registered struct (msgpack [wire name, {field: value}]; a field
                           whose value is its default object is omitted)
                   bytes of 4 KiB or more travel as a "bytes" region, smaller ones inline.
    zero padding up to data_start = align64(20 + header_len)
    regions, each at data_start + offset, zero padding between; total_len ends the last one
    (or the header when there are none).

Plain data supported at any depth: dict (str or int keys), list, tuple, str, int
(-2**63 .. 2**64-1), float, bool, None, bytes, torch.Tensor, numpy.ndarray (bool, integer,
float or complex dtypes) and registered structs (:func:`register_struct`). Subclasses of
str, int and float travel as the base type. Anything else is a
:class:`~omnirelay.errors.PayloadEncodeError` naming the type and its path in the object.
Decoding untrusted bytes raises only :class:`~omnirelay.errors.PayloadDecodeError`
(or a subclass), never an ``IndexError``, ``KeyError`` or ``struct.error``.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any, Final, Literal, NamedTuple

import msgspec
import numpy as np
import torch

from omnirelay.errors import (
    PayloadDecodeError,
    PayloadEncodeError,
    PayloadMagicError,
    PayloadSchemaError,
    PayloadTruncatedError,
    PayloadVersionError,
)
from omnirelay.payload.dtypes import TORCH_BY_DTYPE, TORCH_BY_NAME, TorchDtype, numpy_dtype, numpy_name
from omnirelay.payload.schema import StructSpec, lookup_struct, struct_spec

__all__ = [
    "ALIGNMENT",
    "MAGIC",
    "PREFIX_SIZE",
    "WIRE_VERSION",
    "DecodeHint",
    "EncodePlan",
    "decode",
    "encode",
    "peek_total_size",
    "plan_encode",
]

MAGIC: Final = b"ORLY"
WIRE_VERSION: Final = 1
ALIGNMENT: Final = 64
_PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE: Final = _PREFIX.size  # 20
_U32 = struct.Struct("<I")

_EXT_REGION: Final = 1
_EXT_TUPLE: Final = 2
_EXT_STRUCT: Final = 3

#: Regions up to this size are copied with a memoryview assignment (cheapest for small
#: ones, but it holds the GIL); larger ones with numpy, which releases the GIL while it
#: copies, so a 64 MB put never stalls the threads moving other requests' chunks.
_SMALL_COPY: Final = 256 << 10
#: bytes at least this long travel as a region (one copy) rather than inside the header.
_BYTES_REGION_MIN: Final = 4096
#: numpy 1.x supports 32 dimensions; more would encode but not decode everywhere.
_MAX_DIMS: Final = 32
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
#: Above this many elements, a list of ints is type-checked by msgspec in C.
_LONG_LIST: Final = 64
_PLAIN_TYPES: Final = frozenset({str, int, float, bool, type(None)})
_ZEROS: Final = bytes(ALIGNMENT)

_ENCODER = msgspec.msgpack.Encoder()
_Ext = msgspec.msgpack.Ext


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


# --------------------------------------------------------------------------- header


class _Region(msgspec.Struct, array_like=True, frozen=True):
    kind: Literal["torch", "numpy", "bytes"]
    dtype: str
    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=_MAX_DIMS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]


class _Header(msgspec.Struct, array_like=True, frozen=True):
    regions: list[_Region]
    tree: msgspec.Raw


_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)


# --------------------------------------------------------------------------- encode


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


class _Planner:
    """One walk over the object: lowers it to msgpack-able values and collects regions.

    With ``strict`` set, the C-level fast paths for flat lists and dicts are off and every
    int is range-checked where it is; used only to name the path of an out-of-range int.
    """

    __slots__ = ("data_len", "regions", "sources", "strict")

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.regions: list[_Region] = []
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
        if tp is list:
            return self._lower_items(obj)
        if tp is tuple:
            return _Ext(_EXT_TUPLE, _ENCODER.encode(self._lower_items(obj)))
        if tp is bytes:
            if len(obj) >= _BYTES_REGION_MIN:
                return self._add_region("bytes", "uint8", (len(obj),), len(obj), obj)
            return obj
        if isinstance(obj, torch.Tensor):
            return self._add_tensor(obj)
        if tp is np.ndarray:
            return self._add_array(obj)
        spec = struct_spec(tp)
        if spec is not None:
            return self._lower_struct(obj, spec)
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
        if self.strict:
            return self._lower_dict_checked(d)
        # One pass with the common cases inline (str keys; plain values, nested dicts,
        # tensors): every chunk's header goes through here, on a send worker just woken.
        # Anything else takes the checked walk, which names the offending path.
        out = {}
        for key, value in d.items():
            if type(key) is not str:
                return self._lower_dict_checked(d)
            tv = type(value)
            if tv is str or tv is float or tv is bool or value is None or tv is int:
                out[key] = value  # an int out of range surfaces at encode: then the strict walk
            elif tv is dict:
                try:
                    out[key] = self._lower_dict(value)
                except _PathError as exc:
                    exc.segments.append(f"[{key!r}]")
                    raise
            elif tv is torch.Tensor:
                out[key] = self._add_tensor(value)
            else:
                try:
                    out[key] = self.lower(value)
                except _PathError as exc:
                    exc.segments.append(f"[{key!r}]")
                    raise
        return out

    def _lower_dict_checked(self, d: dict[Any, Any]) -> dict[Any, Any]:
        out = {}
        for key, value in d.items():
            kt = type(key)
            if kt is not str and kt is not int:
                if isinstance(key, str):
                    key = str.__str__(key)
                elif isinstance(key, int) and kt is not bool:
                    key = int.__index__(key)
                else:
                    raise _PathError(f": dict key {key!r} has type {_type_name(kt)}; keys must be str or int")
            if type(key) is int:
                try:
                    _check_int(key)
                except _PathError as exc:
                    exc.segments.append(f"[{key}] (key)")
                    raise
            try:
                out[key] = self.lower(value)
            except _PathError as exc:
                exc.segments.append(f"[{key!r}]")
                raise
        return out

    def _lower_struct(self, obj: Any, spec: StructSpec) -> _Ext:
        fields = {}
        for field in spec.fields:
            value = getattr(obj, field.name)
            if value is field.default:
                continue
            try:
                err = field.check(value)
                if err is not None:
                    raise _PathError(err)
                fields[field.name] = self.lower(value)
            except _PathError as exc:
                exc.segments.append(f".{field.name}")
                raise
        return _Ext(_EXT_STRUCT, _ENCODER.encode((spec.name, fields)))

    def _add_tensor(self, t: torch.Tensor) -> _Ext:
        info = TORCH_BY_DTYPE.get(t.dtype)
        if info is None:
            raise _PathError(f": unsupported torch dtype {t.dtype}")
        if info.int_view is None and type(t) is torch.Tensor:
            # Fast path: numpy() succeeds only for a plain dense CPU tensor without grad,
            # lazy conjugate or negation, which is exactly what may be read as it is.
            try:
                a = t.numpy()
            except (RuntimeError, TypeError):
                pass
            else:
                if a.ndim <= _MAX_DIMS:
                    return self._add_region("torch", info.name, a.shape, a.nbytes, a)
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise _PathError(f": only dense tensors travel (got layout {t.layout}); use .to_dense()")
        if t.dim() > _MAX_DIMS:
            raise _PathError(f": tensor has {t.dim()} dimensions, at most {_MAX_DIMS} travel")
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

    def _add_array(self, a: np.ndarray[Any, Any]) -> _Ext:
        name = numpy_name(a.dtype)
        if name is None:
            raise _PathError(
                f": unsupported numpy dtype {a.dtype} (only bool, integer, float and complex arrays "
                "travel; object, string, void, structured and datetime arrays do not)"
            )
        if a.ndim > _MAX_DIMS:
            raise _PathError(f": array has {a.ndim} dimensions, at most {_MAX_DIMS} travel")
        return self._add_region("numpy", name, a.shape, a.nbytes, a)

    def _add_region(self, kind: Any, dtype: str, shape: tuple[int, ...], nbytes: int, src: Any) -> _Ext:
        offset = _align(self.data_len)
        index = len(self.regions)
        self.regions.append(_Region(kind, dtype, shape, offset, nbytes))
        self.sources.append((offset, nbytes, src))
        self.data_len = offset + nbytes
        return _Ext(_EXT_REGION, _U32.pack(index))


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
        if not self._sources:
            return n
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


def plan_encode(obj: Any) -> EncodePlan:
    """Validate ``obj`` and prepare its encoding. Raises :class:`PayloadEncodeError`."""
    if type(obj) is dict:
        plan = _plan_flat(obj)
        if plan is not None:
            return plan
    try:
        try:
            return _plan(obj, strict=False)
        except OverflowError:
            # An int beyond 64 bits slipped through a fast path: walk again to name it.
            return _plan(obj, strict=True)
    except _PathError as exc:
        raise PayloadEncodeError(f"payload{''.join(reversed(exc.segments))}{exc.tail}") from None
    except RecursionError:
        raise PayloadEncodeError(
            "payload: nested too deeply to encode (or it contains a reference cycle)"
        ) from None
    except OverflowError as exc:  # not expected: the strict walk names every oversized int
        raise PayloadEncodeError(f"payload: {exc}") from exc


def _plan(obj: Any, *, strict: bool) -> EncodePlan:
    planner = _Planner(strict)
    tree = planner.lower(obj)
    header = _ENCODER.encode((planner.regions, tree))
    if len(header) > 0xFFFFFFFF:
        raise PayloadEncodeError(f"payload header of {len(header)} bytes exceeds the u32 header_len")
    head_end = PREFIX_SIZE + len(header)
    data_start = _align(head_end)
    total = data_start + planner.data_len if planner.regions else head_end
    head = _PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(header), total) + header
    return EncodePlan(head, data_start, planner.sources, total)


# The common chunk (dicts of str keys holding plain values, dicts and dense CPU tensors of
# the dtypes numpy reads) is planned by one function with no planner object, no region
# structs and cached reference values: every chunk of every stream goes through here, on a
# send worker just woken. It gives up (None) on anything else, and the planner above
# takes the object from the start, so errors and their paths come from one place. Its
# bytes are identical to the planner's (tested).
_FLAT_DTYPES: Final = {dt: info for dt, info in TORCH_BY_DTYPE.items() if info.int_view is None}
_FLAT_MAX_REGIONS: Final = 64
_REGION_REFS: Final = tuple(_Ext(_EXT_REGION, _U32.pack(i)) for i in range(_FLAT_MAX_REGIONS))


def _plan_flat(obj: dict[Any, Any]) -> EncodePlan | None:
    regions: list[tuple[str, str, tuple[int, ...], int, int]] = []
    sources: list[tuple[int, int, Any]] = []
    try:
        tree = _flat_dict(obj, regions, sources)
    except RecursionError:
        return None
    if tree is None:
        return None
    header = _ENCODER.encode((regions, tree))
    head_end = PREFIX_SIZE + len(header)
    data_start = _align(head_end)
    if sources:
        offset, nbytes, _ = sources[-1]
        total = data_start + offset + nbytes
    else:
        total = head_end
    head = _PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(header), total) + header
    return EncodePlan(head, data_start, sources, total)


def _flat_dict(
    d: dict[Any, Any],
    regions: list[tuple[str, str, tuple[int, ...], int, int]],
    sources: list[tuple[int, int, Any]],
) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if type(key) is not str:
            return None
        tv = type(value)
        if tv is str or tv is float or tv is bool or value is None:
            out[key] = value
        elif tv is int:
            if not _INT_MIN <= value <= _INT_MAX:
                return None
            out[key] = value
        elif tv is dict:
            sub = _flat_dict(value, regions, sources)
            if sub is None:
                return None
            out[key] = sub
        elif tv is torch.Tensor:
            info = _FLAT_DTYPES.get(value.dtype)
            if info is None:
                return None
            try:  # a plain dense CPU tensor without grad, conjugate or negation bit
                a = value.numpy()
            except (RuntimeError, TypeError):
                return None
            index = len(regions)
            if index >= _FLAT_MAX_REGIONS or a.ndim > _MAX_DIMS:
                return None
            if sources:
                last_offset, last_nbytes, _ = sources[-1]
                offset = _align(last_offset + last_nbytes)
            else:
                offset = 0
            nbytes = a.nbytes
            regions.append(("torch", info.name, a.shape, offset, nbytes))
            sources.append((offset, nbytes, a))
            out[key] = _REGION_REFS[index]
        else:
            return None
    return out


def encode(obj: Any) -> bytes:
    """Encode ``obj`` into a new ``bytes``. Raises :class:`PayloadEncodeError`."""
    plan = plan_encode(obj)
    out = bytearray(plan.nbytes)
    plan.write_into(out)
    return bytes(out)


# --------------------------------------------------------------------------- decode


class _Entry(NamedTuple):
    """A validated header: its region table, object tree, and (when the tree is only
    dicts, plain values and tensors) a template that rebuilds the tree without msgpack."""

    regions: list[_RegionInfo]
    tree: bytes
    template: tuple[int, Any] | None
    total: int
    #: The template's tensors as ``(start, shape, numpy dtype, torch view dtype or None)``:
    #: what a DecodeHint makes ahead.
    tensors: tuple[tuple[int, tuple[int, ...], np.dtype[Any], torch.dtype | None], ...]


#: Validated headers by their prefix and header bytes (the prefix holds the total length).
#: Only headers are cached, never data; any change in shapes, dtypes or meta is a miss.
_HEADER_CACHE: dict[bytes, _Entry] = {}
_HEADER_CACHE_ENTRIES: Final = 512
_HEADER_CACHE_MAX_LEN: Final = 4096


def _byte_view(buf: Any) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1:
        return buf
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _read_prefix(mv: memoryview) -> tuple[int, int]:
    """Validate the prefix; return ``(header_len, total_len)``."""
    if len(mv) < PREFIX_SIZE:
        if bytes(mv[:4]) != MAGIC[: len(mv)]:
            raise PayloadMagicError(f"not an omnirelay payload: starts with {bytes(mv[:4])!r}")
        raise PayloadTruncatedError(
            f"buffer of {len(mv)} bytes is shorter than the {PREFIX_SIZE}-byte prefix"
        )
    magic, version, flags, header_len, total = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise PayloadMagicError(f"not an omnirelay payload: starts with {magic!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise PayloadVersionError(f"payload wire version {version}; this build reads version {WIRE_VERSION}")
    if flags:
        raise PayloadDecodeError(f"payload has unknown flags 0x{flags:04x}")
    if total < PREFIX_SIZE + header_len:
        raise PayloadDecodeError(
            f"total_len {total} is shorter than the prefix and the {header_len}-byte header"
        )
    return header_len, total


def peek_total_size(buf: Any) -> int:
    """The total encoded length, from the prefix alone (magic, version and flags checked)."""
    return _read_prefix(_byte_view(buf))[1]


#: A DecodeHint makes outputs ahead only for headers whose tensors hold at most this much.
HINT_MAX_BYTES: Final = 256 << 10


class DecodeHint:
    """What one stream's next decode will likely need, made while it is still in flight.

    A connector keeps one per stream (the shm connector: per mapped slot). ``decode`` with
    ``hint`` records the header it decoded; :meth:`prepare` then makes fresh output tensors
    for that header (numpy's allocator, as a copying decode uses) while the next object is
    still being written. If the next header is the same, decode copies the bytes straight
    into them: on a CPU whose caches went cold while it waited, it skips the two most
    expensive steps (allocating the array and wrapping it in a tensor) on the critical path.
    A different header, or no prepare, decodes as usual; the outputs are dropped.

    Each prepared output is handed to at most one decode (a dict pop, atomic under the GIL).
    """

    __slots__ = ("_entry", "_made")

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        #: start offset -> (tensor, its bytes as a writable 1-d uint8 memoryview)
        self._made: dict[int, tuple[torch.Tensor, memoryview]] = {}

    def prepare(self) -> None:
        """Make the outputs of the last header decoded (a no-op if there are some already,
        or if its tensors exceed :data:`HINT_MAX_BYTES`: a big copy dwarfs an allocation)."""
        if not self.can_prepare:
            return
        assert self._entry is not None  # Invariant: can_prepare says so
        made = {}
        for start, shape, dtype, view in self._entry.tensors:
            a = np.empty(shape, dtype)
            t = _from_numpy(a)
            made[start] = (t if view is None else t.view(view), a.reshape(-1).view(np.uint8).data)
        self._made = made

    @property
    def can_prepare(self) -> bool:
        """Whether :meth:`prepare` would make something now."""
        entry = self._entry
        return entry is not None and bool(entry.tensors) and not self._made

    @property
    def prepared(self) -> int:
        """How many outputs are made and waiting (for tests and counters)."""
        return len(self._made)


def decode(buf: Any, *, copy: bool = True, hint: DecodeHint | None = None) -> Any:
    """Rebuild the object encoded at the start of ``buf`` (extra trailing bytes are ignored).

    With ``copy=True`` every tensor and array owns its memory. With ``copy=False`` they are
    views on ``buf`` and the caller keeps ``buf`` alive and unchanged while they are used;
    when ``buf`` is read-only (``bytes``) numpy views are read-only and torch tensors are
    copied (torch cannot wrap read-only memory). ``hint``: the stream's :class:`DecodeHint`
    (outputs made ahead are used if the header is the one they were made for; with
    ``copy=True`` only). Raises :class:`PayloadDecodeError`.
    """
    mv = _byte_view(buf)
    if len(mv) >= PREFIX_SIZE:
        # Streams repeat headers (same shapes, same meta): a header seen before is not
        # parsed or validated again. The cache key holds the whole prefix (magic,
        # version, flags and total length were checked when it was cached).
        header_len = _U32.unpack_from(mv, 8)[0]
        if header_len <= _HEADER_CACHE_MAX_LEN:
            entry = _HEADER_CACHE.get(bytes(mv[: PREFIX_SIZE + header_len]))
            if entry is not None and len(mv) >= entry.total:
                reader = _Reader(mv, entry.regions, copy)
                if hint is not None:
                    if hint._entry is not entry:
                        hint._entry = entry
                        hint._made = {}
                    elif copy and hint._made:
                        reader.made = hint._made
                        hint._made = {}
                if entry.template is not None:
                    return _instantiate(entry.template, reader)
                return _decode_tree(entry.tree, reader)
    header_len, total = _read_prefix(mv)
    if len(mv) < total:
        raise PayloadTruncatedError(f"buffer holds {len(mv)} bytes; the payload is {total} bytes")
    head_end = PREFIX_SIZE + header_len
    try:
        header = _HEADER_DECODER.decode(mv[PREFIX_SIZE:head_end])
    except msgspec.DecodeError as exc:
        raise PayloadDecodeError(f"malformed payload header: {exc}") from exc
    regions = _check_regions(header.regions, _align(head_end), total)
    tree = bytes(header.tree)
    reader = _Reader(mv[:total], regions, copy)
    obj = _decode_tree(tree, reader)  # raises on a bad tree: nothing is cached then
    if header_len <= _HEADER_CACHE_MAX_LEN:
        if len(_HEADER_CACHE) >= _HEADER_CACHE_ENTRIES:
            _HEADER_CACHE.clear()
        template = _template_of(tree, regions)
        entry = _Entry(regions, tree, template, total, _template_tensors(template))
        _HEADER_CACHE[bytes(mv[:head_end])] = entry
        if hint is not None:
            hint._entry = entry
            hint._made = {}
    elif hint is not None:
        hint._entry = None
        hint._made = {}
    return obj


def _decode_tree(tree: bytes, reader: _Reader) -> Any:
    try:
        return msgspec.msgpack.decode(tree, ext_hook=reader.ext_hook)
    except msgspec.DecodeError as exc:
        raise PayloadDecodeError(f"malformed payload object tree: {exc}") from exc
    except RecursionError:
        raise PayloadDecodeError("payload object tree is nested too deeply") from None
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        # Values msgspec cannot turn into Python objects (e.g. an unhashable map key).
        raise PayloadDecodeError(f"cannot rebuild payload object tree: {exc}") from exc


# A template node is (kind, value): a plain immutable value, a region (a new tensor or
# array per decode), a dict of nodes, or a list of plain values (copied per decode). A
# torch region that numpy reads natively (every dtype but the opaque ones, bfloat16 and
# float8) is a _T_TENSOR: ``(shape, numpy dtype, absolute start, region info)``, built
# inline by _instantiate_dict (the hot path of every repeated chunk header).
_T_PLAIN, _T_REGION, _T_DICT, _T_LIST, _T_TENSOR = 0, 1, 2, 3, 4
_TEMPLATE_PLAIN: Final = frozenset({str, int, float, bool, bytes, type(None)})


class _NoTemplate(Exception):
    pass


class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _ref_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_REGION and len(data) == _U32.size:
        return _Ref(int.from_bytes(data, "little"))
    raise _NoTemplate  # tuples and structs take the general path


def _template_of(tree: bytes, regions: list[_RegionInfo]) -> tuple[int, Any] | None:
    """The template of a tree that decoded cleanly, or None if it has tuples, structs or
    containers inside lists (those are rebuilt by msgpack every time)."""
    try:
        return _node(msgspec.msgpack.decode(tree, ext_hook=_ref_hook), regions)
    except (_NoTemplate, msgspec.DecodeError, RecursionError):
        return None


def _node(obj: Any, regions: list[_RegionInfo]) -> tuple[int, Any]:
    tp = type(obj)
    if tp in _TEMPLATE_PLAIN:
        return _T_PLAIN, obj
    if tp is _Ref:
        if obj.index >= len(regions):
            raise _NoTemplate
        r = regions[obj.index]
        if r.kind == "torch" and r.torch_view is None and r.nbytes:
            return _T_TENSOR, (r.shape, r.read_dtype, r.start, r)
        return _T_REGION, r
    if tp is dict:
        return _T_DICT, tuple((k, *_node(v, regions)) for k, v in obj.items())
    if tp is list and all(type(v) in _TEMPLATE_PLAIN for v in obj):
        return _T_LIST, tuple(obj)
    raise _NoTemplate


def _template_tensors(
    template: tuple[int, Any] | None,
) -> tuple[tuple[int, tuple[int, ...], np.dtype[Any], torch.dtype | None], ...]:
    """The tensors of a template (``_T_TENSOR`` nodes, and torch regions read through an
    int view: bfloat16, float8), in no particular order, as ``(start, shape, numpy dtype,
    torch view dtype or None)``; none if they hold more than HINT_MAX_BYTES together
    (DecodeHint makes these)."""
    out: list[tuple[int, tuple[int, ...], np.dtype[Any], torch.dtype | None]] = []
    todo = [template] if template is not None else []
    nbytes = 0
    while todo:
        kind, value = todo.pop()
        if kind == _T_TENSOR:
            out.append((value[2], value[0], value[1], None))
            nbytes += value[3].nbytes
        elif kind == _T_REGION and value.kind == "torch" and value.nbytes:  # bfloat16, float8
            out.append((value.start, value.shape, value.read_dtype, value.torch_view))
            nbytes += value.nbytes
        elif kind == _T_DICT:
            todo.extend((k, v) for _, k, v in value)
    return tuple(out) if nbytes <= HINT_MAX_BYTES else ()


def _instantiate(node: tuple[int, Any], reader: _Reader) -> Any:
    kind, value = node
    if kind == _T_DICT:
        return _instantiate_dict(value, reader)
    if kind == _T_REGION:
        return reader._build(value)
    if kind == _T_TENSOR:
        return reader._build(value[3])
    if kind == _T_LIST:
        return list(value)
    return value


def _instantiate_dict(items: tuple[tuple[Any, int, Any], ...], reader: _Reader) -> dict[Any, Any]:
    out = {}
    for key, kind, value in items:
        if kind == _T_PLAIN:
            out[key] = value
        elif kind == _T_TENSOR:
            if reader.copy and not reader.made:  # a tensor owning a copy of its bytes (numpy's allocator)
                out[key] = _from_numpy(np.ndarray(value[0], value[1], reader.mv, value[2]).copy())
            else:  # a view, or an output a DecodeHint made ahead
                out[key] = reader._build(value[3])
        elif kind == _T_DICT:
            out[key] = _instantiate_dict(value, reader)
        elif kind == _T_REGION:
            out[key] = reader._build(value)
        else:
            out[key] = list(value)
    return out


_from_numpy = torch.from_numpy


class _RegionInfo(NamedTuple):
    kind: str
    start: int  # absolute
    nbytes: int
    shape: tuple[int, ...]
    torch_dtype: TorchDtype | None
    np_dtype: np.dtype[Any] | None
    #: How the raw bytes are read: numpy dtype, and for a torch dtype that numpy lacks
    #: (bfloat16, float8, ...) the torch dtype to view the same-size ints as.
    read_dtype: np.dtype[Any]
    torch_view: torch.dtype | None


_NP_INT_VIEW: Final[dict[torch.dtype, np.dtype[Any]]] = {
    torch.uint8: np.dtype(np.uint8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}
_U8: Final[np.dtype[Any]] = np.dtype(np.uint8)


class _Reader:
    """Per-decode state: the validated region table and the ``ext_hook`` that uses it."""

    __slots__ = ("copy", "made", "mv", "regions")

    def __init__(self, mv: memoryview, regions: list[_RegionInfo], copy: bool) -> None:
        self.mv = mv
        self.copy = copy
        self.regions = regions
        self.made: dict[int, tuple[torch.Tensor, memoryview]] | None = None  # from a DecodeHint

    def ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_REGION:
            if len(data) != _U32.size:
                raise PayloadDecodeError(f"region reference of {len(data)} bytes, expected {_U32.size}")
            index = int.from_bytes(data, "little")
            if index >= len(self.regions):
                raise PayloadDecodeError(f"reference to region {index}; the table has {len(self.regions)}")
            return self._build(self.regions[index])
        if code == _EXT_TUPLE:
            items = msgspec.msgpack.decode(data, ext_hook=self.ext_hook)
            if type(items) is not list:
                raise PayloadDecodeError(f"tuple record holds {type(items).__name__}, expected an array")
            return tuple(items)
        if code == _EXT_STRUCT:
            record = msgspec.msgpack.decode(data, ext_hook=self.ext_hook)
            if not (
                type(record) is list
                and len(record) == 2
                and type(record[0]) is str
                and type(record[1]) is dict
            ):
                raise PayloadDecodeError("struct record is not [name, {field: value}]")
            return _build_struct(record[0], record[1])
        raise PayloadDecodeError(f"unknown msgpack extension type {code}")

    def _build(self, r: _RegionInfo) -> Any:
        made = self.made.pop(r.start, None) if self.made and r.kind == "torch" else None
        if made is not None:  # made ahead by a DecodeHint: one copy, no allocation
            made[1][:] = self.mv[r.start : r.start + r.nbytes]
            return made[0]
        if r.kind == "bytes":
            return bytes(self.mv[r.start : r.start + r.nbytes])
        if r.nbytes == 0:
            if r.kind == "numpy":
                return np.empty(r.shape, r.np_dtype)
            assert r.torch_dtype is not None
            return torch.empty(0, dtype=torch.uint8).view(r.torch_dtype.dtype).reshape(r.shape)
        src = np.ndarray(r.shape, r.read_dtype, self.mv, r.start)  # bounds checked with the header
        if r.kind == "numpy":
            return src.copy() if self.copy else src
        if self.copy or not src.flags.writeable:
            src = src.copy()  # numpy's allocator: huge pages for big regions, unlike torch.empty
        t = torch.from_numpy(src)
        return t if r.torch_view is None else t.view(r.torch_view)


def _check_regions(regions: list[_Region], data_start: int, total: int) -> list[_RegionInfo]:
    infos = [_check_region(i, r, data_start, total) for i, r in enumerate(regions)]
    for i in range(1, len(infos)):
        prev, cur = infos[i - 1], infos[i]
        if cur.start < prev.start + prev.nbytes:
            raise PayloadDecodeError(f"region {i} overlaps region {i - 1}")
    return infos


def _check_region(i: int, r: _Region, data_start: int, total: int) -> _RegionInfo:
    torch_dtype: TorchDtype | None = None
    np_dtype: np.dtype[Any] | None = None
    if r.kind == "torch":
        torch_dtype = TORCH_BY_NAME.get(r.dtype)
        if torch_dtype is None:
            raise PayloadDecodeError(f"region {i}: unknown torch dtype {r.dtype!r}")
        itemsize = torch_dtype.itemsize
    elif r.kind == "numpy":
        np_dtype = numpy_dtype(r.dtype)
        if np_dtype is None:
            raise PayloadDecodeError(f"region {i}: unknown or unsupported numpy dtype {r.dtype!r}")
        itemsize = np_dtype.itemsize
    else:  # "bytes": the header decoder admits no other kind
        if r.dtype != "uint8" or len(r.shape) != 1:
            raise PayloadDecodeError(f"region {i}: a bytes region must be uint8 and 1-d")
        itemsize = 1
    # Bound the shape even when it holds a 0: torch and numpy compute strides from it.
    if math.prod(max(d, 1) for d in r.shape) * itemsize > 2**62:
        raise PayloadDecodeError(f"region {i}: shape {r.shape} is too large")
    if math.prod(r.shape) * itemsize != r.nbytes:
        raise PayloadDecodeError(
            f"region {i}: {r.nbytes} bytes do not match shape {r.shape} of {r.dtype} ({itemsize} bytes each)"
        )
    if r.offset % ALIGNMENT:
        raise PayloadDecodeError(f"region {i}: offset {r.offset} is not a multiple of {ALIGNMENT}")
    start = data_start + r.offset
    if start + r.nbytes > total:
        raise PayloadDecodeError(
            f"region {i}: bytes [{start}, {start + r.nbytes}) lie past the payload end {total}"
        )
    torch_view: torch.dtype | None = None
    if torch_dtype is not None:
        if torch_dtype.np_dtype is not None:
            read_dtype = torch_dtype.np_dtype
        else:
            assert torch_dtype.int_view is not None  # Invariant: every opaque dtype has one
            read_dtype, torch_view = _NP_INT_VIEW[torch_dtype.int_view], torch_dtype.dtype
    else:
        read_dtype = np_dtype if np_dtype is not None else _U8
    return _RegionInfo(r.kind, start, r.nbytes, r.shape, torch_dtype, np_dtype, read_dtype, torch_view)


def _build_struct(name: str, fields: dict[Any, Any]) -> Any:
    spec = lookup_struct(name)
    if spec is None:
        raise PayloadSchemaError(f"unknown struct type {name!r}")
    for key, value in fields.items():
        field = spec.by_name.get(key) if type(key) is str else None
        if field is None:
            raise PayloadSchemaError(f"unknown field {key!r} for struct {name}")
        err = field.check(value)
        if err is not None:
            raise PayloadSchemaError(f"{name}.{key}{err}")
    try:
        return spec.cls(**fields)
    except TypeError as exc:  # a required field is missing
        raise PayloadSchemaError(f"cannot build {name}: {exc}") from exc
