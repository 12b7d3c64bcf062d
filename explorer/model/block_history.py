"""One block's own story, told from the block events kept in history: who held it, when it was stored (hashed),
copied on write, cached, evicted, and where it came from when every block was relocated.

A relocation renames blocks, so a block's past is followed by its content, not by its number: the block that is
12 now may have been 35 before step 500 ("moved from 35 to 12"), and block 35's events before that step are
its story. Qt-free; :class:`~explorer.widgets.block_history_view.BlockHistoryView` is the list of the Block history dock, and the
inspector shows its newest few lines (``Inspector.follow_history``).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from kvstream.events import BlockEvent, EventKind

from .event_text import block_phrase

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
        b = self.block_id
        mine = []  # the pairs that name this block (or every block), checked in one pass before anything changes
        for pair in pairs:
            e = pair[1]
            if type(e) is not BlockEvent and not isinstance(e, BlockEvent):
                raise TypeError(f"a block's story takes (seq, BlockEvent) pairs, not {type(e).__name__}")
            if e.kind is EventKind.RELOCATED:
                if b in e.block_ids or b in e.new_block_ids:
                    return None
                mine.append(pair)
            elif e.kind is EventKind.CLEARED or b in e.block_ids or b in e.new_block_ids:
                mine.append(pair)
        before = len(self.lines)
        for seq, e in mine:
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
