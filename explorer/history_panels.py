"""The window's history panels: the event log and the selected block's own history, fed from the active source.

Both read the source's kvstream History and nothing else: the event log gets each new frame's events (and starts
over when the source, or the stream behind it, changes); the block history is recomputed from the events kept up
to the frame on view, when the selection or the frame changes and at most once a second while live. A click on a
line of either becomes a jump: the source shows that frame (the timeline follows) and what the line is about is
selected.
"""
from __future__ import annotations

from PySide6 import QtCore

from .block_history import BlockHistoryView
from .eventlog import EventLog
from .source import PoolSource

BLOCK_HISTORY_INTERVAL_S = 1.0  # the selected block's history is recomputed at most once a second while live


class HistoryPanels(QtCore.QObject):
    """Owns the event-log dock and the block-history widget; the window gives it its source and selection."""

    def __init__(self, window, block_watch):
        super().__init__(window)
        self.window = window  # for select_block, the conversations panel and the status line
        self.block_watch = block_watch  # says which block is selected
        self.event_log = EventLog(window)
        self.block_history = BlockHistoryView()
        self.source: PoolSource | None = None
        self._logged_seq: int | None = None  # newest history frame whose events are in the log
        self._logged_stream: int | None = None  # stream id of those frames
        self._stale = False  # the block history needs recomputing
        self._timer = QtCore.QTimer(self)
        self._timer.setInterval(int(BLOCK_HISTORY_INTERVAL_S * 1000))
        self._timer.timeout.connect(self._refresh_if_stale)
        self._timer.start()
        self.event_log.eventActivated.connect(self.jump_to_event)
        self.block_history.lineActivated.connect(lambda seq, _step: self.jump_to(seq))
        block_watch.selectionChanged.connect(lambda _block: self.refresh_block_history())

    def set_source(self, source: PoolSource) -> None:
        """Follow ``source`` (the window's active one) from now on."""
        if self.source is not None:
            self.source.frameArrived.disconnect(self._on_frame)
            self.source.sourceChanged.disconnect(self._on_source_changed)
            self.source.viewingChanged.disconnect(self._on_viewing)
        self.source = source
        source.frameArrived.connect(self._on_frame)
        source.sourceChanged.connect(self._on_source_changed)
        source.viewingChanged.connect(self._on_viewing)
        self._on_source_changed(source.feed)

    def stop(self) -> None:
        self._timer.stop()

    # ---- following the source -----------------------------------------------------------------------------------
    def _on_source_changed(self, _feed) -> None:
        self.event_log.clear()
        self._logged_seq = self._logged_stream = None
        self._log_new_events()
        self.block_history.set_block(None)

    def _on_frame(self, _snapshot) -> None:
        self._log_new_events()

    def _on_viewing(self, _seq) -> None:
        self.refresh_block_history()

    def _log_new_events(self) -> None:
        history = self.source.history
        if history is None or len(history) == 0:
            return
        first, last = history.first_seq, history.last_seq
        if history.stream_id != self._logged_stream:  # a new stream (the attached source restarted)
            self.event_log.clear()
            self._logged_seq, self._logged_stream = None, history.stream_id
        start = first if self._logged_seq is None else max(first, self._logged_seq + 1)
        if start <= last:
            self.event_log.append_events(history.events(start, last))
            self._stale = self.block_watch.block_id is not None and self.source.viewing is None
        self._logged_seq = last

    def _refresh_if_stale(self) -> None:
        if self._stale:
            self.refresh_block_history()

    def refresh_block_history(self) -> None:
        """The selected block's own story, from the events history keeps up to the frame on view."""
        self._stale = False
        history, block = self.source.history, self.block_watch.block_id
        if history is None or len(history) == 0 or block is None:
            self.block_history.set_block(block, ())
            return
        upto = self.source.viewing if self.source.viewing is not None else history.last_seq
        self.block_history.set_block(block, history.events(None, upto))

    # ---- jumps ----------------------------------------------------------------------------------------------------
    def jump_to(self, seq: int) -> bool:
        """Show history frame ``seq`` in every view (the timeline follows); False, with a message, if not kept."""
        history = self.source.history
        if history is None or len(history) == 0 or not history.first_seq <= seq <= history.last_seq:
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
