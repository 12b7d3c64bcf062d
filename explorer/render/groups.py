"""KV cache groups in the grid's colours: one colour per group, the same in the grid, its legend and the filter.

The grid's "group" colour mode and its group filter call these; which group a block serves is decided by
:func:`explorer.model.groups.block_groups` alone.
"""
from __future__ import annotations

import numpy as np

from kvstream.views import BlockState, PoolSnapshot

from ..model import palette
from ..model.groups import block_groups

GROUP_COLOURS = np.array([  # group 0 (full attention in a mixed model), 1, 2, ...: far apart, none a state colour
    [64, 190, 200, 255], [245, 150, 50, 255], [190, 110, 235, 255], [120, 210, 90, 255], [235, 90, 130, 255],
], np.uint8)
GROUP_COLOURS.setflags(write=False)
_GROUP32 = np.ascontiguousarray(GROUP_COLOURS).view(np.uint32)[:, 0]
_FREE32 = np.ascontiguousarray(palette.FREE[None]).view(np.uint32)[0, 0]
_UNKNOWN32 = np.ascontiguousarray(palette.UNOWNED[None]).view(np.uint32)[0, 0]


def group_fill32(snapshot: PoolSnapshot, ids: np.ndarray | None = None) -> np.ndarray:
    """uint32 pixel per block (or per block of ``ids``): its group's colour, cached blocks muted, a block no table
    names (cached, group not known) grey, free blocks the free colour."""
    groups = block_groups(snapshot)
    state = np.asarray(snapshot.state)
    if ids is not None:
        groups, state = groups[ids], state[ids]
    colour = _GROUP32[np.maximum(groups, 0).astype(np.intp) % len(_GROUP32)]
    colour = np.where(groups >= 0, colour, _UNKNOWN32)
    cached = state == BlockState.CACHED
    if cached.any():
        muted = palette.cached(np.ascontiguousarray(colour[cached]).view(np.uint8).reshape(-1, 4))
        colour = colour.copy()
        colour[cached] = np.ascontiguousarray(muted).view(np.uint32)[:, 0]
    return np.where(state == BlockState.FREE, _FREE32, colour).astype(np.uint32)


def outside_group(snapshot: PoolSnapshot, group: int, ids: np.ndarray | None = None) -> np.ndarray:
    """bool per block (or per block of ``ids``): holds KV but is not ``group``'s (the filter dims these)."""
    groups = block_groups(snapshot)
    state = np.asarray(snapshot.state)
    if ids is not None:
        groups, state = groups[ids], state[ids]
    return (state != BlockState.FREE) & (groups != group)
