"""The self-describing chunk frame that slow tiers (disk, Redis) store.

A frame is a fixed 152-byte little-endian header followed by the raw payload::

    offset size  field
         0    5  magic  b"KVSDK"
         5    2  format version (kvsdk.keys.FORMAT_VERSION)
         7    1  checksum algorithm (1: xxh3-128, 2: BLAKE2b-128, 5: GMAC-128, one-time key)
         8    1  ndim (0..8)
         9    7  dtype code, ASCII, NUL-padded ("<f2", "|u1", "bf16", ...)
        16   16  namespace fingerprint
        32   16  chunk key
        48   64  shape: 8 x uint64 (unused dims are 0)
       112    8  payload length in bytes
       120   16  nonce: random for a MAC'd frame, zero otherwise
       136   16  checksum of header bytes [0, 136) + payload
       152    -  payload

Everything read back is untrusted: :func:`decode_chunk` checks every field
against the caller's expectations and the actual buffer, allocates nothing
from a declared size, and raises :class:`CorruptChunk` (never anything else)
on any mismatch. Nothing here pickles or evals.

The checksum is xxh3-128 when the ``xxhash`` package is installed (tens of
GB/s, so it costs little next to disk or network I/O) and BLAKE2b-128 from
the standard library otherwise (~1.4 GB/s). A process without ``xxhash``
cannot verify xxh3 frames: it gets :class:`UnverifiableChunk`, a miss that
must not delete the entry (another process wrote it and can read it).

Authenticated frames: with a deployment secret (:mod:`kvsdk.trust`) the
writer passes ``mac_key`` (the namespace's frame key) and the checksum field
holds a Carter-Wegman MAC, so only a holder of the secret can make a frame
that verifies:

- the writer draws a random 16-byte nonce (in the header);
- a one-time AES-256 key is keyed BLAKE2b of the header [0, 136) (nonce,
  namespace, chunk key, dtype, shape, length) under the frame key: a PRF, so
  every frame has an independent key that nobody without the secret can
  compute, and a header changed in any bit has another key;
- the tag is AES-GMAC of the payload under that key (GCM with an empty
  plaintext, the payload as associated data, a zero IV: each key is used
  once, for one payload, so GCM's nonce rule holds and GHASH's key is never
  seen twice). A one-time GMAC forges with probability about
  (payload bytes / 16) / 2^128.

A reader with ``mac_key`` accepts MAC'd frames only: an unkeyed frame in its
namespace was planted (or written by a process started without the secret)
and is :class:`CorruptChunk`. A reader without a key cannot check a MAC'd
frame: :class:`UnverifiableChunk`.

Why GMAC (format version 5): on a 2 MiB chunk, with AES-NI and carry-less
multiply (VAES/VPCLMULQDQ on x86, the crypto extensions on ARM), OpenSSL's
GMAC runs at the speed of the unkeyed xxh3-128 checksum (~30 GiB/s on one
core here), where the keyed BLAKE3 of format version 4 ran at ~6-9 GiB/s and
HMAC-SHA256 (version 3) at ~1.9 GiB/s (``benchmarks/bench_frame_mac.py``):
the MAC is on every disk and Redis read and write. It runs on the calling
thread; OpenSSL releases the GIL while it hashes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvsdk.backend import BackendError
from kvsdk.keys import FORMAT_VERSION, KEY_BYTES

_xxhash: Any
try:  # optional accelerator; see the module docstring
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

MAGIC = b"KVSDK"
MAX_NDIM = 8
FP_BYTES = 16
CHECKSUM_XXH3_128 = 1
CHECKSUM_BLAKE2B_128 = 2
CHECKSUM_GMAC_128 = 5
"""GMAC under a one-time AES-256 key (see the module docstring). Retired codes, never
accepted: 3 (HMAC-SHA256-128, format version 3), 4 (keyed BLAKE3-128, format version 4)."""
MAC_KEY_BYTES = 32
NONCE_BYTES = 16
_GMAC_PERSON = b"kvsdk-gmac-key"
_ZERO_IV = bytes(12)

_HEADER = struct.Struct("<5sHBB7s16s16s8QQ16s16s")
HEADER_SIZE = _HEADER.size
_CHECKED_PREFIX = HEADER_SIZE - 16  # the checksum covers the header up to itself
assert HEADER_SIZE == 152

_NUMERIC_DTYPE = re.compile(r"^[<>|=]?([biufc])(1|2|4|8|16)$")
_NAMED_DTYPES = {"bf16": 2, "f8e4m3": 1, "f8e5m2": 1}


class CorruptChunk(BackendError):
    """A stored value is not a valid frame for the expected namespace and key."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"corrupt chunk: {reason}")
        self.reason = reason


class UnverifiableChunk(CorruptChunk):
    """A well-formed frame whose checksum this process cannot compute."""


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def digest(self) -> bytes: ...


def gmac_tag(mac_key: bytes, prefix: bytes | memoryview, parts: Sequence[memoryview]) -> bytes:
    """The 16-byte tag of a MAC'd frame: AES-256-GMAC of the payload ``parts``
    (in order) under the one-time key that ``mac_key`` derives from the header
    ``prefix`` (bytes [0, 136): nonce included)."""
    if len(mac_key) != MAC_KEY_BYTES:
        raise ValueError(f"frame MAC key must be {MAC_KEY_BYTES} bytes")
    if len(parts) == 1:  # one call into OpenSSL
        return AESGCM(_one_time_key(mac_key, prefix)).encrypt(_ZERO_IV, b"", parts[0])
    gmac = _Gmac(mac_key, prefix)
    for part in parts:
        gmac.update(part)
    return gmac.digest()


def _one_time_key(mac_key: bytes, prefix: bytes | memoryview) -> bytes:
    return hashlib.blake2b(prefix, digest_size=32, key=mac_key, person=_GMAC_PERSON).digest()


class _Gmac:
    """:func:`gmac_tag` fed in pieces (the payload's parts, or a file's reads)."""

    def __init__(self, mac_key: bytes, prefix: bytes | memoryview) -> None:
        if len(mac_key) != MAC_KEY_BYTES:
            raise ValueError(f"frame MAC key must be {MAC_KEY_BYTES} bytes")
        key = _one_time_key(mac_key, prefix)
        self._ctx = Cipher(algorithms.AES(key), modes.GCM(_ZERO_IV)).encryptor()

    def update(self, data: Any, /) -> None:
        self._ctx.authenticate_additional_data(data)

    def digest(self) -> bytes:
        self._ctx.finalize()
        return self._ctx.tag


def _checksum(
    algorithm: int, mac_key: bytes | None, prefix: bytes | memoryview, parts: Sequence[memoryview]
) -> bytes:
    """The checksum field for ``prefix`` (the header up to it) and the payload ``parts``."""
    if algorithm == CHECKSUM_GMAC_128 and mac_key is not None:
        return gmac_tag(mac_key, prefix, parts)
    h = _payload_hasher(algorithm, mac_key, prefix)
    for part in parts:
        h.update(part)
    return h.digest()


def _payload_hasher(algorithm: int, mac_key: bytes | None, prefix: bytes | memoryview) -> _Hasher:
    """The checksum (or MAC) of a frame with header ``prefix``, ready for its payload."""
    if algorithm == CHECKSUM_GMAC_128:
        if mac_key is None:
            raise UnverifiableChunk("authenticated frame but this process has no deployment secret")
        return _Gmac(mac_key, prefix)
    if mac_key is not None:
        raise CorruptChunk("unauthenticated frame where a deployment secret is set")
    h: _Hasher
    if algorithm == CHECKSUM_XXH3_128:
        if _xxhash is None:
            raise UnverifiableChunk("xxh3-128 checksum but the xxhash package is not installed")
        h = _xxhash.xxh3_128()
    elif algorithm == CHECKSUM_BLAKE2B_128:
        h = hashlib.blake2b(digest_size=16)
    else:
        raise CorruptChunk(f"unknown checksum algorithm {algorithm}")
    h.update(prefix)
    return h


DEFAULT_CHECKSUM = CHECKSUM_XXH3_128 if _xxhash is not None else CHECKSUM_BLAKE2B_128


def dtype_itemsize(code: str) -> int:
    """Bytes per element of a dtype code, or ``ValueError`` if it is not one we store."""
    m = _NUMERIC_DTYPE.match(code)
    if m:
        return int(m.group(2))
    if code in _NAMED_DTYPES:
        return _NAMED_DTYPES[code]
    raise ValueError(f"unsupported dtype code {code!r}")


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    checksum_algorithm: int
    dtype: str
    shape: tuple[int, ...]
    namespace_fp: bytes
    key: bytes
    length: int
    checksum: bytes


def as_payload(payload: Any) -> tuple[memoryview, str, tuple[int, ...]]:
    """A flat byte view of ``payload`` with its dtype code and shape.

    Bytes-like objects are ``|u1`` of their length; numpy arrays and typed
    memoryviews keep their dtype and shape. No copy is made; non-contiguous
    input is a caller error (``ValueError``).
    """
    if isinstance(payload, bytes | bytearray):
        return memoryview(payload), "|u1", (len(payload),)
    if isinstance(payload, memoryview) and payload.ndim == 1 and payload.format in ("B", "b", "c"):
        return payload.cast("B"), "|u1", (payload.nbytes,)
    arr = np.asarray(payload)
    if not arr.flags.c_contiguous:
        raise ValueError("chunk payload must be C-contiguous")
    flat: Any = arr.reshape(-1).view(np.uint8)
    return memoryview(flat), arr.dtype.str, tuple(arr.shape)


def encode_header(
    namespace_fp: bytes,
    key: bytes,
    payload: memoryview | Sequence[memoryview],
    dtype: str,
    shape: Sequence[int],
    *,
    checksum: int = DEFAULT_CHECKSUM,
    mac_key: bytes | None = None,
) -> bytes:
    """The header for a flat byte ``payload``; write it followed by the payload.

    ``payload`` may be a list of flat byte views whose concatenation is the
    payload (scatter/gather I/O: a page that lies in several regions of host
    memory); the checksum is computed over the parts in order, no copy.
    With ``mac_key`` (the namespace's frame key, :mod:`kvsdk.trust`) the
    checksum is a GMAC tag under a fresh nonce and ``checksum`` is ignored."""
    parts = _parts(payload)
    prefix, algorithm = _header_prefix(
        namespace_fp, key, sum(p.nbytes for p in parts), dtype, shape, checksum, mac_key
    )
    return prefix + _checksum(algorithm, mac_key, prefix, parts)


class HeaderAfterPayload:
    """The header of a frame whose payload is given in pieces first (a file
    written a piece at a time, each piece checksummed right after it was
    written, while still in the CPU's cache): :meth:`update` takes the
    payload's bytes in order, :meth:`finish` returns the header, the same as
    :func:`encode_header`'s for the whole payload."""

    def __init__(
        self,
        namespace_fp: bytes,
        key: bytes,
        nbytes: int,
        dtype: str,
        shape: Sequence[int],
        *,
        checksum: int = DEFAULT_CHECKSUM,
        mac_key: bytes | None = None,
    ) -> None:
        self._prefix, algorithm = _header_prefix(
            namespace_fp, key, nbytes, dtype, shape, checksum, mac_key
        )
        self._hasher = _payload_hasher(algorithm, mac_key, self._prefix)
        self._left = nbytes

    def update(self, piece: memoryview) -> None:
        """The next ``piece`` of the payload."""
        self._left -= piece.nbytes
        self._hasher.update(piece)

    def finish(self) -> bytes:
        if self._left:
            raise ValueError(f"{self._left} payload bytes short of (or past) the frame's length")
        return self._prefix + self._hasher.digest()


def _header_prefix(
    namespace_fp: bytes,
    key: bytes,
    nbytes: int,
    dtype: str,
    shape: Sequence[int],
    checksum: int,
    mac_key: bytes | None,
) -> tuple[bytes, int]:
    """The header up to its checksum field (a fresh nonce with ``mac_key``), and
    the checksum algorithm of the frame."""
    nonce = bytes(NONCE_BYTES)
    if mac_key is not None:
        checksum = CHECKSUM_GMAC_128
        nonce = os.urandom(NONCE_BYTES)
    if len(namespace_fp) != FP_BYTES or len(key) != KEY_BYTES:
        raise ValueError("namespace fingerprint and key must be 16 bytes each")
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has more than {MAX_NDIM} dims or a negative dim")
    itemsize = dtype_itemsize(dtype)
    count = 1
    for d in shape:
        count *= d
    if count * itemsize != nbytes:
        raise ValueError(f"{nbytes} payload bytes do not match {dtype} x {tuple(shape)}")
    dims = [*shape, *([0] * (MAX_NDIM - len(shape)))]
    prefix = _HEADER.pack(
        MAGIC, FORMAT_VERSION, checksum, len(shape), dtype.encode("ascii"),
        namespace_fp, key, *dims, nbytes, nonce, bytes(16),
    )[:_CHECKED_PREFIX]  # fmt: skip
    return prefix, checksum


def _parts(payload: memoryview | Sequence[memoryview]) -> Sequence[memoryview]:
    return (payload,) if isinstance(payload, memoryview) else payload


def encode_chunk(
    namespace_fp: bytes,
    key: bytes,
    payload: Any,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    *,
    checksum: int = DEFAULT_CHECKSUM,
    mac_key: bytes | None = None,
) -> bytes:
    """One frame as ``bytes`` (one copy of the payload).

    ``dtype``/``shape`` default to the payload's own (see :func:`as_payload`).
    Writers that can do scatter I/O should use :func:`encode_header` and
    write the header and the payload separately instead.
    """
    flat, own_dtype, own_shape = as_payload(payload)
    header = encode_header(
        namespace_fp,
        key,
        flat,
        own_dtype if dtype is None else dtype,
        own_shape if shape is None else shape,
        checksum=checksum,
        mac_key=mac_key,
    )
    return b"".join((header, flat))


def _view(buf: Any) -> memoryview:
    try:
        mv = memoryview(buf)
        return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
    except TypeError as exc:
        raise CorruptChunk(f"unreadable buffer ({exc})") from None


def parse_header(buf: Any, payload_nbytes: int | None = None) -> ChunkHeader:
    """The header of a frame, checked for structure and against the payload
    bytes actually present (not against a namespace or key, not the checksum):
    those after the header in ``buf``, or ``payload_nbytes`` when the payload
    lies in a buffer of its own."""
    mv = _view(buf)
    if len(mv) < HEADER_SIZE:
        raise CorruptChunk(
            f"truncated: {len(mv)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, algorithm, ndim, raw_dtype, ns, key, *rest = _HEADER.unpack_from(mv)
    dims, length, checksum = rest[:MAX_NDIM], rest[MAX_NDIM], rest[MAX_NDIM + 2]
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}")
    if ndim > MAX_NDIM or any(dims[ndim:]):
        raise CorruptChunk(f"bad shape: ndim {ndim}, dims {dims}")
    try:
        dtype = raw_dtype.rstrip(b"\0").decode("ascii")
        itemsize = dtype_itemsize(dtype)
    except (UnicodeDecodeError, ValueError):
        raise CorruptChunk(f"bad dtype code {raw_dtype!r}") from None
    actual = len(mv) - HEADER_SIZE if payload_nbytes is None else payload_nbytes
    if length > actual:
        raise CorruptChunk(f"truncated: header says {length} payload bytes, {actual} present")
    if length < actual:
        raise CorruptChunk(f"{actual - length} trailing bytes after the payload")
    shape = tuple(dims[:ndim])
    count = 1
    for d in shape:
        count *= d
    if count * itemsize != length:
        raise CorruptChunk(f"{dtype} x {shape} does not match {length} payload bytes")
    return ChunkHeader(version, algorithm, dtype, shape, ns, key, length, checksum)


def _check(
    header: ChunkHeader,
    header_buf: memoryview,
    payload: Sequence[memoryview],
    namespace_fp: bytes,
    key: bytes,
    mac_key: bytes | None,
) -> None:
    _check_identity(header, namespace_fp, key)
    expected = _checksum(header.checksum_algorithm, mac_key, header_buf[:_CHECKED_PREFIX], payload)
    _check_digest(header, expected, mac_key is not None)


def _check_identity(header: ChunkHeader, namespace_fp: bytes, key: bytes) -> None:
    if header.namespace_fp != namespace_fp:
        raise CorruptChunk("foreign namespace")
    if header.key != key:
        raise CorruptChunk("key mismatch")


def _check_digest(header: ChunkHeader, digest: bytes, mac: bool) -> None:
    if not hmac.compare_digest(digest, header.checksum):
        raise CorruptChunk("MAC mismatch" if mac else "checksum mismatch")


def decode_chunk(
    buf: Any, *, namespace_fp: bytes, key: bytes, mac_key: bytes | None = None
) -> memoryview:
    """The payload of a frame (a zero-copy view into ``buf``) after checking
    every header field and the checksum (with ``mac_key``: the MAC, and that
    there is one); :class:`CorruptChunk` otherwise."""
    mv = _view(buf)
    header = parse_header(mv)
    payload = mv[HEADER_SIZE:]
    _check(header, mv, (payload,), namespace_fp, key, mac_key)
    return payload


def verify_chunk(
    header_buf: Any,
    payload: Any,
    *,
    namespace_fp: bytes,
    key: bytes,
    mac_key: bytes | None = None,
) -> ChunkHeader:
    """Check a frame whose header and payload were read into separate buffers
    (e.g. the payload straight into its destination); :class:`CorruptChunk` otherwise.

    ``payload`` may be a list of buffers whose concatenation is the payload
    (a scattered read into several regions); every part is covered by the
    checksum, and the length is their total."""
    head = _view(header_buf)
    body = [_view(p) for p in payload] if isinstance(payload, list | tuple) else [_view(payload)]
    header = parse_header(head[:HEADER_SIZE], sum(len(p) for p in body))
    _check(header, head, body, namespace_fp, key, mac_key)
    return header


class PayloadCheck:
    """Verifies a frame whose payload arrives in pieces after its header (e.g.
    a file read a piece at a time, each piece copied on while still in the
    CPU's cache): the header is checked at once (structure, ``payload_nbytes``
    against its length, namespace, key); :meth:`update` takes the payload's
    bytes in order and :meth:`finish` checks the checksum or MAC over them.
    Raises :class:`CorruptChunk` (or :class:`UnverifiableChunk`) as
    :func:`verify_chunk` does."""

    def __init__(
        self,
        header_buf: Any,
        payload_nbytes: int,
        *,
        namespace_fp: bytes,
        key: bytes,
        mac_key: bytes | None = None,
    ) -> None:
        head = _view(header_buf)[:HEADER_SIZE]
        self.header = parse_header(head, payload_nbytes)
        _check_identity(self.header, namespace_fp, key)
        self._mac = mac_key is not None
        self._hasher = _payload_hasher(self.header.checksum_algorithm, mac_key,
                                       head[:_CHECKED_PREFIX])  # fmt: skip
        self._seen = 0

    def update(self, piece: Any) -> None:
        """The next ``piece`` of the payload."""
        view = _view(piece)
        self._seen += len(view)
        self._hasher.update(view)

    def finish(self) -> ChunkHeader:
        """The header, once every payload byte was given and the checksum matches."""
        if self._seen != self.header.length:
            raise CorruptChunk(f"truncated: {self._seen} of {self.header.length} payload bytes")
        _check_digest(self.header, self._hasher.digest(), self._mac)
        return self.header
