"""Plots of the pool over time: what paging allocates, what it wastes, what sharing saves, what contiguous
reservation would have needed, and how fast decode goes.

One sample is recorded per engine step the GUI sees (at most one per frame; a snapshot published after a command
updates its step's sample); curves are redrawn a few times a second, which is plenty for a human and keeps the GUI
thread light while the engine decodes.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.views import PoolSnapshot

from ..model.metrics_history import MetricsHistory
from .painting import cache_plot_axes

EMPTY_STEPS = 10  # x span of a plot before any sample (and the least span after), so axes read as steps
PLOTS = (  # title, [(series, label, colour)]
    ("Blocks", [("used", "used", "#50c878"), ("cached", "cached", "#5a82d2"), ("free", "free", "#9a9aa6")]),
    ("Token slots", [("allocated", "allocated", "#f0a030"), ("filled", "filled", "#50c878")]),
    ("Saved by sharing (slots)", [("saved", "saved", "#ffffff")]),
    ("Contiguous max-length vs paged",
     [("contiguous", "contiguous", "#e0443e"), ("allocated", "paged", "#f0a030")]),
    ("Decode tokens/s", [("tokens_per_s", "tokens/s", "#50c8c8")]),
    ("Preemptions (total)", [("preemptions", "preemptions", "#e0443e")]),
    ("Prefix-cache hit rate (%)", [("hit_rate", "hit rate", "#d2d250")]),
)


def _top(values: np.ndarray) -> float:
    """The largest measured value (0 when nothing was measured)."""
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else 0.0


MIN_PLOT_WIDTH, MIN_PLOT_HEIGHT = 230, 150  # pixels a plot needs for readable ticks and title
MAX_COLUMNS = 4


class MetricsPanel(QtWidgets.QWidget):
    """A grid of small plots sharing the engine step as x axis.

    The grid reflows to the panel's width (four plots a row on a wide screen, fewer on a narrow one) and scrolls
    vertically rather than squashing plots below legibility (at 1366 x 768 the fourth column ran past the window's
    edge and the tick labels of the short rows overlapped)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.history = MetricsHistory()
        self.plots = pg.GraphicsLayoutWidget()
        self.plots.setMinimumSize(MIN_PLOT_WIDTH, MIN_PLOT_HEIGHT)
        self.curves: list[tuple[str, pg.PlotDataItem]] = []
        self.plot_items: list[tuple[pg.PlotItem, list[str]]] = []
        self.columns = 0  # plots per row now (set by _reflow)
        for title, series in PLOTS:
            plot = pg.PlotItem(title=f"<span style='font-size:9pt'>{title}</span>")
            plot.enableAutoRange(x=False, y=False)  # ranges are set in redraw: empty or one-sample plots too
            for side in ("left", "bottom"):  # "(x0.001)" on an axis that spans one step is noise, not a unit
                plot.getAxis(side).enableAutoSIPrefix(False)
            self.plot_items.append((plot, [name for name, _, _ in series]))
            plot.showGrid(x=True, y=True, alpha=0.2)
            cache_plot_axes(plot)  # (with the grid, each axis spans the plot: replayed on every repaint before)
            plot.setMenuEnabled(False)
            if len(series) > 1:
                plot.addLegend(offset=(4, 4), labelTextSize="7pt", brush=pg.mkBrush(0, 0, 0, 170))  # over curves
            for name, label, colour in series:
                self.curves.append((name, plot.plot(pen=pg.mkPen(colour, width=2), name=label)))
        self.scroll = QtWidgets.QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setWidget(self.plots)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.scroll)
        from .tier_metrics import TierMetrics
        self.tiers = TierMetrics()  # hit rate per tier, block lifetime / idle / reuse-gap histograms (when any)
        body = QtWidgets.QWidget()  # under the other plots in the same scroll area: they keep their height
        column = QtWidgets.QVBoxLayout(body)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        self.scroll.takeWidget()
        from .server_metrics import ServerMetricsView
        self.server = ServerMetricsView()  # a watched vLLM server's own figures (--attach-metrics), when any
        column.addWidget(self.server)
        column.addWidget(self.plots)
        column.addWidget(self.tiers)
        self.scroll.setWidget(body)
        self._dirty = True  # the first redraw sets the empty plots' ranges
        self.until: int | None = None  # show samples up to this step only (a history frame on view); None: all
        self._reflow(MAX_COLUMNS)
        # Re-laid out after a resize, never inside it: a reflow removes and re-adds plots whose axis labels paint
        # through a device-coordinate cache, and doing that from resizeEvent (during the first layout of a fresh
        # window) is where launches crashed in pyqtgraph's AxisItem._updateLabel. A zero-delay single shot runs once
        # the resize is over, and once for a burst of resizes.
        self._reflow_timer = QtCore.QTimer(self)
        self._reflow_timer.setSingleShot(True)
        self._reflow_timer.setInterval(0)
        self._reflow_timer.timeout.connect(self._reflow_to_width)

    def _reflow(self, columns: int) -> None:
        """Lay the plots out ``columns`` to a row; the plot area is tall enough for every row at its least height."""
        columns = max(1, min(MAX_COLUMNS, columns))
        if columns == self.columns:
            return
        self.columns = columns
        layout = self.plots.ci
        for plot, _ in self.plot_items:
            if plot in layout.items:
                layout.removeItem(plot)
        rows = -(-len(self.plot_items) // columns)
        for i, (plot, _) in enumerate(self.plot_items):
            layout.addItem(plot, row=i // columns, col=i % columns)
            bottom = i // columns == rows - 1 or i + columns >= len(self.plot_items)  # nothing below it
            plot.getAxis("bottom").setLabel("step" if bottom else None)
        self.plots.setMinimumHeight(rows * MIN_PLOT_HEIGHT)

    def _reflow_to_width(self) -> None:
        self._reflow(max(1, self.width() // MIN_PLOT_WIDTH))

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        if max(1, min(MAX_COLUMNS, event.size().width() // MIN_PLOT_WIDTH)) != self.columns:
            self._reflow_timer.start()  # (the column count is unchanged for most resizes: nothing to re-lay)

    def show_until(self, step_id: int | None) -> None:
        """Metrics up to ``step_id`` (the step of the history frame being viewed), or all of them (None, live).
        Samples are only ever recorded from live frames; a scrub hides the later ones instead of replaying."""
        step_id = None if step_id is None else int(step_id)
        if step_id != self.until:
            self.until = step_id
            self._dirty = True

    def record(self, snap: PoolSnapshot, timed: bool = True) -> None:
        self.history.record(snap, timed=timed)
        self.tiers.record(snap)
        self._dirty = True

    def show_server(self, watch, has_pool: bool = True) -> None:
        """A watched server's figures above the plots (``watch``: a kvstream ServerWatch, or None); a source
        without a physical pool (KV events) has no step plots to show under them."""
        self.server.set_watch(watch)
        self.plots.setVisible(has_pool)

    def redraw(self) -> None:
        self.server.refresh()
        self.tiers.redraw()
        if not self._dirty:
            return
        x = self.history.series("step")
        keep = len(x) if self.until is None else int(np.searchsorted(x, self.until, side="right"))  # steps ascend
        x = x[:keep]
        for name, curve in self.curves:
            curve.setData(x, self.history.series(name)[:keep], connect="finite")  # NaN: not measured
        held = keep > 0
        first = float(x[0]) if held else 0.0
        last = max(float(x[-1]) if held else 0.0, first + EMPTY_STEPS)
        if self.until is not None:  # the x axis ends at the step on view, even before its sample
            last = max(float(self.until), first + EMPTY_STEPS) if held else last
        for plot, names in self.plot_items:  # y from 0, so a flat line reads as a value, not as noise
            top = max((_top(self.history.series(n)[:keep]) for n in names), default=0.0) if held else 0.0
            plot.setYRange(0, max(top * 1.1, 1.0), padding=0)
            plot.setXRange(first, last, padding=0)
        self._dirty = False

    def clear(self) -> None:
        self.history.clear()
        self.tiers.clear()
        self.until = None
        self._dirty = True
