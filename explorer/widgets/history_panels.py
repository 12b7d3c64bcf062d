"""The window's history panels: the event log and the selected block's own history, fed from the active source.

Both follow the events that come with each new frame of the source (``PoolSource.eventsArrived``, the feed's
frame and its events as one unit): the event log appends them (and starts over when the source, or the stream
behind it, changes); the block history is computed when the selection or the frame on view changes (from the
History for the past, and the events handed out for the newest frames), and while live it is extended with the new
events that concern the block (never recomputed from every kept event). Without a History both still follow the
live frames.
A click on a line of either becomes a jump: the source shows that frame (the timeline follows) and what the line
is about is selected.
"""
from __future__ import annotations

from PySide6 import QtCore

from ..model.block_history import BlockStory
from .block_history_view import BlockHistoryView
from .eventlog import EventLog
from ..model.pool_source import PoolSource

SETTLE_MS = 150  # how long the frame on view must rest before the selected block's story is told up to it


class HistoryPanels(QtCore.QObject):
    """Owns the event-log dock and the block-history widget; the window gives it its source and selection."""

    def __init__(self, window, block_watch):
        super().__init__(window)
        self.window = window  # for select_block, the conversations panel and the status line
        self.block_watch = block_watch  # says which block is selected
        self.event_log = EventLog(window)
        self.block_history = BlockHistoryView()
        self.source: PoolSource | None = None
        self.story: BlockStory | None = None  # the selected block's story while live (extended frame by frame)
        self._story_seq: int | None = None  # newest frame whose events the story has seen
        self.recomputed = 0  # times the block's story was computed from every kept event (tests read it)
        # Telling a block's story up to a past frame walks every kept event (a large share of a second in a long
        # recording: docs/performance.md, "Scrubbing"): while the timeline moves it is told once the frame on view
        # has rested SETTLE_MS.
        self._settle = QtCore.QTimer(self)
        self._settle.setSingleShot(True)
        self._settle.setInterval(SETTLE_MS)
        self._settle.timeout.connect(self.refresh_block_history)
        self.event_log.eventActivated.connect(self.jump_to_event)
        self.block_history.lineActivated.connect(lambda seq, _step: self.jump_to(seq))
        block_watch.selectionChanged.connect(lambda _block: self.refresh_block_history())

    def set_source(self, source: PoolSource) -> None:
        """Follow ``source`` (the window's active one) from now on."""
        PoolSource.switch(self.source, source, eventsArrived=self._on_events, eventsDropped=self._on_dropped,
                          sourceChanged=self._on_source_changed, viewingChanged=self._on_viewing)
        self.source = source
        self._on_source_changed(source.feed)

    # ---- following the source -----------------------------------------------------------------------------------
    def _on_source_changed(self, _feed) -> None:
        self.event_log.clear()
        self.event_log.append_events(self.source.kept_events())  # none for a new feed: its frames come as events
        self.story = None
        self.block_history.set_block(None)

    def _on_events(self, pairs, restarted: bool) -> None:
        if restarted:  # a new stream (the attached source restarted): the log starts over
            self.event_log.clear()
        if pairs:
            self.event_log.append_events(pairs)
        if self.block_watch.block_id is None or self.source.viewing is not None:
            return
        story, seen = self.story, self._story_seq
        if seen is not None:
            pairs = [pair for pair in pairs if pair[0] > seen]  # a recompute during this signal saw them already
        added = None if (restarted or story is None or story.block_id != self.block_watch.block_id) \
            else story.extend(pairs)
        self._story_seq = self.source.events_seq
        if added is None:  # a relocation moved the block (or the stream restarted): tell its story again
            self.refresh_block_history()
        elif added:
            self.block_history.add_lines(added, story.total)

    def _on_dropped(self, count: int) -> None:
        """The feed let events go because the window fell too far behind it: the log has a gap, said where the
        user looks for it."""
        self.window.statusBar().showMessage(f"{count:,} events were dropped: the window fell behind the engine "
                                            f"({self.source.events_dropped:,} in all); the event log has a gap.", 8000)

    def _on_viewing(self, seq) -> None:
        if seq is None or self.block_watch.block_id is None:
            self._settle.stop()
            self.refresh_block_history()
        else:  # a frame of the past: told once the timeline rests, not for every frame dragged or played past
            self._settle.start()

    def refresh_block_history(self) -> None:
        """The selected block's own story, up to the frame on view: from the History for the past, and while live
        up to the newest frame whose events the source handed out (the History may trail it), so that the next
        eventsArrived continues the story exactly; a source without a History tells it from the events it kept."""
        block = self.block_watch.block_id
        self.story = None
        live = self.source.viewing is None
        if block is None or (self.source.events_seq is None and live):
            self.block_history.set_block(block, ())
            return
        pairs = self.source.block_events(block, None if live else self.source.viewing)  # can concern it
        story = BlockStory(block, pairs)
        self.recomputed += 1
        if live:
            self.story, self._story_seq = story, self.source.events_seq
        self.block_history.show_story(block, story)

    # ---- jumps ----------------------------------------------------------------------------------------------------
    def jump_to(self, seq: int) -> bool:
        """Show history frame ``seq`` in every view (the timeline follows); False, with a message, if not kept."""
        history = self.source.history
        if history is None:
            self.window.statusBar().showMessage("This source keeps no history to go back to.", 5000)
            return False
        if len(history) == 0 or not history.first_seq <= seq <= history.last_seq:
            self.window.statusBar().showMessage(f"Frame {seq} is no longer kept in history (memory budget).", 5000)
            return False
        self.source.seek(seq)
        return True

    def jump_to_event(self, seq: int, _step: int, conversation_id: int, block_id: int) -> None:
        """An event clicked in the log: go to its frame and select what it is about."""
        if not self.jump_to(seq):
            return
        if block_id >= 0:
            self.window.select_block(block_id)
        view = self.source.view
        if conversation_id >= 0 and view is not None and view.conversation(conversation_id) is not None:
            self.window.conversations.refresh(view)
            self.window.conversations.select_conversation(conversation_id)
