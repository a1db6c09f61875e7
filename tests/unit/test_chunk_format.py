"""The chunk frame: round trips, every header check, and fuzzed untrusted input."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvsdk import chunk_format as cf
from kvsdk.backend import BackendError
from kvsdk.chunk_format import (
    HEADER_SIZE,
    CorruptChunk,
    decode_chunk,
    encode_chunk,
    encode_header,
    parse_header,
)
from kvsdk.keys import FORMAT_VERSION

NS = hashlib.blake2b(b"ns", digest_size=16).digest()
KEY = hashlib.blake2b(b"key", digest_size=16).digest()
OTHER = hashlib.blake2b(b"other", digest_size=16).digest()


def frame(payload: object = b"hello kv", **kw: object) -> bytes:
    return encode_chunk(NS, KEY, payload, **kw)  # type: ignore[arg-type]


def reason(buf: object, ns: bytes = NS, key: bytes = KEY) -> str:
    with pytest.raises(CorruptChunk) as info:
        decode_chunk(buf, namespace_fp=ns, key=key)
    return info.value.reason


def test_bytes_round_trip_is_zero_copy_view() -> None:
    buf = bytearray(frame(b"\x00\x01payload"))
    out = decode_chunk(buf, namespace_fp=NS, key=KEY)
    assert isinstance(out, memoryview) and bytes(out) == b"\x00\x01payload"
    buf[HEADER_SIZE] = 7  # a view, not a copy
    assert out[0] == 7


def test_numpy_payload_keeps_dtype_and_shape() -> None:
    arr = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    buf = frame(arr)
    header = parse_header(buf)
    assert (header.dtype, header.shape, header.length) == ("<f2", (2, 3, 4), 48)
    assert header.version == FORMAT_VERSION and header.namespace_fp == NS and header.key == KEY
    out = np.frombuffer(decode_chunk(buf, namespace_fp=NS, key=KEY), dtype=header.dtype)
    np.testing.assert_array_equal(out.reshape(header.shape), arr)


def test_explicit_dtype_and_shape_for_raw_bytes() -> None:
    buf = frame(bytes(64), dtype="bf16", shape=(4, 8))
    assert parse_header(buf).shape == (4, 8)
    assert len(decode_chunk(buf, namespace_fp=NS, key=KEY)) == 64


def test_empty_payload() -> None:
    assert bytes(decode_chunk(frame(b""), namespace_fp=NS, key=KEY)) == b""


def test_header_then_payload_equals_encode_chunk() -> None:
    payload = memoryview(b"abc" * 100)
    assert encode_header(NS, KEY, payload, "|u1", (300,)) + payload == frame(bytes(payload))


def test_blake2b_checksum_frames_decode_too() -> None:
    buf = frame(b"x" * 1000, checksum=cf.CHECKSUM_BLAKE2B_128)
    assert parse_header(buf).checksum_algorithm == cf.CHECKSUM_BLAKE2B_128
    assert bytes(decode_chunk(buf, namespace_fp=NS, key=KEY)) == b"x" * 1000


def test_encoder_rejects_inconsistent_input() -> None:
    with pytest.raises(ValueError):
        frame(b"abc", dtype="<f4", shape=(1,))
    with pytest.raises(ValueError):
        frame(b"", dtype="object", shape=(0,))
    with pytest.raises(ValueError):
        frame(b"", shape=(0,) * 9)
    with pytest.raises(ValueError):
        encode_chunk(NS[:8], KEY, b"x")
    with pytest.raises(ValueError):
        frame(np.zeros((4, 4))[:, ::2])


def test_corrupt_chunk_is_a_backend_error() -> None:
    assert issubclass(CorruptChunk, BackendError)


def test_wrong_namespace_and_key_are_refused() -> None:
    assert reason(frame(), ns=OTHER) == "foreign namespace"
    assert reason(frame(), key=OTHER) == "key mismatch"


def test_bad_magic_version_and_checksum_algorithm() -> None:
    buf = bytearray(frame())
    buf[0:5] = b"KVSDX"
    assert reason(buf) == "bad magic"
    buf = bytearray(frame())
    struct.pack_into("<H", buf, 5, FORMAT_VERSION + 1)
    assert "format version" in reason(buf)
    buf = bytearray(frame())
    buf[7] = 99
    assert "checksum algorithm" in reason(buf)


def test_truncated_and_padded_frames() -> None:
    buf = frame(b"p" * 100)
    assert "truncated" in reason(buf[:-1])
    assert "truncated" in reason(buf[:10])
    assert "truncated" in reason(b"")
    assert "trailing" in reason(buf + b"\0")


def test_dtype_shape_length_consistency() -> None:
    buf = bytearray(frame(np.zeros(8, dtype=np.float32)))
    struct.pack_into("<Q", buf, 48, 9)  # shape (9,) but 32 bytes
    assert "does not match" in reason(buf)
    buf = bytearray(frame(np.zeros(8, dtype=np.float32)))
    buf[9:16] = b"<O\0\0\0\0\0"
    assert "dtype" in reason(buf)
    buf = bytearray(frame(np.zeros(8, dtype=np.float32)))
    buf[8] = 9
    assert "shape" in reason(buf)


def test_flipped_payload_bit_fails_the_checksum() -> None:
    buf = bytearray(frame(b"q" * 4096))
    buf[HEADER_SIZE + 2000] ^= 0x10
    assert reason(buf) == "checksum mismatch"


def test_header_field_change_fails_the_checksum() -> None:
    # same length, consistent shape, different dtype: only the checksum catches it
    buf = bytearray(frame(np.zeros(4, dtype=np.float32)))
    buf[9:16] = b"<i4\0\0\0\0"
    assert reason(buf) == "checksum mismatch"


def test_unverifiable_when_xxhash_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cf._xxhash is not None, "xxhash is a kvsdk dependency (pip install -e .)"
    buf = frame(b"abc", checksum=cf.CHECKSUM_XXH3_128)
    monkeypatch.setattr(cf, "_xxhash", None)
    with pytest.raises(cf.UnverifiableChunk):
        decode_chunk(buf, namespace_fp=NS, key=KEY)


def test_never_allocates_from_declared_length() -> None:
    buf = bytearray(frame(b"abc"))
    struct.pack_into("<Q", buf, 112, 1 << 62)
    assert "truncated" in reason(buf)


GOOD = frame(np.arange(64, dtype=np.int16).reshape(8, 8))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_decode(data: bytes) -> None:
    with pytest.raises(CorruptChunk):
        decode_chunk(data, namespace_fp=NS, key=KEY)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_mutated_frames_never_decode(data: st.DataObject) -> None:
    buf = bytearray(GOOD)
    kind = data.draw(st.sampled_from(["flip", "set", "truncate", "extend", "splice"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    elif kind == "set":
        i = data.draw(st.integers(0, len(buf) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        buf[i : i + len(chunk)] = chunk
    elif kind == "truncate":
        del buf[data.draw(st.integers(0, len(buf) - 1)) :]
    elif kind == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=32))
    else:
        i = data.draw(st.integers(0, len(buf)))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    assume(bytes(buf) != GOOD)
    with pytest.raises(CorruptChunk):
        decode_chunk(buf, namespace_fp=NS, key=KEY)


@settings(max_examples=100, deadline=None)
@given(
    payload=st.binary(max_size=2048),
    algorithm=st.sampled_from([cf.CHECKSUM_BLAKE2B_128, cf.DEFAULT_CHECKSUM]),
)
def test_any_payload_round_trips(payload: bytes, algorithm: int) -> None:
    buf = encode_chunk(NS, KEY, payload, checksum=algorithm)
    assert bytes(decode_chunk(buf, namespace_fp=NS, key=KEY)) == payload


# BLAKE3's official test vector (test_vectors.json in the BLAKE3 repository):
# keyed_hash of the empty input under this 32-byte key, first 16 bytes.
_BLAKE3_KEY = b"whats the Elvish word for friend"
_BLAKE3_KEYED_EMPTY_128 = "92b2b75604ed3c761f9d6f62392c8a92"


def test_frame_mac_is_keyed_blake3_per_its_published_vector() -> None:
    """The MAC a secret puts in a frame is BLAKE3's keyed mode (not a look-alike):
    the spec's known answer, and a frame's tag equals keyed BLAKE3 of exactly
    the header up to the tag plus the payload."""
    mac = cf._hasher(cf.CHECKSUM_BLAKE3_MAC_128, _BLAKE3_KEY)
    assert mac.digest().hex() == _BLAKE3_KEYED_EMPTY_128
    buf = frame(b"kv payload", mac_key=_BLAKE3_KEY)
    header = parse_header(buf)
    assert header.checksum_algorithm == cf.CHECKSUM_BLAKE3_MAC_128
    mac = cf._hasher(cf.CHECKSUM_BLAKE3_MAC_128, _BLAKE3_KEY)
    mac.update(buf[: HEADER_SIZE - 16])
    mac.update(b"kv payload")
    assert header.checksum == mac.digest()


def test_retired_hmac_code_is_corrupt_under_a_secret() -> None:
    """Code 3 (HMAC-SHA256, format version 3) is never accepted in this format."""
    buf = bytearray(frame(b"kv", mac_key=_BLAKE3_KEY))
    buf[7] = 3
    with pytest.raises(CorruptChunk):
        decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=_BLAKE3_KEY)
