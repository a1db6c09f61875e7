"""Build a :class:`TieredStore` from a validated config."""

from __future__ import annotations

from functools import partial

from kvsdk import plugins_manager
from kvsdk.backend import Backend, HostTier, TierContext
from kvsdk.config import ConfigError, KVSDKConfig
from kvsdk.events import EventTracker
from kvsdk.keys import Namespace
from kvsdk.metrics import Metrics, start_prometheus_exporter
from kvsdk.slab import SlabError
from kvsdk.store.tiered import TieredStore

_exporters: dict[int, Metrics] = {}


def build_tiers(
    config: KVSDKConfig,
    namespace: Namespace,
    chunk_bytes: int,
    *,
    slab_name: str | None = None,
    slab_regions: int = 1,
) -> list[Backend]:
    backends = plugins_manager.backends()
    policy = plugins_manager.eviction_policies()[config.eviction]
    tiers: list[Backend] = []
    try:
        for i, tier in enumerate(config.tiers):
            ctx = TierContext(
                namespace_fp=namespace.fingerprint,
                namespace_hex=namespace.hex,
                chunk_bytes=chunk_bytes,
                tier_index=i,
                policy_factory=partial(policy),
                extra={"slab_name": slab_name, "slab_regions": slab_regions} if slab_name else {},
            )
            try:
                tiers.append(backends[tier.backend](tier.options, ctx))
            except (ValueError, OSError, SlabError) as exc:
                raise ConfigError(f"tiers[{i}] ({tier.backend}): {exc}") from None
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def build_store(
    config: KVSDKConfig,
    namespace: Namespace,
    chunk_bytes: int,
    *,
    metrics: Metrics | None = None,
    slab_name: str | None = None,
    slab_regions: int = 1,
) -> TieredStore:
    """``slab_name``: the host tier's slab is the shared-memory segment of
    that name, with ``slab_regions`` rank regions per slot, which an engine's
    worker processes attach to (see :mod:`kvsdk.slab`)."""
    host, *lower = build_tiers(
        config, namespace, chunk_bytes, slab_name=slab_name, slab_regions=slab_regions
    )
    assert isinstance(host, HostTier)
    metrics = metrics or Metrics()
    port = config.metrics.prometheus_port
    if port is not None:
        if port in _exporters:  # one exporter per port and process; it serves the first store
            metrics = _exporters[port]
        else:
            start_prometheus_exporter(metrics, port)
            _exporters[port] = metrics
    plugins_manager.plugin_manager().hook.kvsdk_startup(config=config)
    return TieredStore(
        host,
        lower,
        events=EventTracker(enabled=config.events.enabled, max_pending=config.events.max_pending),
        metrics=metrics,
        min_lookups=config.admission.min_lookups,
        tenant_quotas=config.tenant_quotas,
        io_threads=config.io_threads,
    )
