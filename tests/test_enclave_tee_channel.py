"""Frames, array framing and the X25519 -> HKDF-SHA256 -> AES-256-GCM session channel."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedveil.enclave.channel import (
    DERIVATIVES,
    EMBEDDINGS,
    GRADIENT,
    RecordAuthenticationError,
    RecordContextError,
    RecordReplayError,
    SecureChannel,
    client_channel,
    decode_array,
    enclave_channel,
    encode_array,
    pack_frame,
    public_bytes,
    sealed_vector_bytes,
    transcript_hash,
    unpack_frame,
)
from fedveil.errors import CodecError, ValidationError

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.text(max_size=20),
    st.floats(allow_nan=False, allow_infinity=False),
)
headers = st.dictionaries(
    st.text(max_size=10), st.one_of(json_scalars, st.lists(json_scalars, max_size=4)), max_size=6
)


@settings(max_examples=60, deadline=None)
@given(headers, st.lists(st.binary(max_size=40), max_size=5))
def test_frames_round_trip(header: dict, blobs: list[bytes]) -> None:
    data = pack_frame(header, blobs)
    assert len(data) % 8 == 0
    got_header, got_blobs = unpack_frame(data)
    assert got_header == header
    assert [bytes(b) for b in got_blobs] == blobs


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int64]),
        shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
        elements={"allow_nan": False, "allow_infinity": False},
    )
)
def test_arrays_round_trip_exactly(array: np.ndarray) -> None:
    dtype = array.dtype.newbyteorder("<").str
    out = decode_array(encode_array(array), dtype=dtype, ndim=array.ndim)
    assert out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out, array)
    assert not out.flags.writeable


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int64, ">f4"]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
        elements={"allow_nan": False, "allow_infinity": False},
    ),
    st.booleans(),
)
@example(np.arange(40_000, dtype=np.float32).reshape(200, 200), True)  # streamed: over 64 KiB
@example(np.arange(40_000, dtype=np.float64), False)
def test_seal_array_is_seal_of_encode_array_byte_for_byte(array: np.ndarray, transpose: bool) -> None:
    """The record sealed from the array's pieces (streamed through AES-GCM from 64 KiB on) equals the
    record of the built plaintext, for any dtype, byte order, shape and memory layout."""
    array = array.T if transpose else array
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce = os.urandom(32)
    sender, twin = (
        client_channel(client_key, public_bytes(enclave_key), client_id="c", nonce=nonce) for _ in "ab"
    )
    enclave = enclave_channel(enclave_key, public_bytes(client_key), client_id="c", nonce=nonce)
    streamed = sender.seal_array(EMBEDDINGS, 3, 1, array)
    built = twin.seal(EMBEDDINGS, 3, 1, encode_array(array))
    assert isinstance(streamed, bytearray) and streamed == built
    assert enclave.open(streamed, kind=EMBEDDINGS, rnd=3, attempt=1) == encode_array(array)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        hnp.arrays(np.float32, st.integers(0, 30_000), elements={"allow_nan": False}), min_size=1, max_size=6
    )
)
@example([np.arange(20_000, dtype=np.float32), np.ones(3, np.float32), np.arange(5_000, dtype=np.float32)])
def test_seal_pieces_is_seal_of_their_concatenation_byte_for_byte(pieces: list[np.ndarray]) -> None:
    """A gradient sealed from its per-parameter pieces (no joined copy) is the record of the whole."""
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce = os.urandom(32)
    sender, twin = (
        client_channel(client_key, public_bytes(enclave_key), client_id="c", nonce=nonce) for _ in "ab"
    )
    whole = np.concatenate(pieces)
    assert sender.seal_pieces(GRADIENT, 2, 0, pieces) == twin.seal_array(GRADIENT, 2, 0, whole)
    # sealed into a buffer the caller owns (a message's record slot): the same record, in place
    out = np.full(sealed_vector_bytes(whole.size), 0xAB, np.uint8)
    assert sender.seal_pieces(GRADIENT, 3, 0, pieces, out=out) is out
    assert out.tobytes() == twin.seal_array(GRADIENT, 3, 0, whole)


def test_seal_pieces_refuses_what_is_not_flat_float32() -> None:
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    sender = client_channel(client_key, public_bytes(enclave_key), client_id="c", nonce=bytes(32))
    for pieces in ([], [np.ones((2, 2), np.float32)], [np.ones(3, np.float32), np.ones(3)]):
        with pytest.raises(CodecError, match="1-D float32"):
            sender.seal_pieces(GRADIENT, 0, 0, pieces)
    size = sealed_vector_bytes(3)
    for out, why in (
        (bytearray(size + 1), f"record of {size} bytes .* buffer of {size + 1}"),
        (memoryview(bytes(size)), "read-only buffer"),
    ):
        with pytest.raises(ValueError, match=why):
            sender.seal_pieces(GRADIENT, 0, 0, [np.ones(3, np.float32)], out=out)


def test_non_canonical_frames_are_refused() -> None:
    good = pack_frame({"op": "x"}, [b"abc"])
    cases = {
        "magic": b"XXXX" + good[4:],
        "trailing": good + bytes(8),
        "short": good[:-8],
        "padding": good[:-1] + b"\x01",
        "reserved": good[:12] + b"\x01" + good[13:],
    }
    for name, data in cases.items():
        with pytest.raises(CodecError):
            unpack_frame(data)
        assert name
    with pytest.raises(CodecError, match="expected an object"):
        unpack_frame(pack_frame({}, []).replace(b"{}", b"[]"))
    nan = pack_frame({"a": 1.5}).replace(b"1.5", b"NaN")
    with pytest.raises(CodecError):
        unpack_frame(nan)
    with pytest.raises(CodecError, match="exceeds the limit"):
        unpack_frame(pack_frame({"k": "x" * 100}), max_header_bytes=50)


def test_array_layout_is_the_documented_one() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert encode_array(a) == b"FVA1" + bytes([0, 2, 0, 0]) + struct.pack("<2Q", 2, 3) + a.tobytes()
    assert encode_array(np.zeros(1, np.int64))[4:6] == bytes([2, 1])


def test_array_decoding_checks_dtype_ndim_size_and_finiteness() -> None:
    a = np.ones((2, 3), np.float32)
    data = encode_array(a)
    with pytest.raises(CodecError, match="dtype '<f4', expected '<f8'"):
        decode_array(data, dtype="<f8", ndim=2)
    with pytest.raises(CodecError, match="2 dimensions, expected 1"):
        decode_array(data, dtype="<f4", ndim=1)
    with pytest.raises(CodecError, match="NaN or infinity"):
        decode_array(encode_array(np.array([[np.inf]], np.float32)), dtype="<f4", ndim=2)
    assert decode_array(encode_array(np.array([np.nan])), dtype="<f8", ndim=1, finite=False).shape == (1,)
    with pytest.raises(CodecError, match="needs 24 bytes, got 20"):
        decode_array(data[:-4], dtype="<f4", ndim=2)
    with pytest.raises(CodecError, match="needs 24 bytes, got 28"):
        decode_array(data + bytes(4), dtype="<f4", ndim=2)
    for bad in (b"FVA", b"XXXX" + data[4:], data[:6] + b"\x01" + data[7:], data[:4] + b"\x09" + data[5:]):
        with pytest.raises(CodecError):
            decode_array(bad, dtype="<f4", ndim=2)
    with pytest.raises(CodecError, match="too short"):
        decode_array(data[:12], dtype="<f4", ndim=2)
    with pytest.raises(CodecError, match="cannot cross"):
        encode_array(np.ones(3, np.int8))
    with pytest.raises(CodecError, match="at most 8"):
        encode_array(np.ones((1,) * 9))


def _pair(client_id: str = "alice") -> tuple[SecureChannel, SecureChannel]:
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce = os.urandom(32)
    client = client_channel(client_key, public_bytes(enclave_key), client_id=client_id, nonce=nonce)
    enclave = enclave_channel(enclave_key, public_bytes(client_key), client_id=client_id, nonce=nonce)
    return client, enclave


def test_key_schedule_matches_the_documented_derivation() -> None:
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce = os.urandom(32)
    client = client_channel(client_key, public_bytes(enclave_key), client_id="c1", nonce=nonce)
    transcript = transcript_hash("c1", public_bytes(client_key), public_bytes(enclave_key), nonce)
    okm = HKDF(hashes.SHA256(), 88, salt=nonce, info=b"fedveil/enclave-channel/v1" + transcript).derive(
        client_key.exchange(enclave_key.public_key())
    )
    record = client.seal(EMBEDDINGS, 7, 2, b"payload")
    header = struct.pack(">4sBBIQQ", b"FVR1", 1, EMBEDDINGS, 2, 7, 0)
    assert record[:26] == header
    expected = AESGCM(okm[0:32]).encrypt(
        okm[64:76], b"payload", b"fedveil/record/v1" + transcript[:16] + header
    )
    assert record[26:] == expected


def test_records_flow_both_ways() -> None:
    client, enclave = _pair()
    for rnd in range(3):
        assert enclave.open(
            client.seal(EMBEDDINGS, rnd, 0, b"e%d" % rnd), kind=EMBEDDINGS, rnd=rnd, attempt=0
        ) == (b"e%d" % rnd)
        assert (
            client.open(enclave.seal(DERIVATIVES, rnd, 0, b"d"), kind=DERIVATIVES, rnd=rnd, attempt=0) == b"d"
        )


def test_every_flipped_bit_is_refused_and_leaves_the_session_usable() -> None:
    client, enclave = _pair()
    record = client.seal(GRADIENT, 1, 0, bytes(range(40)))
    for bit in range(0, len(record) * 8, 7):
        tampered = bytearray(record)
        tampered[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises((RecordAuthenticationError, RecordContextError, RecordReplayError)):
            enclave.open(bytes(tampered), kind=GRADIENT, rnd=1, attempt=0)
    tampered = bytearray(record)
    tampered[-20] ^= 0x01
    with pytest.raises(RecordAuthenticationError, match="authentication"):
        enclave.open(bytes(tampered), kind=GRADIENT, rnd=1, attempt=0)
    assert enclave.open(record, kind=GRADIENT, rnd=1, attempt=0) == bytes(range(40))


def test_replayed_and_reordered_records_are_refused_but_gaps_are_not() -> None:
    client, enclave = _pair()
    first, second, third, fourth = (client.seal(EMBEDDINGS, 5, 0, b"%d" % i) for i in range(4))
    assert enclave.open(first, kind=EMBEDDINGS, rnd=5, attempt=0) == b"0"
    with pytest.raises(RecordReplayError, match="replayed or reordered"):
        enclave.open(first, kind=EMBEDDINGS, rnd=5, attempt=0)
    assert enclave.open(third, kind=EMBEDDINGS, rnd=5, attempt=0) == b"2"
    with pytest.raises(RecordReplayError, match="sequence number 1 is not above the last accepted 2"):
        enclave.open(second, kind=EMBEDDINGS, rnd=5, attempt=0)
    assert enclave.open(fourth, kind=EMBEDDINGS, rnd=5, attempt=0) == b"3"


def test_records_are_bound_to_kind_round_attempt_direction_and_session() -> None:
    client, enclave = _pair()
    record = client.seal(EMBEDDINGS, 3, 1, b"x")
    with pytest.raises(RecordContextError, match="round 3 attempt 1, expected round 4 attempt 1"):
        enclave.open(record, kind=EMBEDDINGS, rnd=4, attempt=1)
    with pytest.raises(RecordContextError, match="expected round 3 attempt 0"):
        enclave.open(record, kind=EMBEDDINGS, rnd=3, attempt=0)
    with pytest.raises(RecordContextError, match="carries embeddings, expected gradient"):
        enclave.open(record, kind=GRADIENT, rnd=3, attempt=1)
    with pytest.raises(RecordContextError, match="travels client->enclave"):
        client.open(record, kind=EMBEDDINGS, rnd=3, attempt=1)
    _, other_enclave = _pair()
    with pytest.raises(RecordAuthenticationError):
        other_enclave.open(record, kind=EMBEDDINGS, rnd=3, attempt=1)
    forged_round = bytearray(record)
    forged_round[10:18] = struct.pack(">Q", 4)
    with pytest.raises(RecordAuthenticationError):
        enclave.open(bytes(forged_round), kind=EMBEDDINGS, rnd=4, attempt=1)
    assert enclave.open(record, kind=EMBEDDINGS, rnd=3, attempt=1) == b"x"


def test_a_session_for_another_client_id_cannot_open_records() -> None:
    client_key, enclave_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    nonce = os.urandom(32)
    client = client_channel(client_key, public_bytes(enclave_key), client_id="alice", nonce=nonce)
    enclave = enclave_channel(enclave_key, public_bytes(client_key), client_id="mallory", nonce=nonce)
    with pytest.raises(RecordAuthenticationError):
        enclave.open(client.seal(EMBEDDINGS, 0, 0, b"x"), kind=EMBEDDINGS, rnd=0, attempt=0)


def test_wrong_kinds_for_a_direction_cannot_be_sealed() -> None:
    client, enclave = _pair()
    with pytest.raises(ValueError, match="cannot travel"):
        client.seal(DERIVATIVES, 0, 0, b"")
    with pytest.raises(ValueError, match="cannot travel"):
        enclave.seal(EMBEDDINGS, 0, 0, b"")
    with pytest.raises(ValidationError, match="round -1"):
        client.seal(EMBEDDINGS, -1, 0, b"")
    with pytest.raises(ValidationError, match="attempt 4294967296"):
        client.seal(EMBEDDINGS, 0, 2**32, b"")
    with pytest.raises(CodecError, match="5 bytes, expected 32"):
        client_channel(X25519PrivateKey.generate(), b"short", client_id="a", nonce=os.urandom(32))
    with pytest.raises(CodecError, match="client id"):
        client_channel(X25519PrivateKey.generate(), os.urandom(32), client_id="", nonce=os.urandom(32))
