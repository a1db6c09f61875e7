"""The tiered store (host tier + slower tiers) the planner asks, the tier chain
below the host tier, and the handle that owns a store's life."""

from kvsdk.store.chain import TierChain
from kvsdk.store.factory import StoreHandle
from kvsdk.store.tiered import StorePlan, TieredStore

__all__ = ["StoreHandle", "StorePlan", "TierChain", "TieredStore"]
