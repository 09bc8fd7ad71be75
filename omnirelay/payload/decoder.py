"""Decoding: rebuild the object, with one fast path for headers seen before.

* :func:`decode` ``(buf, *, copy=True)`` — rebuild the object; the same struct types come back.
* :func:`peek_total_size` ``(buf) -> int`` — the encoded length, from the prefix alone.

A "device" region (a tensor left on a GPU of the host, docs/protocol.md §3.9) is rebuilt
by the caller's ``device`` hook, ``device(ref_bytes, dtype, shape) -> tensor``, which
copies it out of the producer's device pool (it raises :class:`PayloadDecodeError` for a
reference it cannot serve); a decode without a hook refuses such a payload.

Decoding untrusted bytes raises only :class:`~omnirelay.errors.PayloadDecodeError` (or a
subclass), never an ``IndexError``, ``KeyError`` or ``struct.error``.

The fast path: a stream repeats its header (same shapes, same dtypes, same meta), so a
validated header is cached by its bytes. A hit skips the prefix checks, the header's
parsing and validation, and — when the tree holds only dicts, registered structs, plain
values, lists of plain values and tensors — the msgpack walk and the struct field checks
too: the tree is rebuilt from a template (what each saves: docs/performance.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import msgspec
import numpy as np
import torch

from omnirelay.errors import PayloadDecodeError, PayloadSchemaError, PayloadTruncatedError
from omnirelay.payload.dtypes import TORCH_BY_NAME, TorchDtype, numpy_dtype
from omnirelay.payload.schema import lookup_struct
from omnirelay.payload.wire import (
    ALIGNMENT,
    EXT_REGION,
    EXT_STRUCT,
    EXT_TUPLE,
    HEADER_DECODER,
    MAX_DEVICE_REF,
    PREFIX_SIZE,
    U32,
    Region,
    align,
    byte_view,
    read_prefix,
)

__all__ = ["STOCK_MAX_BYTES", "DeviceTaker", "OutputStock", "decode", "peek_total_size"]

#: ``device(ref_bytes, dtype, shape) -> tensor``: rebuilds a "device" region.
DeviceTaker = Callable[[memoryview, torch.dtype, tuple[int, ...]], torch.Tensor]


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


class _Entry(NamedTuple):
    """A validated header: its region table, object tree, and (when the tree has no
    tuples) a template that rebuilds the tree without msgpack."""

    regions: list[_RegionInfo]
    tree: bytes
    template: tuple[int, Any] | None
    total: int
    #: What an OutputStock makes ahead for this header: its torch regions, or none if
    #: they hold more than STOCK_MAX_BYTES together.
    stockable: tuple[_RegionInfo, ...]


#: Validated headers by their prefix and header bytes (the prefix holds the total length).
#: Only headers are cached, never data; any change in shapes, dtypes or meta is a miss.
_HEADER_CACHE: dict[bytes, _Entry] = {}
_HEADER_CACHE_ENTRIES: Final = 512
_HEADER_CACHE_MAX_LEN: Final = 4096


def peek_total_size(buf: Any) -> int:
    """The total encoded length, from the prefix alone (magic, version and flags checked)."""
    return read_prefix(byte_view(buf))[1]


#: An OutputStock makes tensors ahead only for headers whose tensors hold at most this
#: much together (a bigger copy dwarfs the allocation it saves).
STOCK_MAX_BYTES: Final = 256 << 10


class OutputStock:
    """Output tensors made ahead for one stream's next decode.

    A stream repeats its header (same shapes, same meta); the shm reader keeps one stock
    per slot, since a producer reuses its slots. ``decode(..., stock=)`` records the
    header it decoded; :meth:`refill`, called while the stream is idle, makes fresh
    tensors for that header's torch regions (numpy's allocator, as a copying decode
    uses). A decode of the same header then copies the bytes straight into them: on a
    CPU whose caches went cold while it waited, allocating the array and wrapping it in a
    tensor cost as much as the rest of the get. A different header drops them.

    Each made tensor goes to at most one decode (a dict pop, atomic under the GIL), so
    decodes and refills may run on any threads.
    """

    __slots__ = ("_entry", "_made")

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        #: region start -> (tensor, its bytes as a writable 1-d uint8 memoryview)
        self._made: dict[int, tuple[torch.Tensor, memoryview]] = {}

    @property
    def can_refill(self) -> bool:
        """Whether :meth:`refill` would make something now."""
        entry = self._entry
        return entry is not None and bool(entry.stockable) and not self._made

    @property
    def num_made(self) -> int:
        """Tensors made and waiting for the next decode."""
        return len(self._made)

    def refill(self) -> None:
        """Make the tensors of the header decoded last (a no-op if some are waiting, or
        if its tensors exceed :data:`STOCK_MAX_BYTES`)."""
        entry = self._entry
        if entry is None or not entry.stockable or self._made:
            return
        made = {}
        for r in entry.stockable:
            a = np.empty(r.shape, r.read_dtype)
            t = _from_numpy(a)
            made[r.start] = (
                t if r.torch_view is None else t.view(r.torch_view),
                a.reshape(-1).view(_U8).data,
            )
        self._made = made


def decode(
    buf: Any, *, copy: bool = True, stock: OutputStock | None = None, device: DeviceTaker | None = None
) -> Any:
    """Rebuild the object encoded at the start of ``buf`` (extra trailing bytes are ignored).

    With ``copy=True`` every tensor and array owns its memory. With ``copy=False`` they are
    views on ``buf`` and the caller keeps ``buf`` alive and unchanged while they are used;
    when ``buf`` is read-only (``bytes``) numpy views are read-only and torch tensors are
    copied (torch cannot wrap read-only memory). ``stock``: the stream's
    :class:`OutputStock` (its tensors are used if they were made for this header; with
    ``copy=True`` only). Raises :class:`PayloadDecodeError`.
    """
    mv = byte_view(buf)
    if len(mv) >= PREFIX_SIZE:
        # The cache key holds the whole prefix: magic, version, flags and total length
        # were checked when it was cached.
        header_len = U32.unpack_from(mv, 8)[0]
        if header_len <= _HEADER_CACHE_MAX_LEN:
            entry = _HEADER_CACHE.get(bytes(mv[: PREFIX_SIZE + header_len]))
            if entry is not None and len(mv) >= entry.total:
                reader = _Reader(mv, entry.regions, copy, device)
                if stock is not None:
                    if stock._entry is not entry:
                        stock._entry = entry
                        stock._made = {}
                    elif copy and stock._made:
                        reader.made = stock._made
                        stock._made = {}
                if entry.template is not None:
                    return _instantiate(entry.template, reader)
                return _decode_tree(entry.tree, reader)
    header_len, total = read_prefix(mv)
    if len(mv) < total:
        raise PayloadTruncatedError(f"buffer holds {len(mv)} bytes; the payload is {total} bytes")
    head_end = PREFIX_SIZE + header_len
    try:
        header = HEADER_DECODER.decode(mv[PREFIX_SIZE:head_end])
    except msgspec.DecodeError as exc:
        raise PayloadDecodeError(f"malformed payload header: {exc}") from exc
    regions = _check_regions(header.regions, align(head_end), total)
    tree = bytes(header.tree)
    obj = _decode_tree(
        tree, _Reader(mv[:total], regions, copy, device)
    )  # raises on a bad tree: nothing cached
    entry = None
    if header_len <= _HEADER_CACHE_MAX_LEN:
        if len(_HEADER_CACHE) >= _HEADER_CACHE_ENTRIES:
            _HEADER_CACHE.clear()
        entry = _Entry(regions, tree, _template_of(tree, regions), total, _stockable(regions))
        _HEADER_CACHE[bytes(mv[:head_end])] = entry
    if stock is not None:
        stock._entry = entry
        stock._made = {}
    return obj


def _stockable(regions: list[_RegionInfo]) -> tuple[_RegionInfo, ...]:
    out = tuple(r for r in regions if r.kind == "torch" and r.nbytes)
    return out if sum(r.nbytes for r in out) <= STOCK_MAX_BYTES else ()


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


# --------------------------------------------------------------------------- template
# A template node is (kind, value): a plain immutable value, a region (a new tensor or
# array per decode), a dict of nodes, a list of plain values (copied per decode), or a
# registered struct of nodes. Its struct fields are not checked again: they passed the
# checks when the header was first decoded, and a template rebuilds the same values and
# the same kinds of tensors and arrays every time.
_T_PLAIN, _T_REGION, _T_DICT, _T_LIST, _T_STRUCT = 0, 1, 2, 3, 4
_TEMPLATE_PLAIN: Final = frozenset({str, int, float, bool, bytes, type(None)})


class _NoTemplate(Exception):
    pass


class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _StructRef:
    __slots__ = ("fields", "name")

    def __init__(self, name: str, fields: dict[Any, Any]) -> None:
        self.name = name
        self.fields = fields


def _ref_hook(code: int, data: memoryview) -> Any:
    if code == EXT_REGION and len(data) == U32.size:
        return _Ref(int.from_bytes(data, "little"))
    if code == EXT_STRUCT:
        record = msgspec.msgpack.decode(data, ext_hook=_ref_hook)
        if type(record) is list and len(record) == 2 and type(record[0]) is str and type(record[1]) is dict:
            return _StructRef(record[0], record[1])
    raise _NoTemplate  # tuples take the general path


def _template_of(tree: bytes, regions: list[_RegionInfo]) -> tuple[int, Any] | None:
    """The template of a tree that decoded cleanly, or None if it has tuples or containers
    inside lists (those are rebuilt by msgpack every time)."""
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
        return _T_REGION, regions[obj.index]
    if tp is dict:
        return _T_DICT, tuple((k, *_node(v, regions)) for k, v in obj.items())
    if tp is list and all(type(v) in _TEMPLATE_PLAIN for v in obj):
        return _T_LIST, tuple(obj)
    if tp is _StructRef:
        spec = lookup_struct(obj.name)
        if spec is None or not all(type(k) is str and k in spec.by_name for k in obj.fields):
            raise _NoTemplate
        return _T_STRUCT, (spec.cls, tuple((k, *_node(v, regions)) for k, v in obj.fields.items()))
    raise _NoTemplate


def _instantiate(node: tuple[int, Any], reader: _Reader) -> Any:
    kind, value = node
    if kind == _T_DICT:
        return _instantiate_dict(value, reader)
    if kind == _T_STRUCT:
        return value[0](**_instantiate_dict(value[1], reader))
    if kind == _T_REGION:
        return reader.build(value)
    if kind == _T_LIST:
        return list(value)
    return value


def _instantiate_dict(items: tuple[tuple[Any, int, Any], ...], reader: _Reader) -> dict[Any, Any]:
    out = {}
    for key, kind, value in items:
        if kind == _T_PLAIN:
            out[key] = value
        elif kind == _T_REGION:
            out[key] = reader.build(value)
        elif kind == _T_DICT:
            out[key] = _instantiate_dict(value, reader)
        else:
            out[key] = _instantiate((kind, value), reader)
    return out


# --------------------------------------------------------------------------- regions
_NP_INT_VIEW: Final[dict[torch.dtype, np.dtype[Any]]] = {
    torch.uint8: np.dtype(np.uint8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}
_U8: Final[np.dtype[Any]] = np.dtype(np.uint8)
_from_numpy = torch.from_numpy


class _Reader:
    """Per-decode state: the validated region table and the ``ext_hook`` that uses it."""

    __slots__ = ("copy", "device", "made", "mv", "regions")

    def __init__(
        self, mv: memoryview, regions: list[_RegionInfo], copy: bool, device: DeviceTaker | None = None
    ) -> None:
        self.mv = mv
        self.copy = copy
        self.regions = regions
        self.device = device
        #: Tensors an OutputStock made for this header, by region start.
        self.made: dict[int, tuple[torch.Tensor, memoryview]] | None = None

    def ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_REGION:
            if len(data) != U32.size:
                raise PayloadDecodeError(f"region reference of {len(data)} bytes, expected {U32.size}")
            index = int.from_bytes(data, "little")
            if index >= len(self.regions):
                raise PayloadDecodeError(f"reference to region {index}; the table has {len(self.regions)}")
            return self.build(self.regions[index])
        if code == EXT_TUPLE:
            items = msgspec.msgpack.decode(data, ext_hook=self.ext_hook)
            if type(items) is not list:
                raise PayloadDecodeError(f"tuple record holds {type(items).__name__}, expected an array")
            return tuple(items)
        if code == EXT_STRUCT:
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

    def build(self, r: _RegionInfo) -> Any:
        """The tensor, array or bytes of region ``r``."""
        if self.made:
            made = self.made.pop(r.start, None)  # only torch regions are made ahead
            if made is not None:  # one copy, no allocation
                made[1][:] = self.mv[r.start : r.start + r.nbytes]
                return made[0]
        if r.kind == "bytes":
            return bytes(self.mv[r.start : r.start + r.nbytes])
        if r.kind == "device":
            return self._take_device(r)
        if r.nbytes == 0:
            if r.kind == "numpy":
                return np.empty(r.shape, r.np_dtype)
            assert r.torch_dtype is not None
            return torch.empty(0, dtype=torch.uint8).view(r.torch_dtype.dtype).reshape(r.shape)
        src = np.ndarray(r.shape, r.read_dtype, self.mv, r.start)  # bounds checked with the header
        if r.kind == "numpy":
            return src.copy() if self.copy else src
        if self.copy:
            src = src.copy()  # numpy's allocator: huge pages for big regions, unlike torch.empty
        elif not src.flags.writeable:
            src = src.copy()  # torch cannot wrap read-only memory
        t = _from_numpy(src)
        return t if r.torch_view is None else t.view(r.torch_view)

    def _take_device(self, r: _RegionInfo) -> torch.Tensor:
        if self.device is None:
            raise PayloadDecodeError(
                "the payload holds a tensor left on a GPU (a GPU-direct reference), and this "
                "receiver takes no GPU-direct edge"
            )
        assert r.torch_dtype is not None  # Invariant: _check_region gives device regions one
        return self.device(self.mv[r.start : r.start + r.nbytes], r.torch_dtype.dtype, r.shape)


def _check_regions(regions: list[Region], data_start: int, total: int) -> list[_RegionInfo]:
    infos = [_check_region(i, r, data_start, total) for i, r in enumerate(regions)]
    for i in range(1, len(infos)):
        prev, cur = infos[i - 1], infos[i]
        if cur.start < prev.start + prev.nbytes:
            raise PayloadDecodeError(f"region {i} overlaps region {i - 1}")
    return infos


def _check_region(i: int, r: Region, data_start: int, total: int) -> _RegionInfo:
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
    elif r.kind == "device":
        return _check_device_region(i, r, data_start, total)
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
    start = _region_start(i, r, data_start, total)
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


def _region_start(i: int, r: Region, data_start: int, total: int) -> int:
    """Where region ``i``'s bytes start in the payload, once its offset is aligned and its
    bytes end within the payload."""
    if r.offset % ALIGNMENT:
        raise PayloadDecodeError(f"region {i}: offset {r.offset} is not a multiple of {ALIGNMENT}")
    start = data_start + r.offset
    if start + r.nbytes > total:
        raise PayloadDecodeError(
            f"region {i}: bytes [{start}, {start + r.nbytes}) lie past the payload end {total}"
        )
    return start


def _check_device_region(i: int, r: Region, data_start: int, total: int) -> _RegionInfo:
    """A "device" region: the dtype and shape are the tensor's, the bytes its reference."""
    torch_dtype = TORCH_BY_NAME.get(r.dtype)
    if torch_dtype is None:
        raise PayloadDecodeError(f"region {i}: unknown torch dtype {r.dtype!r}")
    if math.prod(max(d, 1) for d in r.shape) * torch_dtype.itemsize > 2**62:
        raise PayloadDecodeError(f"region {i}: shape {r.shape} is too large")
    if not 0 < r.nbytes <= MAX_DEVICE_REF:
        raise PayloadDecodeError(
            f"region {i}: a device reference of {r.nbytes} bytes (1 to {MAX_DEVICE_REF} travel)"
        )
    start = _region_start(i, r, data_start, total)
    return _RegionInfo("device", start, r.nbytes, r.shape, torch_dtype, None, _U8, None)


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
