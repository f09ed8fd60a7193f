"""Typed messages: frozen dataclasses registered under a unique wire name.

Everything a protocol sends crosses the wire through :mod:`fedveil.core.codec` (docs/architecture.md). A
message class is a frozen dataclass decorated with :func:`message`; the decorator
resolves every field annotation once, rejects what the codec cannot carry, and records a
:class:`MessageSpec` that the codec uses to encode and strictly validate.

Supported field annotations (``from __future__ import annotations`` is fine):

- ``int`` (range of int64), ``float`` (finite), ``str``, ``bool``, ``bytes``, and ``X | None`` of these;
- ``tuple[int, ...]``, ``tuple[float, ...]``, ``tuple[str, ...]``;
- ``dict[str, int]``, ``dict[str, float]``, ``dict[str, str]``;
- ``np.ndarray`` declared with :func:`array_field` (dtype, and optionally ndim, shape, finiteness and a
  bound on the number of elements).

Example::

    @message("fdml.embed_reply")
    @dataclass(frozen=True)
    class EmbedReply:
        round: int
        attempt: int
        embeddings: np.ndarray = array_field(dtype="float32", ndim=2, finite=True)
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = [
    "ARRAY_DTYPES",
    "ArraySpec",
    "FieldSpec",
    "Message",
    "MessageSpec",
    "array_field",
    "is_message",
    "message",
    "message_class",
    "message_spec",
]

ARRAY_DTYPES: tuple[str, ...] = (
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)
"""The dtype names an :func:`array_field` may declare."""

MAX_NDIM = 32
"""The largest number of array dimensions the wire carries (numpy 1.x's limit)."""

_ARRAY_META_KEY = "fedveil.array"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

_SCALAR_KINDS: dict[type, str] = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}
_TUPLE_KINDS: dict[type, str] = {int: "tuple[int]", float: "tuple[float]", str: "tuple[str]"}
_DICT_KINDS: dict[type, str] = {int: "dict[str,int]", float: "dict[str,float]", str: "dict[str,str]"}


@runtime_checkable
class Message(Protocol):
    """Any message instance: a dataclass whose class was registered with :func:`message`.

    Usable in annotations; ``isinstance(x, Message)`` only says that ``x`` is a dataclass instance,
    use :func:`is_message` to ask whether its class is registered.
    """

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


@dataclass(frozen=True)
class ArraySpec:
    """What an array field accepts.

    ``dtype`` is one of :data:`ARRAY_DTYPES`; ``wire_dtype`` its explicit little-endian numpy string
    (``"<f4"``, ``"|u1"``, ...). ``ndim``/``shape`` of ``None`` accept anything; a ``None`` entry in
    ``shape`` accepts any length on that axis. ``finite`` rejects NaN and +-inf (float dtypes only;
    integers and bools are always finite). ``max_elements`` bounds ``arr.size``.
    """

    dtype: str
    ndim: int | None
    shape: tuple[int | None, ...] | None
    finite: bool
    max_elements: int | None

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The little-endian numpy dtype the wire carries."""
        return np.dtype(self.dtype).newbyteorder("<")

    @property
    def wire_dtype(self) -> str:
        """The numpy dtype string written in the header, e.g. ``"<f4"``."""
        return self.numpy_dtype.str


@dataclass(frozen=True)
class FieldSpec:
    """One field of a message: its name, its kind and whether ``None`` is allowed.

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``array``, ``tuple[int]``,
    ``tuple[float]``, ``tuple[str]``, ``dict[str,int]``, ``dict[str,float]``, ``dict[str,str]``.
    ``array`` is set exactly when ``kind == "array"``.
    """

    name: str
    kind: str
    optional: bool
    array: ArraySpec | None = None


@dataclass(frozen=True)
class MessageSpec:
    """A registered message class, its wire name and its fields in declaration order."""

    name: str
    cls: type
    fields: tuple[FieldSpec, ...]


_BY_NAME: dict[str, MessageSpec] = {}
_BY_CLASS: dict[type, MessageSpec] = {}

_C = TypeVar("_C", bound=type)


def array_field(
    *,
    dtype: str,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    finite: bool = True,
    max_elements: int | None = None,
) -> Any:
    """Declare an ``np.ndarray`` field (no default): what dtype, rank, shape and values it accepts.

    ``shape`` entries are axis lengths or ``None`` (any length); giving both ``ndim`` and ``shape``
    requires ``len(shape) == ndim``. Returns a :func:`dataclasses.field` carrying an :class:`ArraySpec`.
    """
    if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
        raise ValueError(
            f"array_field dtype {dtype!r} is not supported; use one of {', '.join(ARRAY_DTYPES)}"
        )
    if ndim is not None and (type(ndim) is not int or not 0 <= ndim <= MAX_NDIM):
        raise ValueError(f"array_field ndim {ndim!r} must be None or an int in [0, {MAX_NDIM}]")
    if shape is not None:
        if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
            raise ValueError(f"array_field shape {shape!r} must be a tuple of at most {MAX_NDIM} entries")
        for dim in shape:
            if dim is not None and (type(dim) is not int or dim < 0):
                raise ValueError(f"array_field shape {shape!r}: entries must be ints >= 0 or None")
        if ndim is not None and ndim != len(shape):
            raise ValueError(f"array_field ndim {ndim} disagrees with shape {shape!r} of length {len(shape)}")
        ndim = len(shape)
    if type(finite) is not bool:
        raise ValueError(f"array_field finite {finite!r} must be a bool")
    if max_elements is not None and (type(max_elements) is not int or max_elements < 0):
        raise ValueError(f"array_field max_elements {max_elements!r} must be None or an int >= 0")
    spec = ArraySpec(dtype=dtype, ndim=ndim, shape=shape, finite=finite, max_elements=max_elements)
    return dataclasses.field(metadata={_ARRAY_META_KEY: spec})


def message(name: str) -> Callable[[_C], _C]:
    """Class decorator: register a frozen dataclass as the message type ``name``.

    ``name`` must be unique across the process (letters, digits, ``_``, ``.``, ``-``; e.g.
    ``"fdml.embed_reply"``). Raises ``TypeError`` when the class is not a frozen dataclass or a field
    has an annotation the codec cannot carry, and ``ValueError`` when the name is malformed or taken.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"message name {name!r} is not allowed; use letters, digits, '_', '.', '-' (e.g. 'fdml.embed')"
        )

    def register(cls: _C) -> _C:
        if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
            raise TypeError(f"@message({name!r}) needs a dataclass; apply @dataclass(frozen=True) below it")
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"@message({name!r}): {cls.__qualname__} must be a frozen dataclass")
        if name in _BY_NAME:
            taken = _BY_NAME[name].cls
            raise ValueError(
                f"message name {name!r} is already registered to {taken.__module__}.{taken.__qualname__}"
            )
        if cls in _BY_CLASS:
            raise ValueError(f"{cls.__qualname__} is already registered as {_BY_CLASS[cls].name!r}")
        try:
            hints = typing.get_type_hints(cls)
        except Exception as exc:
            raise TypeError(
                f"@message({name!r}): cannot resolve the annotations of {cls.__qualname__}: {exc}"
            ) from exc
        specs = tuple(_field_spec(name, f, hints[f.name]) for f in dataclasses.fields(cls))
        spec = MessageSpec(name=name, cls=cls, fields=specs)
        _BY_NAME[name] = spec
        _BY_CLASS[cls] = spec
        return cls

    return register


def _field_spec(msg_name: str, field: dataclasses.Field[Any], hint: Any) -> FieldSpec:
    """Resolve one dataclass field's annotation into a :class:`FieldSpec`, or raise ``TypeError``."""
    where = f"{msg_name}.{field.name}"
    if not field.init:
        raise TypeError(f"{where}: init=False fields cannot be decoded; make it an ordinary field")
    array = field.metadata.get(_ARRAY_META_KEY)
    if hint is np.ndarray:
        if not isinstance(array, ArraySpec):
            raise TypeError(f"{where}: np.ndarray fields must be declared with array_field(dtype=...)")
        return FieldSpec(field.name, "array", optional=False, array=array)
    if array is not None:
        raise TypeError(f"{where}: array_field(...) is only for fields annotated np.ndarray, not {hint!r}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALAR_KINDS:
        return FieldSpec(field.name, _SCALAR_KINDS[hint], optional=False)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _SCALAR_KINDS:
            return FieldSpec(field.name, _SCALAR_KINDS[inner], optional=True)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _TUPLE_KINDS:
        return FieldSpec(field.name, _TUPLE_KINDS[args[0]], optional=False)
    if origin is dict and len(args) == 2 and args[0] is str and args[1] in _DICT_KINDS:
        return FieldSpec(field.name, _DICT_KINDS[args[1]], optional=False)
    raise TypeError(
        f"{where}: annotation {hint!r} is not supported; use int, float, str, bool, bytes (or X | None of "
        "these), tuple[int|float|str, ...], dict[str, int|float|str], or np.ndarray with array_field(...)"
    )


def message_spec(cls: type) -> MessageSpec:
    """The :class:`MessageSpec` of a registered class (exact class, not a subclass); ``TypeError`` if none."""
    spec = _BY_CLASS.get(cls)
    if spec is None:
        raise TypeError(
            f"{getattr(cls, '__qualname__', cls)!r} is not a registered message; decorate it with @message"
        )
    return spec


def message_class(name: str) -> type | None:
    """The class registered under wire name ``name``, or ``None``."""
    spec = _BY_NAME.get(name)
    return None if spec is None else spec.cls


def is_message(obj: object) -> bool:
    """Whether ``obj`` is an instance of a registered message class (exactly, not a subclass)."""
    return type(obj) in _BY_CLASS
