"""'Would this prompt hit?' for a pool stream (``--attach``, ``--open``): the content its frames stored, and when
it left.

A pool stream's frames carry hashes per physical block, never the tokens a hash stands for; its events carry them:
a STORED event names each new hash with its parent's and its tokens (as vLLM's ``BlockStored`` does), so the book
keeps ``(parent hash, tokens) -> hash`` and can follow a prompt's blocks down the chain with no knowledge of the
source's hash function or seed. Evictions, tier drops and resets say when content left and for whom. Whether a
block is held now is read from the frame itself (device hashes, tier hashes), so a book that missed events (joined
late, history trimmed) still never calls a held block gone; a stream's content stored before the book's first
event is learnt from the frame's block tables (a live conversation's tokens under its hashed blocks), and cached
blocks nobody holds then stay unknown ("cold", said in the check's note). Bounded: the oldest entries go first.
Qt-free.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvstream.events import EventKind
from kvstream.prompt_check import Held, PromptCheck, Removal, classify_prompt
from kvstream.views import NO_HASH, BlockState, PoolSnapshot

MAX_CONTENT = 1 << 17  # (parent, tokens) -> hash entries kept; the oldest go first
MAX_REMOVALS = 1 << 17  # removals remembered
_KINDS = frozenset({EventKind.STORED, EventKind.OFFLOADED, EventKind.EVICTED, EventKind.DROPPED, EventKind.CLEARED})
LATE_NOTE = ("Content the pool cached before the explorer saw it stored (before it joined, or older than the history "
             "it keeps) is known only while a conversation holds it; such a block reads as never stored.")


class PromptBook:
    """Content and removals of one pool stream, caught up from its History before each check."""

    def __init__(self):
        self._content: OrderedDict[tuple, int] = OrderedDict()  # (parent hash or None, tokens) -> hash
        self._removed: OrderedDict[int, Removal] = OrderedDict()  # hash -> its last removal
        self._seq: int | None = None  # the last History frame read
        self._stream: int | None = None  # the History's stream id when read (a restart starts over)
        self.joined_late = False  # the first frame read was not the stream's first: earlier content is unknown

    def catch_up(self, history) -> None:
        """Read the events of the History's frames not read yet (all of them the first time, or after a
        restart of the source, or when the frames read before were dropped)."""
        if history is None or not len(history):
            return
        first, last = history.first_seq, history.last_seq
        stream = history.stream_id
        if stream != self._stream or self._seq is None or self._seq < first - 1 or self._seq > last:
            self._content.clear()
            self._removed.clear()
            self._seq, self._stream = None, stream
            self.joined_late = first > 0
        start = first if self._seq is None else self._seq + 1
        if start > last:
            return
        for _seq, event in history.events(start, last, _KINDS):
            self.apply(event)
        self._seq = last

    def apply(self, event) -> None:
        """One block event of the stream, in order."""
        kind = event.kind
        if kind in (EventKind.STORED, EventKind.OFFLOADED):
            hashes, tokens = event.block_hashes, event.token_ids
            if not hashes or len(tokens) % len(hashes):
                return
            size = len(tokens) // len(hashes)
            parent = event.parent_hash
            for i, h in enumerate(hashes):
                self._learn(parent, tuple(tokens[i * size:(i + 1) * size]), int(h))
                parent = int(h)
        elif kind == EventKind.EVICTED:
            for h in event.block_hashes:
                self._remove(int(h), Removal(event.step_id, None, "evicted", event.conversation_id, None))
        elif kind == EventKind.DROPPED:
            for h in event.block_hashes:
                self._remove(int(h), Removal(event.step_id, None, f"{event.tier} tier", event.conversation_id, None))
        elif kind == EventKind.CLEARED:
            for h in set(self._content.values()):
                self._remove(h, Removal(event.step_id, None, "reset", -1, None))

    def _learn(self, parent: int | None, tokens: tuple, h: int) -> None:
        key = (parent, tokens)
        self._content.pop(key, None)
        self._content[key] = h
        if len(self._content) > MAX_CONTENT:
            self._content.popitem(last=False)

    def _remove(self, h: int, removal: Removal) -> None:
        self._removed.pop(h, None)
        self._removed[h] = removal
        if len(self._removed) > MAX_REMOVALS:
            self._removed.popitem(last=False)

    def seed(self, snapshot: PoolSnapshot) -> None:
        """Learn the content of the hashed blocks the frame's conversations hold (their tokens are in the frame)."""
        hashes = snapshot.block_hash
        if hashes is None:
            return
        bs = snapshot.block_size
        for info in snapshot.conversations:
            table = snapshot.block_tables.get(info.conversation_id, ())
            if not table:
                continue
            tokens = info.token_ids
            parent = None
            for i, b in enumerate(table):
                h = int(hashes[b]) if 0 <= b < snapshot.num_blocks else NO_HASH
                piece = tuple(tokens[i * bs:(i + 1) * bs])
                if h == NO_HASH or len(piece) != bs:
                    break
                if self._content.get((parent, piece)) != h:
                    self._learn(parent, piece, h)
                parent = h

    def check(self, token_ids, snapshot: PoolSnapshot, history=None) -> PromptCheck:
        """The prompt against ``snapshot`` (the pool now), with the content read from ``history``."""
        self.catch_up(history)
        self.seed(snapshot)
        bs = snapshot.block_size
        ids = tuple(int(t) for t in token_ids)
        device = _device_blocks(snapshot)
        tiers = {name: set(np.asarray(view.block_hash)[np.asarray(view.state) == BlockState.CACHED].tolist())
                 for name, view in snapshot.tiers.items()}
        held: list[Held | None] = []
        chain: list[int | None] = []
        parent: int | None = None
        for i in range(len(ids) // bs):
            h = self._content.get((parent, ids[i * bs:(i + 1) * bs])) if (i == 0 or parent is not None) else None
            chain.append(h)
            parent = h
            if h is None:
                held.append(None)
            elif h in device:
                held.append(Held("device", device[h], h))
            else:
                tier = next((name for name in ("host", "disk") if h in tiers.get(name, ())), None)
                held.append(Held(tier, None, h) if tier is not None else None)

        def removal(i: int) -> Removal | None:
            h = chain[i]
            if h is None:
                return None
            return self._removed.get(h, Removal(None, None, "evicted", None, None))  # stored, gone: when unknown

        note = LATE_NOTE if self.joined_late else ""
        return classify_prompt(len(ids), bs, held, removal, source=snapshot.source, step=snapshot.step_id,
                               note=note)


def _device_blocks(snapshot: PoolSnapshot) -> dict[int, int]:
    """hash -> the device block holding it (used or cached), for group 0's keys (the plain prefix hashes)."""
    hashes = snapshot.block_hash
    if hashes is None:
        return {}
    state = np.asarray(snapshot.state)
    live = (np.asarray(hashes) != NO_HASH) & (state != BlockState.FREE)
    if snapshot.block_group is not None:
        live &= np.asarray(snapshot.block_group) == 0
    ids = np.flatnonzero(live)
    return dict(zip(np.asarray(hashes)[ids].tolist(), ids.tolist()))
