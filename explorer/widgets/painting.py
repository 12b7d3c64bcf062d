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


def cache_plot_axes(plot) -> None:
    """:func:`cache_painting` for the four axes of a pyqtgraph ``PlotItem`` (shown or not)."""
    cache_painting(*(plot.getAxis(side) for side in ("left", "bottom", "right", "top")))
