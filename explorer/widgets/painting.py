"""Qt's own pixmap cache for pyqtgraph items that change far less often than the view around them repaints.

pyqtgraph repaints every item a repaint's region touches. A plot's axis (with its grid lines, which span the whole
plot) replays its recorded drawing each time, and each of the grid's cell labels draws its box and text: in the serve
demo the axes and the labels took a large share of the GUI thread (figures: docs/gui.md, "What the GUI thread does
at scale"). With ``DeviceCoordinateCache`` Qt keeps each item's pixels and draws them again with one
copy; an item is drawn anew only when it changes (pyqtgraph calls ``update()`` then, which drops the cache) or the
view's scale changes.
"""
from __future__ import annotations

from PySide6 import QtWidgets

CACHED = QtWidgets.QGraphicsItem.CacheMode.DeviceCoordinateCache


def cache_painting(*items: QtWidgets.QGraphicsItem) -> None:
    """Let Qt cache the drawing of ``items`` (and of their child items) in pixmaps."""
    for item in items:
        item.setCacheMode(CACHED)
        for child in item.childItems():
            cache_painting(child)


def image_view(background) -> tuple:
    """(view, box, item): one pyqtgraph ImageItem in a pan/zoom ViewBox with a locked aspect, y down (row 0 at the
    top, as the grids lay out their blocks), drawn pixel for pixel (no downsampling: the image is made at the size it
    is shown). ``background``: the view's RGB."""
    import pyqtgraph as pg
    view = pg.GraphicsView(background=tuple(int(c) for c in background[:3]))
    box = pg.ViewBox(lockAspect=True, invertY=True, enableMenu=False)
    view.setCentralItem(box)
    item = pg.ImageItem(axisOrder="row-major")
    item.setAutoDownsample(False)
    box.addItem(item)
    return view, box, item


def cache_plot_axes(plot) -> None:
    """:func:`cache_painting` for the four axes of a pyqtgraph ``PlotItem`` (shown or not)."""
    cache_painting(*(plot.getAxis(side) for side in ("left", "bottom", "right", "top")))
