"""One block's own story, told from the block events kept in history: who held it, when it was stored (hashed),
copied on write, cached, evicted, and where it came from when every block was relocated.

A relocation renames blocks, so a block's past is followed by its content, not by its number: the block that is
12 now may have been 35 before step 500 ("moved from 35 to 12"), and block 35's events before that step are
its story. ``block_history`` is Qt-free; :class:`BlockHistoryView` is the small list the inspector embeds.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from PySide6 import QtCore, QtWidgets

from kvstream.events import BlockEvent, EventKind

MAX_LINES = 500  # lines the widget lists (the newest); the function itself returns them all


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
    lines = []
    hashed: bool | None = None  # whether the block holds a prefix hash now; None before any event tells
    for seq, e, bid in block_events(events, block_id):
        text = _line_text(e, bid, hashed)
        hashed = _hashed_after(e, bid, hashed)
        if text:
            lines.append(HistoryLine(seq, e.step_id, text))
    return lines


def _line_text(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    who = f"conversation {e.conversation_id}"
    kind = e.kind
    if kind == EventKind.ALLOCATED:
        return f"allocated to {who}"
    if kind == EventKind.SHARED:
        if e.reason == "prefix_hit":
            return f"{who} reused it for its prompt (prefix cache hit)"
        if e.reason == "fork":
            return f"shared with {who}, a fork of conversation {e.other_id}"
        return f"{who} took one more reference to it"
    if kind == EventKind.COPIED_ON_WRITE:
        src, dst = e.block_ids[0], e.new_block_ids[0]
        if bid == dst and bid != src:
            return f"made for {who} as a copy of block {src} (copy on write)"
        return f"{who} wrote into it while shared: copied to block {dst}, which {who} holds instead"
    if kind == EventKind.STORED:
        k = e.block_ids.index(bid)
        digest = f" (hash {e.block_hashes[k]:016x})" if k < len(e.block_hashes) else ""
        owner = f" for {who}" if e.conversation_id >= 0 else ""
        return f"full and hashed{owner}{digest}: a prompt with this prefix can reuse it"
    if kind == EventKind.RELEASED:
        return f"{who} let go of it; others still hold it"
    if kind == EventKind.CACHED:
        return f"{who} let go of it: free, KV kept cached for reuse"
    if kind == EventKind.FREED:
        return f"{who} let go of it: free"
    if kind == EventKind.EVICTED:
        return f"evicted: its cached KV dropped so {who} could have it" if e.conversation_id >= 0 else \
            "evicted: its cached KV dropped"
    if kind == EventKind.PREEMPTED:
        return f"{who} preempted: lost it (to be recomputed)"
    if kind == EventKind.RELOCATED:
        if bid in e.new_block_ids:
            old = e.block_ids[e.new_block_ids.index(bid)]
            return f"moved from {old} to {bid} (every block moved)" if old != bid else \
                f"stayed at {bid} when every block moved"
        if bid in e.block_ids:
            new = e.new_block_ids[e.block_ids.index(bid)]
            return f"every block moved: what block {bid} held went to block {new}; nothing moved in"
        return f"every block moved; block {bid} was free and stayed free"
    if kind == EventKind.CLEARED:
        if hashed is False:
            return ""  # nothing to drop
        return "prefix cache cleared: its hash dropped" if hashed else \
            "prefix cache cleared: any hash it had was dropped"
    return ""  # conversation events name no blocks


def _hashed_after(e: BlockEvent, bid: int, hashed: bool | None) -> bool | None:
    if e.kind == EventKind.STORED:
        return True
    if e.kind in (EventKind.ALLOCATED, EventKind.FREED, EventKind.EVICTED, EventKind.CLEARED):
        return False
    if e.kind == EventKind.COPIED_ON_WRITE and bid == e.new_block_ids[0]:
        return False  # a fresh copy of a block being written: not hashed
    return hashed


class BlockHistoryView(QtWidgets.QWidget):
    """A short list of one block's history for the inspector; clicking a line asks to jump to its frame.

    It is given events (from ``History.events()`` up to the frame on view), never a source, so it can sit in any
    panel and be tested on its own.
    """

    lineActivated = QtCore.Signal(int, int)  # seq, step_id of the clicked line

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.block_id: int | None = None
        self.lines: list[HistoryLine] = []
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
        lines = [] if block_id is None else block_history(events, block_id)  # raises before anything changes
        self.set_lines(block_id, lines)

    def set_lines(self, block_id: int | None, lines: list[HistoryLine]) -> None:
        """Show lines computed elsewhere (say, on a worker thread)."""
        self.block_id, self.lines = block_id, list(lines)
        self.list.clear()
        if block_id is None:
            self.title.setText("Block history: select a block.")
            return
        shown = self.lines[-MAX_LINES:]
        if not self.lines:
            self.title.setText(f"Block {block_id}: nothing happened to it in the history kept.")
        elif len(shown) < len(self.lines):
            self.title.setText(f"Block {block_id}: {len(self.lines):,} events; the newest {len(shown):,} listed.")
        else:
            self.title.setText(f"Block {block_id}: {_count(len(self.lines))} in the history kept.")
        for line in shown:
            item = QtWidgets.QListWidgetItem(f"step {line.step_id:,}: {line.text}")
            item.setData(QtCore.Qt.ItemDataRole.UserRole, (line.seq, line.step_id))
            self.list.addItem(item)
        self.list.scrollToBottom()

    def _clicked(self, item: QtWidgets.QListWidgetItem) -> None:
        seq, step_id = item.data(QtCore.Qt.ItemDataRole.UserRole)
        self.lineActivated.emit(seq, step_id)


def _count(n: int) -> str:
    return f"{n:,} event{'' if n == 1 else 's'}"
