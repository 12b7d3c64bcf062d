"""The Block history dock: one block's story (:mod:`explorer.model.block_history`), a line an event; clicking
a line asks to jump to its frame."""
from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from ..model.block_history import BlockStory, HistoryLine

MAX_LINES = 500  # lines the widget lists (the newest); block_history() itself returns them all


class BlockHistoryView(QtWidgets.QWidget):
    """One block's history, a line an event (the Block history dock); clicking a line asks to jump to its frame.

    It is given events (from ``History.events()`` up to the frame on view) or a :class:`BlockStory`, never a
    source, so it can sit in any panel and be tested on its own.
    """

    lineActivated = QtCore.Signal(int, int)  # seq, step_id of the clicked line
    changed = QtCore.Signal()  # the block or its lines changed (the inspector's short form follows it)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.block_id: int | None = None
        self.lines: list[HistoryLine] = []  # the lines listed (the newest MAX_LINES)
        self.total = 0  # lines of the whole story (listed or not)
        self.title = QtWidgets.QLabel("Block history: select a block.")
        self.title.setWordWrap(True)
        self.list = QtWidgets.QListWidget()
        self.list.setWordWrap(True)
        self.list.setAlternatingRowColors(True)
        self.list.setTextElideMode(QtCore.Qt.TextElideMode.ElideNone)
        self.list.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.itemClicked.connect(self._clicked)
        self.list.itemActivated.connect(self._clicked)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.list, 1)

    def set_block(self, block_id: int | None, events: Iterable[tuple[int, BlockEvent]] = ()) -> None:
        """Show the history of ``block_id`` (None: nothing selected) from (seq, event) pairs, oldest first."""
        story = None if block_id is None else BlockStory(block_id, events, limit=None)  # raises before any change
        self.show_story(block_id, story)

    def show_story(self, block_id: int | None, story: BlockStory | None) -> None:
        """Show a :class:`BlockStory` (None: nothing selected)."""
        self.set_lines(block_id, story.lines if story is not None else [],
                       total=story.total if story is not None else 0)

    def set_lines(self, block_id: int | None, lines: list[HistoryLine], total: int | None = None) -> None:
        """Show lines computed elsewhere; ``total``: how many the whole story has (more than ``lines`` when older
        ones were let go)."""
        self.block_id, self.lines = block_id, list(lines[-MAX_LINES:])
        self.total = len(lines) if total is None else max(int(total), len(lines))
        self.list.clear()
        self._retitle()
        if block_id is not None:
            self._add_items(self.lines)
        self.changed.emit()

    def add_lines(self, lines: list[HistoryLine], total: int | None = None) -> None:
        """Append the newest lines of the block shown (a new frame's events) without rebuilding the list."""
        if self.block_id is None or not lines:
            return
        bar = self.list.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 2
        self.lines.extend(lines)
        self.total = self.total + len(lines) if total is None else int(total)
        excess = len(self.lines) - MAX_LINES
        if excess > 0:
            del self.lines[:excess]
            for _ in range(min(excess, self.list.count())):
                self.list.takeItem(0)  # the oldest go first (takeItem hands ownership back: it is deleted here)
        self._add_items(lines[-MAX_LINES:], scroll=at_end)
        self._retitle()
        self.changed.emit()

    def _add_items(self, lines: list[HistoryLine], scroll: bool = True) -> None:
        for line in lines:
            item = QtWidgets.QListWidgetItem(f"step {line.step_id:,}: {line.text}")
            item.setData(QtCore.Qt.ItemDataRole.UserRole, (line.seq, line.step_id))
            self.list.addItem(item)
        if scroll:
            self.list.scrollToBottom()

    def _retitle(self) -> None:
        block = self.block_id
        if block is None:
            text = "Block history: select a block."
        elif not self.total:
            text = f"Block {block}: nothing happened to it in the history kept."
        elif len(self.lines) < self.total:
            text = f"Block {block}: {self.total:,} events; the newest {len(self.lines):,} listed."
        else:
            text = f"Block {block}: {_count(self.total)} in the history kept."
        if self.title.text() != text:
            self.title.setText(text)

    def _clicked(self, item: QtWidgets.QListWidgetItem) -> None:
        seq, step_id = item.data(QtCore.Qt.ItemDataRole.UserRole)
        self.lineActivated.emit(seq, step_id)


def _count(n: int) -> str:
    return f"{n:,} event{'' if n == 1 else 's'}"
