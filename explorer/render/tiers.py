"""One lower tier (host memory, disk) as an RGBA image, on the device grid's colour rules.

The tier is made into a pool of CACHED / FREE slots (:func:`explorer.model.tiers.tier_snapshot`) and drawn by the
grid's own renderer, so owner colours, the cached mute and the free colour are the device grid's exactly, and a
262,144-slot host tier is one vectorised image like a 65,536-block pool.
"""
from __future__ import annotations

import numpy as np

from kvstream.views import PoolSnapshot

from .grid import GridGeometry, snapshot_to_rgba
from ..model.tiers import ContentBook, tier_snapshot


def tier_rgba(snapshot: PoolSnapshot, name: str, book: ContentBook, color_by: str = "owner",
              selected_slot: int | None = None, geometry: GridGeometry | None = None) -> np.ndarray:
    """uint8 [rows * tile, cols * tile, 4]: tier ``name`` of ``snapshot``, slot 0 at the top left."""
    return snapshot_to_rgba(tier_snapshot(snapshot, name, snapshot.tiers[name], book), color_by,
                            selected_block=selected_slot, geometry=geometry)
