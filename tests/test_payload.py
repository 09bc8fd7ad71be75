"""Tests of omnirelay.payload: the typed schema and the wire codec."""

from __future__ import annotations

import dataclasses
import enum
import random
import struct
import warnings
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import omnirelay.payload as payload_pkg
from omnirelay.errors import (
    PayloadDecodeError,
    PayloadEncodeError,
    PayloadMagicError,
    PayloadSchemaError,
    PayloadTruncatedError,
    PayloadVersionError,
)
from omnirelay.payload import (
    ALIGNMENT,
    MAGIC,
    PREFIX_SIZE,
    WIRE_VERSION,
    Codes,
    Meta,
    OmniPayload,
    decode,
    encode,
    peek_total_size,
    plan_encode,
    register_struct,
)

# --------------------------------------------------------------------------- helpers

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so NaNs and opaque dtypes compare exactly."""
    if t.dtype in (torch.complex64, torch.complex128):
        return torch.view_as_real(t.resolve_conj()).contiguous().view(_INT_OF_SIZE[t.dtype.itemsize // 2])
    return t.contiguous().view(_INT_OF_SIZE[t.dtype.itemsize])


def assert_same(a: Any, b: Any) -> None:
    """Deep equality that also pins types, dtypes and shapes."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(_raw(a), _raw(b))
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, msgspec.Struct):
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert type(key) is type(next(k for k in b if k == key))
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def round_trip(obj: Any, **kwargs: Any) -> Any:
    out = decode(encode(obj), **kwargs)
    assert_same(obj, out)
    return out


def full_payload() -> OmniPayload:
    return OmniPayload(
        codes=Codes(
            audio=torch.arange(16 * 50, dtype=torch.int64), ref=torch.zeros(16, 3, dtype=torch.int64)
        ),
        meta=Meta(
            left_context_size=25,
            first_audio=True,
            codec_frame_valid=torch.tensor([True, False]),
            replace_runtime_additional_information=False,
        ),
        embed={"prefill": torch.randn(7, 32, dtype=torch.bfloat16), "tts_bos": torch.randn(1, 32)},
        hidden_states={"output": torch.randn(7, 32, dtype=torch.float16)},
        ids={"all": [1, 2, 3], "prompt": torch.tensor([1, 2], dtype=torch.int32)},
        speaker="Ethan",
        language="English",
        request_id="req-1",
        extras={"sr": 24000, "wave": np.linspace(0, 1, 10, dtype=np.float32), "spans": [(0, 3), (3, 7)]},
    )


def forge(
    regions: list[Any], tree: Any, *, data: bytes = b"", version: int = WIRE_VERSION, flags: int = 0
) -> bytes:
    """Hand-build a buffer with an arbitrary header (for corrupt-input tests)."""
    header = msgspec.msgpack.encode([regions, tree])
    head = struct.pack("<4sHHIQ", MAGIC, version, flags, len(header), 0) + header
    data_start = -(-len(head) // ALIGNMENT) * ALIGNMENT
    body = head.ljust(data_start, b"\0") + data if data else head
    return body[:12] + struct.pack("<Q", len(body)) + body[20:]


def region_ref(index: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(1, struct.pack("<I", index))


def struct_ext(name: str, fields: dict[Any, Any]) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(3, msgspec.msgpack.encode([name, fields]))


# --------------------------------------------------------------------------- surface


def test_exports() -> None:
    assert sorted(payload_pkg.__all__) == sorted(
        [
            "ALIGNMENT",
            "MAGIC",
            "PREFIX_SIZE",
            "WIRE_VERSION",
            "Codes",
            "EncodePlan",
            "Meta",
            "OmniPayload",
            "TensorLike",
            "decode",
            "encode",
            "peek_total_size",
            "plan_encode",
            "register_struct",
        ]
    )
    for name in payload_pkg.__all__:
        assert getattr(payload_pkg, name) is not None


def test_prefix_layout() -> None:
    buf = encode(full_payload())
    magic, version, flags, header_len, total = struct.unpack_from("<4sHHIQ", buf)
    assert (magic, version, flags, PREFIX_SIZE) == (b"ORLY", 1, 0, 20)
    assert total == len(buf) == peek_total_size(buf)
    assert PREFIX_SIZE + header_len <= total


# --------------------------------------------------------------------------- schema


def test_full_payload_round_trip_keeps_struct_types() -> None:
    sent = full_payload()
    got = round_trip(sent)
    assert type(got) is OmniPayload and type(got.codes) is Codes and type(got.meta) is Meta
    assert got.meta.left_context_size == 25 and got.meta.first_audio is True
    assert got.extras["spans"] == [(0, 3), (3, 7)]


def test_a_repeated_struct_header_decodes_the_new_data_into_fresh_objects() -> None:
    """A header seen before decodes from its cached template, structs included: the same
    struct types, the new tensors' data, and values that belong to this decode alone."""

    def chunk(n: int) -> OmniPayload:
        return OmniPayload(
            codes=Codes(audio=torch.full((800,), n)),
            meta=Meta(first_audio=False, left_context_size=25),
            ids={"all": [1, 2, 3]},
        )

    round_trip(chunk(1))
    buf = bytearray(encode(chunk(2)))  # the same header
    got = decode(buf)
    assert_same(chunk(2), got)
    assert type(got) is OmniPayload and type(got.codes) is Codes and type(got.meta) is Meta
    buf[-64:] = bytes(64)
    assert torch.equal(got.codes.audio, torch.full((800,), 2))  # its tensor owns its memory
    got.ids["all"].append(4)
    assert decode(encode(chunk(3))).ids["all"] == [1, 2, 3]  # nothing shared between decodes


def test_none_fields_are_omitted_and_come_back_none() -> None:
    sent = OmniPayload(meta=Meta(first_audio=True))
    got = round_trip(sent)
    assert got.meta.first_audio is True and got.codes is None and got.meta.left_context_size is None
    assert len(encode(sent)) < 100


def test_an_empty_payload_round_trips_and_finish_flags_are_not_payload_fields() -> None:
    empty = round_trip(OmniPayload())
    assert all(getattr(empty, f) is None for f in OmniPayload.__struct_fields__)
    # Whether a chunk ends its stream travels in the transfer adapter's envelope.
    for flag in ("finished", "is_segment_finished", "codec_streaming"):
        assert flag not in Meta.__struct_fields__
        with pytest.raises(TypeError, match=flag):
            Meta(**{flag: True})


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            OmniPayload(meta=Meta(left_context_size="25")),
            r"payload\.meta\.left_context_size: expected int \| None, got str",
        ),
        (
            OmniPayload(meta=Meta(first_audio=1)),
            r"payload\.meta\.first_audio: expected bool \| None, got int",
        ),
        (OmniPayload(ids={"all": [1, "x"]}), r"payload\.ids\['all'\]\[1\]: expected int, got str"),
        (OmniPayload(embed={"a": [1.0]}), r"payload\.embed\['a'\]: expected Tensor \| ndarray, got list"),
        (OmniPayload(embed={1: torch.zeros(1)}), r"payload\.embed\[1\] \(key\): expected str, got int"),
        (OmniPayload(codes=Meta()), r"payload\.codes: expected Codes \| None, got Meta"),
        (OmniPayload(speaker=3), r"payload\.speaker: expected str \| None, got int"),
        # Types next to the ones a field takes as they are still meet its checker.
        (
            OmniPayload(meta=Meta(left_context_size=True)),
            r"payload\.meta\.left_context_size: expected int \| None, got bool",
        ),
        (OmniPayload(codes=Codes(audio=[1, 2])), r"payload\.codes\.audio: expected Tensor \| ndarray"),
        (
            OmniPayload(meta=Meta(left_context_size=2**64)),
            r"payload\.meta\.left_context_size: int 18446744073709551616 does not fit in 64 bits",
        ),
    ],
)
def test_schema_violations_are_refused_at_encode(payload: OmniPayload, message: str) -> None:
    with pytest.raises(PayloadEncodeError, match=message):
        plan_encode(payload)


def test_a_fields_exact_types_are_ones_its_checker_accepts_whatever_they_hold() -> None:
    """The encoder skips a field's checker for a value of one of its ``exact`` types."""
    from omnirelay.payload.schema import struct_spec

    samples: dict[type, list[Any]] = {
        type(None): [None],
        bool: [True, False],
        int: [0, -(2**63), 2**64 - 1],
        float: [0.5, float("nan")],
        str: ["", "x"],
        bytes: [b"", b"x"],
        torch.Tensor: [torch.zeros(2), torch.zeros((), dtype=torch.bfloat16)],
        np.ndarray: [np.zeros(2), np.zeros((0, 3), np.int8)],
        Codes: [Codes()],
        Meta: [Meta()],
        Span: [Span(start=0, end=1)],
    }
    checked = 0
    for cls in (OmniPayload, Codes, Meta, Span, Alignment):
        spec = struct_spec(cls)
        assert spec is not None
        for field in spec.fields:
            assert field.exact is not None  # no field of these is Any
            for tp in field.exact:
                for value in samples[tp]:
                    assert field.check(value) is None, (cls.__name__, field.name, value)
                    checked += 1
    assert checked > 40


def test_long_id_lists() -> None:
    ids = list(range(5000))
    got = round_trip(OmniPayload(ids={"all": ids}))
    assert got.ids["all"] == ids
    with pytest.raises(PayloadEncodeError, match=r"payload\.ids\['all'\]\[4999\]: expected int, got float"):
        plan_encode(OmniPayload(ids={"all": [*ids[:-1], 1.0]}))


class Span(msgspec.Struct, kw_only=True):
    start: int
    end: int
    label: str | None = None


class Alignment(msgspec.Struct, kw_only=True):
    spans: list[Span]
    wave: torch.Tensor | None = None


register_struct(Span, name="test.Span")
register_struct(Alignment, name="test.Alignment")


def test_registered_struct_of_another_family() -> None:
    sent = OmniPayload(extras={"align": Alignment(spans=[Span(start=0, end=3)], wave=torch.ones(4))})
    got = round_trip(sent)
    assert type(got.extras["align"].spans[0]) is Span
    with pytest.raises(PayloadEncodeError, match=r"payload\.extras\['align'\]\.spans\[0\]: expected Span"):
        plan_encode(OmniPayload(extras={"align": Alignment(spans=[{"start": 0}])}))


class BadAnnotation(msgspec.Struct):
    when: set[int]


class Unregistered(msgspec.Struct):
    x: int


class Outer(msgspec.Struct):
    inner: Unregistered


def test_register_struct_rejects_uncheckable_annotations() -> None:
    with pytest.raises(TypeError, match="cannot check"):
        register_struct(BadAnnotation)
    with pytest.raises(TypeError, match="must be registered"):
        register_struct(Outer)
    with pytest.raises(ValueError, match="already registered"):
        register_struct(Unregistered, name="OmniPayload")


# --------------------------------------------------------------------------- tensors


def _all_torch_dtypes() -> list[torch.dtype]:
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(
        0, 2 if dtype is torch.bool else 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
        return raw.view(dtype).reshape(shape) if shape else raw.view(dtype).reshape(())


@pytest.mark.parametrize("dtype", _all_torch_dtypes(), ids=str)
@pytest.mark.parametrize("shape", [(), (0, 3), (5,), (3, 4, 2)], ids=str)
def test_every_torch_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _random_tensor(dtype, shape)
    got = round_trip({"t": t})
    assert got["t"].shape == torch.Size(shape)
    round_trip({"t": t}, copy=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool, torch.complex128], ids=str)
def test_non_contiguous_tensors(dtype: torch.dtype) -> None:
    base = _random_tensor(dtype, (6, 8))
    for t in (base.t(), base[::2, 1::3], base[:, 5], base.t()[::3]):
        assert not t.is_contiguous()
        got = round_trip([t])[0]
        assert got.is_contiguous()


def test_tensor_flavours() -> None:
    leaf = torch.randn(3, 4, requires_grad=True)
    got = round_trip({"x": leaf.detach()})
    assert torch.equal(decode(encode({"x": leaf}))["x"], got["x"])
    assert not decode(encode([leaf * 2]))[0].requires_grad
    param = torch.nn.Parameter(torch.ones(2))
    assert type(decode(encode(param))) is torch.Tensor
    c = torch.randn(3, dtype=torch.complex64)
    assert torch.equal(decode(encode(c.conj())), c.conj().resolve_conj())
    assert torch.equal(decode(encode(-torch.ones(2, dtype=torch.complex64).conj().imag)), torch.zeros(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensor() -> None:
    t = torch.randn(64, 33, device="cuda").t()[::2]
    got = decode(encode({"t": t}))["t"]
    assert got.device.type == "cpu" and torch.equal(got, t.cpu())


def test_unsupported_tensors() -> None:
    with pytest.raises(PayloadEncodeError, match=r"payload\[0\]: only dense tensors"):
        plan_encode([torch.eye(3).to_sparse()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(PayloadEncodeError, match="unsupported torch dtype"):
        plan_encode(quantized)
    with pytest.raises(PayloadEncodeError, match="meta device"):
        plan_encode(torch.empty(2, device="meta"))


# --------------------------------------------------------------------------- numpy


@pytest.mark.parametrize(
    "dtype", ["?", "u1", "i1", "<i2", ">i4", "<u8", "<f2", "<f4", ">f8", "<c8", "<c16", "int64", "uint16"]
)
def test_numpy_dtypes(dtype: str) -> None:
    a = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    for arr in (a, a.T, a[:, ::-1, ::2], a[0, 0, 0:0], np.asarray(a[1, 2, 3])):
        got = round_trip({"a": arr})["a"]
        assert got.flags.owndata or got.base is not None


@pytest.mark.parametrize(
    ("arr", "kind"),
    [
        (np.array([object()], dtype=object), "object"),
        (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]), "structured"),
        (np.zeros(2, dtype="V4"), "void"),
        (np.array(["ab"]), "<U2"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime"),
    ],
)
def test_numpy_unsupported_dtypes(arr: np.ndarray, kind: str) -> None:
    with pytest.raises(PayloadEncodeError, match=r"payload\['a'\]: unsupported numpy dtype"):
        plan_encode({"a": arr})


# --------------------------------------------------------------------------- plain data


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


def test_plain_data_at_any_depth() -> None:
    obj = {
        "none": None,
        "flags": [True, False],
        "floats": [1.5, float("inf"), -0.0],
        "ints": {1: "one", -2: [2**63 - 1, -(2**63), 2**64 - 1]},
        "tuple": (1, (2, (3,)), [4, (5, "x")], ()),
        "empty": ([], {}, (), ""),
        "bytes": [b"", b"abc", bytes(range(256)) * 40],
        "deep": [[[[{"t": torch.ones(1), "a": np.zeros(1)}]]]],
        "mixed": [1, "a", None, 2.0, torch.zeros(2), (torch.ones(1),)],
    }
    got = round_trip(obj)
    assert type(got["tuple"][2]) is list and type(got["tuple"][2][1]) is tuple
    assert round_trip((1, [2])) == (1, [2])
    assert round_trip([1, (2,)]) == [1, (2,)]
    assert round_trip(b"x" * 10_000) == b"x" * 10_000
    for scalar in (None, 0, -1, 2**64 - 1, 3.25, "héllo", True, b""):
        assert round_trip(scalar) == scalar


def test_subclasses_of_scalars_travel_as_the_base_type() -> None:
    got = decode(encode({Name("k"): [Name("v"), Colour.RED, np.float64(2.5)], "n": Colour.RED}))
    assert got == {"k": ["v", 1, 2.5], "n": 1}
    assert [type(x) for x in got["k"]] == [str, int, float] and type(next(iter(got))) is str


@dataclasses.dataclass
class Point:
    x: int


class Opaque(msgspec.Struct):
    x: int


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (OmniPayload(extras={"x": [1, 2, {3}]}), r"payload\.extras\['x'\]\[2\]: unsupported type set$"),
        ({"f": lambda: 0}, r"payload\['f'\]: unsupported type function"),
        ([Point(1)], r"payload\[0\]: unsupported type .*Point"),
        ((1, object()), r"payload\[1\]: unsupported type object"),
        ({"n": np.int64(3)}, r"payload\['n'\]: unsupported type numpy\.int64 \(a numpy scalar"),
        ({"b": bytearray(b"x")}, r"unsupported type bytearray \(pass bytes"),
        ({1.5: 1}, r"payload: dict key 1.5 has type float"),
        ({True: 1}, r"payload: dict key True has type bool"),
        ([Opaque(x=1)], r"payload\[0\]: unsupported type .*Opaque \(a msgspec.Struct that is not registered"),
        ({"big": [1, 2**64]}, r"payload\['big'\]\[1\]: int 18446744073709551616 does not fit"),
        ({"big": [*range(100), -(2**63) - 1]}, r"payload\['big'\]\[100\]: int .* does not fit"),
        ({2**70: 1}, r"payload\[1180591620717411303424\] \(key\): int .* does not fit"),
        (np.ma.masked_array([1]), r"payload: unsupported type .*MaskedArray \(an ndarray subclass"),
        ([[1], frozenset()], r"payload\[1\]: unsupported type frozenset"),
    ],
)
def test_unsupported_objects_name_type_and_path(obj: Any, message: str) -> None:
    with pytest.raises(PayloadEncodeError, match=message):
        encode(obj)


def test_cycles_and_deep_nesting_are_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(PayloadEncodeError, match="nested too deeply"):
        encode(cycle)


# --------------------------------------------------------------------------- buffers


def test_write_into_a_bigger_reused_buffer() -> None:
    sent = full_payload()
    plan = plan_encode(sent)
    backing = bytearray(b"\xff" * (plan.nbytes + 1000))
    assert plan.write_into(memoryview(backing)) == plan.nbytes
    assert bytes(backing[: plan.nbytes]) == encode(sent)  # padding zeroed, no stale bytes
    assert backing[plan.nbytes :] == b"\xff" * 1000
    assert peek_total_size(backing) == plan.nbytes
    assert_same(sent, decode(memoryview(backing)))
    assert_same(sent, decode(memoryview(backing)[: plan.nbytes], copy=False))
    assert plan.num_regions == 8


def test_write_into_refuses_bad_buffers() -> None:
    plan = plan_encode({"t": torch.ones(10)})
    with pytest.raises(PayloadEncodeError, match="too small"):
        plan.write_into(bytearray(plan.nbytes - 1))
    with pytest.raises(PayloadEncodeError, match="writable"):
        plan.write_into(bytes(plan.nbytes))


def test_copy_true_is_independent_of_the_buffer() -> None:
    buf = bytearray(encode({"t": torch.arange(8), "a": np.arange(8), "b": b"q" * 5000}))
    got = decode(buf)
    buf[PREFIX_SIZE:] = bytes(len(buf) - PREFIX_SIZE)
    assert torch.equal(got["t"], torch.arange(8)) and np.array_equal(got["a"], np.arange(8))
    assert got["b"] == b"q" * 5000
    got["t"][0] = 5  # owns writable memory


def test_copy_false_returns_views() -> None:
    buf = bytearray(encode({"t": torch.arange(8), "a": np.arange(8.0)}))
    got = decode(buf, copy=False)
    got["t"][0] = 42
    got["a"][1] = 7.0
    again = decode(buf)
    assert again["t"][0] == 42 and again["a"][1] == 7.0
    ro = decode(bytes(buf), copy=False)  # read-only memory: numpy read-only view, torch copy
    assert not ro["a"].flags.writeable and ro["t"][0] == 42


def test_trailing_bytes_are_ignored() -> None:
    buf = encode({"t": torch.ones(3)})
    assert_same(decode(buf + b"junk" * 100), {"t": torch.ones(3)})


# --------------------------------------------------------------------------- corrupt input


def test_truncation_at_every_length() -> None:
    buf = encode(full_payload())
    for n in range(len(buf)):
        with pytest.raises(PayloadTruncatedError):
            decode(buf[:n])
    with pytest.raises(PayloadTruncatedError):
        peek_total_size(buf[:10])


def test_magic_version_and_flags() -> None:
    buf = bytearray(encode({"a": 1}))
    with pytest.raises(PayloadMagicError, match="not an omnirelay payload"):
        decode(b"PK\x03\x04" + bytes(buf[4:]))
    with pytest.raises(PayloadMagicError):
        decode(b"XY")
    with pytest.raises(PayloadVersionError, match="version 2"):
        peek_total_size(forge([], 1, version=2))
    with pytest.raises(PayloadDecodeError, match="unknown flags"):
        decode(forge([], 1, flags=4))
    bad_total = bytearray(buf)
    bad_total[12:20] = struct.pack("<Q", 3)
    with pytest.raises(PayloadDecodeError, match="total_len 3"):
        decode(bad_total)


_T = ["torch", "int64", [2], 0, 16]


@pytest.mark.parametrize(
    ("regions", "tree", "data", "error", "message"),
    [
        ([], None, b"", None, None),
        ([], [], b"", None, None),
        ([_T], region_ref(0), bytes(16), None, None),
        ([["torch", "int64", [2], 0, 8]], region_ref(0), bytes(16), PayloadDecodeError, "do not match shape"),
        (
            [["torch", "int65", [2], 0, 16]],
            region_ref(0),
            bytes(16),
            PayloadDecodeError,
            "unknown torch dtype",
        ),
        ([["numpy", "O", [2], 0, 16]], region_ref(0), bytes(16), PayloadDecodeError, "numpy dtype 'O'"),
        ([["numpy", "<i3", [2], 0, 6]], region_ref(0), bytes(6), PayloadDecodeError, "numpy dtype '<i3'"),
        ([["numpy", "(2,)i4", [2], 0, 16]], region_ref(0), bytes(16), PayloadDecodeError, "numpy dtype"),
        (
            [["jax", "int64", [2], 0, 16]],
            region_ref(0),
            bytes(16),
            PayloadDecodeError,
            "malformed payload header",
        ),
        (
            [["torch", "int64", [2], 64, 16]],
            region_ref(0),
            bytes(16),
            PayloadDecodeError,
            "past the payload end",
        ),
        (
            [["torch", "int64", [2], 8, 16]],
            region_ref(0),
            bytes(32),
            PayloadDecodeError,
            "not a multiple of 64",
        ),
        ([_T, _T], [region_ref(0), region_ref(1)], bytes(16), PayloadDecodeError, "overlaps"),
        (
            [["torch", "int64", [-2], 0, 16]],
            region_ref(0),
            bytes(16),
            PayloadDecodeError,
            "malformed payload header",
        ),
        ([["torch", "int64", [0, 2**62], 0, 0]], region_ref(0), b"", PayloadDecodeError, "too large"),
        ([["bytes", "int8", [2], 0, 2]], region_ref(0), bytes(2), PayloadDecodeError, "bytes region"),
        ([_T], region_ref(1), bytes(16), PayloadDecodeError, "reference to region 1"),
        ([_T], msgspec.msgpack.Ext(1, b"\0"), bytes(16), PayloadDecodeError, "region reference of 1 bytes"),
        ([], msgspec.msgpack.Ext(9, b""), b"", PayloadDecodeError, "unknown msgpack extension type 9"),
        ([], msgspec.msgpack.Ext(2, b"\x01"), b"", PayloadDecodeError, "tuple record holds int"),
        ([], msgspec.msgpack.Ext(2, b"\xc1"), b"", PayloadDecodeError, "malformed payload object tree"),
        (
            [],
            msgspec.msgpack.Ext(3, msgspec.msgpack.encode(["Meta"])),
            b"",
            PayloadDecodeError,
            "struct record",
        ),
        ([], struct_ext("Nope", {}), b"", PayloadSchemaError, "unknown struct type 'Nope'"),
        (
            [],
            struct_ext("Meta", {"finishd": True}),
            b"",
            PayloadSchemaError,
            "unknown field 'finishd' for struct Meta",
        ),
        ([], struct_ext("Meta", {1: True}), b"", PayloadSchemaError, "unknown field 1 for struct Meta"),
        (
            [],
            struct_ext("Meta", {"left_context_size": "x"}),
            b"",
            PayloadSchemaError,
            r"Meta\.left_context_size: expected int",
        ),
        (
            [],
            struct_ext("OmniPayload", {"meta": struct_ext("Codes", {})}),
            b"",
            PayloadSchemaError,
            "expected Meta",
        ),
        ([], struct_ext("test.Span", {"start": 1}), b"", PayloadSchemaError, "cannot build test.Span"),
        ([], {(1, 2): 3}, b"", None, None),
    ],
)
def test_forged_headers(
    regions: list[Any], tree: Any, data: bytes, error: type[Exception] | None, message: str | None
) -> None:
    buf = forge(regions, tree, data=data)
    if error is None:
        decode(buf)
        decode(bytearray(buf), copy=False)
    else:
        with pytest.raises(error, match=message):
            decode(buf)


def test_header_that_does_not_parse() -> None:
    buf = bytearray(encode({"a": 1}))
    buf[PREFIX_SIZE] = 0xC1  # a msgpack byte that is never valid
    with pytest.raises(PayloadDecodeError, match="malformed payload header"):
        decode(buf)


def test_fuzz_random_byte_flips() -> None:
    rng = random.Random(1234)
    originals = [
        encode(full_payload()),
        encode({"x": (1, [torch.ones(2, 3, dtype=torch.bfloat16)], {"k": b"v" * 5000}), 7: np.arange(4)}),
        encode(
            OmniPayload(codes=Codes(audio=torch.arange(800).reshape(16, 50)), meta=Meta(left_context_size=0))
        ),
    ]
    outcomes = {"ok": 0, "error": 0}
    for original in originals:
        header_end = PREFIX_SIZE + struct.unpack_from("<I", original, 8)[0]
        for _ in range(1500):
            buf = bytearray(original)
            for _ in range(rng.randint(1, 4)):
                # Mostly the prefix and header, where the structure lives.
                pos = rng.randrange(header_end) if rng.random() < 0.9 else rng.randrange(len(buf))
                buf[pos] = rng.randrange(256)
            cut = len(buf) if rng.random() < 0.8 else rng.randrange(len(buf))
            try:
                decode(bytes(buf[:cut]), copy=rng.random() < 0.5)
                outcomes["ok"] += 1
            except PayloadDecodeError:
                outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 0


def test_microbenchmark_shape_only() -> None:
    """The codec-chunk payload of docs/protocol.md §5.2 (no timing asserts: see the bench command)."""
    chunk = OmniPayload(codes=Codes(audio=torch.arange(16 * 50)), meta=Meta(left_context_size=25))
    plan = plan_encode(chunk)
    buf = bytearray(plan.nbytes)
    plan.write_into(buf)
    assert plan.num_regions == 1 and plan.nbytes < 16 * 50 * 8 + 256
    assert decode(buf).meta.left_context_size == 25


# ---------------------------------------------------------------- repeated headers


def _all_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _all_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _all_tensors(v)]
    return []


@pytest.mark.parametrize(
    "obj",
    [
        {
            "codes": {"audio": torch.arange(800).reshape(16, 50)},
            "meta": {"finished": False, "ids": [1, 2, 3]},
        },
        {"h": torch.randn(2, 8).to(torch.bfloat16), "n": None, "b": b"xy", "f": 1.5, "s": "é"},
        {
            "t": (torch.ones(2), 3),
            "l": [{"x": torch.zeros(3)}, 4],
            "a": np.arange(6, dtype=">i4").reshape(2, 3),
        },
        [torch.ones(1), {"k": torch.zeros(0, 4)}],
        torch.tensor(7),
    ],
    ids=["codec", "bf16-plain", "tuple-list-of-dicts", "list-root", "0d-root"],
)
def test_a_repeated_header_decodes_to_equal_independent_objects(obj: Any) -> None:
    """The second decode of a header takes the cached path (a template for trees of dicts,
    plain values and tensors; msgpack otherwise): same values, fresh containers, fresh
    tensor memory, and a buffer cut short is still refused."""
    data = encode(obj)
    first, second = decode(data), decode(bytearray(data))
    assert _equal(first, obj) and _equal(second, obj)
    assert type(first) is type(obj) and type(second) is type(obj)
    ta, tb = _all_tensors(first), _all_tensors(second)
    assert len(ta) == len(tb) == len(_all_tensors(obj))
    for a, b in zip(ta, tb, strict=True):
        if a.numel():
            assert a.data_ptr() != b.data_ptr()
    if isinstance(first, dict) and isinstance(first.get("meta"), dict):
        first["meta"]["ids"].append(4)  # lists and dicts are the caller's own
        first["meta"]["finished"] = True
        third = decode(data)
        assert third["meta"] == {"finished": False, "ids": [1, 2, 3]}
    with pytest.raises(PayloadTruncatedError):
        decode(data[:-1])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(b, dict):
        return type(a) is dict and list(a) == list(b) and all(_equal(a[k], b[k]) for k in b)
    if isinstance(b, list | tuple):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------- output stocks
def _stock_payload(seed: int) -> OmniPayload:
    g = torch.Generator().manual_seed(seed)
    return OmniPayload(
        codes=Codes(audio=torch.randint(0, 2048, (16 * 50,), generator=g)),
        meta=Meta(left_context_size=25, codec_frame_valid=torch.rand(3, generator=g) > 0.5),
        hidden_states={
            "last": torch.randn(1, 8, generator=g).to(torch.bfloat16),
            "h0": torch.tensor(seed).bfloat16(),
            "scalar": torch.tensor(float(seed)),
        },
        extras={"np": np.arange(4)},  # numpy arrays are not made ahead
    )


def _as_dicts(x: Any) -> Any:
    """Structs as dicts of their fields, at any depth (for _equal)."""
    if isinstance(x, msgspec.Struct):
        return {"type": type(x).__name__, **{k: _as_dicts(v) for k, v in msgspec.structs.asdict(x).items()}}
    if type(x) is dict:
        return {k: _as_dicts(v) for k, v in x.items()}
    return x


def _equal_payload(a: Any, b: OmniPayload) -> bool:
    return _equal(_as_dicts(a), _as_dicts(b))


def test_an_output_stock_fills_tensors_made_ahead_for_a_repeated_header() -> None:
    from omnirelay.payload.codec import OutputStock

    stock = OutputStock()
    stock.refill()  # nothing decoded yet: nothing to make
    assert stock.num_made == 0 and not stock.can_refill
    first = encode(_stock_payload(1))
    assert _equal_payload(decode(first, stock=stock), _stock_payload(1))
    assert stock.can_refill
    stock.refill()
    assert stock.num_made == 5  # one per torch tensor of the header just decoded (bfloat16 too)
    stock.refill()  # made already: not made twice
    assert stock.num_made == 5 and not stock.can_refill
    buf = bytearray(encode(_stock_payload(2)))  # same header, other data
    got = decode(buf, stock=stock)
    assert stock.num_made == 0  # all five used
    assert _equal_payload(got, _stock_payload(2))
    buf[-256:] = bytes(256)  # the outputs own their bytes
    assert _equal_payload(got, _stock_payload(2))
    again = decode(encode(_stock_payload(3)), stock=stock)  # no refill: fresh outputs
    assert _equal_payload(again, _stock_payload(3))
    assert again.codes is not None and got.codes is not None
    assert again.codes.audio.data_ptr() != got.codes.audio.data_ptr()


def test_an_output_stock_made_for_another_header_is_not_used() -> None:
    from omnirelay.payload.codec import OutputStock

    stock = OutputStock()
    decode(encode(_stock_payload(1)), stock=stock)
    stock.refill()
    other = {"codes": {"audio": torch.arange(12).reshape(3, 4)}, "meta": {"finished": True}}
    assert _equal(decode(encode(other), stock=stock), other)  # different header: made ones dropped
    assert stock.num_made == 0
    stock.refill()
    assert stock.num_made == 1  # now made for the header last decoded
    views = decode(encode(other), copy=False, stock=stock)  # views wanted: made ones stay unused
    assert _equal(views, other)
    assert stock.num_made == 1
    corrupt = bytearray(encode(other))
    corrupt[:4] = b"XXXX"
    with pytest.raises(PayloadMagicError):
        decode(corrupt, stock=stock)
    assert _equal(decode(encode(other), stock=stock), other)
    assert stock.num_made == 0


def test_an_output_stock_makes_nothing_for_large_tensors() -> None:
    from omnirelay.payload.codec import OutputStock
    from omnirelay.payload.decoder import STOCK_MAX_BYTES

    stock = OutputStock()
    big = {"x": torch.zeros(STOCK_MAX_BYTES // 4 + 1)}  # one float32 over the bound
    decode(encode(big), stock=stock)
    decode(encode(big), stock=stock)
    stock.refill()
    assert stock.num_made == 0 and not stock.can_refill
    assert _equal(decode(encode(big), stock=stock), big)


# ---------------------------------------------------------------- chunk trees
def _random_chunk_tree(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    dtypes = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.float16, torch.float64]
    out: dict[str, Any] = {}
    for i in range(rng.randint(0, 5)):
        key = rng.choice(["audio", "meta", "h", "ids", "x", "ü/..\0", ""]) + str(i)
        roll = rng.random()
        if roll < 0.3:
            shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
            t = torch.zeros(shape, dtype=rng.choice(dtypes))
            if t.dim() == 2 and rng.random() < 0.5:
                t = t.t()  # non-contiguous
            out[key] = t
        elif roll < 0.45 and depth < 3:
            out[key] = _random_chunk_tree(rng, depth + 1)
        else:
            out[key] = rng.choice([None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, "s", ""])
    return out


def test_random_chunk_trees_round_trip() -> None:
    """Chunks of dicts, plain values and tensors (strided ones too) decode back to the
    object, and a repeated header (the decode cache's hit) decodes the new data."""
    rng = random.Random(5)
    for _ in range(300):
        obj = _random_chunk_tree(rng)
        plan = plan_encode(obj)
        a = bytearray(plan.nbytes)
        plan.write_into(a)
        assert bytes(a) == encode(obj)
        assert _equal(decode(a), obj)
        assert _equal(decode(a), obj)  # the header is cached now


@pytest.mark.parametrize(
    "obj",
    [
        {"x": torch.zeros(2, dtype=torch.bfloat16)},  # opaque dtype: int view needed
        {"x": torch.zeros(2, requires_grad=True)},
        {"x": torch.zeros(2, dtype=torch.complex64).conj()},
        {"x": torch.nn.Parameter(torch.zeros(2))},
        {"x": np.zeros(2)},
        {"x": [1, 2]},
        {"x": (1,)},
        {1: 2},
        {"x": 2**64},
        {"x": b"raw"},
        {f"k{i}": torch.zeros(1) for i in range(65)},
    ],
    ids=[
        "bf16",
        "grad",
        "conj",
        "parameter",
        "numpy",
        "list",
        "tuple",
        "int-key",
        "big-int",
        "bytes",
        "65-regions",
    ],
)
def test_chunks_off_the_common_shapes_encode_or_fail_clearly(obj: dict[Any, Any]) -> None:
    try:
        data = encode(obj)
    except PayloadEncodeError:
        return  # the planner's error, as before
    assert _equal(
        decode(data), obj if not isinstance(obj.get("x"), torch.nn.Parameter) else {"x": torch.zeros(2)}
    )
