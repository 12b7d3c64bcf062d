"""One pool in the middle of the window: a header naming its source, a banner when the past is shown, the grid
with its view options, and the timeline under it.

The pane is given its :class:`~explorer.source.PoolSource` and follows it alone: the grid shows whatever view the
source says is current, the banner appears while a history frame is shown, and a new feed resets the grid. Several
panes side by side (several ``--attach``) are several sources, each with its own header.
"""
from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from .grid import COLOR_BY, COLOR_BY_LABELS
from .grid_view import GridView
from .source import PoolSource

BANNER_STYLE = ("QFrame#history-banner { background: #5a4a12; border-radius: 3px; }"
                " QFrame#history-banner QLabel { color: #ffe9a8; font-weight: bold; }")


class HistoryBanner(QtWidgets.QFrame):
    """"Viewing step N of M" with a Back to live button; hidden while the live frame is shown."""

    liveRequested = QtCore.Signal()

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("history-banner")
        self.setStyleSheet(BANNER_STYLE)
        self.label = QtWidgets.QLabel()
        self.label.setWordWrap(True)
        self.live_button = QtWidgets.QPushButton("Back to live")
        self.live_button.setToolTip("Show the newest frame again (End)")
        self.live_button.clicked.connect(self.liveRequested)
        row = QtWidgets.QHBoxLayout(self)
        row.setContentsMargins(6, 2, 6, 2)
        row.addWidget(self.label, 1)
        row.addWidget(self.live_button)
        self.hide()

    def show_step(self, step: int, live_step: int | None, running: bool) -> None:
        newest = f" of {live_step}" if live_step is not None else ""
        tail = "; the engine keeps running" if running else ""
        self.label.setText(f"Viewing step {step}{newest} (history{tail})")
        self.show()


class PoolPane(QtWidgets.QWidget):
    """Header, history banner, grid options, grid and a slot for the timeline, all bound to one source."""

    activated = QtCore.Signal(object)  # this pane (clicked or its grid clicked): the side panels follow it

    def __init__(self, source: PoolSource, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.source = source
        self.header = QtWidgets.QLabel()
        self.header.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.header.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        self.banner = HistoryBanner()
        self.banner.liveRequested.connect(source.go_live)
        self.grid = GridView()
        self.color_by = QtWidgets.QComboBox()
        for mode in COLOR_BY:
            self.color_by.addItem(COLOR_BY_LABELS[mode], mode)
        self.color_by.currentIndexChanged.connect(lambda _: self.grid.set_color_by(self.color_by.currentData()))
        self.fit = QtWidgets.QPushButton("Fit")
        self.fit.setToolTip("Show the whole pool (pan: drag, zoom: wheel)")
        self.fit.clicked.connect(self.fit_grid)
        self.follow_fit = True  # refit the whole pool on every resize until the user pans or zooms
        self._fitted_size = None  # view box size the pool was last fitted to
        self.grid.box.sigRangeChangedManually.connect(self._user_moved_view)
        self.pool_label = QtWidgets.QLabel()
        self.pool_label.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        options = QtWidgets.QHBoxLayout()
        options.addWidget(QtWidgets.QLabel("Colour by:"))
        options.addWidget(self.color_by)
        options.addWidget(self.fit)
        options.addWidget(self.pool_label, 1)
        self.unavailable = QtWidgets.QLabel()  # shown instead of the grid when the source has no physical pool
        self.unavailable.setWordWrap(True)
        self.unavailable.setAlignment(QtCore.Qt.AlignmentFlag.AlignCenter)
        self.unavailable.hide()
        self._timeline_box = QtWidgets.QVBoxLayout()
        self._timeline_box.setContentsMargins(0, 0, 0, 0)
        self.timeline: QtWidgets.QWidget | None = None
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addWidget(self.banner)
        layout.addLayout(options)
        layout.addWidget(self.grid, 1)
        layout.addWidget(self.unavailable, 1)
        layout.addLayout(self._timeline_box)
        self.grid.blockClicked.connect(lambda _block: self.activated.emit(self))
        source.sourceChanged.connect(self._on_source_changed)
        source.viewChanged.connect(self._on_view)
        source.viewingChanged.connect(lambda _seq: self._update_banner())
        self._on_source_changed(source.feed)

    def fit_grid(self) -> None:
        """Show the whole pool, and keep it whole through resizes."""
        self.follow_fit = True
        self._fitted_size = None

    def render(self) -> bool:
        """Redraw the grid if needed (the window's frame timer calls this); keeps the pool fitted to the view's
        current size until the user pans or zooms. Returns whether it drew."""
        drawn = self.grid.render()
        if self.follow_fit and self.grid.geometry_ is not None:
            size = self.grid.box.size()
            if size != self._fitted_size and size.width() > 0 and size.height() > 0:
                self._fitted_size = size
                self._fit_whole_pool(size)
        return drawn

    def _fit_whole_pool(self, size) -> None:
        """Show every cell with a small margin at the view's aspect ratio (cells stay square), widening the pan
        limits when the view is much wider or taller than the pool, so the fit is never clamped into a crop."""
        geo, box = self.grid.geometry_, self.grid.box
        pad = 1.04
        aspect = size.width() / size.height()
        height = max(geo.rows * pad, geo.cols * pad / aspect)
        width = height * aspect
        cx, cy = geo.cols / 2, geo.rows / 2
        box.setLimits(xMin=min(-0.5 * geo.cols, cx - width / 2), xMax=max(1.5 * geo.cols, cx + width / 2),
                      yMin=min(-0.5 * geo.rows, cy - height / 2), yMax=max(1.5 * geo.rows, cy + height / 2))
        box.setRange(QtCore.QRectF(cx - width / 2, cy - height / 2, width, height), padding=0)

    def _user_moved_view(self, *_):
        self.follow_fit = False

    def set_timeline(self, widget: QtWidgets.QWidget | None) -> None:
        """Put ``widget`` under the grid (replacing any timeline there)."""
        if self.timeline is not None:
            self._timeline_box.removeWidget(self.timeline)
            self.timeline.setParent(None)
        self.timeline = widget
        if widget is not None:
            self._timeline_box.addWidget(widget)

    def _on_source_changed(self, feed) -> None:
        self.grid.reset_view()
        self.follow_fit = True
        self._fitted_size = None
        caps = feed.capabilities
        note = "" if caps.can_command else f" <span style='color:#c8a040'>— read-only: {caps.read_only_reason}</span>"
        self.header.setText(f"<b>{feed.title}</b>{note}")
        self.header.setToolTip(caps.read_only_reason)
        self.grid.setVisible(caps.has_physical_pool)
        self.unavailable.setVisible(not caps.has_physical_pool)
        self.unavailable.setText("" if caps.has_physical_pool else
                                 "This source has no physical block ids, so there is no pool grid to draw: see its "
                                 "content view.")
        self.pool_label.setText("")
        self._update_banner()

    def _on_view(self, snapshot) -> None:
        self.grid.set_snapshot(snapshot)
        mem = snapshot.memory
        if mem is not None:
            text = (f"step {snapshot.step_id} · {mem.num_used_blocks} used, {mem.num_cached_blocks} cached, "
                    f"{mem.num_free_blocks} free of {snapshot.num_blocks} blocks")
        else:
            text = f"step {snapshot.step_id} · {snapshot.num_blocks} blocks"
        self.pool_label.setText(text)
        self.pool_label.setToolTip(text)
        self._update_banner()

    def _update_banner(self) -> None:
        source = self.source
        if source.viewing is None or source.view is None:
            self.banner.hide()
            return
        live = source.live.step_id if source.live is not None else None
        self.banner.show_step(source.view.step_id, live, source.can_command and not source.feed.paused)
