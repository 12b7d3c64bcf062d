"""The pool grid widget: one ImageItem in a pan/zoom ViewBox, hover tooltips, click to select.

Only the GUI thread touches it. The image is rebuilt from a snapshot by :func:`snapshot_to_rgba` when the snapshot
or a view option changes; scene coordinates are cell units (one cell = 1 x 1), so mapping the mouse to a block is
one division. Cell labels (the block id, and ×N on shared blocks) are a small reused pool of TextItems, shown only
when few cells are visible.

Tooltips: Qt asks for one with a ToolTip help event when the mouse rests. A QGraphicsView hands that event to its
scene, which looks for an item with a tooltip, finds none (the grid is one image) and hides whatever tooltip is
showing, so a tooltip shown from the mouse-move handler vanished as soon as the mouse rested (issue 13). The widget
therefore answers the viewport's help events itself, with the block under the mouse.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.views import NO_CHANGE_RECORD, BlockState, ChangeRecord, PoolSnapshot, chain_changes

from ..model import palette
from ..render import grid
from ..render.grid import GridGeometry, changed_blocks, grid_geometry, redraw_blocks, snapshot_to_rgba
from .elided_label import ElidedLabel
from .painting import cache_painting, image_view

MAX_VISIBLE_FOR_LABELS = 144  # cell labels appear only when at most this many cells (12 x 12) are in view
MAX_LABELS = MAX_VISIBLE_FOR_LABELS  # so every visible cell can carry its id
MIN_LABEL_PIXELS = 44  # ... and each cell is at least this wide on screen (the label covers its top-left corner)
FIT_PAD = 1.04  # a fitted pool leaves 2% of its size free on each side


def cell_label(block_id: int, ref_count: int) -> str:
    """What a zoomed-in cell says: its physical id, and ×N when N block tables share it."""
    return f"{block_id} ×{ref_count}" if ref_count > 1 else str(block_id)


HOVER_HINT = "Hover a cell for details; click to inspect it."  # the hover line while no block is under the mouse
HOVER_OWNERS = 2  # owners the hover line names before "and N more" (a prefix block may have hundreds)
TOOLTIP_OWNERS = 8  # owners the tooltip lists, one a line


def block_facts(snapshot: PoolSnapshot, block_id: int, max_owners: int = HOVER_OWNERS) -> list[str]:
    """What the snapshot says about a block, one fact per item; at most ``max_owners`` owners are named, the rest
    counted ("conv 4 (logical 0) and 14 more")."""
    state = BlockState(int(snapshot.state[block_id])).name.lower()
    ref = int(snapshot.ref_count[block_id])
    filled = int(snapshot.num_filled[block_id])
    owners = snapshot.owners_of(block_id)
    facts = [f"block {block_id}: {state}", f"ref count {ref}", f"{filled}/{snapshot.block_size} slots filled"]
    if owners:
        named = [f"conv {c} (logical {i})" for c, i in owners[:max_owners]]
        named[0] = "owners " + named[0]
        if len(owners) > max_owners:
            named[-1] += f" and {len(owners) - max_owners} more"
        facts += named
    elif state == "cached" and int(snapshot.owner[block_id]) >= 0:
        facts.append(f"last filled by conv {int(snapshot.owner[block_id])}")
    return facts


def describe_block(snapshot: PoolSnapshot, block_id: int, max_owners: int = HOVER_OWNERS) -> str:
    """One short line about a block, from the snapshot alone (the hover line under the grid)."""
    return ", ".join(block_facts(snapshot, block_id, max_owners))


def same_pool(a: PoolSnapshot | None, b: PoolSnapshot) -> bool:
    """Whether two snapshots draw the same grid. Every source bumps ``version`` with each change (the engine; a
    pool stream or a recording carries the engine's version; the vLLM tap keeps its own), and the runner publishes
    only on a new version, so equal (version, step, source, shape) means equal arrays: nothing is compared element
    by element. A new step always counts as a change (ages move on)."""
    return a is b or (a is not None and a.version == b.version and a.step_id == b.step_id and a.source == b.source
                      and a.num_blocks == b.num_blocks and a.block_size == b.block_size)


class GridView(QtWidgets.QWidget):
    """Shows the newest snapshot as a grid of cells; emits the block under a click."""

    blockClicked = QtCore.Signal(int)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.snapshot: PoolSnapshot | None = None
        self.geometry_: GridGeometry | None = None
        self.color_by = "owner"
        self.colours = palette.ColourBook()  # the colour book of the source drawn (the pane hands over its source's)
        self.selected_block: int | None = None
        self.selected_conversation: int | None = None
        self.group_filter: int | None = None  # KV cache group whose blocks stay bright (others dimmed); None: all
        self.image: np.ndarray | None = None  # the array last handed to the ImageItem
        self._drawn: tuple | None = None  # (snapshot, geometry, colour mode, selections, group filter, book version)
        self._changes: ChangeRecord = NO_CHANGE_RECORD  # what the frames since the image drawn say changed
        self._owner_slots: np.ndarray | None = None  # the palette entry each block's owner had in the image
        self.partial_draws = 0  # redraws that drew only the blocks that changed (the others: the whole image)
        self.frames_drawn = 0
        self.hovered_block: int | None = None  # the block under the mouse (the hover line describes it)
        self._dirty = False

        self.view, self.box, self.item = image_view(palette.BACKGROUND)
        self.highlight = QtWidgets.QGraphicsRectItem()
        pen = QtGui.QPen(QtGui.QColor(*palette.SELECTED_RING[:3]))
        pen.setCosmetic(True)
        pen.setWidth(2)
        self.highlight.setPen(pen)
        self.highlight.setZValue(10)
        self.highlight.hide()
        self.box.addItem(self.highlight)
        # blocks marked for a reason, one layer each ("misses": a conversation's missed prompt blocks; "check": the
        # blocks a checked prompt would hit): outlined and hatched over their colour. A block on two layers (one a
        # conversation computed, which a new prompt would now hit) shows both: each later layer's outline sits
        # further inside the cell and hatches the other way.
        self.mark_layers: dict[str, tuple[QtWidgets.QGraphicsPathItem, tuple[int, ...], str]] = {}
        self._labels: list[pg.TextItem] = []
        self._label_texts: list[str] = []  # the text each label was last given
        self.hover_label = ElidedLabel(HOVER_HINT)  # never widens the window
        self.hover_hint = HOVER_HINT  # what the hover line says while the mouse is over no block

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.hover_label)

        scene = self.view.scene()
        scene.sigMouseMoved.connect(self._on_mouse_moved)
        scene.sigMouseClicked.connect(self._on_mouse_clicked)
        self.box.sigRangeChanged.connect(lambda *_: (self._update_labels(), self._check_tile()))
        self.box.sigResized.connect(lambda *_: (self.update_limits(), self._check_tile()))  # aspect, cell size
        self.view.viewport().installEventFilter(self)  # answer tooltip requests before the scene hides them

    # ---- state ----------------------------------------------------------------------------------------
    def set_snapshot(self, snapshot: PoolSnapshot, changes: ChangeRecord = NO_CHANGE_RECORD) -> None:
        """Take a newer snapshot; the image is rebuilt only if the pool differs from the one drawn. ``changes``:
        what its frame says changed since the view before (PoolSource.view_changes): only those blocks are drawn
        again, where that view is the one drawn.

        The runner publishes after every command too (inspect_block, tokenize ...), mostly with an unchanged pool.
        """
        if not same_pool(self.snapshot, snapshot):
            self._dirty = True
            # what changed since the image drawn: this frame's record if it starts there, chained with the record
            # of a frame taken but not drawn yet (the grid draws at most once a tick)
            pending = self._changes
            if pending.base is not None and changes.base is self.snapshot:
                changes = chain_changes(pending, changes)
            self._changes = changes
        self.snapshot = snapshot

    def set_color_by(self, mode: str) -> None:
        self.color_by = mode
        self._dirty = True

    def set_selected_block(self, block_id: int | None) -> None:
        self.selected_block = block_id
        self._dirty = True

    def set_selected_conversation(self, conversation_id: int | None) -> None:
        self.selected_conversation = conversation_id
        self._dirty = True

    def set_group_filter(self, group: int | None) -> None:
        """Show the blocks of one KV cache group bright and dim the rest (None: every group)."""
        self.group_filter = group
        self._dirty = True

    def render(self) -> bool:
        """Redraw if anything changed since the last call; returns whether it drew."""
        if not self._dirty or self.snapshot is None:
            return False
        snap = self.snapshot
        geo = self.geometry_
        new_layout = geo is None or geo.num_blocks != snap.num_blocks or geo.block_size != snap.block_size
        if new_layout:
            geo = self.geometry_ = grid_geometry(snap.num_blocks, snap.block_size)
        elif geo.tile != self.wanted_tile():  # cells drawn smaller or larger on screen now
            geo = self.geometry_ = grid_geometry(snap.num_blocks, snap.block_size, self.pixels_per_cell())
        self._draw(snap, geo)
        self._changes = NO_CHANGE_RECORD  # the next frame's record starts from this image
        self.item.setImage(self.image, autoLevels=False)
        self.item.setRect(QtCore.QRectF(0, 0, geo.cols, geo.rows))  # cell units, whatever the tile (after setImage)
        if new_layout:
            self.fit_whole_pool()
            self._place_marks()
        self._place_highlight()
        self._update_labels()
        self._describe_hovered()
        self._dirty = False
        self._check_tile()  # a fit just now may have changed the cells' screen size: draw again next frame
        self.frames_drawn += 1
        return True

    def _draw(self, snap: PoolSnapshot, geo: GridGeometry) -> None:
        """self.image for ``snap``: only the blocks that changed since the image drawn last, when nothing else that
        colours it did (layout, mode, selections, an owner's colour); else the whole image."""
        book = None
        colours = self.colours  # the source's colour book
        if self.color_by == "owner":
            colours.observe(snap)
            book = colours.version  # which entries the colour book had handed out for this image
        settings = (geo, self.color_by, self.selected_conversation, self.selected_block, self.group_filter)
        drawn, ids = self._drawn, None
        if drawn is not None and drawn[1:6] == settings and self.image is not None and not (
                (self.color_by == "group" or self.group_filter is not None)  # a block may change group alone
                and snap.carries_group_tables and drawn[0].group_block_tables != snap.group_block_tables):
            ids = changed_blocks(drawn[0], snap, self.color_by, self.selected_conversation, self._changes)
        owner = np.asarray(snap.owner)
        if ids is not None and book is not None:
            if book != drawn[6]:  # entries handed out since: a block whose owner now has another colour is redrawn
                slots = colours.slots(np.maximum(owner, 0))
                ids = np.union1d(ids, np.nonzero(slots != self._owner_slots)[0])
                self._owner_slots = slots
            else:
                self._owner_slots[ids] = colours.slots(np.maximum(owner[ids], 0))
        if ids is None:
            self.image = snapshot_to_rgba(snap, self.color_by, self.selected_conversation, self.selected_block, geo,
                                          colours, self.group_filter)
            if book is not None:
                self._owner_slots = colours.slots(np.maximum(owner, 0))  # each block's colour in the image
        else:
            self.image = self.image.copy()  # the ImageItem keeps the array it was given: a new one for the new frame
            redraw_blocks(self.image, snap, ids, self.color_by, self.selected_conversation, self.selected_block, geo,
                          colours, self.group_filter)
            self.partial_draws += 1
        self._drawn = (snap, *settings, book)

    def pixels_per_cell(self) -> float:
        """Screen pixels across one cell now (inf before the view has a size)."""
        return grid.pixels_per_cell(self.box)

    def wanted_tile(self) -> int | None:
        """The image tile for the cells' size on screen (None before the first layout)."""
        return grid.wanted_tile(self.geometry_, self.box)

    def _check_tile(self) -> None:
        """After a zoom or a resize: redraw when the cells' screen size calls for another tile."""
        if grid.needs_new_tile(self.geometry_, self.box):
            self._dirty = True

    def fit_rect(self) -> QtCore.QRectF | None:
        """The view rectangle that shows every cell with a small margin at the view box's aspect ratio (cells stay
        square), centred on the pool; None before the first layout or while the box has no size."""
        geo, size = self.geometry_, self.box.size()
        if geo is None or size.width() <= 0 or size.height() <= 0:
            return None
        aspect = size.width() / size.height()
        height = max(geo.rows * FIT_PAD, geo.cols * FIT_PAD / aspect)
        width = height * aspect
        return QtCore.QRectF(geo.cols / 2 - width / 2, geo.rows / 2 - height / 2, width, height)

    def update_limits(self) -> None:
        """Pan limits: half a pool beyond each edge, and never less than the fit for the view's current aspect, so
        a view much wider (or taller) than the pool can still show all of it (8 x 8 cells in a 677 x 295 view
        showed 3.6 of 8 rows when the limits ignored the aspect)."""
        geo = self.geometry_
        if geo is None:
            return
        fit = self.fit_rect()
        x0, x1, y0, y1 = -0.5 * geo.cols, 1.5 * geo.cols, -0.5 * geo.rows, 1.5 * geo.rows
        if fit is not None:
            x0, x1 = min(x0, fit.left()), max(x1, fit.right())
            y0, y1 = min(y0, fit.top()), max(y1, fit.bottom())
        self.box.setLimits(xMin=x0, xMax=x1, yMin=y0, yMax=y1, minXRange=2, minYRange=2)

    def fit_whole_pool(self) -> None:
        """Show the whole pool (limits first, so the fit is never clamped into a crop)."""
        geo = self.geometry_
        if geo is None:
            return
        self.update_limits()
        fit = self.fit_rect()
        if fit is None:  # not laid out yet: the cells, with a margin; the next resize fits again
            self.box.setRange(QtCore.QRectF(0, 0, geo.cols, geo.rows), padding=0.02)
        else:
            self.box.setRange(fit, padding=0)

    def reset_view(self) -> None:
        """Forget the layout (after an engine restart) so the next render fits the new pool."""
        self.geometry_ = None
        self.hovered_block = None
        self.hover_label.setText(HOVER_HINT)  # its block may not exist in the new pool (a restart to fewer blocks)
        self.selected_block = None
        self.selected_conversation = None
        self._dirty = True

    # ---- geometry helpers (also used by tests) ------------------------------------------------------
    def cell_center(self, block_id: int) -> QtCore.QPoint:
        """Viewport pixel at the centre of a block's cell."""
        x, y = self.geometry_.cell_origin(block_id)
        scene = self.box.mapViewToScene(QtCore.QPointF(x + 0.5, y + 0.5))
        return self.view.mapFromScene(scene)

    def cell_colour(self, block_id: int) -> tuple[int, int, int]:
        """RGB of the drawn image in a block's cell, over its first slot (what the user sees there)."""
        geo = self.geometry_
        x, y = geo.cell_origin(block_id)
        t = geo.tile
        r, g, b, _ = self.image[y * t + t // 2, x * t + max(1, t // 8)]
        return int(r), int(g), int(b)

    def block_at_scene(self, scene_pos: QtCore.QPointF) -> int | None:
        if self.geometry_ is None:
            return None
        point = self.box.mapSceneToView(scene_pos)
        return self.geometry_.block_at(point.x(), point.y())

    # ---- mouse ------------------------------------------------------------------------------------------
    def tooltip_at(self, viewport_pos: QtCore.QPoint) -> str:
        """The tooltip for a viewport pixel: the block there, one fact per line ("" outside the pool)."""
        block = self.block_at_scene(self.view.mapToScene(viewport_pos))
        if block is None or self.snapshot is None:
            return ""
        return "\n".join(block_facts(self.snapshot, block, TOOLTIP_OWNERS))

    def eventFilter(self, watched: QtCore.QObject, event: QtCore.QEvent) -> bool:
        if watched is self.view.viewport() and event.type() == QtCore.QEvent.Type.ToolTip:
            text = self.tooltip_at(event.pos())
            if text:
                QtWidgets.QToolTip.showText(event.globalPos(), text, self.view.viewport())
            else:
                QtWidgets.QToolTip.hideText()
            return True  # handled: the scene would hide it again
        if watched is self.view.viewport() and event.type() == QtCore.QEvent.Type.Leave:
            self.hovered_block = None  # the mouse left the grid: the line no longer describes a block under it
            self.hover_label.setText(self.hover_hint)
        return super().eventFilter(watched, event)

    def _describe_hovered(self) -> None:
        """The hover line follows the pool under a resting mouse: after a relocation or an end it said 'used,
        owners conv 1' of a block that was free by then."""
        block, snap = self.hovered_block, self.snapshot
        if block is None or snap is None:
            return
        text = describe_block(snap, block) if block < snap.num_blocks else HOVER_HINT
        if block >= snap.num_blocks:
            self.hovered_block = None  # gone with a smaller pool: the line forgets it
        if self.hover_label.text() != text:
            self.hover_label.setText(text)

    def _on_mouse_moved(self, scene_pos: QtCore.QPointF) -> None:
        block = self.hovered_block = self.block_at_scene(scene_pos)
        if block is None or self.snapshot is None:
            QtWidgets.QToolTip.hideText()
            if self.hover_label.text() != HOVER_HINT:
                self.hover_label.setText(HOVER_HINT)
            return
        self.hover_label.setText(describe_block(self.snapshot, block))
        if QtWidgets.QToolTip.isVisible():  # a tooltip is up: follow the mouse to the next cell at once
            viewport = self.view.viewport()
            pos = self.view.mapFromScene(scene_pos)
            QtWidgets.QToolTip.showText(viewport.mapToGlobal(pos), self.tooltip_at(pos), viewport)

    def _on_mouse_clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        block = self.block_at_scene(event.scenePos())
        if block is not None:
            self.blockClicked.emit(block)

    # ---- overlays -----------------------------------------------------------------------------------------
    def set_marks(self, block_ids, colour: tuple[int, int, int] = (255, 80, 60), note: str = "",
                  layer: str = "misses") -> None:
        """Outline and hatch ``block_ids`` (empty: none) in ``colour`` on mark ``layer``: the blocks a selected
        conversation's prompt missed ("misses"), those a checked prompt would hit ("check"). ``note`` says what
        they mean (the hover line's tooltip)."""
        item = self.mark_layers[layer][0] if layer in self.mark_layers else None
        if item is None:
            item = QtWidgets.QGraphicsPathItem()
            item.setZValue(9 + len(self.mark_layers) * 0.1)
            self.box.addItem(item)
        order = list(self.mark_layers).index(layer) if layer in self.mark_layers else len(self.mark_layers)
        pen = QtGui.QPen(QtGui.QColor(*colour))
        pen.setCosmetic(True)
        pen.setWidth(3)
        item.setPen(pen)
        hatch = QtCore.Qt.BrushStyle.BDiagPattern if order % 2 == 0 else QtCore.Qt.BrushStyle.FDiagPattern
        item.setBrush(QtGui.QBrush(QtGui.QColor(*colour), hatch))
        self.mark_layers[layer] = (item, tuple(int(b) for b in block_ids), note)
        self.hover_label.setToolTip("\n".join(n for _, ids, n in self.mark_layers.values() if ids and n))
        self._place_marks()

    def marks(self, layer: str = "misses") -> tuple[int, ...]:
        """The blocks marked on ``layer`` now."""
        return self.mark_layers[layer][1] if layer in self.mark_layers else ()

    def _place_marks(self) -> None:
        geo = self.geometry_
        for order, (item, ids, _note) in enumerate(self.mark_layers.values()):
            inset = 0.06 + 0.1 * order
            path = QtGui.QPainterPath()
            if geo is not None:
                for b in ids:
                    if 0 <= b < geo.num_blocks:
                        x, y = geo.cell_origin(b)
                        path.addRect(QtCore.QRectF(x + inset, y + inset, 1 - 2 * inset, 1 - 2 * inset))
            item.setPath(path)
            item.setVisible(not path.isEmpty())

    def _place_highlight(self) -> None:
        block = self.selected_block
        if block is None or self.geometry_ is None or block >= self.geometry_.num_blocks:
            self.highlight.hide()
            return
        x, y = self.geometry_.cell_origin(block)
        self.highlight.setRect(QtCore.QRectF(x, y, 1, 1))
        self.highlight.show()

    def _update_labels(self) -> None:
        """Put each cell's block id (and ×N on shared ones) in its top-left corner, but only when the view is
        zoomed in enough for text to be readable without hiding the cell's colour."""
        geo, snap = self.geometry_, self.snapshot
        shown = 0
        if geo is not None and snap is not None:
            rect = self.box.viewRect()
            x0, x1 = max(int(np.floor(rect.left())), 0), min(int(np.ceil(rect.right())), geo.cols)
            y0, y1 = max(int(np.floor(rect.top())), 0), min(int(np.ceil(rect.bottom())), geo.rows)
            pixels = self.view.viewport().width() / max(rect.width(), 1e-9)  # screen pixels per cell
            if 0 < (x1 - x0) * (y1 - y0) <= MAX_VISIBLE_FOR_LABELS and pixels >= MIN_LABEL_PIXELS:
                ids = (np.arange(y0, y1)[:, None] * geo.cols + np.arange(x0, x1)[None, :]).ravel()
                ids = ids[ids < geo.num_blocks][:MAX_LABELS]
                refs = np.asarray(snap.ref_count)[ids]
                for block, ref in zip(ids.tolist(), refs.tolist()):
                    label = self._label(shown)
                    x, y = geo.cell_origin(block)
                    text = cell_label(block, ref)
                    if self._label_texts[shown] != text:  # setText re-lays out the text: only when it changed
                        label.setText(text)
                        self._label_texts[shown] = text
                    label.setPos(x + 0.06, y + 0.06)
                    label.show()
                    shown += 1
        for label in self._labels[shown:]:
            label.hide()

    def label_texts(self) -> list[str]:
        """Texts of the cell labels on screen now (tests read them)."""
        return [label.textItem.toPlainText() for label in self._labels if label.isVisible()]

    def _label(self, index: int) -> pg.TextItem:
        while len(self._labels) <= index:
            label = _CellLabel(color=(255, 255, 255), anchor=(0, 0), fill=pg.mkBrush(0, 0, 0, 130))
            font = label.textItem.font()
            font.setBold(True)
            font.setPointSize(7)
            label.setFont(font)
            label.setZValue(20)
            cache_painting(label)  # drawn again only when its text or the zoom changes, not each grid repaint
            self.box.addItem(label)
            self._labels.append(label)
            self._label_texts.append("")
        return self._labels[index]


class _CellLabel(pg.TextItem):
    """A cell label whose box can live in Qt's item cache (:func:`explorer.widgets.painting.cache_painting`).

    pyqtgraph's ``TextItem.paint``, on an item's first paint, sets the painter's transform to the item's scene
    transform. Painting into a cache pixmap, Qt hands over a painter already moved to the pixmap's origin, so that
    reset put the box outside the pixmap: cached labels showed their text without its dark box, unreadable on bright
    cells. Here the box is drawn in the item's own coordinates; the transform that keeps the text upright and
    unscaled is kept up to date by ``viewTransformChanged`` (pyqtgraph calls it whenever the view's transform
    changes)."""

    def paint(self, p, *args):
        p.setPen(self.border)
        p.setBrush(self.fill)
        p.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing, True)
        p.drawPolygon(self.textItem.mapToParent(self.textItem.boundingRect()))
