"""One pool in the middle of the window: a header naming its source, the grid with its view options, and the
timeline under it.

The pane is given its :class:`~explorer.model.pool_source.PoolSource` and follows it alone: the grid shows whatever view the
source says is current; the timeline (when the source keeps history) is fed the kept range, the event marks and
the memory kept as the history grows (the source's ``historyChanged``; the marks come with each frame's events,
``eventsArrived``), and moves the source's own step cursor, which the source follows (its banner says "viewing step
N of M" and has Back to live). A new feed resets both. Several panes side by side (several ``--attach``) are several
sources, each with its own header.
"""
from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from ..model.pool_counts import pool_counts
from ..model.pool_source import PoolSource
from ..render.grid import COLOR_BY, COLOR_BY_LABELS
from .elided_label import ElidedLabel
from .grid_view import GridView
from .timeline import Timeline


class PoolPane(QtWidgets.QWidget):
    """Header, grid options, grid and timeline, all bound to one source."""

    activated = QtCore.Signal(object)  # this pane (clicked or its grid clicked): the side panels follow it

    def __init__(self, source: PoolSource, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.source = source
        self.header = QtWidgets.QLabel()  # the banner: wraps rather than cut its read-only reason or widen the pane
        self.header.setTextFormat(QtCore.Qt.TextFormat.RichText)
        policy = QtWidgets.QSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Minimum)
        policy.setHeightForWidth(True)  # as many lines as its width needs
        self.header.setSizePolicy(policy)
        self.header.setWordWrap(True)
        self.grid = GridView()
        self.color_by = QtWidgets.QComboBox()
        for mode in COLOR_BY:
            self.color_by.addItem(COLOR_BY_LABELS[mode], mode)
        self.color_by.currentIndexChanged.connect(lambda _: self.grid.set_color_by(self.color_by.currentData()))
        from .group_filter import GroupFilter
        from .tier_grids import TierGrids
        self.group_filter = GroupFilter()  # one KV cache group bright, the others dimmed (shown for several groups)
        self.group_filter.groupChosen.connect(self.grid.set_group_filter)
        self.tier_grids = TierGrids()  # host and disk tiers beside the device grid (shown while a tier is on)
        self.color_by.currentIndexChanged.connect(lambda _: self.tier_grids.set_color_by(self.color_by.currentData()))
        self.fit = QtWidgets.QPushButton("Fit")
        self.fit.setToolTip("Show the whole pool (pan: drag, zoom: wheel)")
        self.fit.clicked.connect(self.fit_grid)
        self.follow_fit = True  # refit the whole pool on every resize until the user pans or zooms
        self._fitted_size = None  # view box size the pool was last fitted to
        self.grid.box.sigRangeChangedManually.connect(self._user_moved_view)
        self.pool_label = ElidedLabel(min_width=0)  # the options row asks no more width than before
        options = QtWidgets.QHBoxLayout()
        self.color_label = QtWidgets.QLabel("Colour by:")
        options.addWidget(self.color_label)
        options.addWidget(self.color_by)
        options.addWidget(self.group_filter)
        options.addWidget(self.fit)
        options.addWidget(self.pool_label, 1)
        self.content_view = None  # the KV-event content view, shown instead of the grid for such a source
        self.grid.colours = source.colours
        self.timeline = Timeline()
        self.timeline.follow(source.cursor)  # one step on view: the timeline draws and moves the source's cursor
        self.timeline.budgetChanged.connect(self._set_budget)
        self._header_text: str | None = None
        self._contiguous_restart = False  # the contiguous view last placed a history frame: start over when live
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addLayout(options)
        self.split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)  # the grid, and the contiguous view
        self.split.setChildrenCollapsible(False)
        self.split.addWidget(self.grid)
        self.contiguous = None  # ContiguousView beside the grid while View > Contiguous side by side is on
        self.outer = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)  # the device pool | its lower tiers
        self.outer.setChildrenCollapsible(False)
        self.outer.addWidget(self.split)
        self.outer.addWidget(self.tier_grids)
        layout.addWidget(self.outer, 1)
        layout.addWidget(self.timeline)
        self._layout = layout
        self.grid.blockClicked.connect(lambda _block: self.activated.emit(self))
        source.sourceChanged.connect(self._on_source_changed)
        source.viewChanged.connect(self._on_view)
        source.eventsArrived.connect(self._on_events)
        source.historyChanged.connect(self.sync_timeline)
        source.cursor.subscribe(self._on_cursor)
        self._on_source_changed(source.feed)

    def fit_grid(self) -> None:
        """Show the whole pool, and keep it whole through resizes."""
        self.follow_fit = True
        self._fitted_size = None

    def render(self) -> bool:
        """Redraw the grid if needed (the window's frame timer calls this); keeps the pool fitted to the view's
        current size until the user pans or zooms. Returns whether it drew."""
        drawn = self.grid.render()
        drawn = self.tier_grids.render() or drawn
        if self.contiguous is not None:
            drawn = self.contiguous.render() or drawn
        if self.follow_fit and self.grid.geometry_ is not None:
            size = self.grid.box.size()
            beside = self.contiguous.box.size() if self.contiguous is not None else None
            if (size, beside) != self._fitted_size and size.width() > 0 and size.height() > 0:
                self._fitted_size = (size, beside)
                self.grid.fit_whole_pool()
                if self.contiguous is not None:
                    self.contiguous.fit_with_grid()  # its box is shorter: both zoom out until it shows whole
        return drawn

    def _user_moved_view(self, *_):
        self.follow_fit = False

    # ---- the timeline ------------------------------------------------------------------------------------------
    def sync_timeline(self) -> None:
        """Give the timeline what history keeps now: the range of frames and the bytes kept."""
        history = self.source.history
        if history is None or len(history) == 0:
            return
        self.timeline.set_range(history.first_seq, history.last_seq, history.step_of)
        recording = getattr(history, "recording", None)  # a recording's size is its file's, not the memory estimate
        self.timeline.set_kept(recording.num_bytes if recording is not None else history.nbytes, history.budget_bytes)

    def _on_events(self, pairs, restarted: bool) -> None:
        """A new frame's events (the source hands them out once for every panel): marks, and the range and bytes
        the History keeps now (``historyChanged`` follows the History when it writes later than the frame came)."""
        if restarted:  # a new stream (a new feed, or the attached source restarted): its marks start over
            self.timeline.clear()
        self.sync_timeline()
        if pairs:
            self.timeline.add_event_markers(pairs)
            self.tier_grids.add_events(pairs, self.source.events_snapshot)

    def _set_budget(self, nbytes) -> None:
        history = self.source.history
        if history is not None:
            history.budget_bytes = int(nbytes)
            self.sync_timeline()

    def _on_cursor(self, cursor) -> None:
        """A move made elsewhere (a seek from the event log) may name a frame newer than the range the timeline was
        last given: give it the History's range now (the cursor itself it draws on its own)."""
        if cursor.seq is not None and cursor.seq > self.timeline.last_seq:
            self.sync_timeline()

    def _on_source_changed(self, feed) -> None:
        self.grid.reset_view()
        self.tier_grids.reset()
        self.tier_grids.detokenize = getattr(feed, "detokenizer", None)
        self.follow_fit = True
        self._fitted_size = None
        caps = feed.capabilities
        self._header_text = None
        self.refresh_header()
        if self.contiguous is not None:
            self.contiguous.reset()
            self.contiguous.setVisible(caps.has_physical_pool)
        self.grid.setVisible(caps.has_physical_pool)
        self.split.setVisible(caps.has_physical_pool)  # hidden whole: an empty splitter kept half the height
        self.outer.setVisible(caps.has_physical_pool)
        for widget in (self.color_label, self.color_by, self.fit, self.pool_label):
            widget.setVisible(caps.has_physical_pool)
        self._show_content_view(feed)
        self.pool_label.setText("")
        self.timeline.clear()
        self.timeline.setVisible(caps.has_history)
        self.timeline.set_live_source(caps.is_live)
        self._on_events(self.source.kept_events(), True)  # frames the source already read (none for a new feed)

    # ---- paged against contiguous -------------------------------------------------------------------------------
    def set_contiguous(self, on: bool) -> None:
        """Show (or hide) the same conversations placed by a contiguous max-length allocator beside the grid, at
        the same scale (the two views pan and zoom across together)."""
        if on and self.contiguous is None and self.source.capabilities.has_physical_pool:
            from .contiguous_view import ContiguousView
            self.contiguous = ContiguousView()
            self.contiguous.colours = self.source.colours
            self.contiguous.link_to(self.grid.box)
            self.split.addWidget(self.contiguous)
            half = max(self.split.width(), 2) // 2  # equal halves ([1, 1] gave the grid a third: size hints won)
            self.split.setSizes([half, half])
            if self.source.view is not None:
                self.contiguous.set_snapshot(self.source.view)
        elif not on and self.contiguous is not None:
            self.contiguous.setParent(None)
            self.contiguous.deleteLater()
            self.contiguous = None

    def refresh_header(self) -> None:
        """Name the source, say how it is doing (live, silent, replaying) and, if read-only, why."""
        feed = self.source.feed
        caps = feed.capabilities
        state = "" if caps.can_command else f" · {feed.status_text()}"  # the engine's state is its toolbar's
        note = "" if caps.can_command else f" <span style='color:#c8a040'>— read-only: {caps.read_only_reason}</span>"
        text = f"<b>{feed.title}</b>{state}{note}"
        if text != self._header_text:
            self._header_text = text
            self.header.setText(text)
            self.header.setToolTip(caps.read_only_reason or feed.title)

    def _show_content_view(self, feed) -> None:
        """A source without physical block ids (KV events) gets the content view where the grid would be."""
        if self.content_view is not None:
            self._layout.removeWidget(self.content_view)
            self.content_view.timer.stop()
            self.content_view.deleteLater()
            self.content_view = None
        subscriber = getattr(feed, "subscriber", None)
        if feed.capabilities.has_physical_pool or subscriber is None or not hasattr(subscriber, "indexes"):
            return
        from .content_view import ContentView
        self.content_view = ContentView(subscriber.indexes, getattr(feed, "tokenizer", None))
        self.content_view.attach(subscriber)
        self._layout.insertWidget(self._layout.indexOf(self.outer) + 1, self.content_view, 1)

    def _on_view(self, snapshot) -> None:
        self.grid.set_snapshot(snapshot, self.source.view_changes)  # what its frame says changed: drawn alone
        tiers_shown = self.tier_grids.isVisibleTo(self)
        self.tier_grids.set_snapshot(snapshot)
        if not tiers_shown and self.tier_grids.isVisibleTo(self):  # tiers appear: the device pool keeps 3/5
            width = max(self.outer.width(), 5)
            self.outer.setSizes([width * 3 // 5, width - width * 3 // 5])
        self.group_filter.set_groups(snapshot)
        if self.contiguous is not None:
            if self.source.viewing is not None or self._contiguous_restart:
                self.contiguous.reset()  # a frame out of order (history): placed afresh, not from the last one
            self._contiguous_restart = self.source.viewing is not None
            self.contiguous.set_snapshot(snapshot)
        text = pool_counts(snapshot).header_text(snapshot.step_id)  # the same counts as the status bar's
        if text != self.pool_label.text():
            self.pool_label.setText(text)
            self.pool_label.setToolTip(text)
