"""Client <-> enclave secure channels, and the byte framing the enclave boundary uses.

**Key schedule** (one per client session; PPFL Sec. 4.1's TEE-to-TEE channel, FDML Sec. V-A's
"send their embeddings ... directly into the TEE")::

    transcript = SHA-256(u16 len(client_id) | client_id (UTF-8) | client X25519 public (32)
                         | enclave X25519 public (32) | client nonce (32))
    okm = HKDF-SHA256(X25519(client, enclave), salt=nonce, info=b"fedveil/enclave-channel/v1" | transcript,
                      length=88)
    key c->e = okm[0:32], key e->c = okm[32:64], iv c->e = okm[64:76], iv e->c = okm[76:88]
    session id = transcript[:16]

**Records** (AES-256-GCM; all integers big-endian)::

    b"FVR1" | direction u8 | kind u8 | attempt u32 | round u64 | seq u64 | ciphertext and 16-byte tag

with GCM nonce ``iv XOR seq`` and associated data ``b"fedveil/record/v1" | session id | the 26-byte
header``. Direction, kind, round, attempt and sequence number are thus authenticated: a flipped bit
anywhere fails authentication, a record for another round, attempt or kind is refused, and the
receiver accepts only sequence numbers above the last one it accepted, so a replayed or reordered
record is refused while a lost one (a dropout) does not desynchronise the session.

Kinds: FDML's ``embeddings`` and ``gradient`` (client -> enclave) and ``derivatives`` (enclave -> client);
PPFL's ``model`` (the layer under training and its classifier, enclave -> client TEE) and ``update``
(the client TEE's trained values, client -> enclave), :mod:`fedveil.enclave.layerwise`.

**Frames** (the plaintext inside records, and every message between host and enclave process; a
small numpy-only format so that the enclave need not import :mod:`fedveil.core`)::

    b"FVE1" | u32 header_len | u32 blob count | u32 zero | header (canonical JSON) | zero pad to 8
            | u64 length of each blob | each blob, zero-padded to 8

Only the canonical layout decodes.

**Arrays** (:func:`encode_array`; the plaintext of every record; little-endian)::

    b"FVA1" | dtype code u8 (0 float32, 1 float64, 2 int64) | ndim u8 | u16 zero | u64 shape[ndim]
            | the values in C order

A fixed binary header rather than JSON keeps the per-client cost of sealing and opening small.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedveil.errors import CodecError, FedveilError, ValidationError

WritableBuffer = bytearray | memoryview | np.ndarray
"""Where a caller may have a record sealed (:meth:`SecureChannel.seal_pieces`'s ``out``)."""

CLIENT_TO_ENCLAVE = 1
ENCLAVE_TO_CLIENT = 2
EMBEDDINGS = 1
GRADIENT = 2
DERIVATIVES = 3
MODEL = 4
UPDATE = 5
KIND_NAMES = {
    EMBEDDINGS: "embeddings",
    GRADIENT: "gradient",
    DERIVATIVES: "derivatives",
    MODEL: "model",
    UPDATE: "update",
}
DIRECTION_NAMES = {CLIENT_TO_ENCLAVE: "client->enclave", ENCLAVE_TO_CLIENT: "enclave->client"}
_KINDS_BY_DIRECTION = {
    CLIENT_TO_ENCLAVE: (EMBEDDINGS, GRADIENT, UPDATE),
    ENCLAVE_TO_CLIENT: (DERIVATIVES, MODEL),
}

NONCE_BYTES = 32
PUBLIC_KEY_BYTES = 32
MAX_CLIENT_ID_BYTES = 256
RECORD_MAGIC = b"FVR1"
_TAG_BYTES = 16
_STREAM_MIN_BYTES = 64 * 1024
"""Plaintexts in pieces at least this long are encrypted piece by piece (no joined copy); smaller ones are
joined first, which costs less than setting up a streaming AES-GCM context (about 5 us)."""
RECORD_OVERHEAD = 26 + _TAG_BYTES
_RECORD_HEADER = struct.Struct(">4sBBIQQ")
_RECORD_AD = b"fedveil/record/v1"
_HKDF_INFO = b"fedveil/enclave-channel/v1"
_MAX_SEQ = 2**64 - 1

FRAME_MAGIC = b"FVE1"
_FRAME_PREFIX = struct.Struct("<4sIII")
_ALIGN = 8
_PADDING = [bytes(n) for n in range(_ALIGN)]
ARRAY_MAGIC = b"FVA1"
ARRAY_DTYPES = ("<f4", "<f8", "<i8")
MAX_ARRAY_NDIM = 8
_ARRAY_PREFIX = struct.Struct("<4sBBH")
_ARRAY_CODES = {dtype: code for code, dtype in enumerate(ARRAY_DTYPES)}
_ITEMSIZES = [np.dtype(d).itemsize for d in ARRAY_DTYPES]
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_ARRAY_NDIM + 1)]


class ChannelError(FedveilError):
    """A record the receiving end of a session refuses."""


class RecordAuthenticationError(ChannelError):
    """AES-GCM authentication failed: the record was tampered with or sealed by another session."""


class RecordReplayError(ChannelError):
    """The record's sequence number is not above the last accepted one: replayed or reordered."""


class RecordContextError(ChannelError):
    """The record is well formed but for another direction, kind, round or attempt."""


# --- frames -------------------------------------------------------------------------------------------


def _pad(n: int) -> int:
    return -n % _ALIGN


def _bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``data`` (cast only when it is not one already)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON: sorted keys, no whitespace, ASCII, no NaN/inf."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")
    except ValueError as exc:
        raise CodecError(f"frame header cannot be encoded as JSON: {exc}") from exc


def _reject_constant(name: str) -> None:
    raise CodecError(f"frame header contains {name}; NaN/inf are not allowed")


def frame_parts(
    header: Mapping[str, Any], blobs: Sequence[bytes | bytearray | memoryview] = ()
) -> list[bytes | memoryview]:
    """The pieces of :func:`pack_frame`'s frame in order, the blobs uncopied: a transport can write them
    straight to where the frame goes (the enclave's shared region, a pipe) instead of joining them first."""
    head = canonical_json(dict(header))
    views = [_bytes_view(b) for b in blobs]
    sizes = [v.nbytes for v in views]
    parts: list[bytes | memoryview] = [
        _FRAME_PREFIX.pack(FRAME_MAGIC, len(head), len(views), 0),
        head,
        _PADDING[_pad(len(head))],
        struct.pack(f"<{len(sizes)}Q", *sizes),
    ]
    for v, n in zip(views, sizes, strict=True):
        parts.append(v)
        parts.append(_PADDING[_pad(n)])
    return parts


def pack_frame(header: Mapping[str, Any], blobs: Sequence[bytes | bytearray | memoryview] = ()) -> bytes:
    """Frame a JSON-able ``header`` and raw ``blobs`` (see the module docstring for the layout)."""
    return b"".join(frame_parts(header, blobs))


def unpack_frame(
    data: bytes | bytearray | memoryview, *, max_header_bytes: int = 16 * 2**20
) -> tuple[dict[str, Any], list[memoryview]]:
    """Inverse of :func:`pack_frame`: the header dict and zero-copy views of the blobs.

    Raises :class:`CodecError` for anything but the canonical layout (wrong magic, lengths that do
    not add up, non-zero padding, trailing bytes, a header that is not a JSON object).
    """
    buf = _bytes_view(data)
    if buf.nbytes < _FRAME_PREFIX.size:
        raise CodecError(f"frame of {buf.nbytes} bytes is shorter than its {_FRAME_PREFIX.size}-byte prefix")
    magic, head_len, count, zero = _FRAME_PREFIX.unpack_from(buf)
    if magic != FRAME_MAGIC:
        raise CodecError(f"frame magic {bytes(magic)!r}, expected {FRAME_MAGIC!r}")
    if zero != 0:
        raise CodecError(f"frame reserved field is {zero}, expected 0")
    if head_len > max_header_bytes:
        raise CodecError(f"frame header of {head_len} bytes exceeds the limit of {max_header_bytes}")
    pos = _FRAME_PREFIX.size
    table = pos + head_len + _pad(head_len)
    body = table + 8 * count
    if body > buf.nbytes:
        raise CodecError(f"frame of {buf.nbytes} bytes is too short for its header and {count} blob lengths")
    head = bytes(buf[pos : pos + head_len])
    if buf[pos + head_len : table] != _PADDING[table - pos - head_len]:
        raise CodecError("frame header padding is not zero")
    try:
        header = json.loads(head.decode("ascii"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"frame header is not ASCII JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError(f"frame header is a JSON {type(header).__name__}, expected an object")
    blobs: list[memoryview] = []
    pos = body
    for i, n in enumerate(struct.unpack_from(f"<{count}Q", buf, table)):
        end = pos + n
        pad = _pad(n)
        if end + pad > buf.nbytes:
            raise CodecError(f"frame blob {i} of {n} bytes runs past the end of the {buf.nbytes}-byte frame")
        blobs.append(buf[pos:end])
        if pad and buf[end : end + pad] != _PADDING[pad]:
            raise CodecError(f"frame blob {i} padding is not zero")
        pos = end + pad
    if pos != buf.nbytes:
        raise CodecError(f"frame has {buf.nbytes - pos} trailing bytes")
    return header, blobs


def _array_parts(array: np.ndarray) -> tuple[bytes, np.ndarray]:
    """:func:`encode_array`'s frame in two pieces: its header and the values as a flat byte view
    (a copy only when ``array`` is not already C-ordered little-endian of an allowed dtype)."""
    a = np.asarray(array)
    code = _ARRAY_CODES.get(a.dtype.newbyteorder("<").str)
    if code is None:
        raise CodecError(f"array dtype {a.dtype} cannot cross the enclave boundary; allowed: {ARRAY_DTYPES}")
    if a.ndim > MAX_ARRAY_NDIM:
        raise CodecError(f"array of {a.ndim} dimensions; at most {MAX_ARRAY_NDIM} cross the enclave boundary")
    head = _ARRAY_PREFIX.pack(ARRAY_MAGIC, code, a.ndim, 0) + _SHAPES[a.ndim].pack(*a.shape)
    return head, np.ascontiguousarray(a, dtype=ARRAY_DTYPES[code]).reshape(-1).view(np.uint8)


def _pieces_parts(pieces: Sequence[np.ndarray]) -> list[bytes | np.ndarray]:
    """:func:`encode_array`'s frame of the flat concatenation of ``pieces`` (1-D float32 arrays), in
    parts: the header, then each piece's values as a byte view, without joining them."""
    arrays = [np.asarray(p) for p in pieces]
    if not arrays or any(a.ndim != 1 or a.dtype != np.float32 for a in arrays):
        got = [f"{a.dtype}{a.shape}" for a in arrays]
        raise CodecError(f"pieces of a flat float32 array must be 1-D float32 arrays, got {got}")
    size = sum(a.size for a in arrays)
    head = _ARRAY_PREFIX.pack(ARRAY_MAGIC, _ARRAY_CODES["<f4"], 1, 0) + _SHAPES[1].pack(size)
    return [head, *(np.ascontiguousarray(a, dtype="<f4").view(np.uint8) for a in arrays)]


def sealed_array_bytes(shape: Sequence[int]) -> int:
    """The length of a sealed record of a float32 array of ``shape`` (a device's ``(n, d)`` embeddings):
    what the untrusted host can check of a record it cannot open."""
    return RECORD_OVERHEAD + _ARRAY_PREFIX.size + _SHAPES[len(shape)].size + 4 * math.prod(shape)


def sealed_vector_bytes(size: int) -> int:
    """The length of a sealed record of a flat float32 array of ``size`` values (a device's gradient)."""
    return sealed_array_bytes((size,))


def encode_array(array: np.ndarray) -> bytes:
    """Frame one float32, float64 or int64 array (little-endian, C order; module docstring)."""
    return b"".join(_array_parts(array))  # the values copied once (tobytes() and + would copy them twice)


def decode_array(
    data: bytes | bytearray | memoryview, *, dtype: str, ndim: int, finite: bool = True
) -> np.ndarray:
    """Decode :func:`encode_array` output, requiring ``dtype`` (e.g. ``"<f4"``) and ``ndim``.

    Returns a read-only view of ``data`` (no copy). ``finite`` refuses NaN and infinities.
    """
    buf = _bytes_view(data)
    if buf.nbytes < _ARRAY_PREFIX.size:
        raise CodecError(f"array of {buf.nbytes} bytes is shorter than its {_ARRAY_PREFIX.size}-byte prefix")
    magic, code, got_ndim, zero = _ARRAY_PREFIX.unpack_from(buf)
    if magic != ARRAY_MAGIC or zero != 0:
        raise CodecError(
            f"array magic {bytes(magic)!r} or reserved field {zero}, expected {ARRAY_MAGIC!r} and 0"
        )
    if code >= len(ARRAY_DTYPES) or ARRAY_DTYPES[code] != dtype:
        got = ARRAY_DTYPES[code] if code < len(ARRAY_DTYPES) else f"code {code}"
        raise CodecError(f"array dtype {got!r}, expected {dtype!r}")
    if got_ndim != ndim:
        raise CodecError(f"array of {got_ndim} dimensions, expected {ndim}")
    offset = _ARRAY_PREFIX.size + 8 * ndim
    if buf.nbytes < offset:
        raise CodecError(f"array of {buf.nbytes} bytes is too short for its {ndim} dimensions")
    shape = _SHAPES[ndim].unpack_from(buf, _ARRAY_PREFIX.size)
    itemsize = _ITEMSIZES[code]
    if math.prod(shape) * itemsize != buf.nbytes - offset:
        raise CodecError(
            f"array shape {list(shape)} needs {math.prod(shape) * itemsize} bytes, got {buf.nbytes - offset}"
        )
    out = np.frombuffer(buf, dtype=dtype, offset=offset).reshape(shape)
    out.flags.writeable = False
    if finite and out.dtype.kind == "f" and not np.isfinite(out).all():
        raise CodecError("array contains NaN or infinity")
    return out


# --- key schedule and records -------------------------------------------------------------------------


def check_client_id(client_id: object) -> str:
    """A client id is a non-empty string of at most 256 UTF-8 bytes."""
    if not isinstance(client_id, str) or not client_id:
        raise CodecError(f"client id {client_id!r} must be a non-empty string")
    try:
        n = len(client_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise CodecError(f"client id {client_id!r} is not valid Unicode") from exc
    if n > MAX_CLIENT_ID_BYTES:
        raise CodecError(f"client id of {n} UTF-8 bytes exceeds {MAX_CLIENT_ID_BYTES}")
    return client_id


def transcript_hash(client_id: str, client_public: bytes, enclave_public: bytes, nonce: bytes) -> bytes:
    """SHA-256 of the handshake transcript (module docstring); both ends derive keys from it."""
    name = check_client_id(client_id).encode("utf-8")
    if len(client_public) != PUBLIC_KEY_BYTES or len(enclave_public) != PUBLIC_KEY_BYTES:
        raise CodecError(f"X25519 public keys must be {PUBLIC_KEY_BYTES} bytes")
    if len(nonce) != NONCE_BYTES:
        raise CodecError(f"nonce of {len(nonce)} bytes, expected {NONCE_BYTES}")
    return hashlib.sha256(
        struct.pack(">H", len(name)) + name + client_public + enclave_public + nonce
    ).digest()


class SecureChannel:
    """One end of a client session: seals records in its sending direction and opens records of the
    other, enforcing the kind, round, attempt and increasing sequence numbers (module docstring).

    Build one with :func:`client_channel` or :func:`enclave_channel`.
    """

    def __init__(self, *, session_id: bytes, sending: int, keys: Mapping[int, tuple[bytes, bytes]]) -> None:
        if sending not in DIRECTION_NAMES:
            raise ValueError(f"sending direction {sending!r} is not one of {sorted(DIRECTION_NAMES)}")
        self.session_id = session_id
        self.sending = sending
        self.receiving = ENCLAVE_TO_CLIENT if sending == CLIENT_TO_ENCLAVE else CLIENT_TO_ENCLAVE
        self._aead = {d: AESGCM(k) for d, (k, _) in keys.items()}
        self._keys = {d: k for d, (k, _) in keys.items()}
        self._iv = {d: int.from_bytes(iv, "big") for d, (_, iv) in keys.items()}
        self._ad_prefix = _RECORD_AD + session_id
        self._next_seq = 0
        self._last_accepted = -1

    def _nonce(self, direction: int, seq: int) -> bytes:
        return (self._iv[direction] ^ seq).to_bytes(12, "big")

    def seal(self, kind: int, rnd: int, attempt: int, plaintext: bytes | memoryview) -> bytearray:
        """Encrypt ``plaintext`` as the next record of ``kind`` for round ``rnd``, attempt ``attempt``."""
        return self._seal(kind, rnd, attempt, (plaintext,))

    def seal_array(self, kind: int, rnd: int, attempt: int, array: np.ndarray) -> bytearray:
        """``seal(kind, rnd, attempt, encode_array(array))``, without building the plaintext: the array's
        frame header and values are encrypted straight from where they are."""
        return self._seal(kind, rnd, attempt, _array_parts(array))

    def seal_pieces(
        self,
        kind: int,
        rnd: int,
        attempt: int,
        pieces: Sequence[np.ndarray],
        *,
        out: WritableBuffer | None = None,
    ) -> bytearray | WritableBuffer:
        """``seal_array(kind, rnd, attempt, np.concatenate(pieces))`` for 1-D float32 ``pieces``, without
        joining them: each piece is encrypted from where it is (a device's gradient straight from the
        per-layer blocks its backward pass wrote). With ``out`` (a writable buffer of exactly the
        record's length, :func:`sealed_vector_bytes`), the record is written there and ``out`` returned."""
        return self._seal(kind, rnd, attempt, _pieces_parts(pieces), out)

    def _seal(
        self,
        kind: int,
        rnd: int,
        attempt: int,
        parts: Sequence[bytes | memoryview | np.ndarray],
        into: WritableBuffer | None = None,
    ) -> bytearray | WritableBuffer:
        if kind not in _KINDS_BY_DIRECTION[self.sending]:
            raise ValueError(f"kind {kind!r} cannot travel {DIRECTION_NAMES[self.sending]}")
        if not (0 <= rnd <= _MAX_SEQ and 0 <= attempt < 2**32):
            raise ValidationError(f"round {rnd!r} and attempt {attempt!r} must fit u64 and u32 (>= 0)")
        if self._next_seq > _MAX_SEQ:
            raise ChannelError("session exhausted its 2**64 sequence numbers; open a new session")
        seq = self._next_seq
        self._next_seq += 1
        header = _RECORD_HEADER.pack(RECORD_MAGIC, self.sending, kind, attempt, rnd, seq)
        views = [_bytes_view(p) for p in parts]
        size = sum(v.nbytes for v in views)
        if len(views) > 1 and size < _STREAM_MIN_BYTES:
            views = [memoryview(b"".join(views))]  # a small copy is cheaper than a streaming context
        # the ciphertext and tag are written behind the header, not concatenated to it
        record = bytearray(RECORD_OVERHEAD + size) if into is None else into
        whole = _bytes_view(record)
        if whole.readonly or whole.nbytes != RECORD_OVERHEAD + size:
            raise ValueError(
                f"a record of {RECORD_OVERHEAD + size} bytes cannot be written into a "
                f"{'read-only ' if whole.readonly else ''}buffer of {whole.nbytes} bytes"
            )
        whole[: _RECORD_HEADER.size] = header
        out = whole[_RECORD_HEADER.size :]
        nonce, ad = self._nonce(self.sending, seq), self._ad_prefix + header
        if len(views) == 1:
            self._aead[self.sending].encrypt_into(nonce, views[0], ad, out)
            return record
        # several pieces: AES-GCM as a stream over them, the same bytes as one encrypt of their join
        enc = Cipher(algorithms.AES(self._keys[self.sending]), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(ad)
        at = 0
        for v in views:
            # update_into wants room for a block beyond its input: the tag's 16 bytes are always behind
            enc.update_into(v, out[at:])
            at += v.nbytes
        enc.finalize()
        out[at:] = enc.tag
        return record

    def open(self, record: bytes | memoryview, *, kind: int, rnd: int, attempt: int) -> bytes:
        """Authenticate and decrypt a record expected to be of ``kind`` for (``rnd``, ``attempt``).

        Raises :class:`RecordContextError` (wrong direction, kind, round, attempt or format),
        :class:`RecordReplayError` (sequence number not above the last accepted) or
        :class:`RecordAuthenticationError` (tampered, or from another session). A refused record
        leaves the session unchanged.
        """
        view = _bytes_view(record)
        if view.nbytes < RECORD_OVERHEAD:
            raise RecordContextError(f"record of {view.nbytes} bytes is shorter than {RECORD_OVERHEAD}")
        magic, direction, got_kind, got_attempt, got_round, seq = _RECORD_HEADER.unpack_from(view)
        if magic != RECORD_MAGIC:
            raise RecordContextError(f"record magic {bytes(magic)!r}, expected {RECORD_MAGIC!r}")
        if direction != self.receiving:
            raise RecordContextError(
                f"record travels {DIRECTION_NAMES.get(direction, direction)}, "
                f"expected {DIRECTION_NAMES[self.receiving]}"
            )
        if got_kind != kind:
            raise RecordContextError(
                f"record carries {KIND_NAMES.get(got_kind, got_kind)}, expected {KIND_NAMES.get(kind, kind)}"
            )
        if (got_round, got_attempt) != (rnd, attempt):
            raise RecordContextError(
                f"record is for round {got_round} attempt {got_attempt}, "
                f"expected round {rnd} attempt {attempt}"
            )
        if seq <= self._last_accepted:
            raise RecordReplayError(
                f"record sequence number {seq} is not above the last accepted {self._last_accepted}: "
                "a replayed or reordered record"
            )
        associated = self._ad_prefix + view[: _RECORD_HEADER.size].tobytes()
        try:
            plaintext = self._aead[direction].decrypt(
                self._nonce(direction, seq), view[_RECORD_HEADER.size :], associated
            )
        except InvalidTag as exc:
            raise RecordAuthenticationError(
                "record failed AES-GCM authentication: tampered with, or sealed by another session"
            ) from exc
        self._last_accepted = seq
        return plaintext


def _derive(
    shared: bytes, *, client_id: str, client_public: bytes, enclave_public: bytes, nonce: bytes
) -> tuple[bytes, dict[int, tuple[bytes, bytes]]]:
    transcript = transcript_hash(client_id, client_public, enclave_public, nonce)
    okm = HKDF(algorithm=hashes.SHA256(), length=88, salt=nonce, info=_HKDF_INFO + transcript).derive(shared)
    keys = {CLIENT_TO_ENCLAVE: (okm[0:32], okm[64:76]), ENCLAVE_TO_CLIENT: (okm[32:64], okm[76:88])}
    return transcript[:16], keys


def _exchange(private_key: X25519PrivateKey, peer_public: bytes) -> bytes:
    if len(peer_public) != PUBLIC_KEY_BYTES:
        raise CodecError(f"X25519 public key of {len(peer_public)} bytes, expected {PUBLIC_KEY_BYTES}")
    try:
        return private_key.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError as exc:
        raise CodecError(f"X25519 key exchange refused the peer public key: {exc}") from exc


def public_bytes(private_key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of an X25519 private key."""
    return private_key.public_key().public_bytes_raw()


def client_channel(
    private_key: X25519PrivateKey, enclave_public: bytes, *, client_id: str, nonce: bytes
) -> SecureChannel:
    """The client's end of the session keyed by its ``private_key`` and the enclave's public key."""
    session_id, keys = _derive(
        _exchange(private_key, enclave_public),
        client_id=client_id,
        client_public=public_bytes(private_key),
        enclave_public=bytes(enclave_public),
        nonce=bytes(nonce),
    )
    return SecureChannel(session_id=session_id, sending=CLIENT_TO_ENCLAVE, keys=keys)


def enclave_channel(
    private_key: X25519PrivateKey, client_public: bytes, *, client_id: str, nonce: bytes
) -> SecureChannel:
    """The enclave's end of the session keyed by its ephemeral ``private_key`` and the client's key."""
    session_id, keys = _derive(
        _exchange(private_key, client_public),
        client_id=client_id,
        client_public=bytes(client_public),
        enclave_public=public_bytes(private_key),
        nonce=bytes(nonce),
    )
    return SecureChannel(session_id=session_id, sending=ENCLAVE_TO_CLIENT, keys=keys)
