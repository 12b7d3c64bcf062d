"""Colours shared by the grid, the legend and the conversation table, so one conversation looks the same everywhere.

Conversation colours come from a golden-ratio walk around the hue circle: a conversation keeps its colour for its
whole life (it depends only on its id) and neighbouring ids get clearly different hues.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

BACKGROUND = np.array([24, 24, 30, 255], np.uint8)  # gaps between cells
FREE = np.array([58, 60, 70, 255], np.uint8)  # a free block
UNOWNED = np.array([120, 120, 128, 255], np.uint8)  # a cached block whose last owner is unknown
SHARED_RING = np.array([255, 255, 255, 255], np.uint8)  # outline of a block with ref count > 1
SELECTED_RING = np.array([255, 212, 0, 255], np.uint8)  # outline of the selected block
STATE_USED = np.array([80, 200, 120, 255], np.uint8)
STATE_CACHED = np.array([90, 130, 210, 255], np.uint8)
EMPTY_SLOT_LEVEL = 0.30  # an empty slot of a used block: its colour at this brightness
CACHED_MIX = 0.35  # a cached block: this much of its last owner's colour, the rest grey
DIM_LEVEL = 0.40  # blocks outside the selected conversation
REF_COLOURS = np.array([  # ref count 0 (unused), 1, 2, 3, 4+
    [58, 60, 70, 255], [70, 150, 200, 255], [250, 160, 40, 255], [235, 70, 60, 255], [220, 60, 220, 255],
], np.uint8)

_GOLDEN = 0.618033988749895


_table = np.zeros((0, 4), np.uint8)  # colours of ids 0..len-1, grown on demand
_muted = np.zeros((0, 4), np.uint8)  # the cached-block colours of the same ids, grown with _table


def _ensure(ids: np.ndarray) -> np.ndarray:
    """``ids`` as int64, with both colour tables grown to cover them."""
    global _table, _muted
    ids = np.asarray(ids, dtype=np.int64)
    top = int(ids.max()) + 1 if ids.size else 0
    if top > len(_table):
        _table = _compute_colours(np.arange(max(top, 2 * len(_table), 64)))
        _muted = mix(_table, UNOWNED, CACHED_MIX)
    return ids


def conversation_colours(ids: np.ndarray) -> np.ndarray:
    """RGBA uint8 [n, 4] for non-negative conversation ids, looked up in a table computed once per id."""
    ids = _ensure(ids)  # before reading the table: it may grow
    return _table[ids]


def cached_colours(ids: np.ndarray) -> np.ndarray:
    """The muted colour of a cached block whose last owner is each id (a hint of that conversation)."""
    ids = _ensure(ids)  # before reading the table: it may grow
    return _muted[ids]


def _compute_colours(ids: np.ndarray) -> np.ndarray:
    """Vectorised HSV -> RGB on a golden-ratio hue walk, alternating saturation and value."""
    hue = (ids * _GOLDEN + 0.08) % 1.0
    sat = np.where(ids % 2 == 0, 0.62, 0.48)
    val = np.where(ids % 3 == 0, 0.97, 0.88)
    h6 = hue * 6.0
    sector = np.floor(h6).astype(np.int64) % 6
    frac = h6 - np.floor(h6)
    p = val * (1 - sat)
    q = val * (1 - sat * frac)
    t = val * (1 - sat * (1 - frac))
    r = np.choose(sector, [val, q, p, p, t, val])
    g = np.choose(sector, [t, val, val, q, p, p])
    b = np.choose(sector, [p, p, t, val, val, q])
    rgba = np.empty((ids.shape[0], 4), np.uint8)
    rgba[:, 0] = np.round(r * 255)
    rgba[:, 1] = np.round(g * 255)
    rgba[:, 2] = np.round(b * 255)
    rgba[:, 3] = 255
    return rgba


def conversation_colour(conversation_id: int) -> tuple[int, int, int]:
    """One conversation's colour as an (r, g, b) tuple, for Qt widgets."""
    r, g, b, _ = conversation_colours(np.array([conversation_id]))[0]
    return int(r), int(g), int(b)


def scale(rgba: np.ndarray, level: float) -> np.ndarray:
    """Darken (level < 1) colours [..., 4], keeping alpha.

    uint8 colours go through a 256-entry lookup table (several times faster than float arithmetic on a large
    pool, and the same bytes, since the table holds exactly that arithmetic for every possible channel value)."""
    if rgba.dtype != np.uint8:
        out = rgba.copy()
        out[..., :3] = (rgba[..., :3].astype(np.float32) * level).astype(np.uint8)
        return out
    out = _scale_table(level)[rgba]
    out[..., 3:] = rgba[..., 3:]
    return out


@lru_cache(maxsize=16, typed=True)
def _scale_table(level) -> np.ndarray:
    """channel value -> that value scaled by ``level``, for every uint8 (read-only)."""
    table = (np.arange(256, dtype=np.float32) * level).astype(np.uint8)
    table.setflags(write=False)
    return table


def mix(rgba: np.ndarray, other: np.ndarray, amount: float) -> np.ndarray:
    """``amount`` of ``rgba`` and the rest of ``other``."""
    out = rgba.astype(np.float32) * amount + other.astype(np.float32) * (1.0 - amount)
    return out.astype(np.uint8)


def ramp(values: np.ndarray, low=(40, 40, 110), mid=(40, 170, 150), high=(250, 230, 70)) -> np.ndarray:
    """A dark-blue -> teal -> yellow colour ramp for values in [0, 1] (fill level, age), RGBA uint8."""
    v = np.clip(np.asarray(values, np.float32), 0.0, 1.0)[:, None]
    low, mid, high = (np.array(c, np.float32) for c in (low, mid, high))
    first = low + (mid - low) * np.clip(v * 2, 0, 1)
    second = mid + (high - mid) * np.clip(v * 2 - 1, 0, 1)
    rgb = np.where(v < 0.5, first, second)
    out = np.full((v.shape[0], 4), 255, np.uint8)
    out[:, :3] = rgb.astype(np.uint8)
    return out


def hex_colour(rgba) -> str:
    """'#rrggbb' for a colour row, for style sheets and HTML."""
    return "#%02x%02x%02x" % tuple(int(c) for c in rgba[:3])
