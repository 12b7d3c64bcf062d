"""One block's own story, told from the block events kept in history: who held it, when it was stored (hashed),
copied on write, cached, evicted, and where it came from when every block was relocated.

A relocation renames blocks, so a block's past is followed by its content, not by its number: the block that is
12 now may have been 35 before step 500 ("moved from 35 to 12"), and block 35's events before that step are
its story. ``block_history`` is Qt-free; :class:`BlockHistoryView` is the list of the Block history dock, and the
inspector shows its newest few lines (``Inspector.follow_history``).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from PySide6 import QtCore, QtWidgets

from kvstream.events import BlockEvent, EventKind

from .event_text import block_phrase

MAX_LINES = 500  # lines the widget lists (the newest); block_history() itself returns them all
MAX_KEPT = 5000  # lines a live BlockStory keeps (the newest); older ones are counted, not kept


class HistoryLine(NamedTuple):
    """One thing that happened to the block, in the frame ``seq`` of step ``step_id``."""

    seq: int  # frame the event arrived in (what the timeline seeks to)
    step_id: int  # engine step of the event
    text: str  # what happened to the block, in words


def block_events(events: Iterable[tuple[int, BlockEvent]], block_id: int) -> list[tuple[int, BlockEvent, int]]:
    """The (seq, event, the block's id at that event) triples that concern the block that is ``block_id`` after
    the last of the (seq, event) pairs, oldest first, following its content back through relocations."""
    if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
        raise ValueError(f"a block id is a non-negative integer, not {block_id!r}")
    picked: list[tuple[int, BlockEvent, int]] = []  # newest first
    cur = block_id
    for seq, e in reversed(list(events)):
        if not isinstance(e, BlockEvent):
            raise TypeError(f"block_history() takes (seq, BlockEvent) pairs, not {type(e).__name__}")
        if e.kind == EventKind.RELOCATED:
            picked.append((seq, e, cur))
            try:
                cur = e.block_ids[e.new_block_ids.index(cur)]  # its id before the move
            except ValueError:
                if cur in e.block_ids:  # what this id held moved away and nothing moved in: a new story starts
                    break
        elif e.kind == EventKind.CLEARED or cur in e.block_ids or cur in e.new_block_ids:
            picked.append((seq, e, cur))
    picked.reverse()
    return picked


def block_history(events: Iterable[tuple[int, BlockEvent]], block_id: int) -> list[HistoryLine]:
    """What happened to the block that is ``block_id`` after the last of the (seq, event) pairs, in words, oldest
    first (see :func:`block_events`)."""
    return BlockStory(block_id, events, limit=None).lines


class BlockStory:
    """One block's history, kept up to date as frames arrive: computed once from the events kept, then extended
    with each new frame's events instead of being recomputed from every kept event.

    At most ``limit`` lines are kept (the newest; ``dropped`` counts the older ones let go). :meth:`extend` declines
    (returns False) when a new event relocates the block: the selection then follows it to its new id, and the
    story is computed again for that id."""

    def __init__(self, block_id: int, events: Iterable[tuple[int, BlockEvent]] = (), limit: int | None = MAX_KEPT):
        self.block_id = block_id  # the block's id after the newest event seen
        self.limit = limit  # lines kept at most (None: all)
        self.lines: list[HistoryLine] = []  # oldest first
        self.dropped = 0  # older lines let go to stay within ``limit``
        self._hashed: bool | None = None  # whether the block holds a prefix hash after the newest line
        for seq, e, bid in block_events(events, block_id):
            self._add(seq, e, bid)
        self._trim()

    @property
    def total(self) -> int:
        """Lines of the whole story, kept or let go."""
        return len(self.lines) + self.dropped

    def extend(self, pairs: Iterable[tuple[int, BlockEvent]]) -> list[HistoryLine] | None:
        """Add newer (seq, event) pairs, oldest first; returns the lines added, or None (nothing changed) when one
        of them relocates this block (compute the story again for the id it moved to)."""
        pairs = list(pairs)
        b = self.block_id
        for _, e in pairs:
            if not isinstance(e, BlockEvent):
                raise TypeError(f"a block's story takes (seq, BlockEvent) pairs, not {type(e).__name__}")
            if e.kind == EventKind.RELOCATED and (b in e.block_ids or b in e.new_block_ids):
                return None
        before = len(self.lines)
        for seq, e in pairs:
            if e.kind in (EventKind.RELOCATED, EventKind.CLEARED) or b in e.block_ids or b in e.new_block_ids:
                self._add(seq, e, b)
        added = self.lines[before:]
        self._trim()
        return added

    def _add(self, seq: int, e: BlockEvent, bid: int) -> None:
        text = block_phrase(e, bid, self._hashed)
        self._hashed = _hashed_after(e, bid, self._hashed)
        if text:
            self.lines.append(HistoryLine(seq, e.step_id, text))

    def _trim(self) -> None:
        excess = 0 if self.limit is None else len(self.lines) - self.limit
        if excess > 0:
            del self.lines[:excess]
            self.dropped += excess


def _hashed_after(e: BlockEvent, bid: int, hashed: bool | None) -> bool | None:
    if e.kind == EventKind.STORED:
        return True
    if e.kind in (EventKind.ALLOCATED, EventKind.FREED, EventKind.EVICTED, EventKind.CLEARED):
        return False
    if e.kind == EventKind.COPIED_ON_WRITE and bid == e.new_block_ids[0]:
        return False  # a fresh copy of a block being written: not hashed
    return hashed


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
