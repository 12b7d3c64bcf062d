"""Where the docks go, how they keep their proportions, and how the arrangement survives from launch to launch.

The first launch arranges the docks for the screen it gets: side by side on a wide screen, tabbed on a laptop, so
that at 1024 x 640 the grid keeps most of the window and no panel is squeezed below legibility (each dock's
content sits in a scroll area, so a small dock scrolls instead of overlapping its text or widening the window).
Later launches restore what the user left (``QMainWindow.saveState``/``saveGeometry`` in QSettings). When the
window is resized, docks keep their share of it, so shrinking and then maximizing gives the old proportions back.
A window larger than the desktop is never saved, and a saved one is never restored: a label that once widened the
window to 3470 px got that layout saved, and the next launch squeezed the Legend and Inspector to 130 and 60 px.
"""
from __future__ import annotations

import struct

from PySide6 import QtCore, QtGui, QtWidgets

LAYOUT_VERSION = 3  # bump when docks are added or renamed: an older saved state is then ignored, not half-applied
ORGANISATION = "paged-kv-explorer"
APPLICATION = "explorer"
RIGHT = QtCore.Qt.DockWidgetArea.RightDockWidgetArea
BOTTOM = QtCore.Qt.DockWidgetArea.BottomDockWidgetArea
H = QtCore.Qt.Orientation.Horizontal
V = QtCore.Qt.Orientation.Vertical
MIN_WIDTH, MIN_HEIGHT = 1024, 640  # the smallest screen the window must be usable on


def _group(window, main, docks, side_by_side: bool, main_right: bool) -> bool:
    """Place ``docks`` with ``main``: side by side (the first beside it, on its left when ``main_right``, the others
    tabbed with that first one, which is raised) or all tabbed with ``main``. Returns whether they went beside."""
    if not (side_by_side and docks):
        for dock in docks:
            window.tabifyDockWidget(main, dock)
        return False
    window.splitDockWidget(*((docks[0], main) if main_right else (main, docks[0])), H)
    for dock in docks[1:]:
        window.tabifyDockWidget(docks[0], dock)
    docks[0].raise_()
    return True


def scrolled(widget: QtWidgets.QWidget) -> QtWidgets.QScrollArea:
    """``widget`` in a frameless scroll area that resizes it: a small dock scrolls instead of squeezing it."""
    area = QtWidgets.QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
    area.setWidget(widget)
    return area


def make_dock(window: QtWidgets.QMainWindow, name: str, title: str, widget: QtWidgets.QWidget,
              scroll: bool = True, min_width: int = 220, min_height: int = 120) -> QtWidgets.QDockWidget:
    """A dock with a stable object name (saveState keys on it) holding ``widget``, scrolled unless told not to.

    Plots and tables scroll by themselves; forms and readouts get a scroll area. ``min_width``/``min_height`` are
    what the content may shrink to before its scroll bars appear.
    """
    dock = QtWidgets.QDockWidget(title, window)
    dock.setObjectName(name)
    if scroll:
        widget.setMinimumSize(min_width, min_height)
        content = scrolled(widget)
    else:
        content = widget
    content.setMinimumSize(0, 0)
    dock.setWidget(content)
    dock.setFeatures(QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetMovable
                     | QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetFloatable
                     | QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetClosable)
    return dock


def arrange(window: QtWidgets.QMainWindow, right: list[QtWidgets.QDockWidget],
            bottom: list[QtWidgets.QDockWidget], width: int, height: int) -> str:
    """Place docks for a ``width`` x ``height`` window; returns the arrangement's name ("wide", "medium", "small").

    ``right`` is [inspector, legend, memory, ...]; ``bottom`` is [conversations, metrics, ...] (extra docks tab with
    the last of their list). Wide: legend/memory beside the inspector, conversations beside metrics. Medium: the
    right docks tab, the bottom ones split. Small: everything tabs; the grid keeps the most room.
    """
    for dock in right + bottom:
        window.removeDockWidget(dock)
    for dock in right:
        window.addDockWidget(RIGHT, dock)
        dock.show()
    for dock in bottom:
        window.addDockWidget(BOTTOM, dock)
        dock.show()
    kind = "wide" if width >= 1600 and height >= 900 else ("medium" if width >= 1280 else "small")
    inspector, *others = right
    conversations, *charts = bottom
    _group(window, inspector, others, kind == "wide", main_right=True)  # wide: the legend column, then the
    inspector.raise_()  # inspector at the far right
    if not _group(window, conversations, charts, kind != "small", main_right=False):
        conversations.raise_()
    if kind == "wide" and others:
        window.resizeDocks([others[0], inspector], [int(width * 0.17), int(width * 0.25)], H)
    else:
        window.resizeDocks([inspector], [int(width * (0.3 if kind == "medium" else 0.33))], H)
    if kind != "small" and charts:
        window.resizeDocks([conversations, charts[0]], [int(width * 0.56), int(width * 0.44)], H)  # table columns
    window.resizeDocks([conversations], [int(height * (0.33 if kind == "wide" else 0.32))], V)
    return kind


def visible_docks(window: QtWidgets.QMainWindow) -> list[QtWidgets.QDockWidget]:
    """Docked (not floating), shown docks whose area is on screen: the front tab of each tab group."""
    return [d for d in window.findChildren(QtWidgets.QDockWidget)
            if d.isVisible() and not d.isFloating() and not d.visibleRegion().isEmpty()]


def keep_proportions(window: QtWidgets.QMainWindow, old: QtCore.QSize, new: QtCore.QSize) -> None:
    """After a resize from ``old`` to ``new``, give each docked panel the same share of the window it had."""
    if old.width() <= 0 or old.height() <= 0 or old == new:
        return
    across, down = [], []
    for dock in visible_docks(window):
        area = window.dockWidgetArea(dock)
        if area in (RIGHT, QtCore.Qt.DockWidgetArea.LeftDockWidgetArea):
            across.append((dock, dock.width() * new.width() / old.width()))
        elif area in (BOTTOM, QtCore.Qt.DockWidgetArea.TopDockWidgetArea):
            down.append((dock, dock.height() * new.height() / old.height()))
    if across:
        window.resizeDocks([d for d, _ in across], [max(int(w), 1) for _, w in across], H)
    if down:
        window.resizeDocks([d for d, _ in down], [max(int(h), 1) for _, h in down], V)


class LayoutMemory:
    """Saves and restores the window's geometry and dock arrangement in a QSettings (None: remember nothing).

    Tests pass a QSettings on a temporary file, so they never read or write the user's own settings.
    """

    def __init__(self, settings: QtCore.QSettings | None):
        self.settings = settings  # where the layout lives, or None
        self.asked_size: tuple[int, int] | None = None  # the size the window was given at launch (--geometry)

    @staticmethod
    def user_settings() -> QtCore.QSettings:
        return QtCore.QSettings(ORGANISATION, APPLICATION)

    def restore(self, window: QtWidgets.QMainWindow, geometry: bool = True,
                size: tuple[int, int] | None = None) -> bool:
        """Restore the saved dock state (and geometry unless told not to); False when nothing usable was saved.

        ``size``: the size the window is given now (--geometry), None for the screen's. A layout saved from a window
        wider or taller than both that and the desktop is not restored (the first-launch arrangement stays)."""
        self.asked_size = size
        if self.settings is None:
            return False
        saved_geometry = self.settings.value("layout/geometry")
        has_geometry = isinstance(saved_geometry, QtCore.QByteArray) and not saved_geometry.isEmpty()
        if has_geometry:
            saved = saved_size(saved_geometry)
            room = largest_window(size)
            if saved is not None and (saved[0] > room[0] or saved[1] > room[1]):
                return False
            if geometry:
                window.restoreGeometry(saved_geometry)
        state = self.settings.value("layout/state")
        if isinstance(state, QtCore.QByteArray) and not state.isEmpty():
            return bool(window.restoreState(state, LAYOUT_VERSION))
        return False

    def save(self, window: QtWidgets.QMainWindow) -> bool:
        """Keep the window's layout; a window larger than the desktop (and than the size it was launched at) is not
        kept: what was saved before stays. Returns whether it saved."""
        if self.settings is None:
            return False
        room = largest_window(self.asked_size)
        if window.width() > room[0] or window.height() > room[1]:  # the window's own size, its frame left out
            return False
        self.settings.setValue("layout/state", window.saveState(LAYOUT_VERSION))
        self.settings.setValue("layout/geometry", window.saveGeometry())
        self.settings.sync()
        return True


GEOMETRY_MAGIC = 0x1D9D0CB  # QWidget.saveGeometry's first four bytes


def saved_size(blob: QtCore.QByteArray) -> tuple[int, int] | None:
    """(width, height) of the window (its frame left out) a ``saveGeometry`` blob holds; None if it is not one.
    Qt's format: magic, major and minor version, the frame rectangle, then the window's own ("normal") rectangle,
    each as left, top, right, bottom."""
    data = bytes(blob.data())
    if len(data) < 40:
        return None
    magic, _major, _minor = struct.unpack_from(">IHH", data)
    if magic != GEOMETRY_MAGIC:
        return None
    left, top, right, bottom = struct.unpack_from(">iiii", data, 24)
    return right - left + 1, bottom - top + 1


def largest_window(size: tuple[int, int] | None) -> tuple[int, int]:
    """The largest window size a layout may have been saved at and still be restored: the desktop's available
    area (all screens), and never less than the smallest supported window or the size asked for now."""
    screen = QtGui.QGuiApplication.primaryScreen()
    room = screen.availableVirtualGeometry().size() if screen is not None else QtCore.QSize(MIN_WIDTH, MIN_HEIGHT)
    asked = size or (0, 0)
    return max(room.width(), MIN_WIDTH, asked[0]), max(room.height(), MIN_HEIGHT, asked[1])
