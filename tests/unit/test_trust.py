"""The deployment secret: MAC'd frames, where the secret comes from, and that
it (and any password) never reaches output."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from kvsdk import trust
from kvsdk.chunk_format import (
    CHECKSUM_GMAC_128,
    HEADER_SIZE,
    CorruptChunk,
    UnverifiableChunk,
    decode_chunk,
    encode_chunk,
    encode_header,
    parse_header,
    verify_chunk,
)
from kvsdk.config import ConfigError
from kvsdk.trust import DeploymentSecret, load_secret, mask_url, redact

NS = hashlib.blake2b(b"ns", digest_size=16).digest()
KEY = hashlib.blake2b(b"key", digest_size=16).digest()
MAC = DeploymentSecret(b"a-deployment-secret-0123456789").derive(b"kvsdk-frame-mac", NS)
OTHER_MAC = DeploymentSecret(b"another-secret-0123456789abcdef").derive(b"kvsdk-frame-mac", NS)
SECRET_TEXT = "s3cret-value-0123456789abcdef"


def test_macd_frame_round_trips_with_its_key() -> None:
    buf = encode_chunk(NS, KEY, b"kv bytes", mac_key=MAC)
    assert parse_header(buf).checksum_algorithm == CHECKSUM_GMAC_128
    assert bytes(decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=MAC)) == b"kv bytes"


def test_macd_frame_verifies_from_scattered_parts() -> None:
    parts = [memoryview(b"ab"), memoryview(b"cdef")]
    header = encode_header(NS, KEY, parts, "|u1", (6,), mac_key=MAC)
    verify_chunk(header, parts, namespace_fp=NS, key=KEY, mac_key=MAC)


def test_unkeyed_frame_is_corrupt_where_a_secret_is_set() -> None:
    """A writer without the secret can only make unkeyed frames: refused, and
    dropped (CorruptChunk, not UnverifiableChunk)."""
    buf = encode_chunk(NS, KEY, b"planted")
    with pytest.raises(CorruptChunk) as info:
        decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=MAC)
    assert not isinstance(info.value, UnverifiableChunk)
    assert "unauthenticated" in info.value.reason


def test_frame_under_another_secret_fails_its_mac() -> None:
    buf = encode_chunk(NS, KEY, b"forged", mac_key=OTHER_MAC)
    with pytest.raises(CorruptChunk, match="MAC mismatch"):
        decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=MAC)


@pytest.mark.parametrize("offset", [0, 7, 20, 40, HEADER_SIZE - 1, HEADER_SIZE + 3])
def test_any_flipped_byte_of_a_macd_frame_is_corrupt(offset: int) -> None:
    buf = bytearray(encode_chunk(NS, KEY, b"x" * 64, mac_key=MAC))
    buf[offset] ^= 0x01
    with pytest.raises(CorruptChunk):
        decode_chunk(buf, namespace_fp=NS, key=KEY, mac_key=MAC)


def test_macd_frame_is_unverifiable_without_a_key() -> None:
    """A process without the secret cannot check it: a miss that keeps the entry."""
    buf = encode_chunk(NS, KEY, b"kv", mac_key=MAC)
    with pytest.raises(UnverifiableChunk):
        decode_chunk(buf, namespace_fp=NS, key=KEY)


# -- where the secret comes from ---------------------------------------------------------


def _secret_file(tmp_path: Path, text: str = SECRET_TEXT, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_no_secret_when_neither_is_set() -> None:
    assert load_secret(None, environ={}) is None


def test_secret_from_env_and_from_file_are_the_same_secret(tmp_path: Path) -> None:
    from_env = load_secret(None, environ={trust.ENV_VAR: SECRET_TEXT})
    from_file = load_secret(str(_secret_file(tmp_path)), environ={})
    assert from_env is not None and from_env == from_file


def test_both_sources_at_once_is_an_error_not_a_precedence(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secret_file: .* also set") as info:
        load_secret(str(_secret_file(tmp_path)), environ={trust.ENV_VAR: SECRET_TEXT})
    assert SECRET_TEXT not in str(info.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_secret_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match=f"mode {mode:04o}.*chmod 600") as info:
        load_secret(str(_secret_file(tmp_path, mode=mode)), environ={})
    assert SECRET_TEXT not in str(info.value)


def test_secret_file_symlink_fifo_and_missing_are_refused(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(_secret_file(tmp_path))
    with pytest.raises(ConfigError, match="not a symlink"):
        load_secret(str(link), environ={})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_secret(str(fifo), environ={})  # returns at once: opened O_NONBLOCK
    with pytest.raises(ConfigError, match="cannot open"):
        load_secret(str(tmp_path / "missing"), environ={})


def test_short_secrets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(None, environ={trust.ENV_VAR: "short"})
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(str(_secret_file(tmp_path, text="short")), environ={})


def test_no_secret_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    trust._warned_no_secret = False
    with caplog.at_level(logging.WARNING, logger="kvsdk.trust"):
        trust.note_trust(None, ["disk"])
        trust.note_trust(None, ["redis"])
        trust.note_trust(DeploymentSecret(SECRET_TEXT.encode()), ["disk"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "planted" in lines[0]
    assert "disk" in lines[0]


def test_no_log_without_shared_tiers(caplog: pytest.LogCaptureFixture) -> None:
    trust._warned_no_secret = False
    with caplog.at_level(logging.WARNING, logger="kvsdk.trust"):
        trust.note_trust(None, [])
    assert not caplog.records


# -- nothing leaks ------------------------------------------------------------------------

PASSWORD = "p@ss:w/rd@x"


@pytest.mark.parametrize(
    "url, shown",
    [
        (f"redis://user:{PASSWORD}@host:6379/0", "redis://user:***@host:6379/0"),
        (f"rediss://:{PASSWORD}@host/0", "rediss://:***@host/0"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://user:a%40b%3Ac%2Fd@host/0", "redis://user:***@host/0"),
    ],
)
def test_mask_url_hides_any_password(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_redact_scrubs_passwords_and_the_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trust.ENV_VAR, SECRET_TEXT)
    text = f"failed: redis://u:{PASSWORD}@h/0 AUTH {PASSWORD} and {SECRET_TEXT}"
    out = redact(text, [PASSWORD])
    assert PASSWORD not in out and SECRET_TEXT not in out
    assert "w/rd" not in out and "ss:" not in out
