"""``KVSDKStorage`` inside SGLang's real HiCache machinery, on CPU.

Every test drives SGLang's own classes (device pool, host pool in each
layout, ``HybridCacheController`` / ``HiCacheController``) with kvsdk loaded
through SGLang's ``dynamic`` storage backend factory; see ``conftest.py``.
Run in the SGLang environment::

    .venv-sglang/bin/python -m pytest tests/integration/sglang -q -p no:cacheprovider
"""

from __future__ import annotations

import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import sglang  # noqa: F401  (missing: a failure, never a skip; scripts/install_sglang.sh)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang_rig import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    Rig,
    disk_config,
    join_workers,
    kvsdk_extra_config,
    run_worker,
    start_workers,
    tiny_model_dir,
    tokens_for,
)

from kvsdk.backend import Backend
from kvsdk.backends.disk import DiskBackend
from kvsdk.chunk_format import HEADER_SIZE
from kvsdk.config import ConfigError
from kvsdk.events import EventKind
from kvsdk.plugins.sglang import KVSDKStorage
from kvsdk.plugins.sglang.storage import load_storage_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/integration
from redis_server import free_port, redis_server_fixture  # noqa: F401

pytestmark = pytest.mark.filterwarnings(
    # SGLang's import-time notes about CUDA-only quantization kernels and torch.jit
    "ignore:Only CUDA:UserWarning",
    "ignore::DeprecationWarning",
)
LAYOUTS = [(False, lay) for lay in MHA_LAYOUTS] + [(True, lay) for lay in MLA_LAYOUTS]


def kvsdk_rig(make_rig: Any, path: Path, **kw: Any) -> Rig:
    config = kw.pop("config", None) or disk_config(path)
    v1 = kw.pop("interface_v1", 1)
    rig: Rig = make_rig(extra_config=kvsdk_extra_config(config, interface_v1=v1), **kw)
    return rig


def counter(rig: Rig, name: str, **labels: Any) -> float:
    return float(rig.storage.metrics.counter(name, **labels))


def page_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvc"))


# -- round trips through the real controller ------------------------------------------------


@pytest.mark.parametrize(
    ("mla", "layout"), LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{lay}" for m, lay in LAYOUTS]
)
def test_backup_query_prefetch_round_trip_is_byte_exact(
    make_rig: Any, tmp_path: Path, mla: bool, layout: str
) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, layout=layout, mla=mla)
    assert isinstance(rig.storage, KVSDKStorage)
    assert rig.ctrl.page_get_func.__name__ == "_page_get_zero_copy"  # interface_v1
    n = 5
    tokens = tokens_for(n, rig.page)
    idx = rig.fill(n, seed=7)
    assert rig.backup(idx, tokens) == n * rig.page
    assert len(page_files(tmp_path)) == n
    # the hit query stops where the stored chain ends; the prefetch loads it all
    hit, loaded, idx2 = rig.prefetch([*tokens, *tokens_for(2, rig.page, start=1)])
    assert (hit, loaded) == (n * rig.page, n * rig.page)
    assert rig.pages(idx2, n) == rig.pages(idx, n)
    geom = rig.storage.geometry
    assert geom is not None and geom.layout == layout
    assert all(p.stat().st_size == HEADER_SIZE + geom.page_bytes for p in page_files(tmp_path))
    # kvsdk's events and metrics for this level
    events = rig.storage.take_events()
    stored = [e for e in events if e.kind is EventKind.STORED]
    assert sum(len(e.keys) for e in stored) == n and stored[0].tier == 1
    assert stored[0].info == tuple(rig.hashes(tokens))  # annotated with SGLang's page hashes
    assert counter(rig, "kvsdk_stored_bytes_total", tier=1) == n * geom.page_bytes
    assert counter(rig, "kvsdk_loaded_bytes_total", tier=1) == n * geom.page_bytes
    assert counter(rig, "kvsdk_lookup_hits_total", tier=1) == n


def test_partial_hit_on_a_diverging_suffix(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, layout="layer_first")
    tokens = tokens_for(6, rig.page)
    idx = rig.fill(6, seed=1)
    assert rig.backup(idx, tokens) == 6 * rig.page
    # same first 3 pages, then a different token: the chain diverges there
    other = [*tokens[: 3 * rig.page], 7, *tokens[3 * rig.page + 1 :]]
    hit, loaded, idx2 = rig.prefetch(other)
    assert (hit, loaded) == (3 * rig.page, 3 * rig.page)
    assert rig.pages(idx2, 3) == rig.pages(idx, 3)


def test_miss_and_unknown_keys(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path)
    assert rig.prefetch(tokens_for(4, rig.page)) == (0, 0, None)
    storage = rig.storage
    hashes = rig.hashes(tokens_for(3, rig.page))
    assert storage.batch_exists(hashes) == 0 and not storage.exists(hashes[0])
    assert storage.batch_get_v1(hashes, rig.pool.alloc(3 * rig.page)) == [False] * 3
    assert storage.get(hashes[0], rig.host.get_dummy_flat_data_page()) is None
    assert counter(rig, "kvsdk_lookup_misses_total") >= 3


def test_hits_after_a_gap_do_not_count(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path)
    tokens = tokens_for(4, rig.page)
    hashes = rig.hashes(tokens)
    idx = rig.fill(4)
    assert rig.storage.batch_set_v1(hashes, idx) == [True] * 4
    assert rig.storage.batch_exists(hashes) == 4
    assert rig.storage.batch_exists([hashes[0], "ab" * 32, *hashes[2:]]) == 1


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_generic_path_and_v1_read_each_others_pages(
    make_rig: Any, tmp_path: Path, layout: str
) -> None:
    v1 = kvsdk_rig(make_rig, tmp_path, layout=layout)
    generic = kvsdk_rig(make_rig, tmp_path, layout=layout, interface_v1=0)
    assert generic.ctrl.page_get_func.__name__ == "_generic_page_get"
    assert generic.storage.namespace == v1.storage.namespace
    a, b = tokens_for(3, v1.page, start=100), tokens_for(3, v1.page, start=500)
    idx_a, idx_b = v1.fill(3, seed=2), generic.fill(3, seed=3)
    assert v1.backup(idx_a, a) == 3 * v1.page  # zero-copy write
    assert generic.backup(idx_b, b) == 3 * v1.page  # generic write (get_data_page)
    _, loaded, got = generic.prefetch(a)  # generic read of v1 pages
    assert loaded == 3 * v1.page and generic.pages(got, 3) == v1.pages(idx_a, 3)
    _, loaded, got = v1.prefetch(b)  # zero-copy read of generic pages
    assert loaded == 3 * v1.page and v1.pages(got, 3) == generic.pages(idx_b, 3)


@pytest.mark.parametrize(
    "geometry",
    [{}, {"mla": True}, {"heads": 8, "head_dim": 128, "page": 16, "layers": 2}],
    ids=["mha", "mla", "mha-32KiB-regions"],
)
def test_region_by_region_copies_match_the_vectorized_ones(
    make_rig: Any, tmp_path: Path, geometry: dict[str, Any]
) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, layout="layer_first", **geometry)
    storage = rig.storage
    storage.tiers[0].__class__ = DiskWithoutScatterGather  # the staging paths
    pool = storage.pool
    assert pool is not None and pool.rows is not None  # SGLang's pools take the vectorized path
    a, b = rig.hashes(tokens_for(3, rig.page, start=1)), rig.hashes(tokens_for(3, rig.page, 50))
    idx_a, idx_b = rig.fill(3, seed=1), rig.fill(3, seed=2)
    assert storage.batch_set_v1(a, idx_a) == [True] * 3  # vectorized gather
    rows, pool.rows = pool.rows, None
    assert storage.batch_set_v1(b, idx_b) == [True] * 3  # region by region
    got = rig.pool.alloc(3 * rig.page)
    assert storage.batch_get_v1(a, got) == [True] * 3  # region by region
    assert rig.pages(got, 3) == rig.pages(idx_a, 3)
    pool.rows = rows
    assert storage.batch_get_v1(b, got) == [True] * 3  # vectorized scatter
    assert rig.pages(got, 3) == rig.pages(idx_b, 3)
    assert pool.local.staging is not None


class DiskWithoutScatterGather(DiskBackend):
    """kvsdk's disk tier with the base class's copying ``put_parts`` /
    ``get_into_parts``: the adapter then stages multi-region pages itself."""

    supports_scatter_gather = False
    put_parts = Backend.put_parts
    get_into_parts = Backend.get_into_parts


@pytest.mark.parametrize(
    ("mla", "layout"),
    [(False, "layer_first"), (False, "page_first"), (False, "page_head"), (True, "layer_first")],
)
def test_multi_region_pages_move_without_staging(
    make_rig: Any, tmp_path: Path, mla: bool, layout: str
) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, layout=layout, mla=mla)
    storage = rig.storage
    assert storage.geometry is not None and storage.geometry.regions > 1
    n = 4
    tokens = tokens_for(n, rig.page)
    idx = rig.fill(n, seed=3)
    assert rig.backup(idx, tokens) == n * rig.page
    hit, loaded, idx2 = rig.prefetch(tokens)
    assert hit == loaded == n * rig.page and rig.pages(idx2, n) == rig.pages(idx, n)
    # straight between the host pool's regions and the files: no staging buffer
    assert storage.pool is not None and getattr(storage.pool.local, "staging", None) is None
    for key, page in zip(storage.chunk_keys(rig.hashes(tokens)), rig.pages(idx, n)):
        (path,) = [p for p in page_files(tmp_path) if p.name == key.hex() + ".kvc"]
        assert path.read_bytes()[HEADER_SIZE:] == page  # the page's regions, in address order


def test_corrupt_region_of_a_multi_region_page_is_a_miss(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, layout="layer_first")
    storage = rig.storage
    assert storage.geometry is not None
    tokens = tokens_for(3, rig.page)
    idx = rig.fill(3, seed=8)
    assert rig.backup(idx, tokens) == 3 * rig.page
    bad = storage.chunk_keys(rig.hashes(tokens))[1]
    (path,) = [p for p in page_files(tmp_path) if p.name == bad.hex() + ".kvc"]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # inside the page's last region
    path.write_bytes(bytes(raw))
    got = rig.pool.alloc(3 * rig.page)
    assert storage.batch_get_v1(rig.hashes(tokens), got) == [True, False, True]
    assert rig.pages(got, 1) == rig.pages(idx, 1)
    assert not path.exists() and counter(rig, "kvsdk_corrupt_chunks_total", tier=1) == 1


def test_base_hicache_controller(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, controller="base", layout="page_first_direct")
    assert type(rig.ctrl).__name__ == "HiCacheController"
    tokens = tokens_for(4, rig.page)
    idx = rig.fill(4, seed=9)
    assert rig.backup(idx, tokens) == 4 * rig.page
    hit, loaded, idx2 = rig.prefetch(tokens)
    assert hit == loaded == 4 * rig.page and rig.pages(idx2, 4) == rig.pages(idx, 4)


def test_models_and_layouts_never_share_pages(make_rig: Any, tmp_path: Path) -> None:
    a = kvsdk_rig(make_rig, tmp_path, model_name=tiny_model_dir(1))
    tokens = tokens_for(2, a.page)
    assert a.backup(a.fill(2), tokens) == 2 * a.page
    b = kvsdk_rig(make_rig, tmp_path, model_name=tiny_model_dir(2))
    c = kvsdk_rig(make_rig, tmp_path, model_name=tiny_model_dir(1), layout="layer_first")
    assert a.prefetch(tokens, load=False)[0] == 2 * a.page
    assert b.prefetch(tokens, load=False)[0] == 0
    assert c.prefetch(tokens, load=False)[0] == 0
    namespaces = {r.storage.namespace.hex for r in (a, b, c) if r.storage.namespace}
    assert len(namespaces) == 3


# -- integrity and failures -------------------------------------------------------------------


def test_corrupt_page_is_a_miss_and_removed(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path)
    tokens = tokens_for(4, rig.page)
    hashes = rig.hashes(tokens)
    idx = rig.fill(4, seed=4)
    assert rig.backup(idx, tokens) == 4 * rig.page
    rig.storage.take_events()
    bad = rig.storage.chunk_keys(hashes[2:3])[0]
    (path,) = [p for p in page_files(tmp_path) if p.name == bad.hex() + ".kvc"]
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    # the query still sees 4 pages; the verified read stops at the corrupt one
    hit, loaded, idx2 = rig.prefetch(tokens)
    assert (hit, loaded) == (4 * rig.page, 2 * rig.page)
    assert rig.pages(idx2, 2) == rig.pages(idx, 2)
    assert counter(rig, "kvsdk_corrupt_chunks_total", tier=1) == 1
    removed = [e for e in rig.storage.take_events() if e.kind is EventKind.REMOVED]
    assert [k for e in removed for k in e.keys] == [bad]
    assert removed[0].info == (hashes[2],)
    assert not path.exists()
    assert rig.prefetch(tokens, load=False)[0] == 2 * rig.page


def test_broken_disk_tier_degrades_to_misses(make_rig: Any, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file where the cache directory should be")
    rig = kvsdk_rig(make_rig, not_a_dir)
    tokens = tokens_for(3, rig.page)
    assert rig.backup(rig.fill(3), tokens) == 0  # refused, no exception
    assert rig.prefetch(tokens) == (0, 0, None)
    assert counter(rig, "kvsdk_allocation_failures_total") == 3


def test_redis_that_is_down_degrades_to_misses(make_rig: Any, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    redis = {"backend": "redis", "url": url, "socket_timeout": 0.2, "connect_timeout": 0.2}
    alone = kvsdk_rig(make_rig, tmp_path, config={"tiers": [redis]})
    tokens = tokens_for(3, alone.page)
    start = time.monotonic()
    assert alone.backup(alone.fill(3), tokens) == 0
    assert alone.prefetch(tokens) == (0, 0, None)
    assert time.monotonic() - start < 10
    # below a working disk tier, a dead redis costs nothing but its own writes
    chain = kvsdk_rig(
        make_rig, tmp_path, config={"tiers": [{"backend": "disk", "path": str(tmp_path)}, redis]}
    )
    idx = chain.fill(3, seed=5)
    assert chain.backup(idx, tokens) == 3 * chain.page
    hit, loaded, idx2 = chain.prefetch(tokens)
    assert hit == loaded == 3 * chain.page and chain.pages(idx2, 3) == chain.pages(idx, 3)


def test_redis_tier_round_trip_and_promotion_to_disk(
    make_rig: Any, tmp_path: Path, redis_server: Any
) -> None:
    config = {
        "tiers": [
            {"backend": "cpu", "capacity": "64MiB"},  # skipped: SGLang's host pool is the host tier
            {"backend": "disk", "path": str(tmp_path)},
            {"backend": "redis", "url": redis_server.url},
        ]
    }
    rig = kvsdk_rig(make_rig, tmp_path, config=config, layout="layer_first")
    assert [type(t).__name__ for t in rig.storage.tiers] == ["DiskBackend", "RedisBackend"]
    tokens = tokens_for(4, rig.page)
    idx = rig.fill(4, seed=6)
    assert rig.backup(idx, tokens) == 4 * rig.page
    rig.storage.tiers[0].clear()  # the disk tier loses everything: redis still has it
    hit, loaded, idx2 = rig.prefetch(tokens)
    assert hit == loaded == 4 * rig.page and rig.pages(idx2, 4) == rig.pages(idx, 4)
    assert counter(rig, "kvsdk_loaded_bytes_total", tier=2) > 0
    deadline = time.monotonic() + 10
    while len(page_files(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # promotion back up to disk runs in the background
    assert len(page_files(tmp_path)) == 4


# -- processes --------------------------------------------------------------------------------


def test_second_process_reads_what_the_first_stored(make_rig: Any, tmp_path: Path) -> None:
    config = disk_config(tmp_path)
    rig = kvsdk_rig(make_rig, tmp_path, config=config, layout="page_head")
    tokens = tokens_for(5, rig.page)
    idx = rig.fill(5, seed=11)
    assert rig.backup(idx, tokens) == 5 * rig.page
    answer = run_worker({"mode": "read", "config": config, "layout": "page_head", "pages": 5})
    assert (answer["hit"], answer["loaded"]) == (5 * rig.page, 5 * rig.page)
    assert [bytes.fromhex(p) for p in answer["read"]] == rig.pages(idx, 5)


def test_two_tp_ranks_agree_on_the_shorter_hit(tmp_path: Path) -> None:
    config = disk_config(tmp_path)
    port = free_port()
    specs = [
        {"mode": "tp", "rank": r, "world": 2, "port": port, "config": config, "pages": 6,
         "store_pages": stored, "seed": 20}
        for r, stored in ((0, 6), (1, 4))
    ]  # fmt: skip
    answers = join_workers(start_workers(specs))
    for a in answers:
        assert a["local_hit_pages"] == (6 if a["rank"] == 0 else 4)
        assert (a["hit"], a["loaded"]) == (16, 16)  # 4 pages of 4 tokens on both ranks
        assert a["read"] == a["written"][:4]
    assert answers[0]["written"][0] != answers[1]["written"][0]  # each rank its own shard
    assert len({p.parent.parent.name for p in page_files(tmp_path)}) == 2  # two namespaces


# -- MLA: one writer rank ---------------------------------------------------------------------


def storage_config(**kw: Any) -> HiCacheStorageConfig:
    base: dict[str, Any] = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=tiny_model_dir(),
    )  # fmt: skip
    base.update(kw)
    return HiCacheStorageConfig(**base)


def test_mla_pages_are_shared_by_ranks_and_written_by_one(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path, mla=True, layout="page_first")
    extra = kvsdk_extra_config(disk_config(tmp_path))
    ranks = [
        KVSDKStorage(
            storage_config(tp_rank=r, tp_size=2, is_mla_model=True, extra_config=extra), {}
        )
        for r in (0, 1)
    ]
    try:
        ranks[0].register_mem_pool_host(rig.host)
        ranks[1].register_mem_pool_host(rig.pool)  # a HostPoolGroup: its KV pool is used
        assert ranks[0].namespace == ranks[1].namespace  # rank-replicated KV: one copy
        assert [s.is_writer for s in ranks] == [True, False]
        hashes = rig.hashes(tokens_for(2, rig.page))
        idx = rig.fill(2, seed=3)
        assert ranks[1].batch_set_v1(hashes, idx) == [True, True]  # not the writer: no-op
        assert ranks[1].batch_exists(hashes) == 0
        assert ranks[0].batch_set_v1(hashes, idx) == [True, True]
        assert ranks[1].batch_exists(hashes) == 2
        got = rig.pool.alloc(2 * rig.page)
        assert ranks[1].batch_get_v1(hashes, got) == [True, True]
        assert rig.pages(got, 2) == rig.pages(idx, 2)
    finally:
        for s in ranks:
            s.close()


# -- configuration and housekeeping -----------------------------------------------------------


def test_config_errors_are_one_clear_sentence(tmp_path: Path) -> None:
    def build(config: Any) -> Any:
        cfg = storage_config(extra_config=kvsdk_extra_config(config))
        return StorageBackendFactory.create_backend("dynamic", cfg, None)

    with pytest.raises(ConfigError, match="needs at least one storage tier"):
        build({"tiers": [{"backend": "cpu", "capacity": "1GiB"}]})
    with pytest.raises(ConfigError, match="needs at least one storage tier"):
        build({})  # kvsdk's default config is host memory only
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capasity: unknown key"):
        build({"tiers": [{"backend": "disk", "path": str(tmp_path), "capasity": "1GiB"}]})
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.backend: got 'cpu'"):
        build({"tiers": [{"backend": "cpu"}, {"backend": "disk", "path": "x"}, {"backend": "cpu"}]})
    with pytest.raises(ConfigError, match="not found"):
        build(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="config: missing"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config={
            k: v for k, v in kvsdk_extra_config(None).items() if k != "config"}), None)  # fmt: skip
    example = Path(__file__).resolve().parents[3] / "examples" / "sglang" / "kvsdk-disk.yaml"
    _, tiers = load_storage_config(example)
    assert [t.backend for t in tiers] == ["disk"] and tiers[0].options.io_threads == 2
    yaml_file = tmp_path / "kvsdk.yaml"
    yaml_file.write_text(f"tiers:\n  - backend: disk\n    path: {tmp_path}\n")
    storage = build(str(yaml_file))
    assert isinstance(storage, KVSDKStorage) and len(storage._tier_configs) == 1
    storage.close()


def test_clear_is_scoped_to_the_instance_that_flushes(make_rig: Any, tmp_path: Path) -> None:
    """Two SGLang instances on one disk directory; one flushes its cache
    (SGLang's ``clear_storage_backend``): it misses its old pages from then on,
    the other still hits all of them, and no page file is deleted. The flushed
    instance stores and hits new pages; the full wipe stays ``kvsdk clear``."""
    config = disk_config(tmp_path)
    writer = kvsdk_rig(make_rig, tmp_path, config=config)
    other = kvsdk_rig(make_rig, tmp_path, config=config)
    tokens = tokens_for(3, writer.page)
    idx = writer.fill(3, seed=5)
    assert writer.backup(idx, tokens) == 3 * writer.page
    files = page_files(tmp_path)
    assert len(files) == 3
    hashes = writer.hashes(tokens)
    assert other.storage.batch_exists(hashes) == 3 and writer.storage.batch_exists(hashes) == 3
    writer.storage.take_events()
    assert writer.ctrl.clear_storage_backend()
    assert writer.storage.batch_exists(hashes) == 0
    assert writer.prefetch(tokens) == (0, 0, None)
    assert any(e.kind is EventKind.CLEARED for e in writer.storage.take_events())
    assert page_files(tmp_path) == files  # the shared tier keeps every entry
    hit, loaded, got = other.prefetch(tokens)  # the other instance is not affected
    assert (hit, loaded) == (3 * other.page, 3 * other.page)
    assert other.pages(got, 3) == writer.pages(idx, 3)
    # after its flush the instance stores and hits again, in its own epoch
    assert writer.backup(idx, tokens) == 3 * writer.page
    assert len(page_files(tmp_path)) == 6
    hit, loaded, got = writer.prefetch(tokens)
    assert (hit, loaded) == (3 * writer.page, 3 * writer.page)
    assert writer.pages(got, 3) == writer.pages(idx, 3)


def test_sglang_storage_metrics_and_prometheus(make_rig: Any, tmp_path: Path) -> None:
    port = free_port()
    config = {**disk_config(tmp_path), "metrics": {"prometheus_port": port}}
    rig = kvsdk_rig(make_rig, tmp_path, config=config)
    rig.storage.storage_config.enable_storage_metrics = True
    tokens = tokens_for(3, rig.page)
    assert rig.backup(rig.fill(3), tokens) == 3 * rig.page
    rig.prefetch(tokens)
    stats = rig.storage.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert rig.storage.get_stats().backup_pgs == []  # drained
    kv = rig.storage.kvsdk_stats()
    assert kv["tiers"]["1:DiskBackend"]["puts"] == 3
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'kvsdk_stored_bytes_total{tier="1"}' in text
