"""A one-line label that never asks for more width than it gets: its text ends in '…' where it does not fit.

A plain QLabel asks for the width of its whole text; in a layout that reaches the window, a long text (the hover
line over a block shared by 16 conversations) made the window itself grow past the screen, and the widened layout
was saved. Every one-line label whose text the app sets as it runs uses this one instead; the full text stays in
``text()`` (tests, copy) and, where the caller sets it, in the tooltip.
"""
from __future__ import annotations

from PySide6 import QtCore, QtGui, QtWidgets


class ElidedLabel(QtWidgets.QLabel):
    """A one-line label that takes the width it is given and ends in '…' when its text does not fit.

    Its size policy ignores the text's width (the layout gives it what is left); its height is one line."""

    def __init__(self, text: str = "", parent: QtWidgets.QWidget | None = None, *, min_width: int = 40):
        super().__init__(text, parent)
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(min_width)
        self.setContentsMargins(4, 0, 8, 0)

    def minimumSizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(self.minimumWidth(), super().minimumSizeHint().height())

    def elided_text(self) -> str:
        """What is drawn now: the text, cut with '…' to the label's width."""
        return self.fontMetrics().elidedText(self.text(), QtCore.Qt.TextElideMode.ElideRight,
                                             self.contentsRect().width())

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:
        painter = QtGui.QPainter(self)
        painter.setPen(self.palette().color(self.foregroundRole()))
        flags = int(QtCore.Qt.AlignmentFlag.AlignLeft | QtCore.Qt.AlignmentFlag.AlignVCenter)
        painter.drawText(self.contentsRect(), flags, self.elided_text())
        painter.end()
