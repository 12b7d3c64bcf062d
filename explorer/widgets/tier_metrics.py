"""The metrics dock's tier plots: prompt-token hit rate per tier over time, and histograms of block lifetime, idle
time before eviction and reuse gap, one curve per tier.

The figures are computed without Qt (:mod:`explorer.model.tier_stats`); this widget only plots them, a few times
a second with the other metrics. It stays hidden until there is something to plot (a pool that has not evicted
or shared anything, and no tier, has no durations yet).
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtWidgets

from ..model.tier_stats import MEASURE_TITLES, MEASURES, BlockDurations, HitRates, histogram
from .painting import cache_plot_axes

TIER_PENS = {"device": "#50c878", "host": "#5aa0f0", "disk": "#c08040", "computed": "#9a9aa6"}
HEIGHT = 170  # pixels of the row of tier plots


class TierMetrics(QtWidgets.QWidget):
    """Four small plots in a row: hit rate per source over steps, then the three duration histograms."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.hit_rates = HitRates()
        self.durations = BlockDurations()
        self.plots = pg.GraphicsLayoutWidget()
        self.hit_plot = self._plot("Prompt tokens by source (%)", 0, "step")
        self.hit_plot.addLegend(offset=(4, 4), labelTextSize="7pt", brush=pg.mkBrush(0, 0, 0, 170))
        self.hit_curves = {s: self.hit_plot.plot(pen=pg.mkPen(TIER_PENS[s], width=2), name=s) for s in TIER_PENS}
        self.histograms: dict[str, pg.PlotItem] = {}
        self.histogram_curves: dict[tuple[str, str], pg.PlotDataItem] = {}
        for col, measure in enumerate(MEASURES, start=1):
            plot = self._plot(MEASURE_TITLES[measure], col, "steps")
            plot.addLegend(offset=(4, 4), labelTextSize="7pt", brush=pg.mkBrush(0, 0, 0, 170))
            self.histograms[measure] = plot
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plots)
        self.setMinimumHeight(HEIGHT)
        self.setVisible(False)
        self._dirty = False

    def _plot(self, title: str, col: int, x_label: str) -> pg.PlotItem:
        plot = self.plots.addPlot(row=0, col=col, title=f"<span style='font-size:9pt'>{title}</span>")
        plot.showGrid(x=True, y=True, alpha=0.2)
        cache_plot_axes(plot)
        plot.setMenuEnabled(False)
        plot.getAxis("bottom").setLabel(x_label)
        for side in ("left", "bottom"):
            plot.getAxis(side).enableAutoSIPrefix(False)
        return plot

    # ---- feeding ------------------------------------------------------------------------------------------------
    def record(self, snapshot) -> None:
        self.hit_rates.record(snapshot)
        self._dirty = True

    def add_events(self, pairs, restarted: bool = False) -> None:
        if restarted:
            self.durations.clear()
        self.durations.add_events(e for _, e in pairs)
        self._dirty = True

    def clear(self) -> None:
        self.hit_rates.clear()
        self.durations.clear()
        self._dirty = True

    # ---- drawing ------------------------------------------------------------------------------------------------
    def has_data(self) -> bool:
        return bool(self.durations.durations.samples) or any(self.hit_rates.totals.values())

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self.setVisible(self.has_data())
        for source, curve in self.hit_curves.items():
            x, y = self.hit_rates.series(source)
            curve.setData(x, y, connect="finite")
        for measure, plot in self.histograms.items():
            for tier in self.durations.durations.tiers():
                samples = self.durations.durations.of(tier, measure)
                curve = self.histogram_curves.get((tier, measure))
                if curve is None:
                    curve = plot.plot(stepMode="center", pen=pg.mkPen(TIER_PENS.get(tier, "#ffffff"), width=2),
                                      name=tier)
                    self.histogram_curves[(tier, measure)] = curve
                counts, edges = histogram(samples)
                curve.setData(edges, counts.astype(float))

    def histogram_counts(self, tier: str, measure: str) -> np.ndarray:
        """The counts drawn for one tier and measure (tests read them)."""
        curve = self.histogram_curves.get((tier, measure))
        return np.zeros(0) if curve is None or curve.yData is None else np.asarray(curve.yData)
