"""Turn a PoolSnapshot into one RGBA image: a cell per physical block, no per-block Python loop.

The grid widget hands this image to a single pyqtgraph ImageItem; drawing thousands of graphics items would not
keep up with a 65,536-block pool. Each cell is a square tile of ``tile`` pixels: a one-pixel gap, an outline ring
(shown for shared or selected blocks) and an interior. When tiles are wide enough the interior shows one vertical
stripe per token slot, filled slots bright and empty ones dark, so a partially filled tail block looks partial;
on large pools the interior is a single colour whose brightness follows the fill level.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvstream.views import NO_CHANGE_RECORD, BlockState, ChangeRecord, PoolSnapshot

from ..model import palette

COLOR_BY = ("owner", "ref_count", "fill", "age", "state", "group")
COLOR_BY_LABELS = {
    "owner": "Owner", "ref_count": "Ref count", "fill": "Fill level", "age": "Age since last access", "state": "State",
    "group": "KV cache group",
}
AGE_HORIZON = 256  # steps; older blocks get the darkest age colour
MAX_IMAGE_SIDE = 512  # pixels across the grid image, about its size on screen: no aliasing, fast on large pools
MIN_STRIPE_TILE = 8  # below this tile size slots are not drawn one by one
MIN_OUTLINE_TILE = 6  # below this, gaps and outlines would alias when scaled to the screen: shade instead


def as_u32(rgba: np.ndarray) -> np.ndarray:
    """View RGBA uint8 [..., 4] as one uint32 per pixel (same bytes, so the image stays RGBA in memory)."""
    return np.ascontiguousarray(rgba, np.uint8).view(np.uint32)[..., 0]


def as_rgba(pixels: np.ndarray) -> np.ndarray:
    """The inverse of as_u32."""
    return np.ascontiguousarray(pixels, np.uint32)[..., None].view(np.uint8)


# Colours as one uint32 per pixel, computed once rather than on every redraw.
_FREE32 = as_u32(palette.FREE[None])[0]
_UNOWNED32 = as_u32(palette.UNOWNED[None])[0]
_BACKGROUND32 = as_u32(palette.BACKGROUND[None])[0]
_STATE_USED32 = as_u32(palette.STATE_USED[None])[0]
_STATE_CACHED32 = as_u32(palette.STATE_CACHED[None])[0]
_REF32 = as_u32(palette.REF_COLOURS)
_REF_CACHED32 = as_u32(palette.scale(palette.REF_COLOURS[:1], 1.6))[0]
_SHADES32 = as_u32(palette.ramp(np.linspace(0.0, 1.0, 256)))  # 256 steps are plenty for the eye
_REF32.setflags(write=False)
_SHADES32.setflags(write=False)


@dataclass(frozen=True)
class GridGeometry:
    """How blocks are laid out: block id b sits at row b // cols, column b % cols, in a tile of tile x tile pixels."""

    num_blocks: int
    block_size: int
    cols: int
    rows: int
    tile: int

    @property
    def striped(self) -> bool:
        return self.tile >= MIN_STRIPE_TILE

    def block_at(self, x: float, y: float) -> int | None:
        """Block under a point given in cell units (x across, y down), or None outside the pool."""
        if x < 0 or y < 0:
            return None
        col, row = int(x), int(y)
        if col >= self.cols or row >= self.rows:
            return None
        block = row * self.cols + col
        return block if block < self.num_blocks else None

    def cell_origin(self, block_id: int) -> tuple[int, int]:
        """(x, y) of the top-left corner of a block's cell, in cell units."""
        return block_id % self.cols, block_id // self.cols


def grid_geometry(num_blocks: int, block_size: int, pixels_per_cell: float | None = None) -> GridGeometry:
    """A near-square layout with a power-of-two column count (64 -> 8 x 8, 65,536 -> 256 x 256).

    ``pixels_per_cell``: how wide a cell is on screen now; the tile is then no wider than that (see
    :func:`fitting_tile`), so the image is never shrunk on screen."""
    cols = 1
    while cols * cols < num_blocks:
        cols *= 2
    rows = -(-num_blocks // cols)
    tile = int(np.clip(MAX_IMAGE_SIDE // cols, 2, 32))
    if pixels_per_cell is not None:
        tile = fitting_tile(pixels_per_cell, tile)
    return GridGeometry(num_blocks, block_size, cols, rows, tile)


def fitting_tile(pixels_per_cell: float, largest: int) -> int:
    """The tile for cells drawn ``pixels_per_cell`` wide: at most that many pixels, at most ``largest``, at least 2.

    Qt scales the image to the screen without smoothing; shrinking it drops whole pixel rows and columns, and the
    one-pixel gaps between cells went with them (free cells merged into larger blocks on a small screen: docs/gui.md).
    Enlarging only repeats pixels, which keeps every gap."""
    if not np.isfinite(pixels_per_cell):
        return int(largest)
    return int(max(2, min(int(largest), int(pixels_per_cell))))


def pixels_per_cell(box) -> float:
    """Screen pixels across one cell of a view box now (a pyqtgraph ViewBox in cell units; inf before it has a
    size). The grid and the contiguous view both ask it, to keep their image tiles no wider than their cells."""
    rect, width = box.viewRect(), box.width()
    return width / rect.width() if rect.width() > 0 and width > 0 else float("inf")


def wanted_tile(geometry: GridGeometry | None, box) -> int | None:
    """The image tile for ``geometry``'s cells at their size on screen in ``box`` (None before the first
    layout)."""
    if geometry is None:
        return None
    return grid_geometry(geometry.num_blocks, geometry.block_size, pixels_per_cell(box)).tile


def needs_new_tile(geometry: GridGeometry | None, box) -> bool:
    """After a zoom or a resize: whether the cells' screen size calls for another tile (draw again)."""
    return geometry is not None and geometry.tile != wanted_tile(geometry, box)


@lru_cache(maxsize=8)
def tile_masks(geometry: GridGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-pixel roles inside one tile: gap [T, T], ring [T, T], slot index per column [T], stripe separator [T].

    Computed once per layout (the grid redraws with the same one many times); the arrays are read-only.
    """
    t = geometry.tile
    outlined = t >= MIN_OUTLINE_TILE
    gap = np.zeros((t, t), bool)
    if outlined:
        gap[0, :] = True
        gap[:, 0] = True
    ring = np.zeros((t, t), bool)
    if outlined:
        width = max(1, t // 12)
        ring[1:1 + width, 1:] = True
        ring[t - width:, 1:] = True
        ring[1:, 1:1 + width] = True
        ring[1:, t - width:] = True
    inner = t - 1 if outlined else t
    x = np.arange(t) - (1 if outlined else 0)
    slot = np.floor(np.clip(x, 0, None) * geometry.block_size / max(inner, 1)).astype(np.int32)
    separator = np.zeros(t, bool)
    if geometry.striped and inner / geometry.block_size >= 3:
        separator[1:] = slot[1:] != slot[:-1]
        separator[:2] = False
    for mask in (gap, ring, slot, separator):
        mask.setflags(write=False)
    return gap, ring, slot, separator


def _column(values, ids: np.ndarray | None, dtype=None) -> np.ndarray:
    """A per-block array of a snapshot as numpy, whole or at blocks ``ids``."""
    a = np.asarray(values, dtype)
    return a if ids is None else a[ids]


def block_colours(snapshot: PoolSnapshot, color_by: str = "owner", selected_conversation: int | None = None,
                  ids: np.ndarray | None = None, book=None,
                  group_filter: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Colour of a filled slot and of an empty slot for every block (or for blocks ``ids``), RGBA uint8
    [blocks, 4] each. ``group_filter``: blocks of other KV cache groups are dimmed."""
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")

    state = _column(snapshot.state, ids)
    n = len(state)
    used = state == BlockState.USED
    cached = state == BlockState.CACHED
    if color_by == "owner":
        book = palette.ColourBook() if book is None else book  # None: this snapshot's own (a hand-built view)
        book.observe(snapshot)  # live conversations get distinct colours before any is looked up
        owner = _column(snapshot.owner, ids)
        has_owner = owner >= 0
        live32, muted32 = palette.owner_colours32(np.maximum(owner, 0), book)
        owners = np.where(has_owner, live32, _UNOWNED32)
        muted = np.where(has_owner, muted32, _UNOWNED32)
        fill32 = np.where(used, owners, np.where(cached, muted, _FREE32))
    elif color_by == "ref_count":
        ref = np.clip(_column(snapshot.ref_count, ids), 0, len(palette.REF_COLOURS) - 1)
        fill32 = np.where(used, _REF32[ref], np.where(cached, _REF_CACHED32, _FREE32))
    elif color_by in ("fill", "age"):
        if color_by == "fill":
            level = _column(snapshot.num_filled, ids, np.float32) / snapshot.block_size
        else:
            age = np.maximum(snapshot.step_id - _column(snapshot.last_access, ids, np.int64), 0)
            level = 1.0 - np.log1p(age) / np.log1p(AGE_HORIZON)
        index = np.clip(np.round(level * 255), 0, 255).astype(np.intp)
        fill32 = np.where(used | cached, _SHADES32[index], _FREE32)
    elif color_by == "group":
        from .groups import group_fill32
        fill32 = group_fill32(snapshot, ids)
    else:  # state
        fill32 = np.where(used, _STATE_USED32, np.where(cached, _STATE_CACHED32, _FREE32))
    fill = np.ascontiguousarray(fill32, np.uint32).view(np.uint8).reshape(n, 4)
    if group_filter is not None:
        from .groups import outside_group
        other = outside_group(snapshot, group_filter, ids)
        fill[other] = palette.scale(fill[other], palette.DIM_LEVEL)
    if selected_conversation is not None:
        member = cached & (_column(snapshot.owner, ids) == selected_conversation)  # what it left in the cache
        table = snapshot.block_tables.get(selected_conversation, ())
        if table:
            if ids is None:
                member[np.asarray(table, np.int64)] = True
            else:
                member |= np.isin(ids, np.asarray(table, np.int64))
        outside = (used | cached) & ~member
        fill[outside] = palette.scale(fill[outside], palette.DIM_LEVEL)
    empty = palette.scale(fill, palette.EMPTY_SLOT_LEVEL)
    empty32 = empty.view(np.uint32)[:, 0]
    empty32[~(used | cached)] = _FREE32
    return fill, empty


def _tile_rows(snapshot: PoolSnapshot, color_by: str, selected_conversation: int | None, geo: GridGeometry,
               ids: np.ndarray | None, book=None, group_filter: int | None = None) -> np.ndarray:
    """The pixel row every tile repeats (before outlines and gaps), uint32 [blocks, tile], for every block or for
    blocks ``ids``; may be a read-only broadcast."""
    fill, empty = block_colours(snapshot, color_by, selected_conversation, ids, book, group_filter)
    num_filled = _column(snapshot.num_filled, ids, np.int32)
    _, _, slot, separator = tile_masks(geo)
    fill32, empty32 = as_u32(fill), as_u32(empty)  # one uint32 per pixel: 4x fewer elements to move
    if geo.striped:
        profile = np.where(slot[None, :] < num_filled[:, None], fill32[:, None], empty32[:, None])  # [n, T]
        if separator.any():  # slot boundaries in blocks that hold tokens; a free block is one plain cell (its
            holding = _column(snapshot.state, ids) != BlockState.FREE  # stripes read as cell gaps at block size 8)
            lines = profile[holding][:, separator]  # [holding blocks, separator columns]
            profile[np.ix_(holding, separator)] = as_u32(palette.scale(as_rgba(lines), 0.7))
        return profile
    # empty + (fill - empty) * filled / block_size, in integers (exact, and faster than float32: docs/performance.md)
    bs = snapshot.block_size
    wide = np.uint16 if bs <= 257 else np.uint32  # 255 * block_size must fit
    k = np.clip(num_filled, 0, bs).astype(wide)[:, None]
    shade = ((empty.astype(wide) * (bs - k) + fill.astype(wide) * k) // bs).astype(np.uint8)
    return np.broadcast_to(as_u32(shade)[:, None], (len(num_filled), geo.tile))


def _rings(snapshot: PoolSnapshot, selected_block: int | None, ids: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(whether each block, or each of ``ids``, has an outline: shared or selected; the outline's RGBA)."""
    ring_on = _column(snapshot.ref_count, ids) > 1
    ring_colour = np.zeros((len(ring_on), 4), np.uint8)
    ring_colour[ring_on] = palette.SHARED_RING
    if selected_block is not None and 0 <= selected_block < snapshot.num_blocks:
        at = [selected_block] if ids is None else np.nonzero(ids == selected_block)[0]
        ring_on[at] = True
        ring_colour[at] = palette.SELECTED_RING
    return ring_on, ring_colour


def snapshot_to_rgba(snapshot: PoolSnapshot, color_by: str = "owner", selected_conversation: int | None = None,
                     selected_block: int | None = None, geometry: GridGeometry | None = None,
                     book=None, group_filter: int | None = None) -> np.ndarray:
    """The grid image, uint8 [rows * tile, cols * tile, 4], row-major with block 0 at the top left; owners in
    ``book``'s colours (the source's colour book; None: a book of this snapshot alone, for a hand-built view)."""
    geo = geometry or grid_geometry(snapshot.num_blocks, snapshot.block_size)
    n, t = snapshot.num_blocks, geo.tile
    profile = _tile_rows(snapshot, color_by, selected_conversation, geo, None, book, group_filter)
    gap, ring, _, _ = tile_masks(geo)
    ring_on, ring_colour = _rings(snapshot, selected_block, None)

    background = _BACKGROUND32
    cells = geo.rows * geo.cols
    if cells > n:  # blocks past the end of the pool are drawn as background
        profile = np.concatenate([profile, np.full((cells - n, t), background, np.uint32)])
    image = np.empty((geo.rows, t, geo.cols, t), np.uint32)  # [row, y in tile, col, x in tile]: memory order
    image[...] = profile.reshape(geo.rows, 1, geo.cols, t)  # every pixel row of a tile repeats the profile
    if ring_on.any():
        ids = np.nonzero(ring_on)[0]
        r, c = ids // geo.cols, ids % geo.cols
        if ring.any():
            ry, rx = np.nonzero(ring)
            image[r[:, None], ry[None, :], c[:, None], rx[None, :]] = as_u32(ring_colour[ids])[:, None]
        else:  # tiles too small for an outline: lighten shared blocks instead
            lit = palette.mix(as_rgba(image[r, :, c, :]), ring_colour[ids][:, None, None, :], 0.45)
            image[r, :, c, :] = as_u32(lit)
    if gap.any():
        image[:, 0] = background
        image[:, :, :, 0] = background
    return image.reshape(geo.rows * t, geo.cols * t).view(np.uint8).reshape(geo.rows * t, geo.cols * t, 4)


def redraw_blocks(image: np.ndarray, snapshot: PoolSnapshot, ids: np.ndarray, color_by: str = "owner",
                  selected_conversation: int | None = None, selected_block: int | None = None,
                  geometry: GridGeometry | None = None, book=None, group_filter: int | None = None) -> None:
    """Draw blocks ``ids`` of ``snapshot`` into ``image`` (an image of :func:`snapshot_to_rgba` with the same
    geometry), in place, exactly as snapshot_to_rgba would draw them: a step of a large pool changes a few hundred
    blocks of tens of thousands, and drawing only those costs a fraction of the whole image (figures:
    docs/performance.md, "Grid")."""
    geo = geometry or grid_geometry(snapshot.num_blocks, snapshot.block_size)
    t = geo.tile
    ids = np.asarray(ids, np.int64)
    if not len(ids):
        return
    tiles = np.empty((len(ids), t, t), np.uint32)
    tiles[...] = _tile_rows(snapshot, color_by, selected_conversation, geo, ids, book, group_filter)[:, None, :]
    gap, ring, _, _ = tile_masks(geo)
    ring_on, ring_colour = _rings(snapshot, selected_block, ids)
    if ring_on.any():
        on = np.nonzero(ring_on)[0]
        if ring.any():
            ry, rx = np.nonzero(ring)
            tiles[on[:, None], ry[None, :], rx[None, :]] = as_u32(ring_colour[on])[:, None]
        else:
            tiles[on] = as_u32(palette.mix(as_rgba(tiles[on]), ring_colour[on][:, None, None, :], 0.45))
    if gap.any():
        tiles[:, 0] = _BACKGROUND32
        tiles[:, :, 0] = _BACKGROUND32
    pixels = image.view(np.uint32).reshape(geo.rows, t, geo.cols, t)
    span = np.arange(t)
    pixels[(ids // geo.cols)[:, None, None], span[None, :, None], (ids % geo.cols)[:, None, None],
           span[None, None, :]] = tiles


PARTIAL_LIMIT = 1 / 8  # redraw only the changed blocks while they are at most this share of the pool


DRAWN_FROM = ("state", "num_filled", "ref_count", "owner")  # the per-block arrays a tile is drawn from (age colours
# read last_access too, and are drawn whole)


def changed_blocks(before: PoolSnapshot, after: PoolSnapshot, color_by: str,
                   selected_conversation: int | None = None,
                   changes: ChangeRecord = NO_CHANGE_RECORD) -> np.ndarray | None:
    """Ids of the blocks whose tile may be drawn differently in ``after`` than in ``before`` (same pool size), under
    ``color_by``, ``selected_conversation`` and the colour book as it is now; None when every block may (age colours
    move with every step; the selected conversation's table changed, and its blocks are drawn bright, the others
    dim), or when that is too many to be worth drawing one by one.

    ``changes``: what the frame says changed since ``changes.base`` (FeedFrame.changes). When that base is
    ``before``, these are the blocks its record names, and no array is compared; otherwise (a frame of history, a
    stream that sends no record, frames the grid did not draw in between) the arrays are compared."""
    if color_by == "age" or before.num_blocks != after.num_blocks or before.block_size != after.block_size:
        return None
    if selected_conversation is not None and \
            before.block_tables.get(selected_conversation) != after.block_tables.get(selected_conversation):
        return None
    changed = np.zeros(after.num_blocks, bool)
    if changes.base is before and changes.block_masks is not None:
        for name in DRAWN_FROM:
            changed |= changes.block_masks[name]
    else:
        for name in DRAWN_FROM:
            old, new = np.asarray(getattr(before, name)), np.asarray(getattr(after, name))
            if old is not new:
                changed |= old != new
    ids = np.nonzero(changed)[0]
    return ids if len(ids) <= PARTIAL_LIMIT * after.num_blocks else None
