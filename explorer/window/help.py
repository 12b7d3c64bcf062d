"""The Help window: what each mark in the grid means, what the colour-by modes show, the contiguous view, the
keyboard and mouse, and the way into the lesson.

The swatches come from :func:`explorer.widgets.legend.legend_entries` (the grid's own palette and rules) and the shortcuts
from the window's own actions (:func:`explorer.window.menus.shortcut_rows`), so the help cannot drift from what the window
draws and does.
"""
from __future__ import annotations

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from ..model import palette
from ..render.grid import COLOR_BY, COLOR_BY_LABELS
from ..widgets.contiguous_view import GAP, swatch as contiguous_swatch
from ..widgets.legend import legend_entries
from .layout import scrolled

MODE_TEXT = {  # what each colour-by mode answers
    "owner": "Which conversation holds each block (one colour per live conversation; cached blocks keep a muted "
             "hint of their last owner).",
    "ref_count": "How many block-table entries name each block: 2 or more means shared (a common prefix or a fork).",
    "fill": "How many of a block's slots hold K/V: only a conversation's last block is ever partly filled.",
    "age": "How long ago each block was last written or read: what an LRU eviction would drop first.",
    "state": "Used (held by a conversation), cached (free, but its KV is kept for a matching prefix) or free.",
    "group": "Which KV cache group each block serves: a model with full-attention and sliding-window layers pages "
             "each kind as its own group in the one pool (the group filter beside it dims the other groups).",
}
MOUSE = (  # (gesture, what it does) on the grid
    ("Click a cell", "inspect that block: its tokens, owners, prefix hash and K/V (the Inspector)"),
    ("Hover a cell", "one line about the block under the status of the grid, and a tooltip"),
    ("Drag", "pan the grid"),
    ("Mouse wheel", "zoom; zoomed in, each cell shows its physical block id (and ×N when shared)"),
    ("Fit", "show the whole pool again"),
    ("Click a conversation", "select it: its blocks stay bright, every other block dims"),
    ("Ctrl+Return", "in the add and reply dialogs: send (Return starts a new line, Tab goes to the next field)"),
    ("Left / Right, Home", "on the timeline (click it first): one frame back or on (with Shift: to the previous or "
                           "next mark), the oldest frame kept; End: back to live"),
)
LESSON_TEXT = ("The lesson replays the source text's experiment one position at a time: blocks of 4 slots, keys 0, "
               "query 1, values 1, 2, 3, ... When the fifth position arrives it takes a second block somewhere else "
               "in the pool, and the attention result is the same in both layouts. Chapter 2 steps the same "
               "positions through a sliding window of 4 beside paging alone: the window releases the first block "
               "when position 8 arrives, because the model never reads it again; paging alone keeps everything.")


def _rows_widget(rows: list[tuple[QtGui.QPixmap | str, str]]) -> QtWidgets.QWidget:
    """A two-column list: a swatch (or a short bold text) and a word-wrapped explanation."""
    box = QtWidgets.QWidget()
    grid = QtWidgets.QGridLayout(box)
    grid.setContentsMargins(6, 6, 6, 6)
    grid.setVerticalSpacing(4)
    for row, (mark, text) in enumerate(rows):
        left = QtWidgets.QLabel()
        if isinstance(mark, QtGui.QPixmap):
            left.setPixmap(mark)
        else:
            left.setText(f"<b>{mark}</b>")
        label = QtWidgets.QLabel(text)
        label.setWordWrap(True)
        grid.addWidget(left, row, 0, QtCore.Qt.AlignmentFlag.AlignTop)
        grid.addWidget(label, row, 1)
    grid.setColumnStretch(1, 1)
    grid.setRowStretch(len(rows), 1)
    return box


def mark_rows() -> list[tuple[QtGui.QPixmap, str]]:
    """Every mark of the grid in the owner mode (the default), and of the contiguous view."""
    rows = legend_entries("owner")
    example = np.append(palette.LIVE_COLOURS[0], 255).astype(np.uint8)
    rows += [
        (contiguous_swatch(example), "contiguous view: a slot holding K/V, in its conversation's colour"),
        (contiguous_swatch(palette.scale(example, palette.EMPTY_SLOT_LEVEL)),
         "contiguous view: reserved for the rest of max new tokens, still empty (and perhaps never used)"),
        (contiguous_swatch(GAP, hatched=True),
         "contiguous view: free slots between reservations, too short for the next request (external "
         "fragmentation)"),
    ]
    return rows


def shortcut_table(window: QtWidgets.QWidget | None) -> list[tuple[str, str]]:
    """(keys, action) of the window's actions, plus the grid's mouse gestures."""
    rows: list[tuple[str, str]] = []
    actions = getattr(window, "window_actions", None)  # the window's own actions: the table cannot drift from them
    if actions is not None:
        rows = actions.shortcut_rows()
    return rows + list(MOUSE)


class HelpDialog(QtWidgets.QDialog):
    """What the grid shows, colour-by modes, shortcuts and the lesson, as tabs; non-modal, reused.

    ``lessonRequested`` fires when the user asks for the lesson; with a parent window that has ``open_lesson``,
    the dialog calls it directly."""

    lessonRequested = QtCore.Signal()

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Help: the paged KV-cache explorer")
        self.tabs = QtWidgets.QTabWidget()
        intro = QtWidgets.QLabel(
            "Each cell of the grid is one physical block of the KV-cache pool; its stripes are the block's token "
            "slots. A conversation's blocks may lie anywhere: its block table maps logical block i to a physical "
            "id, so the order of text is not the order in memory.")
        intro.setWordWrap(True)
        marks = QtWidgets.QWidget()
        marks_layout = QtWidgets.QVBoxLayout(marks)
        marks_layout.setContentsMargins(0, 0, 0, 0)
        marks_layout.addWidget(intro)
        marks_layout.addWidget(_rows_widget(mark_rows()), 1)
        self.tabs.addTab(scrolled(marks), "Grid marks")
        modes = [(COLOR_BY_LABELS[m], MODE_TEXT[m]) for m in COLOR_BY]
        self.tabs.addTab(scrolled(_rows_widget(modes)), "Colour by")
        self.shortcuts = shortcut_table(parent)
        self.tabs.addTab(scrolled(_rows_widget(self.shortcuts)), "Keys and mouse")
        lesson = QtWidgets.QWidget()
        lesson_layout = QtWidgets.QVBoxLayout(lesson)
        text = QtWidgets.QLabel(LESSON_TEXT)
        text.setWordWrap(True)
        self.lesson_button = QtWidgets.QPushButton("Open the lesson")
        self.lesson_button.clicked.connect(self._open_lesson)
        lesson_layout.addWidget(text)
        lesson_layout.addWidget(self.lesson_button, 0, QtCore.Qt.AlignmentFlag.AlignLeft)
        lesson_layout.addStretch(1)
        self.tabs.addTab(scrolled(lesson), "Lesson")
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(buttons)
        self.resize(520, 460)

    def _open_lesson(self) -> None:
        self.lessonRequested.emit()
        opener = getattr(self.parent(), "open_lesson", None)
        if callable(opener):
            opener()

    def texts(self) -> list[str]:
        """Every label's text, for tests and searches."""
        return [label.text() for label in self.findChildren(QtWidgets.QLabel) if label.text()]
