"""The weights' identity covers every byte: a one-byte edit anywhere changes
it (a sample of each tensor would miss most), and the per-file digest cache
never serves a digest for bytes that changed, even with size and mtime kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvsdk.weights import cache_dir, file_digest, weights_fingerprint

SIZE = 3 << 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSDK_CACHE_DIR", str(tmp_path / "cache"))


def model(path: Path) -> Path:
    path.mkdir()
    (path / "model-00001.safetensors").write_bytes(os.urandom(SIZE))
    (path / "model-00002.safetensors").write_bytes(os.urandom(SIZE))
    (path / "config.json").write_text("{}")  # not a weight file
    return path


def edit_one_byte_keeping_size_and_mtime(f: Path, at: int) -> None:
    st = f.stat()
    with f.open("r+b") as fh:
        fh.seek(at)
        old = fh.read(1)
        fh.seek(at)
        fh.write(bytes([old[0] ^ 1]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns


def test_a_one_byte_edit_anywhere_changes_the_fingerprint(tmp_path: Path) -> None:
    root = model(tmp_path / "m")
    before = weights_fingerprint(root)
    assert weights_fingerprint(root) == before  # deterministic, now from the cache
    entries = list((cache_dir() / "weights").glob("*.json"))
    assert len(entries) == 2
    assert {json.loads(e.read_text())["path"] for e in entries} == {
        str(p.resolve()) for p in root.glob("*.safetensors")
    }
    for at in (12_345, SIZE // 2 + 7, SIZE - 1):  # between any per-tensor samples
        edit_one_byte_keeping_size_and_mtime(root / "model-00002.safetensors", at)
        after = weights_fingerprint(root)
        assert after != before  # ctime moved: the cached digest is not served
        before = after


def test_the_cache_answers_for_an_unchanged_file_only(tmp_path: Path) -> None:
    f = model(tmp_path / "m") / "model-00001.safetensors"
    digest = file_digest(f)
    (entry,) = [e for e in (cache_dir() / "weights").glob("*.json")]
    record = json.loads(entry.read_text())
    assert record["blake3"] == digest
    # a cached digest is served while the file's identity is unchanged...
    entry.write_text(json.dumps(record | {"blake3": "00" * 32}))
    assert file_digest(f) == "00" * 32
    # ...and never once the file changed
    edit_one_byte_keeping_size_and_mtime(f, 99)
    assert file_digest(f) not in ("00" * 32, digest)


def test_without_a_writable_cache_the_digest_is_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = model(tmp_path / "m") / "model-00001.safetensors"
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KVSDK_CACHE_DIR", str(blocker))
    assert file_digest(f) == file_digest(f)
    monkeypatch.setenv("KVSDK_CACHE_DIR", str(tmp_path / "cache2"))
    assert file_digest(f) == file_digest(f)
