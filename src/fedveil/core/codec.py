"""The wire codec: the only way a message becomes bytes and bytes become a message.

The wire format: a length-prefixed JSON header plus raw array buffers; no pickle, no
torch (this module imports neither), strict validation with errors that name the field.

Wire format (all integers little-endian)::

    b"FVL1" | u32 header_len | header (header_len bytes of UTF-8 JSON) | zero pad to 8 | data

The header is ``{"arrays": [...], "fields": {...}, "type": NAME}`` with sorted keys and no whitespace.
``fields`` holds every scalar, tuple and dict field as JSON (tuples as lists; a ``None`` as ``null``).
``arrays`` holds one entry per ``np.ndarray`` field and per non-``None`` ``bytes`` field (bytes travel as
uint8 arrays of shape ``[len]``), in field declaration order::

    {"dtype": "<f4", "field": "embeddings", "nbytes": 1349120, "offset": 0, "shape": [2635, 128]}

``dtype`` is the explicit little-endian numpy string of the declared dtype (``"|u1"``, ``"|b1"`` and
``"|i1"`` for one-byte types). ``offset`` counts from the start of the data section, which begins at the
first multiple of 8 after the header. Each buffer is C-contiguous and followed by zero padding to a
multiple of 8, so every offset is 8-byte aligned, each array starts right where the previous one's
padding ends, and the whole message is a multiple of 8 bytes long. Only this canonical layout decodes:
the same message always encodes to the same bytes, and anything else (overlaps, gaps, trailing bytes,
non-zero padding) is rejected. The header's JSON spelling (whitespace, key order, string escapes) is not
checked, so other encoders need not reproduce Python's ``json`` byte for byte; duplicate keys and the
non-standard ``NaN``/``Infinity`` tokens are rejected.

Scalars: ``int`` must fit int64, ``float`` must be finite (JSON has no NaN/inf; use ``float | None`` for
"no value"), ``str`` must be valid Unicode (no lone surrogates). Decoding is exact: ``true`` is not an
int, ``1`` is not a float, ``1.0`` is not an int, and array dtypes are never cast. Encoding accepts
numpy scalars and ``int`` for ``float`` fields (PEP 484's numeric tower) and normalises them.

Decoded arrays are read-only views into the input buffer (no copy) when it is 8-byte aligned; a caller
that passes a ``bytearray`` or writable ``memoryview`` must not modify it while the message lives.
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from typing import Any

import numpy as np

from fedveil.core.messages import (
    MAX_NDIM,
    ArraySpec,
    FieldSpec,
    Message,
    MessageSpec,
    message_class,
    message_spec,
)
from fedveil.errors import CodecError

__all__ = ["MAGIC", "decode", "encode", "encode_frames_with_slot", "encode_with_slot", "encoded_size"]

MAGIC = b"FVL1"
"""The first four bytes of every encoded message (format version 1)."""

_PREFIX = struct.Struct("<4sI")
_ALIGN = 8
_ZEROS = bytes(_ALIGN)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U32_MAX = 2**32 - 1
_ENTRY_KEYS = frozenset({"field", "dtype", "shape", "offset", "nbytes"})
_HEADER_KEYS = frozenset({"type", "fields", "arrays"})
_BYTES_WIRE_DTYPE = "|u1"
_ARRAY_KINDS = frozenset({"array", "bytes"})


def _align(n: int) -> int:
    return n + (-n % _ALIGN)


def _clip(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters for an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def _short(value: object) -> str:
    """A short ``repr`` of untrusted input for an error message; never raises (deep nesting, huge ints)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"<int of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


def _json_type(value: object) -> str:
    """How a decoded JSON value's type reads in an error message."""
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(
        type(value), type(value).__name__
    )


# --- scalar fields: strict checks shared by encode (after normalising) and decode ---------------------


def _check_int(where: str, value: Any) -> int:
    if type(value) is not int:
        raise CodecError(f"{where}: {_json_type(value)} {_short(value)}, expected int")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise CodecError(f"{where}: int {_short(value)} is outside the int64 range")
    return value


def _check_float(where: str, value: Any) -> float:
    if type(value) is not float:
        raise CodecError(f"{where}: {_json_type(value)} {_short(value)}, expected float")
    if not math.isfinite(value):
        raise CodecError(f"{where}: float {value!r} is not finite; NaN/inf cannot cross the wire (use None)")
    return value


def _check_str(where: str, value: Any) -> str:
    if type(value) is not str:
        raise CodecError(f"{where}: {_json_type(value)} {_short(value)}, expected str")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CodecError(f"{where}: string {_short(value)} is not valid Unicode ({exc.reason})") from exc
    return value


def _check_bool(where: str, value: Any) -> bool:
    if type(value) is not bool:
        raise CodecError(f"{where}: {_json_type(value)} {_short(value)}, expected bool")
    return value


_ELEMENT_CHECKS = {"int": _check_int, "float": _check_float, "str": _check_str, "bool": _check_bool}
_ELEMENT_KIND = {
    "tuple[int]": "int",
    "tuple[float]": "float",
    "tuple[str]": "str",
    "dict[str,int]": "int",
    "dict[str,float]": "float",
    "dict[str,str]": "str",
}


def _decode_value(where: str, kind: str, value: Any) -> Any:
    """Decode side: check one JSON value of ``kind`` exactly; JSON lists become tuples."""
    if kind in _ELEMENT_CHECKS:
        return _ELEMENT_CHECKS[kind](where, value)
    check = _ELEMENT_CHECKS[_ELEMENT_KIND[kind]]
    if kind.startswith("tuple"):
        if type(value) is not list:
            raise CodecError(f"{where}: {_json_type(value)}, expected a list for {kind}")
        return tuple(check(f"{where}[{i}]", v) for i, v in enumerate(value))
    if type(value) is not dict:
        raise CodecError(f"{where}: {_json_type(value)}, expected an object for {kind}")
    return {_check_str(f"{where} key", k): check(f"{where}[{_short(k)}]", v) for k, v in value.items()}


def _normalise(where: str, kind: str, value: Any) -> Any:
    """Encode side: numpy scalars become Python ones, subclasses of int/str their base type, and an
    ``int`` in a float field a ``float`` (PEP 484's numeric tower). Anything else is left for the check."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError as exc:
            raise CodecError(f"{where}: int {_short(value)} is too large for a float") from exc
    if kind == "int" and isinstance(value, int):
        return int(value)
    if kind == "str" and isinstance(value, str):
        return str.__str__(value)
    return value


def _encode_value(where: str, kind: str, value: Any) -> Any:
    """Encode side: normalise and check one scalar, tuple or dict field value; return its JSON form."""
    if kind in _ELEMENT_CHECKS:
        return _ELEMENT_CHECKS[kind](where, _normalise(where, kind, value))
    element = _ELEMENT_KIND[kind]
    check = _ELEMENT_CHECKS[element]
    if kind.startswith("tuple"):
        if not isinstance(value, tuple):
            raise CodecError(f"{where}: {type(value).__name__}, expected a tuple for {kind}")
        return [check(f"{where}[{i}]", _normalise(where, element, v)) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise CodecError(f"{where}: {type(value).__name__}, expected a dict for {kind}")
    return {
        _check_str(f"{where} key", _normalise(where, "str", k)): check(
            f"{where}[{_short(k)}]", _normalise(where, element, v)
        )
        for k, v in value.items()
    }


# --- arrays -------------------------------------------------------------------------------------------


def _check_array_shape(where: str, spec: ArraySpec, shape: tuple[int, ...]) -> None:
    if spec.ndim is not None and len(shape) != spec.ndim:
        raise CodecError(f"{where}: ndim {len(shape)} (shape {shape}), expected ndim {spec.ndim}")
    if spec.shape is not None:
        for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
            if want is not None and got != want:
                raise CodecError(
                    f"{where}: shape {shape}, expected {spec.shape} (axis {axis} is {got}, not {want})"
                )
    size = math.prod(shape)
    if spec.max_elements is not None and size > spec.max_elements:
        raise CodecError(f"{where}: {size} elements (shape {shape}) exceed max_elements={spec.max_elements}")


def _check_finite(where: str, spec: ArraySpec, arr: np.ndarray) -> None:
    if spec.finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
        raise CodecError(f"{where}: {bad} non-finite value(s) (NaN/inf) in a finite field")


def _encode_array(where: str, spec: ArraySpec, value: Any) -> np.ndarray:
    """Validate an array field value; return it C-contiguous and little-endian (no copy if it already is)."""
    if not isinstance(value, np.ndarray):
        raise CodecError(
            f"{where}: {type(value).__name__} is not a numpy array; expected an ndarray of {spec.dtype}"
        )
    wire = spec.numpy_dtype
    if value.dtype.newbyteorder("<") != wire:
        raise CodecError(f"{where}: dtype {value.dtype}, expected {spec.dtype}")
    if value.ndim > MAX_NDIM:
        raise CodecError(f"{where}: ndim {value.ndim} exceeds the wire's limit of {MAX_NDIM}")
    _check_array_shape(where, spec, value.shape)
    _check_finite(where, spec, value)
    return value.astype(wire, order="C", copy=False)


# --- encode -------------------------------------------------------------------------------------------


def _spec_of(msg: object) -> MessageSpec:
    try:
        return message_spec(type(msg))
    except TypeError as exc:
        raise CodecError(f"cannot encode {type(msg).__qualname__}: {exc}") from exc


def _plan(msg: Message) -> tuple[bytes, list[tuple[str, Any, int]]]:
    """Validate ``msg`` and lay it out: the header bytes and each buffer with its field and byte length."""
    spec = _spec_of(msg)
    fields: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    buffers: list[tuple[str, Any, int]] = []
    offset = 0
    for field in spec.fields:
        where = f"{spec.name}.{field.name}"
        value = getattr(msg, field.name)
        if value is None and field.optional:
            fields[field.name] = None
            continue
        if field.array is not None:
            arr = _encode_array(where, field.array, value)
            dtype, shape, nbytes = arr.dtype.str, list(arr.shape), arr.nbytes
            buffer: Any = arr.reshape(-1).view(np.uint8)
        elif field.kind == "bytes":
            if not isinstance(value, (bytes, bytearray)):
                raise CodecError(f"{where}: {type(value).__name__}, expected bytes")
            dtype, shape, nbytes, buffer = _BYTES_WIRE_DTYPE, [len(value)], len(value), value
        else:
            fields[field.name] = _encode_value(where, field.kind, value)
            continue
        entries.append(
            {"field": field.name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}
        )
        buffers.append((field.name, buffer, nbytes))
        offset = _align(offset + nbytes)
    header = json.dumps(
        {"type": spec.name, "fields": fields, "arrays": entries},
        ensure_ascii=False,
        allow_nan=False,
        sort_keys=True,
        separators=(",", ":"),
    ).encode("utf-8")
    if len(header) > _U32_MAX:
        raise CodecError(f"{spec.name}: header of {len(header)} bytes exceeds the u32 length prefix")
    return header, buffers


def encode(msg: Message) -> bytes:
    """Encode a registered message to bytes (format in the module docstring), validating every field.

    Raises :class:`CodecError` naming ``type.field`` when a value does not match its declaration (wrong
    type, dtype, ndim or shape, NaN/inf in a finite field, too many elements, int outside int64).
    Array buffers are copied exactly once, into the returned ``bytes``.
    """
    header, buffers = _plan(msg)
    parts: list[Any] = [
        _PREFIX.pack(MAGIC, len(header)),
        header,
        _ZEROS[: -(_PREFIX.size + len(header)) % _ALIGN],
    ]
    for _, buffer, nbytes in buffers:
        parts.append(buffer)
        parts.append(_ZEROS[: -nbytes % _ALIGN])
    return b"".join(parts)


def encode_with_slot(msg: Message, field: str) -> tuple[memoryview, np.ndarray]:
    """``encode(msg)`` but for the bytes of ``field`` (a 1-D array field), which are left for the caller
    to write: returns the message's buffer and a writable ``uint8`` view of that field's bytes in it.

    Only the field's dtype and length are taken from ``msg`` (pass ``np.zeros(n, dtype)``: its values are
    never written out). Until the caller has written the whole slot, those bytes of the buffer are
    undefined. A device that encrypts its upload straight into the slot (FDML's sealed gradient) saves one
    copy of the payload and the zeroing of a separate record; the bytes are then exactly ``encode`` of the
    finished message. What the caller writes is not validated here: the receiver's ``decode`` checks it
    (for a float field, finiteness) as it checks every message.
    """
    frames, slots = encode_frames_with_slot(msg, field, 1)
    return memoryview(frames[0]), slots[0]


def encode_frames_with_slot(msg: Message, field: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` encodings of ``msg`` back to back in one buffer, each but for the bytes of ``field`` (as
    :func:`encode_with_slot`): returns the frames ``(count, frame_bytes)`` and the slots
    ``(count, field_bytes)``, both ``uint8`` and views of the same buffer.

    Frames are 8-byte multiples and every slot starts at an 8-byte boundary, so ``slots.view(dtype)`` is
    a ``(count, n)`` array of the field's dtype whose rows are the messages' fields: a client pool that
    computes ``count`` devices' uploads as the rows of one matrix writes them straight into their
    messages (FL-traditional's new weights), and ``frames[i]`` is then exactly ``encode`` of device
    ``i``'s message.
    """
    spec = _spec_of(msg)
    chosen = next((f for f in spec.fields if f.name == field), None)
    if chosen is None or chosen.array is None or chosen.array.ndim != 1:
        raise CodecError(f"{spec.name}.{field}: encode_with_slot needs a 1-D array field")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise CodecError(f"{spec.name}: {count!r} frames; encode_frames_with_slot needs a count >= 1")
    header, buffers = _plan(msg)
    start = _align(_PREFIX.size + len(header))
    size = start + sum(_align(nbytes) for _, _, nbytes in buffers)
    frames = np.empty((count, size), np.uint8)
    head = _PREFIX.pack(MAGIC, len(header)) + header
    frames[:, : len(head)] = np.frombuffer(head, np.uint8)
    frames[:, len(head) : start] = 0
    slots = frames[:, :0]
    at = start
    for name, buffer, nbytes in buffers:
        if name == field:
            slots = frames[:, at : at + nbytes]
        else:
            frames[:, at : at + nbytes] = np.frombuffer(buffer, np.uint8, count=nbytes)
        frames[:, at + nbytes : _align(at + nbytes)] = 0
        at = _align(at + nbytes)
    return frames, slots


def encoded_size(msg: Message) -> int:
    """``len(encode(msg))`` without building the bytes (still validates ``msg``)."""
    header, buffers = _plan(msg)
    return _align(_PREFIX.size + len(header)) + sum(_align(nbytes) for _, _, nbytes in buffers)


# --- decode -------------------------------------------------------------------------------------------


class _DuplicateKeyError(ValueError):
    pass


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(f"duplicate key {_short(key)}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _parse_header(raw: memoryview) -> Any:
    try:
        return json.loads(
            bytes(raw).decode("utf-8"),
            object_pairs_hook=_object_without_duplicates,
            parse_constant=_reject_constant,
        )
    except RecursionError as exc:
        raise CodecError("wire: header JSON is nested too deeply") from exc
    except ValueError as exc:
        raise CodecError(f"wire: header is not valid UTF-8 JSON ({_clip(str(exc))})") from exc


def _expected_names(expected: type | tuple[type, ...]) -> str:
    types_ = expected if isinstance(expected, tuple) else (expected,)
    names = []
    for t in types_:
        try:
            names.append(message_spec(t).name)
        except TypeError:
            names.append(getattr(t, "__qualname__", repr(t)))
    return " or ".join(names)


def _check_size(where: str, what: str, value: Any) -> int:
    """A shape entry, offset or byte count from the header: an int in [0, 2**63)."""
    if type(value) is not int or not 0 <= value <= _INT64_MAX:
        raise CodecError(f"{where}: {what} {_short(value)} must be an int in [0, 2**63)")
    return value


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    expected: type | tuple[type, ...] | None = None,
) -> Message:
    """Decode and strictly validate one message (format in the module docstring).

    ``max_bytes`` bounds the total length (checked before anything is parsed); ``expected`` is the
    message class (or classes) the caller accepts. Every failure raises :class:`CodecError` naming the
    message type and field, e.g. ``"fdml.embed_reply.embeddings: dtype '<f8', expected '<f4' (float32)"``.
    Arrays are read-only views into ``data`` when it is 8-byte aligned, copies otherwise.
    """
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise TypeError(f"decode needs bytes, bytearray or memoryview, not {type(data).__name__}") from exc
    if view.ndim != 1 or view.itemsize != 1 or view.format != "B":
        if not view.c_contiguous:
            raise CodecError("wire: the memoryview is not C-contiguous")
        view = view.cast("B")
    total = view.nbytes
    if max_bytes is not None and total > max_bytes:
        raise CodecError(f"wire: message of {total} bytes exceeds max_bytes={max_bytes}")
    if total < _PREFIX.size:
        raise CodecError(f"wire: {total} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, header_len = _PREFIX.unpack(view[: _PREFIX.size])
    if magic != MAGIC:
        raise CodecError(f"wire: magic {magic!r}, expected {MAGIC!r}")
    if header_len > total - _PREFIX.size:
        raise CodecError(
            f"wire: header length {header_len} exceeds the {total - _PREFIX.size} bytes after the prefix"
        )
    header = _parse_header(view[_PREFIX.size : _PREFIX.size + header_len])
    if type(header) is not dict or set(header) != _HEADER_KEYS:
        got = sorted(header) if type(header) is dict else _json_type(header)
        raise CodecError(f"wire: header must be an object with keys arrays, fields, type; got {_short(got)}")
    name = header["type"]
    if type(name) is not str:
        raise CodecError(f"wire: message type {_short(name)} is not a string")
    cls = message_class(name)
    if cls is None:
        raise CodecError(f"wire: unknown message type {_short(name)}")
    if expected is not None and not issubclass(cls, expected):
        raise CodecError(f"{name}: unexpected message type, expected {_expected_names(expected)}")
    spec = message_spec(cls)
    values = _decode_fields(spec, header["fields"], header["arrays"], view, _PREFIX.size + header_len)
    try:
        return spec.cls(**values)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"{name}: the class rejected the decoded fields ({_clip(str(exc))})") from exc


def _decode_fields(
    spec: MessageSpec, fields: Any, entries: Any, view: memoryview, header_end: int
) -> dict[str, Any]:
    """Validate the header's ``fields`` and ``arrays`` against ``spec`` and build the field values."""
    name = spec.name
    if type(fields) is not dict:
        raise CodecError(f"{name}: header 'fields' is {_json_type(fields)}, expected an object")
    if type(entries) is not list:
        raise CodecError(f"{name}: header 'arrays' is {_json_type(entries)}, expected a list")
    declared = {f.name: (i, f) for i, f in enumerate(spec.fields)}
    values: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in declared:
            raise CodecError(f"{name}.{_short(key)}: unexpected field; {name} declares {', '.join(declared)}")
        field = declared[key][1]
        where = f"{name}.{key}"
        if value is None:
            if not field.optional:
                raise CodecError(f"{where}: null, but the field is not optional")
            values[key] = None
        elif field.kind in _ARRAY_KINDS:
            raise CodecError(f"{where}: {field.kind} field given in 'fields'; it belongs in the arrays table")
        else:
            values[key] = _decode_value(where, field.kind, value)

    total = view.nbytes
    data_start = _align(header_end)
    if data_start > total:
        raise CodecError(f"{name}: message ends inside the header padding ({total} < {data_start} bytes)")
    if any(view[header_end:data_start]):
        raise CodecError(f"{name}: non-zero padding after the header")
    layout: list[tuple[str, FieldSpec, tuple[int, ...], int]] = []
    next_offset, last_index = 0, -1
    for n, entry in enumerate(entries):
        if type(entry) is not dict or set(entry) != _ENTRY_KEYS:
            raise CodecError(
                f"{name}: arrays[{n}] must be an object with keys dtype, field, nbytes, offset, shape"
            )
        key = entry["field"]
        if type(key) is not str or key not in declared:
            raise CodecError(f"{name}.{_short(key)}: unexpected field; {name} declares {', '.join(declared)}")
        index, field = declared[key]
        where = f"{name}.{key}"
        if field.kind not in _ARRAY_KINDS:
            raise CodecError(f"{where}: {field.kind} field given in the arrays table; it belongs in 'fields'")
        if key in values:
            raise CodecError(f"{where}: given more than once")
        if index < last_index:
            raise CodecError(f"{where}: arrays table is not in field declaration order")
        last_index = index
        wire = field.array.wire_dtype if field.array is not None else _BYTES_WIRE_DTYPE
        if entry["dtype"] != wire:
            declared_dtype = field.array.dtype if field.array is not None else "bytes"
            raise CodecError(f"{where}: dtype {_short(entry['dtype'])}, expected {wire!r} ({declared_dtype})")
        shape = entry["shape"]
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise CodecError(f"{where}: shape {_short(shape)} must be a list of at most {MAX_NDIM} ints")
        shape = tuple(_check_size(where, "shape entry", dim) for dim in shape)
        if field.kind == "bytes" and len(shape) != 1:
            raise CodecError(f"{where}: shape {shape}, bytes travel as shape [length]")
        if field.array is not None:
            _check_array_shape(where, field.array, shape)
        offset = _check_size(where, "offset", entry["offset"])
        nbytes = _check_size(where, "nbytes", entry["nbytes"])
        if offset != next_offset:
            raise CodecError(
                f"{where}: offset {offset}, expected {next_offset} (canonical 8-byte aligned layout)"
            )
        itemsize = np.dtype(wire).itemsize
        if math.prod(shape) * itemsize != nbytes:
            raise CodecError(
                f"{where}: nbytes {nbytes} does not match shape {shape} of {itemsize}-byte items"
            )
        start = data_start + offset
        padded_end = start + _align(nbytes)
        if padded_end > total:
            raise CodecError(
                f"{where}: data [{start}, {padded_end}) runs past the end of the {total}-byte message"
            )
        if any(view[start + nbytes : padded_end]):
            raise CodecError(f"{where}: non-zero padding after the data")
        layout.append((where, field, shape, start))
        next_offset = _align(offset + nbytes)
        values[key] = None
    if data_start + next_offset != total:
        raise CodecError(
            f"{name}: message is {total} bytes, but its header describes {data_start + next_offset} "
            "(trailing or missing bytes)"
        )
    missing = [f.name for f in spec.fields if f.name not in values]
    if missing:
        raise CodecError(f"{name}.{missing[0]}: missing (missing fields: {', '.join(missing)})")

    for where, field, shape, start in layout:
        values[field.name] = _read_array(where, field, shape, view, start)
    return values


def _read_array(where: str, field: FieldSpec, shape: tuple[int, ...], view: memoryview, start: int) -> Any:
    """A validated field's value: ``bytes``, or a read-only array view (a copy if unaligned)."""
    if field.array is None:
        return bytes(view[start : start + shape[0]])
    dtype = field.array.numpy_dtype
    count = math.prod(shape)
    try:
        arr = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
    except ValueError as exc:
        raise CodecError(f"{where}: shape {shape} cannot be represented ({exc})") from exc
    if not arr.flags.aligned:
        arr = arr.copy()
    arr = arr.astype(dtype.newbyteorder("="), copy=False)
    _check_finite(where, field.array, arr)
    arr.flags.writeable = False
    return arr
