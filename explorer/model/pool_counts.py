"""How many blocks of a pool view are used, cached and free, counted once per view for every panel that says so.

The grid's header and the status bar both name these numbers. They used to disagree while live ("36 used, 476
cached" above the grid, "pool 54/512 used · 458 cached" below it): the header counted the frame on view, the status
bar a frame it had read up to half a second before. Both now show :func:`pool_counts` of the same view, counted
from its per-block states, which every source has (a source's memory figures may be missing: a view without them
said only "512 blocks").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstream.views import BlockState, PoolSnapshot


@dataclass(frozen=True)
class PoolCounts:
    """Blocks by state, and the slots of used blocks, in one view."""

    num_blocks: int  # blocks in the pool
    used: int  # blocks some block table refers to
    cached: int  # blocks nobody refers to that keep a reusable full prefix block
    free: int  # blocks holding nothing reusable
    filled_slots: int  # token slots of used blocks holding K/V (a shared block counted once)
    allocated_slots: int  # used * block_size

    @property
    def used_percent(self) -> float:
        return 100.0 * self.used / max(self.num_blocks, 1)

    def header_text(self, step_id: int) -> str:
        """The grid header's words."""
        return (f"step {step_id:,} · {self.used} used, {self.cached} cached, {self.free} free of "
                f"{self.num_blocks} blocks")

    def status_text(self) -> str:
        """The status bar's words."""
        return (f"pool {self.used}/{self.num_blocks} used ({self.used_percent:.0f}%) · {self.cached} cached · "
                f"{self.filled_slots}/{self.allocated_slots} slots filled")


_last: tuple[PoolSnapshot, PoolCounts] | None = None  # the view counted last and its counts (views are immutable)


def pool_counts(snapshot: PoolSnapshot) -> PoolCounts:
    """The counts of ``snapshot`` (counted once; the header and the status bar ask for the same view)."""
    global _last
    if _last is not None and _last[0] is snapshot:
        return _last[1]
    state = np.asarray(snapshot.state)
    by_state = np.bincount(state.astype(np.intp, copy=False), minlength=3) if state.size else np.zeros(3, np.intp)
    used_mask = state == BlockState.USED
    filled = int(np.asarray(snapshot.num_filled)[used_mask].sum())
    used = int(by_state[BlockState.USED])
    counts = PoolCounts(num_blocks=int(snapshot.num_blocks), used=used, cached=int(by_state[BlockState.CACHED]),
                        free=int(by_state[BlockState.FREE]), filled_slots=filled,
                        allocated_slots=used * int(snapshot.block_size))
    _last = (snapshot, counts)
    return counts
