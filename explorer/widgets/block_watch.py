"""Keeps the block inspector on the selected block, by itself: the window only says which block is selected.

Every view the source delivers updates the inspector's summary at once (state, ref count, fill, owners come with
the view). Full details (tokens, hash, K/V) are asked of the source at most five times a second, and only when the
block's summary changed or the view moved to another frame: ``inspect_block`` on the local engine goes through the
engine thread, and asking in a loop would keep it busy. A relocation moves the selection with the block's content.
"""
from __future__ import annotations

from PySide6 import QtCore

from kvstream.events import EventKind

from ..model.pool_source import PoolSource

INSPECT_INTERVAL_MS = 200  # at most 5 detail requests a second


class BlockWatch(QtCore.QObject):
    """Selection -> inspector, through a :class:`PoolSource` (which may be swapped with :meth:`set_source`)."""

    selectionChanged = QtCore.Signal(object)  # block id or None (also when a relocation moved it)

    def __init__(self, source: PoolSource, inspector, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self.inspector = inspector
        self.source: PoolSource | None = None
        self.block_id: int | None = None
        self.moved_from: int | None = None  # the id the selected block had before the last relocation
        self.requests = 0  # detail requests sent (tests read it)
        self._due = False
        self._pending = None
        self._key = None
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(INSPECT_INTERVAL_MS)
        self.timer.timeout.connect(self._request)
        self.timer.start()
        self.set_source(source)

    def set_source(self, source: PoolSource) -> None:
        if self.source is source:
            return
        PoolSource.switch(self.source, source, viewChanged=self._on_view, sourceChanged=self._on_source_changed,
                          viewingChanged=self._on_viewing, eventsArrived=self._on_events)
        self.source = source
        self._on_source_changed(source.feed)

    def select(self, block_id: int | None) -> None:
        """The user picked a block (or nothing)."""
        self.block_id = None if block_id is None else int(block_id)
        self.moved_from = None
        self.inspector.select(self.block_id, self.source.view, seq=self.source.viewing)
        self._key = None
        self._due = self.block_id is not None
        self.selectionChanged.emit(self.block_id)
        self._request()

    def stop(self) -> None:
        self.timer.stop()

    # ---- following the source ---------------------------------------------------------------------------------
    def _on_source_changed(self, _feed) -> None:
        self._pending = None
        if self.block_id is not None:
            self.select(None)

    def _on_viewing(self, _seq) -> None:
        self._key = None  # another frame: ask for its details again
        self._pending = None  # an answer still on its way is of the frame left: never shown over this one
        self._due = self.block_id is not None

    def _on_view(self, snapshot) -> None:
        b = self.block_id
        if b is None:
            return
        if b >= snapshot.num_blocks:
            self.select(None)
            return
        owners = list(snapshot.owners_of(b))
        self.inspector.show_summary(snapshot, owners=owners, seq=self.source.viewing)  # of the frame viewed
        key = (self.source.viewing, int(snapshot.state[b]), int(snapshot.ref_count[b]), int(snapshot.num_filled[b]),
               int(snapshot.owner[b]), int(snapshot.last_access[b]), tuple(owners))
        if key != self._key:
            self._key = key
            self._due = True

    def _on_events(self, pairs, restarted: bool) -> None:
        """Live only: when new frames hold a relocation that moved the selected block, select its new id (the
        frames of a restarted stream are not news: they were there before the selection)."""
        if restarted or self.block_id is None or self.source.viewing is not None:
            return
        for seq, event in pairs:
            if event.kind != EventKind.RELOCATED:
                continue
            mapping = dict(zip(event.block_ids, event.new_block_ids))  # old id -> new id
            old = self.block_id
            if old not in mapping or mapping[old] == old:
                continue
            new = int(mapping[old])
            follow = getattr(self.inspector, "follow_relocation", None)
            if follow is not None:
                follow(mapping, seq=seq)  # the inspector keeps its contents and says "moved from old to new"
            else:
                self.inspector.select(new, self.source.view)
            self.block_id, self.moved_from = new, old
            self._key = None
            self._due = True
            self.selectionChanged.emit(new)

    def _request(self) -> None:
        b = self.block_id
        if b is None or not self._due or self._pending is not None:
            return
        self._due = False
        self.requests += 1
        source = self.source
        future = self._pending = source.inspect_block(b)

        def done(info) -> None:
            if future is self._pending:
                self._pending = None
                self.inspector.show_block(info)

        def failed(exc) -> None:
            if future is self._pending:
                self._pending = None
                self.inspector.note.setText(f"Could not inspect block {b}: {exc}")

        source.futures.watch(future, done, failed)
