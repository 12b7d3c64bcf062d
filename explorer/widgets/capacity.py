"""The Capacity dock: a trace's hit rate against pool size, one curve per eviction policy, the optimum (Belady) as
the bound and the infinite pool as the ceiling, with the live replay marked at its pool's size.

The sweep runs on a worker thread (explorer.model.capacity.CapacityJob: the fast path in C, or the engine itself
with tiers), point by point, so the curves grow while the window keeps its pace; a new trace cancels the sweep in
flight, and a finished one is kept per trace (by its content). A click on a point asks the window to restart the
live replay at that size and policy (:attr:`CapacityPanel.restartRequested`). With lower tiers the live policy's
curve is drawn as bands, one per medium its hits came from.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from ..model.capacity import (MEDIA, CapacityCache, CapacityJob, CapacityResult, CapacitySpec, LiveMarker,
                              policy_name, trace_digest)
from ..model.words import number
from .elided_label import ElidedLabel
from .painting import cache_plot_axes

PLACEHOLDER = ("Open a trace (File > Open trace…, or drop a trace file on the window) to see its hit rate against "
               "pool size for each eviction policy.")
COLOURS = {"lru": "#e0443e", "fifo": "#f0a030", "s3fifo": "#50c8c8", "s3lru": "#50c878", "radix": "#c080f0",
           "belady": "#ffffff"}
MEDIUM_BRUSHES = {"GPU": (80, 200, 120, 110), "CPU": (90, 130, 210, 110), "STORAGE": (160, 110, 210, 110)}
REDRAW_MS = 150  # points arriving faster than this are drawn together
DEFAULT_TARGET = 25.0  # the hit rate (%) the dock finds the pool size for, until the user asks for another
QUEUED = QtCore.Qt.ConnectionType.QueuedConnection


def byte_text(nbytes: float) -> str:
    """1536 -> '1.5 KiB': a byte count as the axis and the readouts write it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} TiB"


def block_text(blocks: float) -> str:
    """12000 -> '12k': a pool size as the axis writes it."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if blocks >= size:
            return f"{blocks / size:.3g}{unit}"
    return f"{blocks:.3g}"


def labelled(values) -> list[bool]:
    """Which of a log axis's ticks get a label: the decades, and 2 and 5 times them where fewer than two decades
    show (pyqtgraph puts a tick at every multiple, whose labels would run into each other)."""
    decades = [abs(v - round(v)) < 1e-6 for v in values]
    if sum(decades) >= 2:
        return decades
    return [d or min(abs((v - math.floor(v)) - f) for f in (math.log10(2), math.log10(5))) < 1e-6
            for v, d in zip(values, decades)]


class BlocksAxis(pg.AxisItem):
    """The bottom axis: pool sizes in blocks, on a log scale ('10k' rather than pyqtgraph's '1e+04')."""

    def tickStrings(self, values, scale, spacing):
        if not self.logMode:
            return super().tickStrings(values, scale, spacing)
        return [block_text(10 ** v) if keep else "" for v, keep in zip(values, labelled(values))]


class BytesAxis(pg.AxisItem):
    """The top axis: the pool's size in bytes of the live model's K/V (blocks x bytes per block)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_per_block = 0

    def tickStrings(self, values, scale, spacing):
        if not self.bytes_per_block:
            return ["" for _ in values]
        if not self.logMode:
            return [byte_text(v * self.bytes_per_block) for v in values]
        return [byte_text(10 ** v * self.bytes_per_block) if keep else "" for v, keep in zip(values, labelled(values))]


class CapacityPanel(QtWidgets.QWidget):
    """Hit rate against pool size for the trace the live engine replays (see the module's docstring)."""

    restartRequested = QtCore.Signal(str, int)  # policy, pool size in blocks: restart the live replay there
    _planned = QtCore.Signal(object, object, str)  # from the worker thread: token, plan, description
    _point = QtCore.Signal(object, object)  # token, CurvePoint
    _done = QtCore.Signal(object, bool, str)  # token, complete, error ("" for none)
    _answered = QtCore.Signal(object, float, object)  # token, rate, {policy: blocks or None}

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.cache = CapacityCache()
        self.result: CapacityResult | None = None  # what is drawn (filled in while a sweep runs)
        self.job: CapacityJob | None = None  # the sweep in flight or last finished, for the current trace
        self.key = None  # (trace digest, spec) of what is shown
        self.marker: LiveMarker | None = None
        self.description = ""
        self.error = ""
        self.answers: dict[float, dict] = {}  # target rate -> {policy: blocks or None} for the current result
        self.threads: list[threading.Thread] = []  # workers started (tests join them)
        self._token = None  # the sweep whose points are wanted; stale ones are dropped
        self._answer_token = None
        self._planned.connect(self._on_planned, QUEUED)
        self._point.connect(self._on_point, QUEUED)
        self._done.connect(self._on_done, QUEUED)
        self._answered.connect(self._on_answered, QUEUED)

        self.header = ElidedLabel(PLACEHOLDER)  # one line (the whole of it in the tooltip): the plot keeps the room
        self.header.setToolTip(PLACEHOLDER)
        self.progress = QtWidgets.QProgressBar()
        self.progress.setMaximumHeight(16)
        self.progress.setTextVisible(True)
        self.progress.setFormat("sweeping: %v of %m points")
        self.progress.hide()
        self.top_axis = BytesAxis("top")
        self.plot_widget = pg.PlotWidget(axisItems={"top": self.top_axis, "bottom": BlocksAxis("bottom")})
        self.plot_widget.setMinimumSize(260, 100)
        plot = self.plot = self.plot_widget.getPlotItem()
        plot.setMenuEnabled(False)
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.setLogMode(x=True, y=False)
        plot.setLabel("bottom", "pool size (blocks)")
        plot.setLabel("left", "prompt blocks hit (%)")
        plot.getAxis("left").enableAutoSIPrefix(False)
        plot.showAxis("top")
        plot.getAxis("top").setStyle(showValues=False)
        cache_plot_axes(plot)
        self.legend = plot.addLegend(offset=(6, 6), labelTextSize="8pt", brush=pg.mkBrush(0, 0, 0, 170))
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.bands: list = []  # the live policy's hits by medium (with tiers): fills and their edges
        self.ceiling = pg.InfiniteLine(angle=0, movable=False, pen=pg.mkPen("#9a9aa6", width=1,
                                                                             style=QtCore.Qt.PenStyle.DotLine),
                                       label="", labelOpts={"position": 0.97, "color": "#c8c8d0",
                                                            "anchors": [(1, 1), (1, 1)]})
        self.ceiling.hide()
        plot.addItem(self.ceiling)
        self.marker_item = pg.PlotDataItem([], [], pen=None, symbol="star", symbolSize=20,
                                           symbolBrush=pg.mkBrush("#ffd84a"), symbolPen=pg.mkPen("#000000"))
        plot.addItem(self.marker_item)
        self.marker_text = pg.TextItem("", color="#ffd84a", anchor=(0, 1.2))
        plot.addItem(self.marker_text)
        self.live = ElidedLabel("")
        self.target = QtWidgets.QDoubleSpinBox()
        self.target.setRange(0.1, 99.9)
        self.target.setDecimals(1)
        self.target.setSuffix(" %")
        self.target.setValue(DEFAULT_TARGET)
        self.target.setToolTip("The hit rate to find the smallest pool for, policy by policy")
        self.target.valueChanged.connect(lambda _v: self._target_timer.start())
        self._target_timer = QtCore.QTimer(self)
        self._target_timer.setSingleShot(True)
        self._target_timer.setInterval(400)
        self._target_timer.timeout.connect(self.find_target)
        self.answer = ElidedLabel("")
        target_row = QtWidgets.QHBoxLayout()
        target_row.addWidget(QtWidgets.QLabel("Pool for a hit rate of"))
        target_row.addWidget(self.target)
        target_row.addWidget(self.answer, 1)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.header)
        layout.addWidget(self.progress)
        layout.addWidget(self.plot_widget, 1)
        layout.addWidget(self.live)
        layout.addLayout(target_row)
        self._redraw_timer = QtCore.QTimer(self)
        self._redraw_timer.setSingleShot(True)
        self._redraw_timer.setInterval(REDRAW_MS)
        self._redraw_timer.timeout.connect(self.redraw)

    # ---- what to sweep ------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A sweep is running."""
        return self._token is not None

    @property
    def settled(self) -> bool:
        """Nothing is being worked out: the sweep is done (or stopped) and the answer for the target rate is in."""
        return self._token is None and self._answer_token is None

    def set_trace(self, trace, spec: CapacitySpec) -> None:
        """Sweep ``trace`` as ``spec`` says (the live replay's context, tiers and policy), unless it is what is shown
        or being swept now; a sweep in flight for anything else is cancelled. A trace swept before is drawn at once."""
        key = (trace_digest(trace), spec)
        if key == self.key:
            return
        self.cancel()
        self.key = key
        self.error = ""
        self.answers = {}
        self.answer.setText("")
        cached = self.cache.get(key)
        if cached is not None:
            self.result, self.job = cached
            self.description = self.job.description
            self._show_header()
            self.redraw()
            self.find_target()
            return
        self.result = None
        self.description = f"{trace.name}: preparing the sweep…"
        self._show_header()
        self.redraw()
        job = self.job = CapacityJob(trace, spec)
        job.description = self.description
        token = self._token = object()
        self.progress.setRange(0, 0)  # busy until the plan says how many points
        self.progress.show()
        self._start(self._run, token, job)

    def clear(self) -> None:
        """No trace: the placeholder, nothing drawn, no sweep running."""
        self.cancel()
        self.key = self.result = self.job = self.marker = None
        self.description = self.error = ""
        self.answers = {}
        self.answer.setText("")
        self.live.setText("")
        self._set_header(PLACEHOLDER)
        self.redraw()

    def cancel(self) -> None:
        """Stop the sweep in flight (its thread ends at its next point; its late points are dropped)."""
        if self.job is not None and self._token is not None:
            self.job.cancel()
        self._token = self._answer_token = None
        self.progress.hide()

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="capacity sweep", daemon=True)
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    # ---- the worker thread --------------------------------------------------------------------------------------
    def _run(self, token, job: CapacityJob) -> None:
        """On the worker thread: every point, handed to the GUI thread as it is done."""
        try:
            complete = job.run(lambda point: self._emit(self._point, token, point),
                               lambda plan, text: self._emit(self._planned, token, plan, text))
            error = ""
        except Exception as exc:  # a sweep that cannot run (a pool too large, no compiler and no engine): said
            complete, error = False, f"{type(exc).__name__}: {exc}"
        self._emit(self._done, token, complete, error)

    def _emit(self, signal, *args) -> None:
        try:
            signal.emit(*args)
        except RuntimeError:  # the panel was deleted (the window closed) while the sweep ran
            pass

    # ---- the GUI thread ------------------------------------------------------------------------------------------
    def _on_planned(self, token, plan, description: str) -> None:
        if token is not self._token:
            return
        self.result = CapacityResult(plan)
        self.description = self.job.description = description
        self.progress.setRange(0, plan.num_points)
        self.progress.setValue(0)
        self._show_header()

    def _on_point(self, token, point) -> None:
        if token is not self._token or self.result is None:
            return
        self.result.add(point)
        self.progress.setValue(self.result.num_points)
        if not self._redraw_timer.isActive():
            self._redraw_timer.start()

    def _on_done(self, token, complete: bool, error: str) -> None:
        if token is not self._token:
            return
        self._token = None
        self.progress.hide()
        if error:
            self.error = error
        elif complete and self.result is not None:
            self.result.complete = True
            self.cache.put(self.key, (self.result, self.job))
            self.find_target()
        self._show_header()
        self.redraw()

    def _show_header(self) -> None:
        if self.error:
            self._set_header(f"{self.description}. The sweep stopped: {self.error}")
            return
        tail = ""
        if self.result is not None and self.result.complete:
            tail = " Click a point to restart the live replay at that size and policy."
        elif self.result is not None:
            tail = " Sweeping in the background (instant replays, one request at a time)…"
        self._set_header(self.description + "." + tail if self.description else PLACEHOLDER)

    def _set_header(self, text: str) -> None:
        self.header.setText(text)
        self.header.setToolTip(text)

    # ---- the answer to "how many blocks for X%?" ------------------------------------------------------------------
    def find_target(self) -> None:
        """The smallest pool for the target hit rate, per policy, once the curves are in: by bisection on the fast
        path (off the GUI thread), from the curve's points where the engine replays."""
        result, job = self.result, self.job
        if result is None or not result.complete or job is None:
            return
        rate = round(self.target.value() / 100, 4)
        if rate in self.answers:
            self._show_answer(rate)
            return
        self.answer.setText("finding…")
        token = self._answer_token = object()
        self._start(self._answer, token, job, rate)

    def _answer(self, token, job: CapacityJob, rate: float) -> None:
        answers = {}
        try:
            plan = job.prepare()
            for policy in plan.all_policies:
                if plan.engine_path(policy):
                    answers[policy] = ("grid", self.result.blocks_for(policy, rate) if self.result else None)
                else:
                    answers[policy] = ("exact", job.blocks_for_rate(policy, rate))
        except Exception as exc:  # noqa: BLE001 - said in the label, the dock goes on
            answers = {"error": str(exc)}
        self._emit(self._answered, token, rate, answers)

    def _on_answered(self, token, rate: float, answers: dict) -> None:
        if token is not self._answer_token:
            return
        self._answer_token = None
        self.answers[rate] = answers
        self._show_answer(rate)

    def _show_answer(self, rate: float) -> None:
        answers = self.answers.get(rate, {})
        if "error" in answers:
            self._set_answer(f"could not be found: {answers['error']}")
            return
        parts = []
        for policy, (how, blocks) in answers.items():
            if blocks is None:
                parts.append(f"{policy_name(policy)}: never")
            else:
                parts.append(f"{policy_name(policy)}: {'≤ ' if how == 'grid' else ''}{number(blocks)} blocks")
        ceiling = self.result.infinite.hit_rate if self.result and self.result.infinite else None
        tail = f" (the infinite pool reaches {ceiling:.1%})" if ceiling is not None else ""
        self._set_answer(" · ".join(parts) + tail)

    def _set_answer(self, text: str) -> None:
        self.answer.setText(text)
        self.answer.setToolTip(text)

    # ---- the live replay ----------------------------------------------------------------------------------------
    def set_live(self, marker: LiveMarker | None, bytes_per_block: int = 0, model: str = "") -> None:
        """The live replay's marker (None: no live replay), and the live model's bytes per block for the top axis
        (0: no byte axis, as for --model none, whose blocks hold no K/V)."""
        if bytes_per_block != self.top_axis.bytes_per_block:
            self.top_axis.bytes_per_block = bytes_per_block
            self.top_axis.setStyle(showValues=bool(bytes_per_block))
            self.plot.setLabel("top", f"K/V bytes of {model}" if bytes_per_block else None)
            self.top_axis.picture = None
            self.top_axis.update()
        if marker == self.marker:
            return
        self.marker = marker
        self.live.setText(marker.text() if marker is not None else "")
        self.live.setToolTip(self.live.text())
        self._draw_marker()

    def _draw_marker(self) -> None:
        marker = self.marker
        rate = marker.hit_rate if marker is not None else None
        if rate is None:
            self.marker_item.setData([], [])
            self.marker_text.setText("")
            return
        self.marker_item.setData([marker.blocks], [100 * rate])
        self.marker_text.setText(f"live {rate:.1%}")
        self.marker_text.setPos(math.log10(max(1, marker.blocks)), 100 * rate)

    # ---- drawing --------------------------------------------------------------------------------------------------
    def redraw(self) -> None:
        result = self.result
        plot = self.plot
        for item in self.bands:
            plot.removeItem(item)
        self.bands = []
        if result is None:
            for curve in self.curves.values():
                plot.removeItem(curve)
                self.legend.removeItem(curve)
            self.curves = {}
            self.ceiling.hide()
            self._draw_marker()
            return
        plan = result.plan
        for policy in [p for p in self.curves if p not in plan.all_policies]:
            plot.removeItem(self.curves[policy])
            self.legend.removeItem(self.curves[policy])
            del self.curves[policy]
        for policy in plan.all_policies:
            xs, ys = result.curve(policy)
            curve = self.curves.get(policy)
            if curve is None:
                colour = COLOURS.get(policy, "#d0d0d0")
                style = QtCore.Qt.PenStyle.DashLine if policy == plan.spec.bound else QtCore.Qt.PenStyle.SolidLine
                name = policy_name(policy) + (" (optimum)" if policy == plan.spec.bound else "")
                curve = pg.PlotDataItem(pen=pg.mkPen(colour, width=2, style=style), symbol="o", symbolSize=6,
                                        symbolBrush=pg.mkBrush(colour), symbolPen=None, name=name)
                curve.sigPointsClicked.connect(self._on_points_clicked)
                plot.addItem(curve)
                self.curves[policy] = curve
            curve.setData(xs, 100 * ys, data=[(policy, int(b)) for b in xs])
        if plan.tiers:
            self._draw_bands(result, plan.policies[-1] if plan.policies else None)
        if result.infinite is not None:
            rate = result.infinite.hit_rate
            self.ceiling.setValue(100 * rate)
            self.ceiling.label.setFormat(f"infinite pool {rate:.1%}")
            self.ceiling.show()
        else:
            self.ceiling.hide()
        tops = [100 * result.infinite.hit_rate if result.infinite else 0.0]
        if self.marker is not None and self.marker.hit_rate is not None:
            tops.append(100 * self.marker.hit_rate)
        plot.setYRange(0, max(5.0, max(tops) * 1.12), padding=0)
        self._draw_marker()

    def _draw_bands(self, result: CapacityResult, policy: str | None) -> None:
        """The live policy's hit rate split by the medium the hits came from (GPU, then host, then disk)."""
        if policy is None:
            return
        xs, stacks = result.stacked(policy)
        if len(xs) < 2:
            return
        below = pg.PlotDataItem(xs, np.zeros(len(xs)), pen=None)
        self.plot.addItem(below)
        self.bands.append(below)
        for medium in MEDIA:
            edge = pg.PlotDataItem(xs, 100 * stacks[medium], pen=None)
            self.plot.addItem(edge)
            fill = pg.FillBetweenItem(below, edge, brush=pg.mkBrush(*MEDIUM_BRUSHES[medium]))
            fill.setToolTip(f"{policy_name(policy)}: hits from {medium}")
            self.plot.addItem(fill)
            self.bands += [edge, fill]
            below = edge

    def _on_points_clicked(self, _item, points, _event=None) -> None:
        if points is None or len(points) == 0:
            return
        data = points[0].data()
        if isinstance(data, tuple) and len(data) == 2:
            self.restartRequested.emit(str(data[0]), int(data[1]))

    def shutdown(self) -> None:
        """The window closes: stop the sweep in flight."""
        self.cancel()
