"""Colours shared by the grid, the legend and the conversation table, so one conversation looks the same everywhere.

Live conversations must differ clearly from one another (issue 13: ids 3 and 11 were both pink under a pure
function of the id). So colours are handed out, not computed: :class:`ColourBook` gives each conversation, when it
is first seen live, the first of :data:`LIVE_COLOURS` (sixteen hues picked far apart in CIELAB, and far from the
free, cached, shared and selected marks) that no other live conversation holds. A conversation keeps its colour
for its whole life; once it has finished its colour may go to a newcomer (its cached blocks are drawn muted). Past
sixteen live conversations, 32 more picked far apart (:data:`MORE_COLOURS`), then a golden-ratio walk around the hue
circle. Ids the book has
never seen live (a hand-built view, a recording opened at its end) use their id (modulo 1024) as the palette index.
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
CACHED_MIX = 0.30  # a cached block: this much of its last owner's colour, the rest grey (then see below)
CACHED_DARKER = 12.0  # a cached block is at least this much darker (CIELAB L*) than its owner's used blocks...
CACHED_OVER_FREE = 12.0  # ...and at least this much lighter than a free block (when both cannot hold, this wins)
DIM_LEVEL = 0.40  # blocks outside the selected conversation
REF_COLOURS = np.array([  # ref count 0 (unused), 1, 2, 3, 4+
    [58, 60, 70, 255], [70, 150, 200, 255], [250, 160, 40, 255], [235, 70, 60, 255], [220, 60, 220, 255],
], np.uint8)

_GOLDEN = 0.618033988749895

MAX_TRACKED_ID = 1 << 20  # ids the book keeps a dense entry for (8 MiB at most); larger ones use the fallback
FALLBACK_PERIOD = 1024  # an id the book has not seen live uses palette entry id % this

LIVE_COLOURS = np.array([  # the first sixteen palette entries: min CIELAB distance 32 (40 among the first 12)
    [237, 149, 47], [116, 84, 252], [51, 255, 133], [255, 51, 173], [47, 123, 237], [255, 51, 65], [43, 217, 194],
    [212, 237, 142], [255, 153, 153], [187, 255, 51], [51, 201, 255], [241, 51, 255], [235, 153, 255],
    [255, 207, 153], [168, 176, 248], [217, 65, 105],
], np.uint8)  # every one at L* 48 or more, so its cached form can be darker than it and still lighter than free
# (a deep blue, 51 51 255, and a violet, 136 65 217, were darker than their grey cached forms: cached looked brighter
# than used, and the two read as one blue)
MORE_COLOURS = np.array([  # entries 16-47: each the farthest (CIELAB) from all before it and from the marks, L* >= 48;
    # min distance 21. The hue walk that followed entry 15 put entry 16 at distance 7 from it: a crowd of 21 live
    # conversations showed two in the same colour.
    [45, 135, 0], [120, 120, 45], [0, 255, 0], [45, 135, 90], [180, 105, 150], [150, 165, 0], [15, 120, 180],
    [240, 90, 0], [165, 195, 165], [180, 90, 45], [180, 60, 195], [60, 195, 0], [0, 195, 120], [255, 195, 240],
    [0, 135, 150], [180, 135, 105], [255, 255, 105], [165, 255, 255], [165, 255, 195], [120, 105, 180],
    [135, 210, 90], [225, 195, 90], [255, 120, 180], [165, 195, 225], [255, 0, 0], [255, 255, 0], [210, 180, 180],
    [180, 90, 90], [135, 180, 105], [150, 105, 225], [165, 45, 255], [255, 150, 105],
], np.uint8)
PICKED_COLOURS = np.concatenate([LIVE_COLOURS, MORE_COLOURS])  # the palette's first 48 entries


class ColourBook:
    """Which palette entry each conversation holds: distinct among the live ones, kept for a conversation's life.

    :meth:`observe` is cheap (one pass over the live conversations) and idempotent; every panel that draws
    conversation colours calls it with the snapshot it draws, so all of them agree whichever runs first."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._slot = np.full(0, -1, np.int64)  # conversation id -> palette index, -1: never seen live
        self._seen: tuple[object, int] | None = None  # (snapshot, its version) observed last: asked again, a no-op
        self.sorts = 0  # times conversations were sorted (tests read it)
        self.version = getattr(self, "version", 0) + 1  # changes whenever an entry is handed out (drawers compare it)

    def observe(self, snapshot) -> None:
        """Give every live conversation of ``snapshot`` a palette entry no other live one holds, and a stopped one
        never seen before an entry no live one holds (so a table row never looks like a live conversation's).

        The grid, the table, the detail and the contiguous view each observe the snapshot they draw, several times
        a frame: the work is done once per snapshot (the same object at the same version; the object is held, so
        its id cannot be reused by another)."""
        seen = self._seen
        if seen is not None and seen[0] is snapshot and seen[1] == getattr(snapshot, "version", None):
            return
        self._seen = (snapshot, getattr(snapshot, "version", None))
        self.sorts += 1
        order = sorted((c.arrival_step, c.conversation_id, c.is_live) for c in snapshot.conversations
                       if 0 <= c.conversation_id < MAX_TRACKED_ID)
        if not order:
            return
        self._grow(max(cid for _, cid, _ in order) + 1)
        live = [cid for _, cid, is_live in order if is_live]
        taken, newcomers = set(), []
        for cid in live:  # first come keeps its entry; a duplicate gives it up
            slot = int(self._slot[cid])
            if slot >= 0 and slot not in taken:
                taken.add(slot)
            else:
                newcomers.append(cid)
        newcomers += [cid for _, cid, is_live in order if not is_live and self._slot[cid] < 0]
        free = (s for s in range(len(order) + len(taken) + 1) if s not in taken)
        for cid in newcomers:
            self._slot[cid] = next(free)
        if newcomers:
            self.version += 1

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Palette index of each id (int64)."""
        ids = np.asarray(ids, np.int64)
        known = np.full(ids.shape, -1, np.int64)
        inside = (ids >= 0) & (ids < len(self._slot))
        known[inside] = self._slot[ids[inside]]
        return np.where(known >= 0, known, ids % FALLBACK_PERIOD)

    def _grow(self, size: int) -> None:
        if size > len(self._slot):
            grown = np.full(max(size, 2 * len(self._slot), 64), -1, np.int64)
            grown[:len(self._slot)] = self._slot
            self._slot = grown


_table = np.zeros((0, 4), np.uint8)  # colour of palette index 0..len-1, grown on demand
_muted = np.zeros((0, 4), np.uint8)  # the cached-block colours of the same indices, grown with _table
_table32 = np.zeros(0, np.uint32)  # the same two tables, one uint32 (an RGBA pixel) per entry: a gather of 65,536
_muted32 = np.zeros(0, np.uint32)  # of these is several times faster than of [n, 4] rows


def _ensure(slots: np.ndarray) -> np.ndarray:
    """``slots`` as int64, with both colour tables grown to cover them."""
    global _table, _muted, _table32, _muted32
    slots = np.asarray(slots, dtype=np.int64)
    top = int(slots.max()) + 1 if slots.size else 0
    if top > len(_table):
        _table = np.ascontiguousarray(_compute_colours(np.arange(max(top, 2 * len(_table), 64))))
        _muted = np.ascontiguousarray(cached(_table))
        _table32, _muted32 = _table.view(np.uint32)[:, 0], _muted.view(np.uint32)[:, 0]
    return slots


def conversation_colours(ids: np.ndarray, book: ColourBook) -> np.ndarray:
    """RGBA uint8 [n, 4] for non-negative conversation ids: each id's palette entry in ``book`` (conversation ids are
    per source, so each source the window watches has its own book, PoolSource.colours)."""
    slots = _ensure(book.slots(ids))  # before reading the table: it may grow
    return _table[slots]


def owner_colours32(ids: np.ndarray, book: ColourBook) -> tuple[np.ndarray, np.ndarray]:
    """For each id, as uint32 pixels (the grid's form): its :func:`conversation_colours` entry, and the muted colour
    of a cached block it last filled (a hint of that conversation). The colour book is asked once, not once per lookup
    (figures: docs/performance.md, "Grid")."""
    slots = _ensure(book.slots(ids))
    return _table32[slots], _muted32[slots]


def _compute_colours(slots: np.ndarray) -> np.ndarray:
    """Palette entries: LIVE_COLOURS and MORE_COLOURS first, then a golden-ratio hue walk, alternating saturation and
    value."""
    ids = slots
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
    listed = ids < len(PICKED_COLOURS)
    rgba[listed, :3] = PICKED_COLOURS[ids[listed]]
    return rgba


def conversation_colour(conversation_id: int, book: ColourBook) -> tuple[int, int, int]:
    """One conversation's colour as an (r, g, b) tuple, for Qt widgets."""
    r, g, b, _ = conversation_colours(np.array([conversation_id]), book)[0]
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


def lightness(rgba: np.ndarray) -> np.ndarray:
    """CIELAB L* (0 black .. 100 white) of sRGB colours [..., 3 or 4]: how light a colour looks."""
    y = _linear(rgba) @ np.array([0.2126, 0.7152, 0.0722])
    return np.where(y > (6 / 29) ** 3, 116 * np.cbrt(y) - 16, y * (29 / 3) ** 3)


def cielab(rgba: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of sRGB colours [..., 3 or 4], [..., 3]: Euclidean distances there are perceptual distances."""
    xyz = _linear(rgba) @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                                    [0.0193, 0.1192, 0.9505]]).T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def _linear(rgba: np.ndarray) -> np.ndarray:
    c = np.asarray(rgba, np.float64)[..., :3] / 255
    return np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)


def cached(rgba: np.ndarray) -> np.ndarray:
    """The colour of a cached block whose last owner's colour is ``rgba`` [..., 4] uint8: mostly grey with a hint of
    the owner, and never lighter than the owner's used blocks (a grey mix of a dark blue once looked brighter than
    the blue itself): its L* is CACHED_DARKER under the owner's, but CACHED_OVER_FREE over a free block's."""
    rgba = np.asarray(rgba, np.uint8)
    muted = mix(rgba, UNOWNED, CACHED_MIX)
    target = np.maximum(np.minimum(lightness(muted), lightness(rgba) - CACHED_DARKER),
                        lightness(FREE) + CACHED_OVER_FREE)
    # scaling sRGB values by s scales luminance by about s ** 2.2; L* -> luminance is exact
    want = np.where(target > 8, ((target + 16) / 116) ** 3, target / (29 / 3) ** 3)
    have = np.maximum(_linear(muted) @ np.array([0.2126, 0.7152, 0.0722]), 1e-6)
    factor = (want / have) ** (1 / 2.2)
    out = muted.copy()
    out[..., :3] = np.clip(np.round(muted[..., :3] * factor[..., None]), 0, 255).astype(np.uint8)
    return out


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
