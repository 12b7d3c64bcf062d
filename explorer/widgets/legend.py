"""A legend that explains every mark the grid can draw, for the current colour-by mode.

Swatches are painted from the same palette and the same colour rules as the grid, so they cannot drift apart.
"""
from __future__ import annotations

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from ..model import palette

SWATCH = 18


def _swatch(fill, empty=None, ring=None, filled_fraction: float = 1.0) -> QtGui.QPixmap:
    """A small cell: filled part, empty part, optional outline."""
    pix = QtGui.QPixmap(SWATCH * 2, SWATCH)
    pix.fill(QtGui.QColor(*palette.BACKGROUND[:3]))
    painter = QtGui.QPainter(pix)
    width = SWATCH * 2 - 2
    cut = int(round(width * filled_fraction))
    painter.fillRect(1, 1, cut, SWATCH - 2, QtGui.QColor(*[int(c) for c in fill[:3]]))
    if empty is not None and cut < width:
        painter.fillRect(1 + cut, 1, width - cut, SWATCH - 2, QtGui.QColor(*[int(c) for c in empty[:3]]))
    if ring is not None:
        pen = QtGui.QPen(QtGui.QColor(*[int(c) for c in ring[:3]]))
        pen.setWidth(2)
        painter.setPen(pen)
        painter.drawRect(2, 2, SWATCH * 2 - 4, SWATCH - 4)
    painter.end()
    return pix


def _gradient(colours: np.ndarray) -> QtGui.QPixmap:
    pix = QtGui.QPixmap(SWATCH * 4, SWATCH)
    painter = QtGui.QPainter(pix)
    for x in range(SWATCH * 4):
        c = colours[int(x * (len(colours) - 1) / (SWATCH * 4 - 1))]
        painter.setPen(QtGui.QColor(int(c[0]), int(c[1]), int(c[2])))
        painter.drawLine(x, 0, x, SWATCH)
    painter.end()
    return pix


def legend_entries(mode: str) -> list[tuple[QtGui.QPixmap, str]]:
    """(swatch, explanation) rows for a colour-by mode; the shared/selected/dim marks apply in every mode."""
    example = np.append(palette.LIVE_COLOURS[0], 255).astype(np.uint8)  # a fixed example, whoever holds it now
    dark = palette.scale(example, palette.EMPTY_SLOT_LEVEL)
    rows: list[tuple[QtGui.QPixmap, str]] = [(_swatch(palette.FREE), "free block")]
    if mode == "owner":
        cached = palette.cached(example)
        rows += [(_swatch(example), "used: one colour per conversation"),
                 (_swatch(example, dark, filled_fraction=0.25), "partial tail: filled slots bright, empty dark"),
                 (_swatch(cached), "cached: free but holds reusable prefix KV (hint of last owner)")]
    elif mode == "ref_count":
        rows += [(_swatch(palette.REF_COLOURS[k]), f"used, ref count {label}")
                 for k, label in ((1, "1"), (2, "2"), (3, "3"), (4, "4 or more"))]
        rows.append((_swatch(palette.scale(palette.REF_COLOURS[0], 1.6)), "cached (ref count 0)"))
    elif mode == "fill":
        rows.append((_gradient(palette.ramp(np.linspace(0, 1, 32))), "slots filled: few → all"))
    elif mode == "age":
        rows.append((_gradient(palette.ramp(np.linspace(1, 0, 32))), "last access: just now → 256+ steps ago"))
    elif mode == "group":
        from ..render.groups import GROUP_COLOURS
        rows += [(_swatch(GROUP_COLOURS[g]), f"KV cache group {g}{note}")
                 for g, note in ((0, " (full attention)"), (1, " (sliding window)"))]
        rows.append((_swatch(palette.cached(GROUP_COLOURS[1])), "cached"))
    else:
        rows += [(_swatch(palette.STATE_USED), "used"), (_swatch(palette.STATE_CACHED), "cached")]
    rows += [(_swatch(example, ring=palette.SHARED_RING),
              "shared: ref count > 1 (zoomed in, cells show their id and ×N)"),
             (_swatch(example, ring=palette.SELECTED_RING), "selected block"),
             (_swatch(palette.scale(example, palette.DIM_LEVEL)), "dimmed: not in the selected conversation")]
    return rows


class Legend(QtWidgets.QWidget):
    """Swatch + text rows, rebuilt when the colour-by mode changes."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._layout = QtWidgets.QGridLayout(self)
        self._layout.setContentsMargins(4, 4, 4, 4)
        self._layout.setVerticalSpacing(2)
        self.mode = ""
        self.set_mode("owner")

    def set_mode(self, mode: str) -> None:
        if mode == self.mode:
            return
        self.mode = mode
        while self._layout.count():
            item = self._layout.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        entries = legend_entries(mode)
        for row, (pix, text) in enumerate(entries):
            icon = QtWidgets.QLabel()
            icon.setPixmap(pix)
            label = QtWidgets.QLabel(text)
            label.setWordWrap(True)
            self._layout.addWidget(icon, row, 0, QtCore.Qt.AlignmentFlag.AlignTop)
            self._layout.addWidget(label, row, 1)
        self._layout.setRowStretch(len(entries), 1)
        self._layout.setColumnStretch(1, 1)
