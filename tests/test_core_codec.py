"""The wire codec: round trips, determinism, strict validation with named fields, and fuzzing."""

from __future__ import annotations

import copy
import enum
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, make_dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedveil.core.codec import MAGIC, decode, encode, encode_frames_with_slot, encode_with_slot, encoded_size
from fedveil.core.messages import ARRAY_DTYPES, array_field, message
from fedveil.errors import CodecError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@message("test.codec.scalars")
@dataclass(frozen=True)
class Scalars:
    i: int
    f: float
    s: str
    flag: bool
    raw: bytes
    oi: int | None
    of: float | None
    os: str | None
    oflag: bool | None
    oraw: bytes | None
    ti: tuple[int, ...]
    tf: tuple[float, ...]
    ts: tuple[str, ...]
    di: dict[str, int]
    df: dict[str, float]
    ds: dict[str, str]


@message("test.codec.embed_reply")
@dataclass(frozen=True)
class EmbedReply:
    round: int
    attempt: int
    embeddings: np.ndarray = array_field(dtype="float32", ndim=2, finite=True)


@message("test.codec.constrained")
@dataclass(frozen=True)
class Constrained:
    x: np.ndarray = array_field(dtype="float32", shape=(None, 4), max_elements=40)
    ids: np.ndarray = array_field(dtype="int32", ndim=1)
    blob: bytes = b""
    note: str = ""


@message("test.codec.slotted")
@dataclass(frozen=True)
class Slotted:
    round: int
    before: np.ndarray = array_field(dtype="float32", ndim=1)
    record: np.ndarray = array_field(dtype="uint8", ndim=1)
    after: bytes = b""


@message("test.codec.picky")
@dataclass(frozen=True)
class Picky:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"n must be >= 0, got {self.n}")


def _array_message(dtype: str) -> type:
    """One message class per dtype: a free array (NaN/inf allowed) and a finite one, any shape."""
    cls = make_dataclass(
        f"Arrays_{dtype}",
        [
            ("tag", int),
            ("free", np.ndarray, array_field(dtype=dtype, finite=False)),
            ("strict", np.ndarray, array_field(dtype=dtype)),
        ],
        frozen=True,
    )
    return message(f"test.codec.arrays.{dtype}")(cls)


ARRAY_MESSAGES = {dtype: _array_message(dtype) for dtype in ARRAY_DTYPES}


# --- strategies ---------------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=12)
KEYS = st.text(max_size=6)
scalars_messages = st.builds(
    Scalars,
    i=INT64,
    f=FLOATS,
    s=TEXT,
    flag=st.booleans(),
    raw=st.binary(max_size=40),
    oi=st.none() | INT64,
    of=st.none() | FLOATS,
    os=st.none() | TEXT,
    oflag=st.none() | st.booleans(),
    oraw=st.none() | st.binary(max_size=20),
    ti=st.lists(INT64, max_size=5).map(tuple),
    tf=st.lists(FLOATS, max_size=5).map(tuple),
    ts=st.lists(TEXT, max_size=5).map(tuple),
    di=st.dictionaries(KEYS, INT64, max_size=4),
    df=st.dictionaries(KEYS, FLOATS, max_size=4),
    ds=st.dictionaries(KEYS, TEXT, max_size=4),
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def array_messages(draw: st.DrawFn, dtype: str | None = None) -> Any:
    dtype = draw(st.sampled_from(ARRAY_DTYPES)) if dtype is None else dtype
    np_dtype = np.dtype(dtype)
    finite_elements = None
    if np_dtype.kind == "f":
        finite_elements = st.floats(allow_nan=False, allow_infinity=False, width=8 * np_dtype.itemsize)
    free = draw(hnp.arrays(np_dtype, SHAPES))
    strict = draw(hnp.arrays(np_dtype, SHAPES, elements=finite_elements))
    return ARRAY_MESSAGES[dtype](tag=draw(INT64), free=free, strict=strict)


any_message = scalars_messages | array_messages()


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _same_message(a: Any, b: Any) -> bool:
    """Field by field; ``repr`` tells -0.0 from 0.0 and a tuple from a list, dicts compare sorted."""
    if type(a) is not type(b):
        return False
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not _same_array(x, y):
                return False
        elif isinstance(x, dict):
            if type(y) is not dict or repr(sorted(x.items())) != repr(sorted(y.items())):
                return False
        elif repr(x) != repr(y):
            return False
    return True


# --- wire surgery helpers -----------------------------------------------------------------------------


def _split(wire: bytes) -> tuple[dict[str, Any], bytes]:
    """A valid encoding's parsed header and its data section."""
    n = int.from_bytes(wire[4:8], "little")
    return json.loads(wire[8 : 8 + n]), wire[8 + n + (-(8 + n) % 8) :]


def _join(header: Any, data: bytes, *, raw_header: bytes | None = None) -> bytes:
    """Assemble a message from a header and a data section, padding the header as the format says."""
    if raw_header is None:
        raw_header = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = -(8 + len(raw_header)) % 8
    return MAGIC + len(raw_header).to_bytes(4, "little") + raw_header + bytes(pad) + data


def _embed_reply(rows: int = 3, cols: int = 4) -> EmbedReply:
    emb = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) / 7
    return EmbedReply(round=5, attempt=1, embeddings=emb)


def _constrained() -> Constrained:
    return Constrained(
        x=np.ones((3, 4), np.float32), ids=np.arange(5, dtype=np.int32), blob=b"hello", note="n"
    )


# --- round trips and determinism ----------------------------------------------------------------------


@PROPERTY
@given(scalars_messages)
def test_scalar_messages_round_trip(msg: Scalars) -> None:
    wire = encode(msg)
    back = decode(wire)
    assert back == msg
    assert _same_message(back, msg)
    assert type(back.raw) is bytes
    assert type(back.ti) is tuple


@PROPERTY
@given(array_messages())
def test_array_messages_round_trip_for_every_dtype_and_shape(msg: Any) -> None:
    back = decode(encode(msg), expected=type(msg))
    assert _same_message(back, msg)
    assert back.free.dtype == np.dtype(msg.free.dtype)
    assert not back.free.flags.writeable
    assert not back.strict.flags.writeable


@PROPERTY
@given(any_message)
def test_encoding_is_deterministic_aligned_and_sized(msg: Any) -> None:
    wire = encode(msg)
    assert wire == encode(msg)
    assert encode(decode(wire)) == wire
    assert len(wire) == encoded_size(msg)
    assert len(wire) % 8 == 0
    assert wire[:4] == MAGIC


@PROPERTY
@given(
    rnd=INT64,
    before=hnp.arrays(np.float32, st.integers(0, 9), elements=st.floats(-1e3, 1e3, width=32)),
    record=st.binary(max_size=70),
    after=st.binary(max_size=20),
)
def test_a_slot_written_by_the_caller_gives_the_bytes_of_encode(
    rnd: int, before: np.ndarray, record: bytes, after: bytes
) -> None:
    """``encode_with_slot`` lays the message out and leaves one uint8 field's bytes to the caller
    (FDML devices seal their gradient straight into it): once written, the buffer is ``encode``'s."""
    placeholder = np.full(len(record), 0xAB, np.uint8)  # never read: its bytes must not leak through
    frame, slot = encode_with_slot(Slotted(rnd, before, placeholder, after), "record")
    assert slot.nbytes == len(record) and slot.flags.writeable
    slot[:] = np.frombuffer(record, np.uint8)
    want = encode(Slotted(rnd, before, np.frombuffer(record, np.uint8), after))
    assert bytes(frame) == want
    assert decode(frame).record.tobytes() == record


def test_encode_with_slot_wants_a_flat_array_field() -> None:
    msg = Slotted(1, np.zeros(2, np.float32), np.zeros(3, np.uint8))
    for field in ("after", "round", "nothing"):
        with pytest.raises(CodecError, match=f"test.codec.slotted.{field}: encode_with_slot needs"):
            encode_with_slot(msg, field)
    with pytest.raises(CodecError, match="dtype float64"):
        encode_with_slot(Slotted(1, np.zeros(2), np.zeros(3, np.uint8)), "record")
    with pytest.raises(CodecError, match="needs a count >= 1"):
        encode_frames_with_slot(msg, "record", 0)


@PROPERTY
@given(
    rnd=st.integers(0, 2**40),
    count=st.integers(1, 5),
    n=st.integers(0, 9),
    record=st.binary(max_size=13),
    after=st.binary(max_size=11),
    seed=st.integers(0, 2**32 - 1),
)
def test_frames_whose_float_slots_are_written_as_one_matrix_are_encode_s_bytes(
    rnd: int, count: int, n: int, record: bytes, after: bytes, seed: int
) -> None:
    """``encode_frames_with_slot`` lays out ``count`` messages in one buffer and leaves a float32 field to
    the caller, who writes all of them as the rows of one ``(count, n)`` matrix (FL-traditional's new
    weights): each frame is then ``encode`` of its message, and a non-finite value written there is
    refused by ``decode`` (the receiver's check)."""
    template = Slotted(rnd, np.zeros(n, np.float32), np.frombuffer(record, np.uint8), after)
    frames, slots = encode_frames_with_slot(template, "before", count)
    rows = slots.view(np.float32)
    assert rows.shape == (count, n) and frames.shape[1] % 8 == 0 and rows.ctypes.data % 8 == 0
    values = np.random.default_rng(seed).normal(size=(count, n)).astype(np.float32)
    rows[:] = values
    for i in range(count):
        want = encode(Slotted(rnd, values[i], np.frombuffer(record, np.uint8), after))
        assert frames[i].tobytes() == want
        np.testing.assert_array_equal(decode(memoryview(frames[i])).before, values[i])
    if n:
        rows[count - 1, n - 1] = np.nan
        with pytest.raises(CodecError, match="non-finite"):
            decode(memoryview(frames[count - 1]))


@PROPERTY
@given(st.dictionaries(KEYS, INT64, min_size=2, max_size=6))
def test_dict_insertion_order_does_not_change_the_bytes(d: dict[str, int]) -> None:
    base = Scalars(0, 0.0, "", False, b"", None, None, None, None, None, (), (), (), d, {}, {})
    reverse = Scalars(
        0, 0.0, "", False, b"", None, None, None, None, None, (), (), (), dict(reversed(d.items())), {}, {}
    )
    assert encode(base) == encode(reverse)


@pytest.mark.parametrize("dtype", ARRAY_DTYPES)
def test_zero_size_and_zero_dim_arrays_round_trip(dtype: str) -> None:
    cls = ARRAY_MESSAGES[dtype]
    for shape in [(0,), (3, 0), (0, 0, 2), ()]:
        msg = cls(tag=1, free=np.zeros(shape, dtype), strict=np.ones(shape, dtype))
        assert _same_message(decode(encode(msg)), msg)


def test_header_layout_matches_the_documented_format() -> None:
    wire = encode(_constrained())
    header, data = _split(wire)
    assert header == {
        "type": "test.codec.constrained",
        "fields": {"note": "n"},
        "arrays": [
            {"field": "x", "dtype": "<f4", "shape": [3, 4], "offset": 0, "nbytes": 48},
            {"field": "ids", "dtype": "<i4", "shape": [5], "offset": 48, "nbytes": 20},
            {"field": "blob", "dtype": "|u1", "shape": [5], "offset": 72, "nbytes": 5},
        ],
    }
    assert len(data) == 80
    assert data[:48] == np.ones((3, 4), "<f4").tobytes()
    assert data[68:72] == bytes(4)
    assert data[72:77] == b"hello"


def test_header_json_spelling_is_free_but_the_layout_is_not() -> None:
    header, data = _split(encode(_constrained()))
    spelled = json.dumps(dict(reversed(header.items())), indent=2, ensure_ascii=True).encode()
    assert _same_message(decode(_join(None, data, raw_header=spelled)), _constrained())


def test_decoded_arrays_are_views_into_the_input_bytes() -> None:
    wire = encode(_embed_reply(64, 32))
    back = decode(wire)
    base = np.frombuffer(wire, np.uint8)
    start = back.embeddings.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    assert 0 < start < len(wire)
    assert start % 8 == 0
    assert not back.embeddings.flags.owndata


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "unaligned", "2d-view"])
def test_decode_accepts_bytes_like_inputs(kind: str) -> None:
    msg = _embed_reply()
    wire = encode(msg)
    data: Any
    if kind == "bytearray":
        data = bytearray(wire)
    elif kind == "memoryview":
        data = memoryview(wire)
    elif kind == "unaligned":
        data = memoryview(b"x" + wire)[1:]
    else:
        data = memoryview(np.frombuffer(wire, np.uint8).reshape(-1, 8))
    back = decode(data)
    assert _same_message(back, msg)
    assert back.embeddings.flags.aligned
    assert not back.embeddings.flags.writeable


def test_decode_rejects_non_bytes_input() -> None:
    with pytest.raises(TypeError, match="decode needs bytes"):
        decode("FVL1")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="not C-contiguous"):
        decode(memoryview(np.zeros((4, 4), np.uint8)[:, ::2]))


def test_encode_normalises_numpy_scalars_subclasses_and_ints_for_floats() -> None:
    class Phase(enum.IntEnum):
        EMBED = 1

    class Label(str, enum.Enum):
        A = "a"

    msg = _scalars(
        i=np.int64(7),
        f=3,
        s=np.str_("s"),
        flag=np.bool_(True),
        raw=bytearray(b"b"),
        oi=Phase.EMBED,
        of=np.float32(0.5),
        os=Label.A,
        ti=(np.int8(1), Phase.EMBED),
        tf=(1, np.float64(2.5)),
        ts=(Label.A,),
        di={Label.A: np.uint8(3)},
        df={"x": 1},
    )
    back = decode(encode(msg))
    expected = _scalars(
        i=7, f=3.0, s="s", flag=True, raw=b"b", oi=1, of=0.5, os="a", ti=(1, 1), tf=(1.0, 2.5)
    )
    assert back == Scalars(**{**vars(expected), "ts": ("a",), "di": {"a": 3}, "df": {"x": 1.0}})
    values = (back.i, back.f, back.s, back.flag, back.oi, back.os, back.ti[1], back.ts[0])
    assert [type(x) for x in values] == [int, float, str, bool, int, str, int, str]


def test_encode_accepts_non_contiguous_and_big_endian_arrays() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for arr in (base[:, ::2], base.T, base.astype(">f4"), base[::-1]):
        back = decode(encode(EmbedReply(1, 1, arr)))
        assert back.embeddings.dtype == np.float32
        np.testing.assert_array_equal(back.embeddings, arr)


def test_encode_does_not_keep_a_reference_to_mutable_input() -> None:
    arr = np.ones((2, 2), np.float32)
    wire = encode(EmbedReply(1, 1, arr))
    arr[0, 0] = 9
    assert decode(wire).embeddings[0, 0] == 1


# --- encode-side validation ---------------------------------------------------------------------------


def _scalars(**changes: Any) -> Scalars:
    base = {f.name: None for f in fields(Scalars)}
    base.update(i=0, f=0.0, s="", flag=False, raw=b"", ti=(), tf=(), ts=(), di={}, df={}, ds={})
    base.update(changes)
    return Scalars(**base)


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (
            lambda: EmbedReply(1, 1, np.ones((2, 2), np.float64)),
            "test.codec.embed_reply.embeddings: dtype float64, expected float32",
        ),
        (
            lambda: EmbedReply(1, 1, np.ones(3, np.float32)),
            "test.codec.embed_reply.embeddings: ndim 1 (shape (3,)), expected ndim 2",
        ),
        (
            lambda: EmbedReply(1, 1, [[1.0]]),
            "test.codec.embed_reply.embeddings: list is not a numpy array; expected an ndarray of float32",
        ),
        (
            lambda: EmbedReply(1, 1, np.array([[1.0, np.nan]], np.float32)),
            "test.codec.embed_reply.embeddings: 1 non-finite value(s)",
        ),
        (
            lambda: EmbedReply(1, 1, np.array([[np.inf, -np.inf]], np.float32)),
            "test.codec.embed_reply.embeddings: 2 non-finite value(s)",
        ),
        (
            lambda: EmbedReply(True, 1, np.ones((1, 1), np.float32)),
            "test.codec.embed_reply.round: bool True, expected int",
        ),
        (
            lambda: EmbedReply(2**63, 1, np.ones((1, 1), np.float32)),
            "test.codec.embed_reply.round: int 9223372036854775808 is outside the int64 range",
        ),
        (
            lambda: EmbedReply(1.0, 1, np.ones((1, 1), np.float32)),
            "test.codec.embed_reply.round: float 1.0, expected int",
        ),
        (
            lambda: Constrained(np.ones((2, 3), np.float32), np.arange(2, dtype=np.int32)),
            "test.codec.constrained.x: shape (2, 3), expected (None, 4) (axis 1 is 3, not 4)",
        ),
        (
            lambda: Constrained(np.ones((11, 4), np.float32), np.arange(2, dtype=np.int32)),
            "test.codec.constrained.x: 44 elements (shape (11, 4)) exceed max_elements=40",
        ),
        (
            lambda: Constrained(np.ones((1, 4), np.float32), np.arange(2, dtype=np.int64)),
            "test.codec.constrained.ids: dtype int64, expected int32",
        ),
        (
            lambda: Constrained(np.ones((1, 4), np.float32), np.arange(2, dtype=np.int32), blob="x"),
            "test.codec.constrained.blob: str, expected bytes",
        ),
        (lambda: _scalars(f=float("nan")), "test.codec.scalars.f: float nan is not finite"),
        (lambda: _scalars(of=float("inf")), "test.codec.scalars.of: float inf is not finite"),
        (
            lambda: _scalars(f=10**400),
            "test.codec.scalars.f: int <int of 1329 bits> is too large for a float",
        ),
        (lambda: _scalars(f="1.0"), "test.codec.scalars.f: str '1.0', expected float"),
        (
            lambda: _scalars(i=10**5000),
            "test.codec.scalars.i: int <int of 16610 bits> is outside the int64 range",
        ),
        (lambda: _scalars(ti=([[[[1]]]],)), "test.codec.scalars.ti[0]: list [[[[...]]]], expected int"),
        (lambda: _scalars(s="\ud800"), "test.codec.scalars.s: string '\\ud800' is not valid Unicode"),
        (lambda: _scalars(flag=1), "test.codec.scalars.flag: int 1, expected bool"),
        (lambda: _scalars(raw=None), "test.codec.scalars.raw: NoneType, expected bytes"),
        (lambda: _scalars(i=None), "test.codec.scalars.i: null None, expected int"),
        (lambda: _scalars(ti=[1]), "test.codec.scalars.ti: list, expected a tuple for tuple[int]"),
        (lambda: _scalars(ti=(1, "2")), r"test.codec.scalars.ti[1]: str '2', expected int"),
        (lambda: _scalars(tf=(float("nan"),)), "test.codec.scalars.tf[0]: float nan is not finite"),
        (lambda: _scalars(di={1: 1}), "test.codec.scalars.di key: int 1, expected str"),
        (lambda: _scalars(ds={"k": 1}), "test.codec.scalars.ds['k']: int 1, expected str"),
        (
            lambda: _scalars(df=[("k", 1.0)]),
            "test.codec.scalars.df: list, expected a dict for dict[str,float]",
        ),
    ],
)
def test_encode_rejects_invalid_messages_naming_the_field(msg: Callable[[], Any], match: str) -> None:
    with pytest.raises(CodecError, match=re.escape(match)):
        encode(msg())
    with pytest.raises(CodecError, match=re.escape(match)):
        encoded_size(msg())


def test_encode_rejects_unregistered_classes() -> None:
    @dataclass(frozen=True)
    class Loose:
        round: int

    @dataclass(frozen=True)
    class SubReply(EmbedReply):
        pass

    with pytest.raises(CodecError, match=r"cannot encode .*Loose: .* not a registered message"):
        encode(Loose(1))
    with pytest.raises(CodecError, match=r"cannot encode .*SubReply"):
        encode(SubReply(1, 1, np.ones((1, 1), np.float32)))
    with pytest.raises(CodecError, match="cannot encode int"):
        encode(3)


# --- decode-side validation: each failure named -------------------------------------------------------


def _mutate(
    msg: Any, edit: Callable[[dict[str, Any]], None], data_edit: Callable[[bytearray], None] | None = None
) -> bytes:
    header, data = _split(encode(msg))
    edit(header)
    buf = bytearray(data)
    if data_edit is not None:
        data_edit(buf)
    return _join(header, bytes(buf))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets ``header[a][b]...`` for ``path`` "a/b/..." (list indices as ints)."""

    def edit(header: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        node: Any = header
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        node: Any = header
        for p in parents:
            node = node[p]
        del node[last]

    return edit


def _nan_at(index: int, value: float = float("nan")) -> Callable[[bytearray], None]:
    def edit(buf: bytearray) -> None:
        buf[4 * index : 4 * index + 4] = np.float32(value).tobytes()

    return edit


def _swap_arrays(header: dict[str, Any]) -> None:
    """Put ``ids`` before ``x`` with offsets that would be canonical for that order."""
    x, ids = header["arrays"][0], header["arrays"][1]
    header["arrays"][:2] = [dict(ids, offset=0), dict(x, offset=24)]


def _zero_size_with_shape(shape: list[int]) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header["arrays"][0].update(shape=shape, nbytes=0)

    return edit


def _swap_data(buf: bytearray) -> None:
    """The data section to match :func:`_swap_arrays`: ids (20 bytes + 4 pad) first, then x (48 bytes)."""
    buf[0:72] = buf[48:72] + buf[0:48]


def _duplicate_array(header: dict[str, Any]) -> None:
    header["arrays"].insert(1, dict(header["arrays"][0], offset=48))


E = "test.codec.embed_reply"
VALID = encode(_embed_reply())
CONSTRAINED = encode(_constrained())
SCALARS_XY = encode(_scalars(raw=b"xy"))
C = "test.codec.constrained"
S = "test.codec.scalars"


@pytest.mark.parametrize(
    ("msg", "edit", "data_edit", "match"),
    [
        (
            _embed_reply,
            _set("fields/extra", 1),
            None,
            f"{E}.'extra': unexpected field; {E} declares round, attempt, embeddings",
        ),
        (_embed_reply, _delete("fields/attempt"), None, f"{E}.attempt: missing"),
        (_embed_reply, _set("fields/round", None), None, f"{E}.round: null, but the field is not optional"),
        (_embed_reply, _set("fields/round", True), None, f"{E}.round: bool True, expected int"),
        (_embed_reply, _set("fields/round", 1.0), None, f"{E}.round: float 1.0, expected int"),
        (_embed_reply, _set("fields/round", "1"), None, f"{E}.round: str '1', expected int"),
        (
            _embed_reply,
            _set("fields/round", 2**63),
            None,
            f"{E}.round: int 9223372036854775808 is outside the int64 range",
        ),
        (
            _embed_reply,
            _set("fields/round", -(2**63) - 1),
            None,
            f"{E}.round: int -9223372036854775809 is outside",
        ),
        (
            _embed_reply,
            _set("fields/embeddings", [[1.0]]),
            None,
            f"{E}.embeddings: array field given in 'fields'",
        ),
        (
            _embed_reply,
            _set("arrays/0/field", "round"),
            None,
            f"{E}.round: int field given in the arrays table",
        ),
        (_embed_reply, _set("arrays/0/field", "nope"), None, f"{E}.'nope': unexpected field"),
        (_embed_reply, _set("arrays/0/field", 3), None, f"{E}.3: unexpected field"),
        (
            _embed_reply,
            _set("arrays", []),
            None,
            f"{E}: message is 136 bytes, but its header describes 88 (trailing or missing bytes)",
        ),
        (_embed_reply, _delete("arrays/0/nbytes"), None, f"{E}: arrays[0] must be an object with keys"),
        (_embed_reply, _set("arrays/0/extra", 0), None, f"{E}: arrays[0] must be an object with keys"),
        (_embed_reply, _set("arrays/0", [1]), None, f"{E}: arrays[0] must be an object with keys"),
        (
            _embed_reply,
            _set("arrays/0/dtype", "<f8"),
            None,
            f"{E}.embeddings: dtype '<f8', expected '<f4' (float32)",
        ),
        (
            _embed_reply,
            _set("arrays/0/dtype", ">f4"),
            None,
            f"{E}.embeddings: dtype '>f4', expected '<f4' (float32)",
        ),
        (
            _embed_reply,
            _set("arrays/0/dtype", "float32"),
            None,
            f"{E}.embeddings: dtype 'float32', expected '<f4'",
        ),
        (_embed_reply, _set("arrays/0/dtype", "|O"), None, f"{E}.embeddings: dtype '|O', expected '<f4'"),
        (
            _embed_reply,
            _set("arrays/0/shape", [12]),
            None,
            f"{E}.embeddings: ndim 1 (shape (12,)), expected ndim 2",
        ),
        (
            _embed_reply,
            _set("arrays/0/shape", [4, 4]),
            None,
            f"{E}.embeddings: nbytes 48 does not match shape (4, 4) of 4-byte items",
        ),
        (
            _embed_reply,
            _set("arrays/0/shape", [-3, -4]),
            None,
            f"{E}.embeddings: shape entry -3 must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            _set("arrays/0/shape", [3, True]),
            None,
            f"{E}.embeddings: shape entry True must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            _set("arrays/0/shape", "3x4"),
            None,
            f"{E}.embeddings: shape '3x4' must be a list of at most 32 ints",
        ),
        (_embed_reply, _set("arrays/0/shape", [1] * 33), None, f"{E}.embeddings: shape [1, 1, 1"),
        (
            _embed_reply,
            _set("arrays/0/shape", [0, 2**70]),
            None,
            f"{E}.embeddings: shape entry 1180591620717411303424 must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            _set("arrays/0/shape", [10**4000, 4]),
            None,
            f"{E}.embeddings: shape entry <int of 13288 bits> must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            _zero_size_with_shape([0, 2**62]),
            lambda b: b.clear(),
            f"{E}.embeddings: shape (0, 4611686018427387904) cannot be represented",
        ),
        (
            _embed_reply,
            _set("arrays/0/offset", 8),
            None,
            f"{E}.embeddings: offset 8, expected 0 (canonical 8-byte aligned layout)",
        ),
        (
            _embed_reply,
            _set("arrays/0/offset", -8),
            None,
            f"{E}.embeddings: offset -8 must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            _set("arrays/0/nbytes", 4.0),
            None,
            f"{E}.embeddings: nbytes 4.0 must be an int in [0, 2**63)",
        ),
        (
            _embed_reply,
            None,
            _nan_at(5),
            f"{E}.embeddings: 1 non-finite value(s) (NaN/inf) in a finite field",
        ),
        (_embed_reply, None, _nan_at(0, float("-inf")), f"{E}.embeddings: 1 non-finite value(s)"),
        (
            _constrained,
            _set("arrays/0/shape", [4, 3]),
            None,
            f"{C}.x: shape (4, 3), expected (None, 4) (axis 1 is 3, not 4)",
        ),
        (
            _constrained,
            _set("arrays/0/shape", [12, 4]),
            None,
            f"{C}.x: 48 elements (shape (12, 4)) exceed max_elements=40",
        ),
        (
            _constrained,
            _set("arrays/2/shape", [5, 1]),
            None,
            f"{C}.blob: shape (5, 1), bytes travel as shape [length]",
        ),
        (_constrained, _set("arrays/2/dtype", "|i1"), None, f"{C}.blob: dtype '|i1', expected '|u1' (bytes)"),
        (_constrained, _set("arrays/1/offset", 40), None, f"{C}.ids: offset 40, expected 48"),
        (_constrained, _swap_arrays, _swap_data, f"{C}.x: arrays table is not in field declaration order"),
        (_constrained, _duplicate_array, None, f"{C}.x: given more than once"),
        (_constrained, _set("fields/blob", "aGVsbG8="), None, f"{C}.blob: bytes field given in 'fields'"),
        (_constrained, None, lambda b: b.__setitem__(70, 1), f"{C}.ids: non-zero padding after the data"),
        (
            _constrained,
            None,
            lambda b: b.extend(bytes(8)),
            f"{C}: message is {len(CONSTRAINED) + 8} bytes, but its header describes {len(CONSTRAINED)}",
        ),
        (
            _constrained,
            None,
            lambda b: b.__delitem__(slice(-8, None)),
            f"{C}.blob: data [{len(CONSTRAINED) - 8}, {len(CONSTRAINED)}) runs past the end of the",
        ),
        (lambda: _scalars(), _set("fields/f", 1), None, f"{S}.f: int 1, expected float"),
        (
            lambda: _scalars(),
            _set("fields/s", "\ud800"),
            None,
            f"{S}.s: string '\\ud800' is not valid Unicode",
        ),
        (lambda: _scalars(), _set("fields/s", ["a"]), None, f"{S}.s: list ['a'], expected str"),
        (lambda: _scalars(), _set("fields/flag", 0), None, f"{S}.flag: int 0, expected bool"),
        (
            lambda: _scalars(),
            _set("fields/ti", {"a": 1}),
            None,
            f"{S}.ti: object, expected a list for tuple[int]",
        ),
        (lambda: _scalars(), _set("fields/ts", ["a", 1]), None, f"{S}.ts[1]: int 1, expected str"),
        (lambda: _scalars(), _set("fields/tf", [1.5, None]), None, f"{S}.tf[1]: null None, expected float"),
        (
            lambda: _scalars(),
            _set("fields/di", [1]),
            None,
            f"{S}.di: list, expected an object for dict[str,int]",
        ),
        (lambda: _scalars(), _set("fields/df", {"a": "b"}), None, f"{S}.df['a']: str 'b', expected float"),
        (
            lambda: _scalars(),
            _set("fields/ds", {"\udfff": "b"}),
            None,
            f"{S}.ds key: string '\\udfff' is not valid Unicode",
        ),
        (
            lambda: _scalars(raw=b"xy"),
            _delete("arrays/0"),
            None,
            f"{S}: message is 208 bytes, but its header describes 200",
        ),
        (
            lambda: _scalars(raw=b"xy"),
            _set("fields/raw", None),
            None,
            f"{S}.raw: null, but the field is not optional",
        ),
        (lambda: _scalars(oraw=b"xy"), _set("fields/oraw", None), None, f"{S}.oraw: given more than once"),
        (
            lambda: Picky(1),
            _set("fields/n", -1),
            None,
            "test.codec.picky: the class rejected the decoded fields (n must be >= 0, got -1)",
        ),
    ],
)
def test_decode_rejects_invalid_fields_naming_them(
    msg: Callable[[], Any],
    edit: Callable[[dict[str, Any]], None] | None,
    data_edit: Callable[[bytearray], None] | None,
    match: str,
) -> None:
    wire = _mutate(msg(), edit or (lambda h: None), data_edit)
    with pytest.raises(CodecError, match=re.escape(match)):
        decode(wire)


def test_finite_false_fields_carry_nan_and_inf() -> None:
    cls = ARRAY_MESSAGES["float64"]
    free = np.array([np.nan, np.inf, -np.inf, -0.0])
    back = decode(encode(cls(tag=0, free=free, strict=np.zeros(1))))
    assert _same_array(back.free, free)


_HEADER_END = 8 + int.from_bytes(VALID[4:8], "little")  # 159: one byte of header padding follows


def _scalars_raw_header() -> bytes:
    return SCALARS_XY[8 : 8 + int.from_bytes(SCALARS_XY[4:8], "little")]


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"", "wire: 0 bytes is shorter than the 8-byte prefix"),
        (b"FVL1\x00\x00\x00", "wire: 7 bytes is shorter"),
        (b"FVL2" + VALID[4:], "wire: magic b'FVL2', expected b'FVL1'"),
        (
            VALID[:4] + (2**32 - 1).to_bytes(4, "little") + VALID[8:],
            "wire: header length 4294967295 exceeds the",
        ),
        (VALID[:4] + (len(VALID) - 7).to_bytes(4, "little") + VALID[8:], "wire: header length"),
        (_join(None, b"", raw_header=b"\xff\xfe"), "wire: header is not valid UTF-8 JSON"),
        (_join(None, b"", raw_header=b'{"type": '), "wire: header is not valid UTF-8 JSON"),
        (_join(None, b"", raw_header=b""), "wire: header is not valid UTF-8 JSON"),
        (
            _join(None, b"", raw_header=b'{"a": NaN}'),
            "wire: header is not valid UTF-8 JSON (NaN is not allowed",
        ),
        (
            _join(None, b"", raw_header=b'{"a": -Infinity}'),
            "wire: header is not valid UTF-8 JSON (-Infinity is not",
        ),
        (
            _join(None, b"", raw_header=b'{"a": 1, "a": 2}'),
            "wire: header is not valid UTF-8 JSON (duplicate key 'a')",
        ),
        (
            _join(None, b"", raw_header=b"[" * 100_000 + b"]" * 100_000),
            "wire: header JSON is nested too deeply",
        ),
        (_join(None, b"", raw_header=b"1" * 5000), "wire: header is not valid UTF-8 JSON"),
        (
            _join(
                None,
                b"",
                raw_header=b'{"arrays":[],"fields":{"round":%s},"type":"%s"}'
                % (b"[" * 900 + b"]" * 900, E.encode()),
            ),
            f"{E}.round: list [[[[...]]]], expected int",
        ),
        (_join([1], b""), "wire: header must be an object with keys arrays, fields, type; got 'list'"),
        (
            _join({"type": E, "fields": {}}, b""),
            "wire: header must be an object with keys arrays, fields, type; got ['fields', 'type']",
        ),
        (
            _join({"type": E, "fields": {}, "arrays": [], "x": 1}, b""),
            "got ['arrays', 'fields', 'type', 'x']",
        ),
        (_join({"type": 7, "fields": {}, "arrays": []}, b""), "wire: message type 7 is not a string"),
        (
            _join({"type": "test.codec.nobody", "fields": {}, "arrays": []}, b""),
            "wire: unknown message type 'test.codec.nobody'",
        ),
        (
            _join({"type": E, "fields": [], "arrays": []}, b""),
            f"{E}: header 'fields' is list, expected an object",
        ),
        (
            _join({"type": E, "fields": {}, "arrays": {}}, b""),
            f"{E}: header 'arrays' is object, expected a list",
        ),
        (
            VALID[:-1],
            f"{E}.embeddings: data [{len(VALID) - 48}, {len(VALID)}) runs past the end of the",
        ),
        (
            VALID[:_HEADER_END],
            f"{E}: message ends inside the header padding ({_HEADER_END} < {_HEADER_END + 1} bytes)",
        ),
        (VALID[:_HEADER_END] + b"\x01" + VALID[_HEADER_END + 1 :], f"{E}: non-zero padding after the header"),
        (VALID[:-4] + b"\x00\x00\xc0\x7f", f"{E}.embeddings: 1 non-finite value(s)"),
        (
            VALID + bytes(8),
            f"{E}: message is {len(VALID) + 8} bytes, but its header describes {len(VALID)} (trailing or",
        ),
        (
            _join(
                None,
                _split(SCALARS_XY)[1],
                raw_header=_scalars_raw_header().replace(b'"f":0.0', b'"f":1e999'),
            ),
            f"{S}.f: float inf is not finite",
        ),
    ],
)
def test_decode_rejects_malformed_wire_data(wire: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=re.escape(match)):
        decode(wire)


def test_max_bytes_is_checked_before_parsing() -> None:
    n = len(VALID)
    assert decode(VALID, max_bytes=n).round == 5
    with pytest.raises(CodecError, match=re.escape(f"wire: message of {n} bytes exceeds max_bytes={n - 1}")):
        decode(VALID, max_bytes=n - 1)
    garbage = b"\xff" * 1000
    with pytest.raises(CodecError, match="exceeds max_bytes=999"):
        decode(garbage, max_bytes=999)


def test_expected_type_is_enforced() -> None:
    assert isinstance(decode(VALID, expected=EmbedReply), EmbedReply)
    assert isinstance(decode(VALID, expected=(Scalars, EmbedReply)), EmbedReply)
    with pytest.raises(CodecError, match=re.escape(f"{E}: unexpected message type, expected {S}")):
        decode(VALID, expected=Scalars)
    with pytest.raises(CodecError, match=re.escape(f"expected {S} or {C}")):
        decode(VALID, expected=(Scalars, Constrained))


# --- fuzzing: nothing but CodecError, and whatever decodes is a valid message ---------------------------


SAMPLES = [
    VALID,
    encode(_constrained()),
    encode(_scalars(raw=b"abc", oraw=b"", ti=(1, -2), tf=(0.5,), ts=("x",), di={"a": 1}, df={"b": 2.0})),
    encode(ARRAY_MESSAGES["bool"](tag=3, free=np.ones((2, 3), bool), strict=np.zeros(0, bool))),
    encode(
        ARRAY_MESSAGES["uint16"](tag=-1, free=np.arange(7, dtype=np.uint16), strict=np.array(9, np.uint16))
    ),
]


def _decode_or_codec_error(data: bytes | bytearray) -> Any:
    """Decode: a CodecError naming the wire or a test message type is fine, anything else fails."""
    try:
        msg = decode(data)
    except CodecError as exc:
        assert str(exc).startswith(("wire: ", "test.codec.")), str(exc)
        return None
    assert encode(decode(encode(msg))) == encode(msg)
    return msg


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_codec_error(data)
    _decode_or_codec_error(MAGIC + data)
    _decode_or_codec_error(MAGIC + len(data).to_bytes(4, "little") + data)


@FUZZ
@given(st.one_of(st.sampled_from(SAMPLES), any_message.map(encode)), st.data())
def test_fuzz_byte_flips_truncations_and_insertions(wire: bytes, data: st.DataObject) -> None:
    buf = bytearray(wire)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 8))]
    _decode_or_codec_error(bytes(buf))
    _decode_or_codec_error(buf)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


@FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_structured_header_mutations(wire: bytes, data: st.DataObject) -> None:
    header, section = _split(wire)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(_paths(header))))
        op = data.draw(st.sampled_from(["replace", "delete", "add"]))
        header = copy.deepcopy(header)
        if not path:
            header = data.draw(JSON_VALUES)
            continue
        parent: Any = header
        for p in path[:-1]:
            parent = parent[p]
        if op == "replace":
            parent[path[-1]] = data.draw(JSON_VALUES)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(JSON_VALUES)
        else:
            parent.insert(path[-1], data.draw(JSON_VALUES))
        if not isinstance(header, dict):
            break
    _decode_or_codec_error(_join(None, section, raw_header=json.dumps(header, allow_nan=True).encode()))


# --- the codec imports neither torch nor pickle --------------------------------------------------------


def test_codec_imports_neither_torch_nor_pickle() -> None:
    """In a fresh interpreter: torch cannot be imported at all, and pickle-like modules are poisoned
    (numpy itself imports pickle, so we poison after numpy is loaded) while the codec is imported and
    used; the codec's and messages' namespaces hold no such module."""
    script = textwrap.dedent(
        """
        import sys, types
        import numpy as np
        sys.modules["torch"] = None
        class Poison(types.ModuleType):
            def __getattr__(self, name):
                raise AssertionError(f"{self.__name__}.{name} used")
        for name in ("pickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"):
            sys.modules[name] = Poison(name)
        from dataclasses import dataclass
        from fedveil.core import codec, messages
        @messages.message("test.import.ping")
        @dataclass(frozen=True)
        class Ping:
            n: int
            x: np.ndarray = messages.array_field(dtype="float32")
        back = codec.decode(codec.encode(Ping(3, np.ones(4, np.float32))))
        assert back.n == 3 and back.x.sum() == 4
        banned = {"torch", "pickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
        for module in (codec, messages):
            for value in vars(module).values():
                if isinstance(value, types.ModuleType):
                    assert value.__name__ not in banned, value
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
