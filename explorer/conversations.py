"""The conversations table, and the detail view of the selected conversation (block table and streaming text).

The table model is updated in place from each snapshot (rows inserted, changed cells signalled) rather than
rebuilt, so selection and scroll position survive 30 updates a second.
"""
from __future__ import annotations

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.snapshot import ConversationInfo, PoolSnapshot

from .palette import conversation_colour
from .table_model import RowsModel

COLUMNS = ("id", "status", "prompt", "generated", "blocks", "shared", "tail fill")


def conversation_row(info: ConversationInfo, snapshot: PoolSnapshot) -> tuple:
    """The table cells of one conversation, derived from the snapshot's block tables."""
    table = snapshot.block_tables.get(info.conversation_id, ())
    shared = int((np.asarray(snapshot.ref_count)[list(table)] > 1).sum()) if table else 0
    tail = f"{int(snapshot.num_filled[table[-1]])}/{snapshot.block_size}" if table else "-"
    return (info.conversation_id, str(info.status), len(info.prompt_token_ids), len(info.output_token_ids),
            len(table), shared, tail)


class ConversationsModel(RowsModel):
    """One row per conversation ever added, in id order."""

    COLUMNS = COLUMNS

    def cell_data(self, row: tuple, column: int, role):
        if role == QtCore.Qt.ItemDataRole.DecorationRole and column == 0:
            return QtGui.QColor(*conversation_colour(row[0]))
        if role == QtCore.Qt.ItemDataRole.TextAlignmentRole and column >= 2:
            return int(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        return super().cell_data(row, column, role)

    def conversation_id(self, row: int) -> int:
        return self._rows[row][0]

    def row_of(self, conversation_id: int) -> int | None:
        for i, row in enumerate(self._rows):
            if row[0] == conversation_id:
                return i
        return None

    def refresh(self, snapshot: PoolSnapshot) -> None:
        """Bring the rows up to date with ``snapshot`` (conversations only ever get added, never removed)."""
        new_rows = [conversation_row(info, snapshot) for info in snapshot.conversations]
        if len(new_rows) < len(self._rows) or any(a[0] != b[0] for a, b in zip(self._rows, new_rows)):
            self.set_rows(new_rows)  # a different engine (restart): start over
            return
        old = len(self._rows)
        changed = [i for i in range(old) if self._rows[i] != new_rows[i]]
        if changed:  # one signal for the span of changed rows, not one per row
            self._rows[:old] = new_rows[:old]
            self.dataChanged.emit(self.index(changed[0], 0), self.index(changed[-1], len(COLUMNS) - 1))
        if len(new_rows) > old:
            self.beginInsertRows(QtCore.QModelIndex(), old, len(new_rows) - 1)
            self._rows.extend(new_rows[old:])
            self.endInsertRows()


class ConversationDetail(QtWidgets.QWidget):
    """Block table (logical -> physical) and the text of one conversation, prompt dim and output normal."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.title = QtWidgets.QLabel("Select a conversation to see its block table and text.")
        self.title.setWordWrap(True)
        self.table_label = QtWidgets.QLabel()
        self.table_label.setWordWrap(True)
        self.table_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.text = QtWidgets.QTextBrowser()
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.title)
        layout.addWidget(self.table_label)
        layout.addWidget(self.text, 1)
        self._key = None
        self._shown = ("", "")  # (prompt, output) currently in the text view
        self._prompt_format = QtGui.QTextCharFormat()
        self._prompt_format.setForeground(QtGui.QColor(138, 138, 150))
        self._output_format = QtGui.QTextCharFormat()

    def show_conversation(self, info: ConversationInfo | None, snapshot: PoolSnapshot) -> None:
        if info is None:
            if self._key is not None:
                self.title.setText("Select a conversation to see its block table and text.")
                self.table_label.clear()
                self.text.clear()
                self._shown = ("", "")
                self._key = None
            return
        table = snapshot.block_tables.get(info.conversation_id, ())
        refs = [int(snapshot.ref_count[b]) for b in table]
        fills = [int(snapshot.num_filled[b]) for b in table]
        key = (info.conversation_id, str(info.status), len(info.prompt_text), info.output_text, tuple(table),
               tuple(refs), tuple(fills))
        if key == self._key:
            return
        self._key = key
        r, g, b = conversation_colour(info.conversation_id)
        self.title.setText(
            f"<b style='color:rgb({r},{g},{b})'>■</b> <b>Conversation {info.conversation_id}</b> — {info.status}, "
            f"{len(info.prompt_token_ids)} prompt + {len(info.output_token_ids)} generated tokens"
            + (f", forked from {info.parent_id}" if info.parent_id is not None else "")
            + (f", {info.num_cached_tokens} prompt tokens from the prefix cache" if info.num_cached_tokens else ""))
        if table:
            cells = []
            for i, (block, ref, fill) in enumerate(zip(table, refs, fills)):
                mark = f" <b>×{ref}</b>" if ref > 1 else ""
                partial = f" ({fill}/{snapshot.block_size})" if fill < snapshot.block_size else ""
                cells.append(f"<span style='white-space:nowrap'>{i}→<b>{block}</b>{mark}{partial}</span>")
            self.table_label.setText("Block table (logical → physical): " + ", &nbsp;".join(cells))
        else:
            self.table_label.setText("Block table: empty (it holds no blocks now)")
        self._show_text(info)

    def _show_text(self, info: ConversationInfo) -> None:
        """Prompt dim, output normal; when only new output arrived, append it instead of redrawing everything."""
        scrollbar = self.text.verticalScrollBar()
        at_end = scrollbar.value() >= scrollbar.maximum() - 4
        shown_prompt, shown_output = self._shown
        cursor = QtGui.QTextCursor(self.text.document())
        if shown_prompt == info.prompt_text and info.output_text.startswith(shown_output):
            cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
            cursor.insertText(info.output_text[len(shown_output):], self._output_format)
        else:
            self.text.clear()
            cursor = QtGui.QTextCursor(self.text.document())
            cursor.insertText(info.prompt_text, self._prompt_format)
            cursor.insertText(info.output_text, self._output_format)
        self._shown = (info.prompt_text, info.output_text)
        if at_end:
            scrollbar.setValue(scrollbar.maximum())

    def plain_text(self) -> str:
        return self.text.toPlainText()


class ConversationsPanel(QtWidgets.QWidget):
    """Table of conversations with add / fork / reply / end buttons; emits what the user asked for."""

    selectionChanged = QtCore.Signal(object)  # conversation id, or None
    addRequested = QtCore.Signal()
    forkRequested = QtCore.Signal(int)
    replyRequested = QtCore.Signal(int)
    endRequested = QtCore.Signal(int)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.model = ConversationsModel(self)
        self.view = QtWidgets.QTableView()
        self.view.setModel(self.model)
        self.view.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.view.verticalHeader().hide()
        header = self.view.horizontalHeader()
        for column, width in enumerate((48, 70, 58, 78, 50, 56, 60)):  # fixed: resizing to contents re-reads
            header.resizeSection(column, width)                        # every cell on every update
        header.setStretchLastSection(True)
        self.view.verticalHeader().setDefaultSectionSize(22)
        self.view.setAlternatingRowColors(True)
        self.view.selectionModel().selectionChanged.connect(self._on_selection)
        self.buttons = {}
        bar = QtWidgets.QHBoxLayout()
        for key, text, tip in (("add", "Add…", "Ctrl+N"), ("fork", "Fork", "Ctrl+F"), ("reply", "Reply…", "Ctrl+R"),
                               ("end", "End", "Ctrl+E")):
            button = QtWidgets.QPushButton(text)
            button.setToolTip(f"{text.rstrip('…')} ({tip})")
            bar.addWidget(button)
            self.buttons[key] = button
        bar.addStretch(1)
        self.buttons["add"].clicked.connect(self.addRequested)
        self.buttons["fork"].clicked.connect(lambda: self._emit_for_selected(self.forkRequested))
        self.buttons["reply"].clicked.connect(lambda: self._emit_for_selected(self.replyRequested))
        self.buttons["end"].clicked.connect(lambda: self._emit_for_selected(self.endRequested))
        self.detail = ConversationDetail()
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        left = QtWidgets.QWidget()
        left_layout = QtWidgets.QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        left_layout.addLayout(bar)
        left_layout.addWidget(self.view, 1)
        split.addWidget(left)
        split.addWidget(self.detail)
        split.setSizes([560, 440])
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(split)
        self._snapshot: PoolSnapshot | None = None

    def selected_conversation(self) -> int | None:
        rows = self.view.selectionModel().selectedRows()
        return self.model.conversation_id(rows[0].row()) if rows else None

    def select_conversation(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row is not None:
            self.view.selectRow(row)

    def refresh(self, snapshot: PoolSnapshot) -> None:
        self._snapshot = snapshot
        self.model.refresh(snapshot)
        cid = self.selected_conversation()
        self.detail.show_conversation(snapshot.conversation(cid) if cid is not None else None, snapshot)
        self._enable_buttons()

    def _enable_buttons(self) -> None:
        cid = self.selected_conversation()
        info = self._snapshot.conversation(cid) if (cid is not None and self._snapshot) else None
        status = str(info.status) if info else ""
        self.buttons["fork"].setEnabled(status in ("waiting", "running", "preempted"))
        self.buttons["reply"].setEnabled(status == "finished")
        self.buttons["end"].setEnabled(status in ("waiting", "running", "preempted", "finished"))

    def _on_selection(self, *_):
        cid = self.selected_conversation()
        if self._snapshot is not None:
            self.detail.show_conversation(self._snapshot.conversation(cid) if cid is not None else None,
                                          self._snapshot)
        self._enable_buttons()
        self.selectionChanged.emit(cid)

    def _emit_for_selected(self, signal) -> None:
        cid = self.selected_conversation()
        if cid is not None:
            signal.emit(cid)
