"""A hostile writer: write access to kvsdk's disk directory and Redis database,
no deployment secret, and nothing but public knowledge (docs/security.md).

    python attacker.py PLAN_JSON REPORT_JSON

It knows the prompts it targets (token ids), vLLM's prefix hash (sha256 with
vLLM's fixed default seed) and kvsdk's code (chunk keys, frame format, disk
layout, Redis key names); it lists the directory and the database and reads
every frame. ``PLAN_JSON``:

- ``disk_dir``, ``redis_url``;
- ``prompts``: ``{"x_disk": [...token ids], "x_redis": [...]}``: it plants
  ``x_disk`` on disk and ``x_redis`` in Redis;
- ``targets``: ``{"disk": ["<ns>/<key>", ...], "redis": [...]}``: entries of a
  namespace whose keys it cannot compute (a deployment with a secret) that it
  saw appear while the target prompt was served, and overwrites.

What it does, per prompt and tier:

1. computes the prompt's chunk keys under every namespace name it sees (the
   name is the key-derivation key when there is no secret) and reports which
   of those entries exist;
2. copies the frames of the namespace where they exist (an honest engine
   without the secret wrote them), then overwrites them there with *forged*
   frames: noise of the right dtype and shape under a valid header and
   checksum (kvsdk's own frame code);
3. in every other namespace, plants forged frames at the keys it computes
   there (its best guess of where the engine looks);
4. overwrites each ``targets`` entry, cycling through: a forged frame for that
   namespace and key; another target's valid (MAC'd) frame copied over it;
   the payload replaced by noise under the original header and MAC; the
   honest engine's frame for the same prompt replayed verbatim; the honest
   payload under a header restamped with this namespace and key.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("forged", "swapped", "edited_payload", "replayed", "restamped")


def vllm_block_hashes(tokens: list[int], block_size: int = 32) -> list[bytes]:
    """What vLLM computes for a prompt without salt, LoRA or images: public."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    out: list[bytes] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            hash_fn, parent, tokens[start : start + block_size], None
        )
        out.append(bytes(parent))
    return out


def disk_path(root: Path, ns: str, key: str, shards: int = 256) -> Path:
    """kvsdk's disk layout (public code): ``<root>/<ns>/<shard>/<key>.kvc``."""
    width = len(f"{shards - 1:x}")
    return root / ns / f"{int(key[:8], 16) % shards:0{width}x}" / f"{key}.kvc"


def write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".planted")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Tier:
    def __init__(self, kind: str, plan: dict[str, Any]) -> None:
        self.kind = kind
        self.root = Path(plan["disk_dir"])
        if kind == "redis":
            import redis as redis_py

            self.client = redis_py.Redis.from_url(plan["redis_url"], socket_timeout=60)

    def namespaces(self) -> list[str]:
        if self.kind == "disk":
            return sorted(p.name for p in self.root.iterdir() if p.is_dir())
        return sorted({k.decode().split(":")[1] for k in self.client.scan_iter(b"kvsdk:*")})

    def read(self, ns: str, key: str) -> bytes | None:
        if self.kind == "disk":
            p = disk_path(self.root, ns, key)
            return p.read_bytes() if p.exists() else None
        value: Any = self.client.get(f"kvsdk:{ns}:{key}")
        return None if value is None else bytes(value)

    def write(self, ns: str, key: str, frame: bytes) -> None:
        if self.kind == "disk":
            write_file(disk_path(self.root, ns, key), frame)
        else:
            self.client.set(f"kvsdk:{ns}:{key}", frame)


def noise_like(header: Any, seed: int) -> Any:
    """Plausible KV (float32, the tiny model's dtype) of the frame's payload length."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(header.length // 4, dtype=np.float32)


def main() -> None:
    from kvsdk.chunk_format import HEADER_SIZE, encode_chunk, parse_header
    from kvsdk.keys import chunk_keys

    assert "KVSDK_SECRET" not in os.environ, "the attacker must not hold the secret"
    plan_path, report_path = sys.argv[1:3]
    plan = json.loads(Path(plan_path).read_text())
    report: dict[str, Any] = {"computed": {}, "planted": [], "targets": []}
    honest: dict[str, list[bytes]] = {}
    tiers = {"disk": Tier("disk", plan), "redis": Tier("redis", plan)}
    for name, tier_kind in (("x_disk", "disk"), ("x_redis", "redis")):
        tier = tiers[tier_kind]
        hashes = vllm_block_hashes(plan["prompts"][name])
        report["computed"][name] = {}
        computed: dict[str, list[str]] = {}
        for ns in tier.namespaces():
            keys = [k.hex() for k in chunk_keys(bytes.fromhex(ns), hashes, 0)]
            frames = [tier.read(ns, k) for k in keys]
            found = [f for f in frames if f is not None]
            report["computed"][name][ns] = {"keys": keys, "found": len(found)}
            computed[ns] = keys
            if found and len(found) == len(keys):
                honest[name] = found  # an honest engine without the secret wrote them
        assert name in honest, f"no namespace holds {name} under computable keys"
        for ns, keys in computed.items():
            existed = report["computed"][name][ns]["found"] > 0
            for i, k in enumerate(keys):
                header = parse_header(honest[name][i])
                forged = encode_chunk(
                    bytes.fromhex(ns), bytes.fromhex(k), noise_like(header, i), header.dtype,
                    header.shape,
                )  # fmt: skip
                tier.write(ns, k, forged)
                report["planted"].append(
                    {"tier": tier_kind, "ns": ns, "key": k, "existed": existed}
                )
    for tier_kind, prompt in (("disk", "x_disk"), ("redis", "x_redis")):
        tier = tiers[tier_kind]
        entries = [e.split("/") for e in plan["targets"][tier_kind]]
        originals = [tier.read(ns, k) for ns, k in entries]
        assert all(o is not None for o in originals), "a target entry is missing"
        for i, ((ns, k), original) in enumerate(zip(entries, originals)):
            assert original is not None
            header = parse_header(original)
            kind = KINDS[i % len(KINDS)]
            good = honest[prompt][i]
            if kind == "forged":
                frame = encode_chunk(
                    bytes.fromhex(ns), bytes.fromhex(k), noise_like(header, 50 + i), header.dtype,
                    header.shape,
                )  # fmt: skip
            elif kind == "swapped":
                frame = originals[(i + 1) % len(originals)]  # type: ignore[assignment]
            elif kind == "edited_payload":
                frame = original[:HEADER_SIZE] + noise_like(header, 50 + i).tobytes()
            elif kind == "replayed":
                frame = good
            else:  # restamped
                frame = encode_chunk(
                    bytes.fromhex(ns), bytes.fromhex(k), good[HEADER_SIZE:], header.dtype,
                    header.shape,
                )  # fmt: skip
            assert frame != original
            tier.write(ns, k, frame)
            report["targets"].append({"tier": tier_kind, "ns": ns, "key": k, "kind": kind})
    Path(report_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
