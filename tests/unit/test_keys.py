"""Chunk keys: 16 bytes, deterministic across processes, scoped by namespace,
chained over token chunks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsdk.keys import (
    CHAIN_HASH_BYTES,
    FORMAT_VERSION,
    KEY_BYTES,
    GroupLayout,
    Namespace,
    chunk_key,
    chunk_keys,
    token_chunk_hashes,
)
from kvsdk.trust import DeploymentSecret

TPC = 4


def _namespace(**changes: Any) -> Namespace:
    base = Namespace(
        model="meta-llama/Llama-3-8B@abc123",
        dtype="bfloat16",
        groups=(GroupLayout(shape=(2, 16, 8, 128), dtype="bfloat16"),),
        tokens_per_chunk=256,
        rank=0,
        world_size=2,
    )
    return dataclasses.replace(base, **changes)


TOKENS = list(range(1000, 1000 + 4 * TPC + 3))  # four full chunks and a partial tail


def _keys(ns: Namespace, group: int = 0, tokens: list[int] = TOKENS) -> list[bytes]:
    return chunk_keys(ns.fingerprint, token_chunk_hashes(tokens, TPC), group)


def test_chunk_keys_are_16_bytes() -> None:
    keys = _keys(_namespace())
    assert KEY_BYTES == 16
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(_namespace().fingerprint) == 16


def test_chain_hashes_are_at_least_128_bits() -> None:
    hashes = token_chunk_hashes(TOKENS, TPC)
    assert all(len(h) == CHAIN_HASH_BYTES >= 16 for h in hashes)


def test_only_full_chunks_are_hashed() -> None:
    assert len(token_chunk_hashes(TOKENS, TPC)) == 4
    assert token_chunk_hashes(TOKENS[: TPC - 1], TPC) == []


_CHILD = """
import sys
from kvsdk.keys import GroupLayout, Namespace, chunk_keys, token_chunk_hashes
ns = Namespace("m", "float16", (GroupLayout((2, 16, 64), "float16"),), 16, tenant_salt="t")
hashes = token_chunk_hashes(list(range(100)), 16)
print(ns.hex, *(k.hex() for k in chunk_keys(ns.fingerprint, hashes, 1)))
"""


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.append(proc.stdout.split())
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 1 + 6  # fingerprint and six chunk keys

    # ... and equal to this process's own answer.
    ns = Namespace("m", "float16", (GroupLayout((2, 16, 64), "float16"),), 16, tenant_salt="t")
    mine = chunk_keys(ns.fingerprint, token_chunk_hashes(list(range(100)), 16), 1)
    assert outputs[0] == [ns.hex, *(k.hex() for k in mine)]


def test_keys_are_pinned_to_known_values() -> None:
    """Golden values: a change here silently orphans every stored chunk, so it
    must come with a FORMAT_VERSION bump."""
    ns = Namespace("m", "float16", (GroupLayout((2, 16, 64), "float16"),), 16)
    hashes = token_chunk_hashes(list(range(32)), 16)
    keys = chunk_keys(ns.fingerprint, hashes, 0)
    assert FORMAT_VERSION == 5
    assert [k.hex() for k in keys] == _GOLDEN_KEYS


# FORMAT_VERSION 5 (frame nonce, MAC: one-time-key GMAC); version 4 (keyed BLAKE3) gave
# ["b1ff454a1d453ce2449c3cf9d2bb6ee5", "65c180a94605255d364f5d56dac388ba"], version 3
# ["34b9c9eb394a26702eb0d1e54b3c0e7e", "57412564875a6ef58a0a187c7741a232"]
_GOLDEN_KEYS = ["2daf35b667db07f51ebe60d4c42052c8", "21f7a1aabf10f493ed66f61993cfaabf"]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "meta-llama/Llama-3-8B@def456"},
        {"dtype": "float16"},
        {"groups": (GroupLayout(shape=(2, 16, 8, 64), dtype="bfloat16"),)},
        {"groups": (GroupLayout(shape=(2, 16, 8, 128), dtype="bfloat16", layout="hnd"),)},
        {"tokens_per_chunk": 512},
        {"rank": 1},
        {"world_size": 4},
        {"format_version": FORMAT_VERSION + 1},
        {"tenant_salt": "tenant-b"},
        {"extra": (("lora", "adapter-7"),)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_keys_differ_across_namespaces(change: dict[str, Any]) -> None:
    base, other = _namespace(), _namespace(**change)
    assert base.fingerprint != other.fingerprint
    assert set(_keys(base)).isdisjoint(_keys(other))


def test_with_tenant_changes_only_the_salt() -> None:
    ns = _namespace()
    salted = ns.with_tenant("tenant-b")
    assert salted == dataclasses.replace(ns, tenant_salt="tenant-b")
    assert salted.fingerprint != ns.fingerprint
    assert ns.with_tenant("").fingerprint == ns.fingerprint


def test_equal_namespaces_share_keys() -> None:
    assert _keys(_namespace()) == _keys(_namespace())


def test_keys_differ_by_group_index() -> None:
    ns = _namespace()
    by_group = [_keys(ns, group=g) for g in range(4)]
    flat = [k for keys in by_group for k in keys]
    assert len(set(flat)) == len(flat)


def test_engine_provided_block_hashes_are_accepted() -> None:
    fp = _namespace().fingerprint
    engine_hashes = [bytes([i]) * 32 for i in range(3)] + [b"short", b"x" * 64]
    keys = chunk_keys(fp, engine_hashes, 0)
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    assert keys == [chunk_key(fp, h, 0) for h in engine_hashes]
    assert chunk_key(fp, engine_hashes[0], 0) != chunk_key(fp, engine_hashes[0], 1)


def test_numpy_and_list_token_ids_hash_alike() -> None:
    as_list = token_chunk_hashes(TOKENS, TPC)
    assert token_chunk_hashes(np.array(TOKENS, dtype=np.int32), TPC) == as_list
    assert token_chunk_hashes(np.array(TOKENS, dtype=np.int64), TPC) == as_list


def test_extra_content_changes_every_hash() -> None:
    plain = token_chunk_hashes(TOKENS, TPC)
    salted = token_chunk_hashes(TOKENS, TPC, extra=b"image-digest")
    assert all(a != b for a, b in zip(plain, salted))


tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, cut=st.integers(min_value=0, max_value=40))
def test_hashes_of_a_prefix_are_the_first_hashes_of_the_whole(tokens: list[int], cut: int) -> None:
    whole = token_chunk_hashes(tokens, TPC)
    prefix = token_chunk_hashes(tokens[:cut], TPC)
    assert prefix == whole[: len(prefix)]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), min_size=TPC, max_size=40), data=st.data())
def test_changing_a_token_changes_its_chunk_and_every_later_hash(
    tokens: list[int], data: st.DataObject
) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = [*tokens]
    changed[i] += 1
    a, b = token_chunk_hashes(tokens, TPC), token_chunk_hashes(changed, TPC)
    first = i // TPC
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, chunks=st.integers(min_value=0, max_value=10))
def test_parent_continuation_equals_hashing_the_whole(tokens: list[int], chunks: int) -> None:
    whole = token_chunk_hashes(tokens, TPC)
    split = min(chunks, len(whole)) * TPC
    head = token_chunk_hashes(tokens[:split], TPC)
    parent = head[-1] if head else bytes(CHAIN_HASH_BYTES)
    tail = token_chunk_hashes(tokens[split:], TPC, parent=parent)
    assert head + tail == whole


def test_same_chunk_content_after_different_prefixes_hashes_differently() -> None:
    chunk = [7] * TPC
    a = token_chunk_hashes([1] * TPC + chunk, TPC)
    b = token_chunk_hashes([2] * TPC + chunk, TPC)
    assert a[1] != b[1]


def test_short_engine_hashes_still_get_namespaced_keys() -> None:
    """Hashes under 16 bytes get namespaced keys like any other."""
    a = Namespace("m", "float16", (GroupLayout((2, 16, 64), "float16"),), 16)
    b = a.with_tenant("other")
    short = b"\x01\x02\x03\x04\x05\x06\x07\x08"
    ka, kb = chunk_key(a.fingerprint, short, 0), chunk_key(b.fingerprint, short, 0)
    assert len(ka) == len(kb) == 16
    assert ka != kb
    assert chunk_keys(a.fingerprint, [short], 0) == [ka]


SECRET = DeploymentSecret(b"0123456789abcdef-deployment")


def test_a_secret_changes_every_name_and_key_and_keeps_them_private() -> None:
    """With a secret, the public name, the key-derivation key and the frame key
    are three different values, none computable from the namespace alone."""
    plain, keyed = _namespace(), _namespace().with_secret(SECRET)
    assert plain.public_fp == plain.fingerprint and plain.frame_key is None
    assert len({keyed.public_fp, keyed.fingerprint, plain.fingerprint}) == 3
    assert keyed.frame_key is not None and len(keyed.frame_key) == 32
    assert set(_keys(plain)).isdisjoint(_keys(keyed))
    other = _namespace().with_secret(DeploymentSecret(b"another-deployment-secret"))
    assert set(_keys(other)).isdisjoint(_keys(keyed))
    assert other.public_fp != keyed.public_fp


def test_the_secret_is_not_in_repr_or_canonical_bytes() -> None:
    keyed = _namespace().with_secret(SECRET)
    assert b"deployment" not in keyed.canonical_bytes()
    assert "deployment" not in repr(keyed) and "deployment" not in repr(SECRET)
    assert keyed.canonical_bytes() == _namespace().canonical_bytes()


def test_keys_do_not_reveal_a_mask_from_one_known_prompt() -> None:
    """Keys are a PRF of the whole chain hash: key XOR hash is not a constant
    (with an XOR mask, one known prompt and a listing would give away all keys)."""
    ns = _namespace()
    hashes = token_chunk_hashes(TOKENS, TPC)
    keys = chunk_keys(ns.fingerprint, hashes, 0)
    masks = {bytes(a ^ b for a, b in zip(k, h[:16], strict=True)) for k, h in zip(keys, hashes)}
    assert len(masks) == len(keys)


def test_suffixed_engine_hashes_get_distinct_keys() -> None:
    """The whole hash is keyed, not its first 16 bytes: SGLang's ``<hex>_k`` and
    ``<hex>_v`` page keys are two chunks."""
    fp = _namespace().fingerprint
    base = ("ab" * 32).encode()
    assert chunk_key(fp, base + b"_k", 0) != chunk_key(fp, base + b"_v", 0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    tpc=st.integers(1, 40),
)
def test_token_lists_hash_like_int64_arrays(tokens: list[int], tpc: int) -> None:
    """Lists and tuples take a path without numpy (the scheduler hashes a prompt
    tail per request): the same little-endian int64 bytes, the same chain."""
    want = token_chunk_hashes(np.array(tokens, dtype=np.int64), tpc, extra=b"salt")
    assert token_chunk_hashes(tokens, tpc, extra=b"salt") == want
    assert token_chunk_hashes(tuple(tokens), tpc, extra=b"salt") == want
    # what numpy converts, e.g. floats, still hashes as numpy's int64 of it
    floats = [float(t % 1000) + 0.5 for t in tokens]
    assert token_chunk_hashes(floats, tpc) == token_chunk_hashes(np.asarray(floats, "<i8"), tpc)
    with pytest.raises(OverflowError):
        token_chunk_hashes([2**63], 1)
