"""Build tiers and stores from a validated config, and own their life.

:class:`StoreHandle` is what an adapter holds: opening it starts the
Prometheus exporter (when configured), builds the event tracker with the
plugins' ``kvsdk_publish_events`` hook as its sink and fires
``kvsdk_startup``; it then builds the store (vLLM: a :class:`TieredStore`)
or the tier chain (SGLang: a :class:`TierChain`); ``close`` closes them and
fires ``kvsdk_shutdown``, exactly once. :func:`build_store` is a bare store
(no exporter, no lifecycle hooks) for tests and benchmarks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

from kvsdk import plugins_manager
from kvsdk.admission import SecondSight
from kvsdk.backend import Backend, HostTier, SlabRequest, TierContext
from kvsdk.config import ConfigError, KVSDKConfig, TierConfig
from kvsdk.events import EventSink, EventTracker, KVEvent
from kvsdk.keys import Namespace
from kvsdk.metrics import Metrics, start_prometheus_exporter
from kvsdk.slab import SlabError
from kvsdk.store.chain import TierChain
from kvsdk.store.tiered import TieredStore
from kvsdk.trust import mask_url, note_trust
from kvsdk.types import Locality

_exporters: dict[int, Metrics] = {}
_exporters_lock = threading.Lock()


def build_tiers(
    config: KVSDKConfig,
    namespace: Namespace,
    chunk_bytes: int,
    *,
    slab: SlabRequest | None = None,
) -> list[Backend]:
    """Every tier of ``config``, in order (closed again if one fails to build).
    ``slab``: the host tier's slab is that shared-memory segment, which the
    engine's worker processes attach to (see :mod:`kvsdk.slab`)."""
    backends = plugins_manager.backends()
    policy = plugins_manager.eviction_policies()[config.eviction]
    tiers: list[Backend] = []
    try:
        for i, tier in enumerate(config.tiers):
            ctx = TierContext(
                namespace_fp=namespace.public_fp,
                namespace_hex=namespace.hex,
                chunk_bytes=chunk_bytes,
                tier_index=i,
                policy_factory=partial(policy),
                slab=slab,
                frame_key=namespace.frame_key,
            )
            try:
                tiers.append(backends[tier.backend](tier.options, ctx))
            except (ValueError, OSError, SlabError) as exc:
                raise ConfigError(f"tiers[{i}] ({tier.backend}): {exc}") from None
    except BaseException:
        for t in tiers:
            t.close()
        raise
    note_trust(namespace.secret, (t.name for t in tiers if t.locality is not Locality.PROCESS))
    return tiers


def describe_tier(tier: TierConfig) -> str:
    """Where a configured tier keeps its data, for the start-up log (never a
    password: a URL is masked)."""
    parts = []
    for name in ("path", "url", "capacity"):
        value = getattr(tier.options, name, None)
        if value is not None:
            parts.append(f"{name}={mask_url(str(value)) if name == 'url' else value}")
    return ", ".join(parts) or "its defaults"


def plugin_event_sink() -> EventSink:
    """The plugins' ``kvsdk_publish_events`` hook as an event sink (plugins
    registered later are called too)."""
    hook = plugins_manager.plugin_manager().hook.kvsdk_publish_events

    def publish(events: Sequence[KVEvent]) -> None:
        hook(events=events)

    return publish


def build_store(
    config: KVSDKConfig,
    namespace: Namespace,
    chunk_bytes: int,
    *,
    metrics: Metrics | None = None,
    events: EventTracker | None = None,
    slab: SlabRequest | None = None,
) -> TieredStore:
    """A :class:`TieredStore` over the tiers of ``config`` (its events go to the
    plugins' sinks unless ``events`` is given). No exporter, no lifecycle
    hooks: an adapter opens a :class:`StoreHandle` instead."""
    host, *lower = build_tiers(config, namespace, chunk_bytes, slab=slab)
    assert isinstance(host, HostTier)
    if events is None:
        events = EventTracker(
            enabled=config.events.enabled,
            max_pending=config.events.max_pending,
            sink=plugin_event_sink(),
        )
    return TieredStore(
        host,
        lower,
        events=events,
        metrics=metrics or Metrics(),
        min_lookups=config.admission.min_lookups,
        second_sight=_second_sight(config, [host, *lower]),
        tenant_quotas=config.tenant_quotas,
        tail_share=config.prompt_tail_share,
        io_threads=config.io_threads,
        lookup_wait_s=config.lookup_wait_ms / 1000,
        promotion_wait_s=config.promotion_wait_ms / 1000,
        store_backoff=config.store_backoff,
    )


def _second_sight(config: KVSDKConfig, tiers: Sequence[Backend]) -> SecondSight | None:
    """The admission ``config`` asks for over ``tiers`` (see ``AdmissionConfig.policy``)."""
    policy = config.admission.policy
    if policy == "auto":  # a slower tier may be read by other engines (or after a restart)
        alone = len(tiers) == 1 and tiers[0].locality is Locality.PROCESS
        policy = "second_sight" if alone else "all"
    if policy != "second_sight":
        return None
    host = tiers[0]
    assert isinstance(host, HostTier)
    return SecondSight(memory=4 * host.num_slots + 1024)


class StoreHandle:
    """One owner of a store's life (see the module docstring).

    ``port_offset`` is added to ``metrics.prometheus_port`` (one port per rank
    on a node); one exporter serves a port per process, with the metrics of
    the first handle that opened it.
    """

    def __init__(self, config: KVSDKConfig, *, port_offset: int = 0) -> None:
        self.config = config
        self.metrics = Metrics()
        port = config.metrics.prometheus_port
        if port is not None:
            port += port_offset
            with _exporters_lock:
                if port in _exporters:
                    self.metrics = _exporters[port]
                else:
                    try:
                        start_prometheus_exporter(self.metrics, port)
                    except OSError as exc:
                        raise ConfigError(
                            f"metrics.prometheus_port: cannot serve on port {port}"
                            + (f" (the configured port + {port_offset})" if port_offset else "")
                            + f": {exc.strerror or exc}"
                        ) from None
                    _exporters[port] = self.metrics
        self.events = EventTracker(
            enabled=config.events.enabled,
            max_pending=config.events.max_pending,
            sink=plugin_event_sink(),
        )
        self.store: TieredStore | None = None
        self.chain: TierChain | None = None
        self._closed = False
        plugins_manager.plugin_manager().hook.kvsdk_startup(config=config)

    def build_store(
        self, namespace: Namespace, chunk_bytes: int, *, slab: SlabRequest | None = None
    ) -> TieredStore:
        """The vLLM path: host tier and slower tiers behind a :class:`TieredStore`.
        If it cannot be built, the handle is closed and the error raised."""
        assert self.store is None and not self._closed
        try:
            self.store = build_store(
                self.config,
                namespace,
                chunk_bytes,
                metrics=self.metrics,
                events=self.events,
                slab=slab,
            )
        except BaseException:
            self.close()
            raise
        self.store.warm_up()
        return self.store

    def build_chain(
        self,
        namespace: Namespace,
        item_bytes: int,
        *,
        config: KVSDKConfig | None = None,
        track_keys: int = 0,
    ) -> TierChain:
        """The storage-level path: the tiers of ``config`` (default: the handle's)
        as a :class:`TierChain` with a background copier for copy-ups. A chain
        built before is closed first (a new namespace replaces it)."""
        assert not self._closed
        if self.chain is not None:
            self.chain.close()
            self.chain = None
        tiers = build_tiers(config or self.config, namespace, item_bytes)
        self.chain = TierChain(
            tiers,
            metrics=self.metrics,
            events=self.events,
            item_bytes=item_bytes,
            track_keys=track_keys,
            copy_up=True,
            store_backoff=(config or self.config).store_backoff,
        )
        return self.chain

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the store or chain, then fire ``kvsdk_shutdown``; once."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.store is not None:
                self.store.shutdown()
            if self.chain is not None:
                self.chain.close()
        finally:
            plugins_manager.plugin_manager().hook.kvsdk_shutdown()
