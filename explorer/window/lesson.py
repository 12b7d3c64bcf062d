"""The guided lesson: one toy sequence stepped through a paged pool, then moved to other blocks.

The window only draws :class:`engine.lesson.ToyPagedSequence`, which keeps its K/V in the engine's pool tensors,
takes blocks from the engine's BlockPool and gets its output from ``paged_attention``; nothing here fakes a number.
The pool is one pyqtgraph ImageItem fed an RGBA array (one cell per slot); only the handful of values in filled
slots and the block labels are text items.
"""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QAction, QFont, QKeySequence
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMainWindow, QPushButton, QSizePolicy, QVBoxLayout,
                               QWidget)

from engine import ToyPagedSequence  # the public name; its view() is what the window draws

from ..model import lesson_text, palette

CELL_X, CELL_Y = 64, 32  # pixels per slot in the image (the view scales it; this sets the gaps' proportions)
SLOT_GAP = 6
BLOCK_GAP = 8
RING = 3
LESSON_COLOUR = np.array([255, 170, 60, 255], np.uint8)  # the lesson's sequence: warm, stands out from the tenants
TENANT_COLOUR = np.array([72, 82, 104, 255], np.uint8)  # other conversations: present but in the background
CHANGED = "#ffb347"
WINDOW = 4  # the window chapter's sliding window, in positions (blocks stay 4 slots)
TEXT = "#e6e6ea"  # text drawn on the dark pool picture
MUTED = "#8a8a96"  # secondary text, readable on light and dark window themes alike


def lesson_rgba(view) -> np.ndarray:
    """uint8 [num_blocks * CELL_Y, block_size * CELL_X, 4]: block b is row b, slot s column s (block 0 on top).

    ``view`` is what ``ToyPagedSequence.view()`` returns."""
    n, bs = view.num_blocks, view.block_size
    roles = np.array(view.roles)
    filled = ~np.isnan(view.slot_values)  # [n, bs]
    lesson = roles == "lesson"
    free = roles == "free"
    colour = np.empty((n, bs, 4), np.uint8)
    colour[:] = TENANT_COLOUR
    colour[~filled & ~free[:, None]] = palette.scale(TENANT_COLOUR, 0.55)
    colour[lesson[:, None] & filled] = LESSON_COLOUR
    colour[lesson[:, None] & ~filled] = palette.scale(LESSON_COLOUR, 0.28)
    colour[free] = palette.FREE
    cell = np.broadcast_to(colour[:, None, :, None, :], (n, CELL_Y, bs, CELL_X, 4)).copy()  # [n, y, slot, x, 4]
    x0, x1 = SLOT_GAP // 2, CELL_X - SLOT_GAP // 2
    y0, y1 = BLOCK_GAP // 2, CELL_Y - BLOCK_GAP // 2
    cell[:, :, :, :x0] = palette.BACKGROUND
    cell[:, :, :, x1:] = palette.BACKGROUND
    cell[:, :y0] = palette.BACKGROUND
    cell[:, y1:] = palette.BACKGROUND
    if view.newest is not None:
        b, s = view.newest
        ring = cell[b, :, s]
        ring[y0:y0 + RING, x0:x1] = palette.SELECTED_RING
        ring[y1 - RING:y1, x0:x1] = palette.SELECTED_RING
        ring[y0:y1, x0:x0 + RING] = palette.SELECTED_RING
        ring[y0:y1, x1 - RING:x1] = palette.SELECTED_RING
    return cell.reshape(n * CELL_Y, bs * CELL_X, 4)


class PoolView(pg.GraphicsLayoutWidget):
    """The toy pool: one row of slots per physical block, values written in filled slots, the table beside it."""

    def __init__(self, num_blocks: int, block_size: int, parent=None):
        super().__init__(parent)
        self.setBackground(tuple(int(c) for c in palette.BACKGROUND[:3]))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.plot = self.addPlot()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(False, False)
        self.plot.hideButtons()
        self.plot.invertY(True)
        self.plot.hideAxis("bottom")
        self.plot.showAxis("top")
        self.plot.setXRange(0, block_size + 1.5, padding=0)
        self.plot.setYRange(0, num_blocks, padding=0.01)
        left, top = self.plot.getAxis("left"), self.plot.getAxis("top")
        left.setTicks([[(b + 0.5, f"block {b}") for b in range(num_blocks)]])
        left.setWidth(58)  # fixed: auto-sizing leaves the labels out until a second paint
        top.setTicks([[(s + 0.5, f"slot {s}") for s in range(block_size)]])
        for axis in (left, top):
            axis.setPen(pg.mkPen(MUTED))
            axis.setTextPen(pg.mkPen(TEXT))
            axis.setStyle(tickLength=0)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        value_font, label_font, self._empty_font = QFont(), QFont(), QFont()
        self._value_font = value_font
        self._empty_font.setPointSize(9)
        value_font.setPointSize(13)
        value_font.setBold(True)
        label_font.setPointSize(10)
        self._values: list[pg.TextItem] = []
        for i in range(num_blocks * block_size):  # created and placed once, shown only in filled slots of the lesson
            item = pg.TextItem(color="#1b1b22", anchor=(0.5, 0.5))
            item.setFont(value_font)
            item.setPos(i % block_size + 0.5, i // block_size + 0.5)  # slot, block
            item.hide()
            self.plot.addItem(item)
            self._values.append(item)
        self._labels: list[pg.TextItem] = []
        for b in range(num_blocks):  # beside each block: who holds it
            item = pg.TextItem(color=TEXT, anchor=(0, 0.5))
            item.setFont(label_font)
            item.setPos(block_size + 0.08, b + 0.5)
            self.plot.addItem(item)
            self._labels.append(item)
        self.setMinimumSize(300, 330)

    def show_view(self, view) -> None:
        self.image.setImage(lesson_rgba(view), autoLevels=False)
        self.image.setRect(QRectF(0, 0, view.block_size, view.num_blocks))  # one unit per slot and per block
        logical_of = {b: i for i, b in enumerate(view.block_table) if b >= 0}  # -1: released by the window
        for b in range(view.num_blocks):
            for s in range(view.block_size):
                item = self._values[b * view.block_size + s]
                v = view.slot_values[b, s]
                if view.roles[b] == "lesson":
                    empty = math.isnan(v)
                    item.setText("empty" if empty else f"{v:g}")
                    item.setColor(MUTED if empty else "#1b1b22")
                    item.setFont(self._empty_font if empty else self._value_font)
                    item.show()
                else:
                    item.hide()
            role = view.roles[b]
            if role == "lesson":
                label, colour = f"\u2190 logical {logical_of[b]}", palette.hex_colour(LESSON_COLOUR)
            elif role == "free":
                label, colour = "free", MUTED
            else:
                label, colour = f"conv {role}", MUTED
            self._labels[b].setText(label)
            self._labels[b].setColor(colour)


def table_html(table: tuple[int, ...], previous: tuple[int, ...] | None = None) -> str:
    """The block table as a two-row HTML table; entries that differ from ``previous`` are highlighted."""
    if not table:
        return f"<span style='color:{MUTED}'>Block table: empty (no block allocated yet)</span>"
    cells_l = "".join(f"<td align='center' style='padding:2px 10px'>{i}</td>" for i in range(len(table)))
    cells_p = ""
    for i, b in enumerate(table):
        if b < 0:  # released by the sliding window: a hole in the table (vLLM's null block)
            cells_p += f"<td align='center' style='padding:2px 10px; color:{MUTED}'>\u2205</td>"
            continue
        changed = previous is not None and i < len(previous) and previous[i] != b
        style = "padding:2px 10px; font-weight:bold" + (f"; color:{CHANGED}" if changed else "")
        cells_p += f"<td align='center' style='{style}'>{b}</td>"
    head = f"style='color:{MUTED}; padding-right:8px'"
    return (f"<b>Block table</b> <span style='color:{MUTED}'>(logical \u2192 physical)</span>"
            f"<table style='margin-top:4px' cellspacing='0' border='1' "
            f"bordercolor='#555'><tr><td {head}>logical</td>{cells_l}</tr>"
            f"<tr><td {head}>physical</td>{cells_p}</tr></table>")


def result_html(view) -> str:
    n = view.num_positions
    if n == 0:
        return f"<span style='color:{MUTED}'>Attention output: no positions yet</span>"
    first = max(1, n - view.sliding_window + 1) if getattr(view, "sliding_window", None) else 1
    count = n - first + 1
    stored = _stored_values(view, first, n)  # what the pool holds at those positions (an fp8 pool cuts some)
    shown = [f"{v:g}" for v in stored]
    values = ", ".join(shown) if count <= 6 else f"{shown[0]}, {shown[1]}, \u2026, {shown[-1]}"
    total = sum(stored)
    over = (f"the window of {view.sliding_window} over positions {first}..{n}" if first > 1 else
            f"paged_attention over {n} position{'s' if n > 1 else ''}")
    return (f"Attention output <span style='font-size:20pt; font-weight:bold; "
            f"color:{palette.hex_colour(LESSON_COLOUR)}'>{view.result:g}</span><br>"
            f"<span style='color:{MUTED}'>{over} = "
            f"mean({values}) = {total:g}/{count}</span>")


def _stored_values(view, first: int, last: int) -> list[float]:
    """The values the pool holds at positions first..last (1-based), read through the block table: the positions
    themselves in float32, what they were cut to in an fp8 pool."""
    table, size = view.block_table, view.block_size
    return [float(view.slot_values[table[(p - 1) // size], (p - 1) % size]) for p in range(first, last + 1)]


class LayoutPanel(QFrame):
    """A titled pool picture with its block table and attention output underneath."""

    def __init__(self, title: str, num_blocks: int, block_size: int, parent=None):
        super().__init__(parent)
        self.setFrameShape(QFrame.StyledPanel)
        layout = QVBoxLayout(self)
        self.title = QLabel(title)
        self.title.setStyleSheet("font-weight:bold; font-size:12pt")
        self.title.setWordWrap(True)
        self.pool = PoolView(num_blocks, block_size)
        self.table = QLabel()
        self.result = QLabel()
        self.table.setStyleSheet("font-size:11pt")
        for label in (self.table, self.result):
            label.setTextFormat(Qt.RichText)
            label.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)  # side-by-side panels share width equally
        layout.addWidget(self.title)
        layout.addWidget(self.pool, 1)
        layout.addWidget(self.table)
        layout.addWidget(self.result)

    def show_view(self, view, previous_table: tuple[int, ...] | None = None) -> None:
        self.pool.show_view(view)
        self.table.setText(table_html(view.block_table, previous_table))
        self.result.setText(result_html(view))


class LessonWindow(QMainWindow):
    """Step a toy sequence through a paged pool; see blocks appear, the table grow, and the output stay right."""

    def __init__(self, parent=None, seed: int = 0, kv_cache_dtype: str = "auto"):
        super().__init__(parent)
        self.setWindowTitle("Lesson: text order is not a memory address")
        self.kv_cache_dtype = kv_cache_dtype  # the engine's pool dtype: the toy stores its values the same way
        self.lesson = ToyPagedSequence(kv_cache_dtype=kv_cache_dtype)
        self.paging: ToyPagedSequence | None = None  # the window chapter's twin: the same positions, paging alone
        self.layout_seed = seed
        self._before = None  # the layout just before the last "Change layout"

        self.step_button = QPushButton("Step \u25b6   (Space / \u2192)")
        self.reset_button = QPushButton("Reset")
        self.layout_button = QPushButton("Change layout")
        self.layout_button.setToolTip("Move every used block to another physical id, data and table included")
        self.window_button = QPushButton(f"Chapter 2: a window of {WINDOW}")
        self.window_button.setCheckable(True)
        self.window_button.setToolTip("The same positions through a sliding window of 4 positions, beside paging alone")
        self.window_button.toggled.connect(self.set_window_chapter)
        self.position_label = QLabel()
        self.position_label.setStyleSheet("font-size:12pt")
        for button in (self.step_button, self.reset_button, self.layout_button, self.window_button):
            button.setFocusPolicy(Qt.NoFocus)  # Space must step, not press whichever button has focus
            button.setMinimumHeight(30)
        self.step_button.clicked.connect(self.step)
        self.reset_button.clicked.connect(self.reset)
        self.layout_button.clicked.connect(self.change_layout)
        self.step_action = QAction("Step", self)
        self.step_action.setShortcuts([QKeySequence(Qt.Key_Space), QKeySequence(Qt.Key_Right)])
        self.step_action.setShortcutContext(Qt.WindowShortcut)
        self.step_action.triggered.connect(self.step)
        self.addAction(self.step_action)

        controls = QHBoxLayout()
        controls.addWidget(self.step_button)
        controls.addWidget(self.reset_button)
        controls.addWidget(self.layout_button)
        controls.addWidget(self.window_button)
        controls.addSpacing(16)
        controls.addWidget(self.position_label)
        controls.addStretch(1)

        n, bs = self.lesson.num_blocks, self.lesson.block_size
        self.before_panel = LayoutPanel("Before the layout change", n, bs)
        self.current_panel = LayoutPanel("Physical pool", n, bs)
        self.compare_label = QLabel()
        self.compare_label.setTextFormat(Qt.RichText)
        self.compare_label.setWordWrap(True)
        self.compare_label.setStyleSheet("padding:6px; background:rgba(90,170,90,45); border:1px solid #6b8f4e")
        panels = QHBoxLayout()
        panels.addWidget(self.before_panel, 1)
        panels.addWidget(self.current_panel, 1)
        legend = QLabel(
            f"<span style='color:{palette.hex_colour(LESSON_COLOUR)}'>\u25a0</span> lesson's K/V &nbsp; "
            f"<span style='color:{palette.hex_colour(palette.scale(LESSON_COLOUR, 0.28))}'>\u25a0</span> "
            f"empty slot of its last block &nbsp; "
            f"<span style='color:{palette.hex_colour(TENANT_COLOUR)}'>\u25a0</span> other conversation &nbsp; "
            f"<span style='color:{palette.hex_colour(palette.FREE)}'>\u25a0</span> free &nbsp; "
            f"<span style='color:{palette.hex_colour(palette.SELECTED_RING)}'>\u25a1</span> newest position")
        legend.setTextFormat(Qt.RichText)
        legend.setWordWrap(True)
        left = QVBoxLayout()
        left.addLayout(panels, 1)
        left.addWidget(self.compare_label)
        left.addWidget(legend)

        self.explain_title = QLabel()
        self.explain_title.setStyleSheet("font-weight:bold; font-size:14pt")
        self.explain_title.setWordWrap(True)
        self.explain_text = QLabel()
        self.explain_text.setWordWrap(True)
        self.explain_text.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.explain_text.setStyleSheet("font-size:11pt")
        self.memory_label = QLabel()
        self.memory_label.setTextFormat(Qt.RichText)
        self.memory_label.setWordWrap(True)
        self.setup_label = QLabel()
        self.setup_label.setTextFormat(Qt.RichText)
        self.setup_label.setWordWrap(True)
        self.setup_label.setStyleSheet(f"color:{MUTED}")
        side = QVBoxLayout()
        side.addWidget(self.explain_title)
        side.addWidget(self.explain_text)
        side.addSpacing(8)
        side.addWidget(self.memory_label)
        side.addSpacing(8)
        side.addWidget(self.setup_label)
        side.addStretch(1)
        side_widget = QWidget()
        side_widget.setLayout(side)
        side_widget.setFixedWidth(380)
        side_widget.setSizePolicy(QSizePolicy.Fixed, QSizePolicy.Preferred)

        body = QHBoxLayout()
        body.addLayout(left, 1)
        body.addSpacing(12)
        body.addWidget(side_widget)
        root = QVBoxLayout()
        root.addLayout(controls)
        root.addLayout(body, 1)
        central = QWidget()
        central.setLayout(root)
        self.setCentralWidget(central)
        self.resize(1280, 780)
        self.refresh()

    # ---- actions --------------------------------------------------------------------------------------------
    def set_window_chapter(self, on: bool) -> None:
        """Chapter 2: the lesson's sequence reads through a sliding window of WINDOW positions, and a twin with
        paging alone is stepped beside it, so the one block the window gives back shows against the other's
        table that keeps everything."""
        if self.window_button.isChecked() != on:
            self.window_button.setChecked(on)  # toggled() calls back here
            return
        self.lesson = ToyPagedSequence(sliding_window=WINDOW if on else None, kv_cache_dtype=self.kv_cache_dtype)
        self.paging = ToyPagedSequence(kv_cache_dtype=self.kv_cache_dtype) if on else None
        self._before = None
        self.setWindowTitle("Lesson: a window releases what paging keeps" if on else
                            "Lesson: text order is not a memory address")
        self.refresh()

    def step(self) -> None:
        if not self.lesson.can_step():
            return
        if self.paging is not None and self.paging.can_step():
            self.paging.step()
        self.lesson.step()
        self._before = None  # the side-by-side compares one moment; a new position ends it
        self.refresh()

    def reset(self) -> None:
        self.lesson.reset()
        if self.paging is not None:
            self.paging.reset()
        self._before = None
        self.refresh()

    def change_layout(self) -> None:
        if self.lesson.num_positions == 0:
            return
        self._before = self.lesson.view()
        self.lesson.change_layout(self.layout_seed)
        self.layout_seed += 1  # a second press moves the blocks somewhere else again
        self.refresh()

    # ---- drawing --------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        lesson = self.lesson
        view = lesson.view()
        n = view.num_positions
        self.position_label.setText(f"Positions: <b>{n}</b> of at most {lesson.max_positions} &nbsp; "
                                    f"\u00b7 &nbsp; blocks used: <b>{len(view.block_table)}</b> &nbsp; "
                                    f"\u00b7 &nbsp; free queue: {', '.join(map(str, lesson.free_queue)) or 'empty'}")
        can_step = lesson.can_step()
        self.step_button.setEnabled(can_step)
        self.step_action.setEnabled(can_step)
        self.layout_button.setEnabled(n > 0 and self.paging is None)
        if self.paging is not None:
            self._refresh_window_chapter(view)
            return
        comparing = self._before is not None
        self.before_panel.setVisible(comparing)
        self.compare_label.setVisible(comparing)
        if comparing:
            change = lesson.last_change
            self.before_panel.show_view(self._before)
            self.before_panel.title.setText(f"Before the change ({n} positions)")
            self.current_panel.title.setText(f"After the change (same {n} positions)")
            self.current_panel.show_view(view, change.before_table)
            verdict = "bit-identical" if change.bit_identical else "DIFFERENT"
            self.compare_label.setText(  # random_cycle moves every block, so every table entry changed
                f"<b>Same data, other blocks.</b> Table {list(change.before_table)} \u2192 "
                f"{list(change.after_table)} (every block moved). "
                f"Output {change.before_result:g} before and {change.after_result:g} after: <b>{verdict}</b>.")
        else:
            self.current_panel.title.setText(f"Physical pool: {view.num_blocks} blocks \u00d7 {view.block_size} slots "
                                             f"(one head, dimension 1)")
            self.current_panel.show_view(view)
        m = self._explain(lesson)
        per_slot = m["contiguous_bytes"] // max(lesson.max_positions, 1)  # the engine's sizes, read from its figures
        per_entry = m["table_bytes"] // len(view.block_table) if view.block_table else 4  # int32 entries
        note = "<b>How this pool was set up</b><br>" + lesson_text.setup_note(lesson)
        if lesson.last_change is not None:
            note += " Change layout has since moved every used block, so these ids have changed."
        self.setup_label.setText(note)
        self.memory_label.setText(
            f"<b>Memory of this sequence</b><br>"
            f"K/V in use: {m['filled_slots']} slots = {m['kv_bytes']} B<br>"
            f"empty tail slots: {m['empty_tail_slots']} = {m['tail_bytes']} B<br>"
            f"block table: {len(view.block_table)} entries \u00d7 {per_entry} B = {m['table_bytes']} B<br>"
            f"<span style='color:{MUTED}'>contiguous reservation for {lesson.max_positions} positions: "
            f"{m['contiguous_bytes']} B ({per_slot} B per slot: one key + one value)</span>")

    def _explain(self, lesson) -> dict:
        """The chapter's explanation in its title and text; returns the lesson's memory figures for the caller's
        own words about them."""
        title, text = lesson_text.explanation(lesson)
        self.explain_title.setText(title)
        self.explain_text.setText(text)
        return lesson.memory()

    def _refresh_window_chapter(self, view) -> None:
        """Paging alone on the left, the window on the right, the releases said between them."""
        lesson, paging = self.lesson, self.paging
        twin = paging.view()
        self.before_panel.setVisible(True)
        self.compare_label.setVisible(True)
        self.before_panel.title.setText(f"Paging alone (full attention): {len(paging.live_blocks)} "
                                        f"block{'s' if len(paging.live_blocks) != 1 else ''} held")
        self.before_panel.show_view(twin)
        held = len(lesson.live_blocks)
        self.current_panel.title.setText(f"Window of {WINDOW}: {held} block{'s' if held != 1 else ''} held")
        self.current_panel.show_view(view)
        if lesson.released:
            gone = ", ".join(f"logical {lg} (physical {b}) at position {at}" for at, lg, b in lesson.released)
            verdict = (f"<b>Released by the window:</b> {gone}. The model never reads those positions again. "
                       f"Paging alone released nothing: its table still has {len(paging.block_table)} blocks.")
        else:
            verdict = ("<b>Nothing released yet.</b> A block goes only when every one of its positions is behind "
                       f"the window (blocks of {lesson.block_size}, a window of {WINDOW}: the first goes at "
                       f"position {2 * lesson.block_size}). Paging alone never releases anything.")
        self.compare_label.setText(verdict)
        m = self._explain(lesson)
        self.memory_label.setText(
            f"<b>Memory of this sequence</b><br>"
            f"K/V kept: {m['filled_slots']} slots = {m['kv_bytes']} B "
            f"(paging alone: {paging.memory()['filled_slots']} slots)<br>"
            f"blocks released by the window: {m['released_blocks']}<br>"
            f"block table: {len(view.block_table)} entries, \u2205 = released")
        self.setup_label.setText("<b>How this pool was set up</b><br>" + lesson_text.setup_note(lesson))

    # ---- readouts for tests and scripts ---------------------------------------------------------------------
    def result_text(self) -> str:
        return self.current_panel.result.text()

    def table_text(self) -> str:
        return self.current_panel.table.text()
