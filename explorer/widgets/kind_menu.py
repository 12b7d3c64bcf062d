"""A menu of block-event kinds, each with its colour swatch and a tick, for the timeline's marks and the event
log's filter.

Both widgets ask the same question (which kinds?) and must answer it with the same colours, so the menu lives in
one place. It stays open while the user ticks several kinds, and offers the notable kinds (the default), all, or
none in one click.
"""
from __future__ import annotations

from typing import Iterable

from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.events import NOTABLE_KINDS, EventKind

from ..model.event_colours import KIND_COLOURS, KIND_NAMES, KIND_PRIORITY


def as_kind(kind) -> EventKind:
    """An EventKind from itself or its string value; ValueError naming the valid ones otherwise."""
    try:
        return kind if isinstance(kind, EventKind) else EventKind(kind)
    except ValueError:
        raise ValueError(f"not a block event kind: {kind!r} (one of {', '.join(k.value for k in EventKind)})")


def swatch_icon(rgb: tuple[int, int, int], size: int = 14) -> QtGui.QIcon:
    """The kind's colour: filled with a tick when the action is checked, an outline when it is not."""
    colour = QtGui.QColor(*rgb)
    icon = QtGui.QIcon()
    for state in (QtGui.QIcon.State.On, QtGui.QIcon.State.Off):
        pix = QtGui.QPixmap(size, size)
        pix.fill(QtCore.Qt.GlobalColor.transparent)
        painter = QtGui.QPainter(pix)
        painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        box = QtCore.QRectF(1.5, 1.5, size - 3, size - 3)
        if state == QtGui.QIcon.State.On:
            painter.fillRect(box, colour)
            ink = QtGui.QColor(20, 20, 20) if colour.lightness() > 110 else QtGui.QColor(245, 245, 245)
            painter.setPen(QtGui.QPen(ink, 2))
            painter.drawPolyline([QtCore.QPointF(size * 0.25, size * 0.52), QtCore.QPointF(size * 0.43, size * 0.72),
                                  QtCore.QPointF(size * 0.77, size * 0.30)])
        else:
            painter.setPen(QtGui.QPen(colour, 2))
            painter.drawRect(box)
        painter.end()
        icon.addPixmap(pix, QtGui.QIcon.Mode.Normal, state)
        icon.addPixmap(pix, QtGui.QIcon.Mode.Active, state)
    return icon


class KindMenu(QtWidgets.QMenu):
    """Checkable event kinds, most telling first; emits ``kindsChanged`` with the ticked set after each change."""

    kindsChanged = QtCore.Signal(object)  # frozenset of EventKind now ticked

    def __init__(self, parent: QtWidgets.QWidget | None = None, kinds: Iterable[EventKind] = NOTABLE_KINDS):
        super().__init__(parent)
        self.addAction("Notable kinds (default)").triggered.connect(lambda: self.set_kinds(NOTABLE_KINDS))
        self.addAction("All kinds").triggered.connect(lambda: self.set_kinds(EventKind))
        self.addAction("None").triggered.connect(lambda: self.set_kinds(()))
        self.addSeparator()
        self.kind_actions: dict[EventKind, QtGui.QAction] = {}
        for kind in KIND_PRIORITY:
            action = self.addAction(swatch_icon(KIND_COLOURS[kind]), KIND_NAMES[kind])
            action.setCheckable(True)
            action.toggled.connect(self._toggled)
            self.kind_actions[kind] = action
        self._quiet = False  # set while several ticks change at once: one signal at the end
        self.set_kinds(kinds, emit=False)

    def kinds(self) -> frozenset:
        return frozenset(k for k, action in self.kind_actions.items() if action.isChecked())

    def set_kinds(self, kinds: Iterable[EventKind | str], emit: bool = True) -> None:
        """Tick exactly these kinds (ValueError on an unknown one, nothing changed)."""
        wanted = {as_kind(k) for k in kinds}
        before = self.kinds()
        self._quiet = True
        try:
            for kind, action in self.kind_actions.items():
                action.setChecked(kind in wanted)
        finally:
            self._quiet = False
        if emit and self.kinds() != before:
            self.kindsChanged.emit(self.kinds())

    def _toggled(self, _on: bool) -> None:
        if not self._quiet:
            self.kindsChanged.emit(self.kinds())

    def mouseReleaseEvent(self, event: QtGui.QMouseEvent) -> None:
        action = self.activeAction()
        if action is not None and action.isCheckable() and action.isEnabled():
            action.trigger()  # tick without closing: the user may want several
            return
        super().mouseReleaseEvent(event)
