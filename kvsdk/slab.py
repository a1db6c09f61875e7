"""Host slabs shared by the halves of one engine in one process.

An engine's scheduler side (which owns the tiered store's index) and its
worker side (which copies blocks) can be built separately, in either order;
both ask for the slab by name with the same geometry and get the same tensor.
Pinned when CUDA is available (true DMA for device copies).
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_slabs: dict[str, torch.Tensor] = {}


def host_slab(
    name: str, num_slots: int, slot_bytes: int, *, pin: bool | None = None
) -> torch.Tensor:
    """The ``uint8 (num_slots, slot_bytes)`` slab called ``name``, created on first use."""
    with _lock:
        slab = _slabs.get(name)
        if slab is None:
            if pin is None:
                pin = torch.cuda.is_available()
            slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin)
            _slabs[name] = slab
        elif tuple(slab.shape) != (num_slots, slot_bytes):
            raise ValueError(
                f"host slab {name!r} exists as {tuple(slab.shape)}, asked for "
                f"{(num_slots, slot_bytes)}: both sides of an engine must use the same config"
            )
        return slab


def release_slab(name: str) -> None:
    with _lock:
        _slabs.pop(name, None)
