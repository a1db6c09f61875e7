"""The tiered store (host tier + slower tiers) the planner asks."""

from kvsdk.store.tiered import StorePlan, TieredStore

__all__ = ["StorePlan", "TieredStore"]
