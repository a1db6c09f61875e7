"""The identity of a model's weights, for the namespace: a digest of every byte.

Two checkpoints that differ in one weight must not share KV, so each weight
file is hashed whole (BLAKE3, multi-threaded over a memory map). A file's
digest is cached beside its identity on disk (device, inode, size, mtime and
ctime: a write changes ctime, which no user can set back), so an engine
restarted on the same files reads each byte once per machine, not once per
start. Processes starting together (an engine's scheduler and workers) wait
on one lock per file instead of hashing it each.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

import blake3

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def cache_dir() -> Path:
    """``$KVSDK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvsdk``, else ``~/.cache/kvsdk``."""
    if explicit := os.environ.get("KVSDK_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvsdk"


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _hash_file(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        h.update_mmap(str(path))
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """BLAKE3 of every byte of ``path``, from the cache while the file is unchanged."""
    path = path.resolve()
    ident = _identity(path.stat())
    root = cache_dir() / "weights"
    entry = root / (hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest() + ".json")
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(entry.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process hashes, the others read its result
            try:
                cached = json.loads(entry.read_text())
                if cached.get("identity") == ident and cached.get("path") == str(path):
                    return str(cached["blake3"])
            except (OSError, ValueError, AttributeError):
                pass
            digest = _hash_file(path)
            if _identity(path.stat()) == ident:  # not rewritten while it was read
                tmp = entry.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"path": str(path), "identity": ident, "blake3": digest}))
                tmp.replace(entry)
            return digest
    except OSError as exc:  # no writable cache: hash every time
        log.debug("kvsdk: weights digest cache unavailable (%s)", exc)
        return _hash_file(path)


def weight_files(root: Path) -> list[Path]:
    """The weight files directly in directory ``root``, sorted by name."""
    return sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def hub_snapshot(model: str, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The local snapshot directory of hub model ``model`` (no network), or None."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except Exception:  # not cached, offline, not a hub id, no huggingface_hub
        return None


def weights_fingerprint(root: Path) -> str:
    """Digest over every weight file in directory ``root`` (name, size, contents)."""
    h = hashlib.blake2b(digest_size=16)
    for f in weight_files(root):
        h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little"))
        h.update(bytes.fromhex(file_digest(f)))
    return h.hexdigest()
