"""The chunk frame: round trips, every header check, and fuzzed untrusted input."""

from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
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


@pytest.mark.parametrize("algorithm", [cf.CHECKSUM_XXH3_128, cf.CHECKSUM_BLAKE2B_128])
def test_a_header_written_after_its_payload_pieces_equals_encode_header(algorithm: int) -> None:
    """The disk tier writes the payload first, a piece at a time, and the header
    last: pieces of any size give the frame ``encode_header`` gives at once."""
    payload = memoryview(bytes(range(256)) * 40)
    expected = encode_header(NS, KEY, payload, "|u1", (len(payload),), checksum=algorithm)
    for size in (1, 7, 4096, len(payload)):
        after = cf.HeaderAfterPayload(NS, KEY, len(payload), "|u1", (len(payload),),
                                      checksum=algorithm)  # fmt: skip
        for at in range(0, len(payload), size):
            after.update(payload[at : at + size])
        assert after.finish() == expected


def test_a_macd_header_written_after_its_payload_verifies() -> None:
    mac = bytes(range(32))
    payload = memoryview(np.arange(1000, dtype=np.float32).tobytes())
    after = cf.HeaderAfterPayload(NS, KEY, payload.nbytes, "<f4", (1000,), mac_key=mac)
    after.update(payload[:1001])
    after.update(payload[1001:])
    buf = after.finish() + payload
    assert bytes(decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=mac)) == bytes(payload)
    flipped = bytearray(buf)
    flipped[HEADER_SIZE + 2000] ^= 1
    with pytest.raises(CorruptChunk):
        decode_chunk(flipped, namespace_fp=NS, key=KEY, mac_key=mac)


def test_a_header_after_too_few_or_too_many_payload_bytes_is_refused() -> None:
    short = cf.HeaderAfterPayload(NS, KEY, 10, "|u1", (10,))
    short.update(memoryview(bytes(9)))
    with pytest.raises(ValueError, match="payload bytes"):
        short.finish()
    long = cf.HeaderAfterPayload(NS, KEY, 10, "|u1", (10,))
    long.update(memoryview(bytes(11)))
    with pytest.raises(ValueError, match="payload bytes"):
        long.finish()


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


# The GCM specification's Test Case 13 (McGrew and Viega, "The Galois/Counter
# Mode of Operation"): AES-256, all-zero key and IV, nothing to encrypt or
# authenticate: the tag.
_GCM_TC13_TAG = "530f8afbc74536b9a963b4f1c4cb738b"
_MAC_KEY = b"whats the Elvish word for friend"


def test_frame_mac_is_gmac_under_a_one_time_key() -> None:
    """The MAC a secret puts in a frame is AES-256-GMAC (not a look-alike: the
    GCM spec's known answer) of exactly the payload, under the key that keyed
    BLAKE2b derives from exactly the header up to the tag (nonce included)."""
    assert AESGCM(bytes(32)).encrypt(bytes(12), b"", None).hex() == _GCM_TC13_TAG
    buf = frame(b"kv payload", mac_key=_MAC_KEY)
    header = parse_header(buf)
    assert header.checksum_algorithm == cf.CHECKSUM_GMAC_128
    one_time = hashlib.blake2b(
        buf[: HEADER_SIZE - 16], digest_size=32, key=_MAC_KEY, person=b"kvsdk-gmac-key"
    ).digest()
    assert header.checksum == AESGCM(one_time).encrypt(bytes(12), b"", b"kv payload")


def test_every_macd_frame_has_its_own_nonce_and_key() -> None:
    """Two frames of the same payload and key differ in nonce and tag (a
    one-time key is never reused), both verify; unkeyed frames stay deterministic."""
    a, b = frame(b"kv", mac_key=_MAC_KEY), frame(b"kv", mac_key=_MAC_KEY)
    assert a[120:136] != b[120:136] and a[136:152] != b[136:152]
    for buf in (a, b):
        assert bytes(decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=_MAC_KEY)) == b"kv"
    assert frame(b"kv") == frame(b"kv") and frame(b"kv")[120:136] == bytes(16)


def test_a_macd_frame_with_any_header_bit_flipped_fails() -> None:
    """The header reaches the tag through the one-time key: a flipped bit in
    the nonce, the dtype or the length field is a MAC mismatch or a structural error."""
    buf = frame(b"kv payload", mac_key=_MAC_KEY)
    for offset in (9, 120, 135):
        bad = bytearray(buf)
        bad[offset] ^= 0x01
        with pytest.raises(CorruptChunk):
            decode_chunk(bad, namespace_fp=NS, key=KEY, mac_key=_MAC_KEY)


def test_a_macd_frame_verifies_from_parts_split_anywhere() -> None:
    payload = bytes(range(256)) * 40
    header = cf.encode_header(
        NS, KEY, memoryview(payload), "|u1", (len(payload),), mac_key=_MAC_KEY
    )
    for cuts in ((1,), (17, 4000), (16, 32, 10239)):
        edges = (0, *cuts, len(payload))
        parts = [memoryview(payload)[a:b] for a, b in itertools.pairwise(edges)]
        cf.verify_chunk(header, parts, namespace_fp=NS, key=KEY, mac_key=_MAC_KEY)


def test_retired_hmac_code_is_corrupt_under_a_secret() -> None:
    """Codes 3 (HMAC-SHA256) and 4 (keyed BLAKE3) are never accepted in this format."""
    for code in (3, 4):
        buf = bytearray(frame(b"kv", mac_key=_MAC_KEY))
        buf[7] = code
        with pytest.raises(CorruptChunk):
            decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=_MAC_KEY)


@pytest.mark.parametrize("mac_key", [None, "mac"], ids=["checksum", "mac"])
def test_a_frame_checked_piece_by_piece_as_it_is_read(mac_key: str | None) -> None:
    """PayloadCheck (the disk tier's streaming read): the header is checked at
    once, the payload in pieces of any size; a flipped bit anywhere, a missing
    byte or a foreign namespace or key fails."""
    mk = _MAC_KEY if mac_key else None
    payload = bytes(range(256)) * 41
    buf = encode_chunk(NS, KEY, payload, mac_key=mk)
    head, body = buf[:HEADER_SIZE], memoryview(buf)[HEADER_SIZE:]

    def check(head: bytes, body: memoryview, piece: int, **kw: bytes) -> None:
        args = {"namespace_fp": NS, "key": KEY, **kw}
        c = cf.PayloadCheck(head, len(body), mac_key=mk, **args)  # type: ignore[arg-type]
        for at in range(0, len(body), piece):
            c.update(body[at : at + piece])
        assert c.finish().length == len(payload)

    for piece in (1 << 20, 4096, 1000, 7):
        check(head, body, piece)
    for offset in (0, 5000, len(payload) - 1):
        bad = bytearray(body)
        bad[offset] ^= 0x80
        with pytest.raises(CorruptChunk, match="mismatch"):
            check(head, memoryview(bad), 4096)
    with pytest.raises(CorruptChunk, match="truncated"):
        check(head, body[:-1], 4096)
    with pytest.raises(CorruptChunk, match="foreign namespace"):
        check(head, body, 4096, namespace_fp=OTHER)
    with pytest.raises(CorruptChunk, match="key mismatch"):
        check(head, body, 4096, key=OTHER)
    c = cf.PayloadCheck(head, len(body), namespace_fp=NS, key=KEY, mac_key=mk)
    c.update(body[:-1])  # a file that shrank under the reader
    with pytest.raises(CorruptChunk, match="truncated"):
        c.finish()
