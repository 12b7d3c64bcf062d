"""The contiguous allocator's memory drawn beside the paged grid, at the same scale, with its summary line.

The memory is the paged pool's size (``num_blocks * block_size`` slots) laid out exactly like the grid: rows of
cells of ``block_size`` slots, so the two pictures line up cell for cell and their pan and zoom can be linked. A
cell here is not a block (a contiguous allocator has none), only the same number of slots. Colours:

- a filled slot: its conversation's colour (the same as in the grid and the table);
- a reserved but empty slot: that colour, dark (the part of the max-length reservation not generated yet);
- a gap: free slots stranded between reservations (external fragmentation), hatched in red and the free colour
  (a pattern no conversation colour can be mistaken for);
- free memory after the last reservation: the grid's free colour.
A bright line marks where each reservation starts when cells are wide enough to show slots.

One ImageItem fed one RGBA array, as the grid; the image is rebuilt only when the layout changed.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.views import PoolSnapshot

from ..model import palette
from ..model.contiguous import GAP_SLOT, ContiguousAllocator, ContiguousLayout
from ..render import grid
from ..render.grid import GridGeometry, as_rgba, as_u32, grid_geometry, tile_masks
from .grid_view import FIT_PAD
from .painting import image_view

GAP = np.array([214, 58, 48, 255], np.uint8)  # free slots between reservations: hatched with palette.FREE
HATCH = 4  # pixels per period of the gap hatching (diagonal: half GAP, half FREE)
RUN_START = np.array([235, 235, 240, 255], np.uint8)  # the first pixel column of a reservation's first slot
LEGEND = (("filled", None), ("reserved but empty", None), ("gap between reservations", GAP), ("free", palette.FREE))


def slot_colours(layout: ContiguousLayout, book=None) -> np.ndarray:
    """One uint32 (RGBA bytes) per slot of the contiguous memory: what each slot is drawn as (two slice
    assignments per reservation, never a Python loop over slots). ``book``: the source's colour book (None: a
    fresh one, for a layout drawn alone)."""
    colours = np.full(layout.num_slots, as_u32(palette.FREE[None])[0], np.uint32)
    if not layout.reservations:
        return colours
    ids = np.array([r.conversation_id for r in layout.reservations], np.int64)
    bright = palette.conversation_colours(ids, palette.ColourBook() if book is None else book)  # [runs, 4]
    bright32 = as_u32(bright).tolist()
    dark32 = as_u32(palette.scale(bright, palette.EMPTY_SLOT_LEVEL)).tolist()
    colours[:max(r.end for r in layout.reservations)] = as_u32(GAP[None])[0]  # below the top, free = gap
    for r, fill, dark in zip(layout.reservations, bright32, dark32):
        colours[r.start:r.start + r.filled] = fill
        colours[r.start + r.filled:r.end] = dark
    return colours


def contiguous_rgba(layout: ContiguousLayout, geometry: GridGeometry, book=None) -> np.ndarray:
    """The picture, uint8 [rows * tile, cols * tile, 4], laid out as the paged grid of the same pool."""
    geo, bs, t = geometry, layout.block_size, geometry.tile
    n = geo.num_blocks  # cells of block_size slots: as many as the pool has blocks
    gap, _, slot, separator = tile_masks(geo)
    colours = slot_colours(layout, book).reshape(n, bs)  # [cell, slot in cell]
    is_gap = (layout.slot_roles() == GAP_SLOT).reshape(n, bs)  # [cell, slot in cell]
    if geo.striped:
        profile = colours[:, slot]  # [cell, x in tile]: each pixel column shows its slot
        starts = np.array([r.start for r in layout.reservations], np.int64)
        if starts.size:  # the first pixel column of each reservation's first slot
            inside = np.nonzero(~gap[-1])[0]  # pixel columns that are not the gap between cells
            first_x = inside[np.minimum(np.searchsorted(slot[inside], np.arange(bs)), len(inside) - 1)]  # [slot]
            cells, slots = starts // bs, starts % bs
            profile[cells, first_x[slots]] = as_u32(RUN_START[None])[0]
        if separator.any():
            profile[:, separator] = as_u32(palette.scale(as_rgba(profile[:, separator]), 0.85))
        gap_profile = is_gap[:, slot]  # [cell, x in tile]
    else:  # a few pixels per cell: the mean colour of its slots
        total = as_rgba(colours).sum(axis=1, dtype=np.uint32)  # [cell, 4]: channel sums over the cell's slots
        profile = np.broadcast_to(as_u32((total // bs).astype(np.uint8))[:, None], (n, t))
        gap_profile = np.broadcast_to(is_gap.mean(axis=1)[:, None] >= 0.5, (n, t))  # mostly gap: hatched
    cells = geo.rows * geo.cols
    background = as_u32(palette.BACKGROUND[None])[0]
    if cells > n:
        profile = np.concatenate([profile, np.full((cells - n, t), background, np.uint32)])
        gap_profile = np.concatenate([gap_profile, np.zeros((cells - n, t), bool)])
    image = np.empty((geo.rows, t, geo.cols, t), np.uint32)  # [row, y in tile, col, x in tile]
    image[...] = profile.reshape(geo.rows, 1, geo.cols, t)
    if gap_profile.any():  # hatch the gaps: diagonal stripes of GAP and FREE over the whole picture
        height, width = geo.rows * t, geo.cols * t
        stripes = ((np.arange(height)[:, None] + np.arange(width)[None, :]) % HATCH) < HATCH // 2  # [y, x]
        stripes = stripes.reshape(geo.rows, t, geo.cols, t)
        hatched = np.broadcast_to(gap_profile.reshape(geo.rows, 1, geo.cols, t), image.shape) & ~stripes
        image[hatched] = as_u32(palette.FREE[None])[0]
    if gap.any():
        image[:, 0] = background
        image[:, :, :, 0] = background
    return image.reshape(geo.rows * t, geo.cols * t).view(np.uint8).reshape(geo.rows * t, geo.cols * t, 4)


def describe_slot(layout: ContiguousLayout, slot: int) -> str:
    """One line about a slot of the contiguous memory, for the hover line."""
    r = layout.reservation_at(slot)
    if r is not None:
        return (f"slot {slot}: conversation {r.conversation_id}'s reservation, slots {r.start}..{r.end - 1} "
                f"({r.length} = prompt + max new tokens), {r.filled} filled, {r.length - r.filled} reserved but empty")
    roles = layout.slot_roles()
    if roles[slot] == GAP_SLOT:
        lo = slot
        while lo > 0 and roles[lo - 1] == GAP_SLOT:
            lo -= 1
        hi = slot
        while hi + 1 < layout.num_slots and roles[hi + 1] == GAP_SLOT:
            hi += 1
        return (f"slot {slot}: a gap of {hi - lo + 1} free slots between reservations (the next request waits "
                f"for a run of its whole length)")
    return f"slot {slot}: free"


def swatch(colour, hatched: bool = False) -> QtGui.QPixmap:
    """A legend square: the colour, or the gap hatching."""
    size = 14
    tile = np.empty((size, size, 4), np.uint8)
    tile[:] = colour
    if hatched:
        stripes = ((np.arange(size)[:, None] + np.arange(size)[None, :]) % HATCH) >= HATCH // 2
        tile[stripes] = palette.FREE
    image = QtGui.QImage(tile.tobytes(), size, size, 4 * size, QtGui.QImage.Format.Format_RGBA8888)
    return QtGui.QPixmap.fromImage(image.copy())


def _match_scale(source: pg.ViewBox, target: pg.ViewBox) -> None:
    """Give ``target`` the units per pixel and the top-left corner of ``source`` (both have locked aspects)."""
    rect = source.viewRect()
    width = source.width()
    if width <= 0 or target.width() <= 0 or rect.width() <= 0:
        return
    per_pixel = rect.width() / width
    target.setRange(QtCore.QRectF(rect.left(), rect.top(), target.width() * per_pixel,
                                  target.height() * per_pixel), padding=0)


class ContiguousView(QtWidgets.QWidget):
    """The same live conversations, placed by a contiguous max-length allocator of the same memory.

    Feed it every snapshot (:meth:`set_snapshot`: the model keeps its placement from frame to frame) and call
    :meth:`render` from the frame timer; it draws only when the layout changed and the widget is visible."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.model = ContiguousAllocator()
        self.colours = palette.ColourBook()  # the colour book of the source drawn (the pane hands over its source's)
        self.layout_: ContiguousLayout | None = None
        self.geometry_: GridGeometry | None = None
        self.image: np.ndarray | None = None
        self._dirty = False
        self._drawn_key = None
        self._grid_box: pg.ViewBox | None = None  # the paged grid's view box, when linked (same scale)
        self._syncing = False  # a scale change in progress between the two boxes (no echo)

        self.title = QtWidgets.QLabel("<b>Contiguous reservation</b> (what paging replaces): each conversation "
                                      "reserves prompt + max new tokens in one run, first fit, first come first served")
        self.title.setWordWrap(True)
        self.summary = QtWidgets.QLabel("No conversations yet.")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.view, self.box, self.item = image_view(palette.BACKGROUND)
        self.hover_label = QtWidgets.QLabel("Hover the memory for details.")
        self.hover_label.setWordWrap(True)
        legend = QtWidgets.QGridLayout()  # two marks a row: one row of four kept the view from half the pane
        legend.setHorizontalSpacing(4)
        legend.setVerticalSpacing(1)
        example = np.append(palette.LIVE_COLOURS[0], 255).astype(np.uint8)
        for i, (text, colour) in enumerate(LEGEND):
            if text == "filled":
                colour = example
            elif text == "reserved but empty":
                colour = palette.scale(example, palette.EMPTY_SLOT_LEVEL)
            icon = QtWidgets.QLabel()
            icon.setPixmap(swatch(colour, hatched=colour is GAP))
            legend.addWidget(icon, i // 2, 2 * (i % 2))
            legend.addWidget(QtWidgets.QLabel(text), i // 2, 2 * (i % 2) + 1)
        legend.setColumnStretch(4, 1)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.summary)
        layout.addWidget(self.view, 1)
        layout.addLayout(legend)
        layout.addWidget(self.hover_label)
        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.box.sigRangeChanged.connect(self._check_tile)
        self.box.sigResized.connect(self._check_tile)

    def set_snapshot(self, snapshot: PoolSnapshot) -> None:
        """Place the snapshot's live conversations (call with every new snapshot, in order)."""
        self.colours.observe(snapshot)
        self.layout_ = self.model.update(snapshot)
        key = (self.layout_.reservations, self.layout_.num_slots, self.layout_.block_size)
        if key != self._drawn_key:
            self._dirty = True
        self.summary.setText(self.layout_.summary())

    def reset(self) -> None:
        """Forget the placement (after an engine restart)."""
        self.model.reset()
        self.layout_ = None
        self.geometry_ = None
        self._drawn_key = None

    def summary_text(self) -> str:
        return self.summary.text()

    def link_to(self, grid_box: pg.ViewBox) -> None:
        """Draw at the paged grid's scale and pan and zoom with it: the same cell units per screen pixel, the same
        top-left cell, whatever the two widgets' sizes (pyqtgraph's own axis links copy the range, which gives
        two boxes of different widths different scales). Panning or zooming either one moves both."""
        self._grid_box = grid_box
        grid_box.sigRangeChanged.connect(self._follow_grid)
        grid_box.sigResized.connect(self._follow_grid)
        self.box.sigResized.connect(self._follow_grid)
        self.box.sigRangeChangedManually.connect(self._lead_grid)
        self._follow_grid()

    def _follow_grid(self, *_) -> None:
        """Take the grid's scale and top-left corner."""
        self._match(self._grid_box, self.box)

    def _lead_grid(self, *_) -> None:
        """The user panned or zoomed this view: move the grid the same way."""
        self._match(self.box, self._grid_box)

    def _match(self, leader, follower) -> None:
        """``follower`` takes ``leader``'s scale and corner, once: the move it makes does not come back."""
        if self._grid_box is not None and not self._syncing:
            self._syncing = True
            try:
                _match_scale(leader, follower)
            finally:
                self._syncing = False

    def fit_with_grid(self) -> None:
        """Where this view, at the grid's scale, would cut off its last rows (its box is shorter than the grid's:
        the title, summary and legend take room), zoom both out until every cell here shows, with the same margin
        as a fitted grid. At the default dock height the side-by-side view clipped its bottom row."""
        geo, grid_box = self.geometry_, self._grid_box
        if geo is None or grid_box is None or self._syncing:
            return
        width, height = self.box.width(), self.box.height()
        if width <= 0 or height <= 0 or grid_box.width() <= 0 or grid_box.viewRect().width() <= 0:
            return
        shared = grid_box.viewRect().width() / grid_box.width()  # cell units per pixel, both views
        needed = max(geo.cols * FIT_PAD / width, geo.rows * FIT_PAD / height)
        if needed <= shared * 1.001:
            return
        rect = QtCore.QRectF(geo.cols / 2 - width * needed / 2, geo.rows / 2 - height * needed / 2,
                             width * needed, height * needed)
        self._syncing = True
        try:
            self.box.setRange(rect, padding=0)
            _match_scale(self.box, grid_box)
        finally:
            self._syncing = False

    def render(self, force: bool = False) -> bool:
        """Redraw if the layout changed since the last call (and the widget is shown); returns whether it drew."""
        if self.layout_ is None or not self._dirty or not (force or self.isVisible()):
            return False
        lay = self.layout_
        geo = self.geometry_
        new_layout = geo is None or geo.num_blocks * geo.block_size != lay.num_slots or geo.block_size != lay.block_size
        if new_layout:
            geo = self.geometry_ = grid_geometry(lay.num_slots // lay.block_size, lay.block_size)
        elif geo.tile != self.wanted_tile():  # drawn at another size on screen now (see grid.fitting_tile)
            geo = self.geometry_ = grid_geometry(geo.num_blocks, geo.block_size, grid.pixels_per_cell(self.box))
        self.image = contiguous_rgba(lay, geo, self.colours)
        self.item.setImage(self.image, autoLevels=False)
        self.item.setRect(QtCore.QRectF(0, 0, geo.cols, geo.rows))
        if new_layout:
            if self._grid_box is None:
                self.box.setRange(QtCore.QRectF(0, 0, geo.cols, geo.rows), padding=0.02)
            else:
                self._follow_grid()
        self._drawn_key = (lay.reservations, lay.num_slots, lay.block_size)
        self._dirty = False
        self._check_tile()
        return True

    def wanted_tile(self) -> int | None:
        """The image tile for the cells' size on screen (None before the first layout)."""
        return grid.wanted_tile(self.geometry_, self.box)

    def _check_tile(self, *_) -> None:
        if grid.needs_new_tile(self.geometry_, self.box):
            self._dirty = True

    def slot_at_scene(self, scene_pos: QtCore.QPointF) -> int | None:
        geo, lay = self.geometry_, self.layout_
        if geo is None or lay is None:
            return None
        point = self.box.mapSceneToView(scene_pos)
        cell = geo.block_at(point.x(), point.y())
        if cell is None:
            return None
        within = min(max(point.x() - int(point.x()), 0.0), 0.999)
        return cell * geo.block_size + int(within * geo.block_size)

    def _on_mouse_moved(self, scene_pos: QtCore.QPointF) -> None:
        slot = self.slot_at_scene(scene_pos)
        if slot is not None and self.layout_ is not None:
            self.hover_label.setText(describe_slot(self.layout_, slot))
