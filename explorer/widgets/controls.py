"""Engine controls: run / pause, single step, a speed limit and a restart action, as a toolbar.

The toolbar only emits what the user asked for; the main window turns that into runner commands, so the controls
stay correct across an engine restart (the runner they talk to changes).
"""
from __future__ import annotations

from PySide6 import QtCore, QtGui, QtWidgets

SPEEDS = (("unlimited", None), ("100 steps/s", 100.0), ("30 steps/s", 30.0), ("10 steps/s", 10.0),
          ("5 steps/s", 5.0), ("2 steps/s", 2.0), ("1 step/s", 1.0))


class EngineControls(QtWidgets.QToolBar):
    """Run/pause (Space), step (Ctrl+.), speed limit, restart (Ctrl+Shift+R)."""

    pauseToggled = QtCore.Signal(bool)  # True: pause
    stepRequested = QtCore.Signal()
    speedChanged = QtCore.Signal(object)  # steps/s, or None for unlimited
    restartRequested = QtCore.Signal()
    rateChanged = QtCore.Signal(float)  # served traffic's arrivals, requests/s

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__("Engine", parent)
        self.setObjectName("engine-controls")
        # not checkable: its text says what pressing it does ("❚❚ Pause" / "▶ Run"); a checkable action showed a
        # checkbox beside the glyph in the Engine menu
        self.pause_action = QtGui.QAction("❚❚ Pause", self)
        self.pause_action.setShortcut(QtGui.QKeySequence("Space"))
        self.pause_action.setToolTip("Pause or run the engine (Space)")
        self.pause_action.setProperty("help_text", "Pause or run the engine")  # the shortcut help's words
        self.pause_action.triggered.connect(lambda _checked=False: self.set_paused(not self.paused))
        self.paused = False
        self.step_action = QtGui.QAction("Step", self)
        self.step_action.setShortcut(QtGui.QKeySequence("Ctrl+."))
        self.step_action.setToolTip("Run exactly one engine step (Ctrl+.)")
        self.step_action.triggered.connect(self.stepRequested)
        self.speed = QtWidgets.QComboBox()
        for text, value in SPEEDS:
            self.speed.addItem(text, value)
        self.speed.setToolTip("Speed limit of the engine thread")
        self.speed.currentIndexChanged.connect(lambda _: self.speedChanged.emit(self.speed.currentData()))
        self.restart_action = QtGui.QAction("Restart engine…", self)
        self.restart_action.setShortcut(QtGui.QKeySequence("Ctrl+Shift+R"))
        self.restart_action.triggered.connect(self.restartRequested)
        self.addAction(self.pause_action)
        self.addAction(self.step_action)
        self.addWidget(QtWidgets.QLabel(" speed: "))
        self.addWidget(self.speed)
        self.addSeparator()
        self.addAction(self.restart_action)
        self._build_rate()
        self._syncing = False

    def _build_rate(self) -> None:
        """The served traffic's arrival rate (shown only while a demo serves traffic): 0 to 10 requests/s."""
        box = QtWidgets.QWidget()
        row = QtWidgets.QHBoxLayout(box)
        row.setContentsMargins(6, 0, 0, 0)
        self.rate = QtWidgets.QSlider(QtCore.Qt.Orientation.Horizontal)
        self.rate.setRange(0, 100)  # tenths of a request per second
        self.rate.setValue(10)
        self.rate.setFixedWidth(120)
        self.rate.setToolTip("Served traffic: new requests per second, Poisson arrivals (0: none arrive)")
        self.rate_label = QtWidgets.QLabel()
        self.rate_label.setMinimumWidth(self.rate_label.fontMetrics().horizontalAdvance("arrivals: 10.0/s") + 4)
        row.addWidget(QtWidgets.QLabel("arrivals:"))
        row.addWidget(self.rate)
        row.addWidget(self.rate_label)
        self.rate.valueChanged.connect(self._on_rate)
        self._on_rate(self.rate.value(), emit=False)
        self.rate_action = self.addWidget(box)
        self.rate_action.setVisible(False)

    def rate_value(self) -> float:
        return self.rate.value() / 10.0

    def _on_rate(self, value: int, emit: bool = True) -> None:
        self.rate_label.setText(f"{value / 10:.1f}/s")
        if emit:
            self.rateChanged.emit(value / 10.0)

    def show_rate(self, on: bool) -> None:
        self.rate_action.setVisible(on)

    def set_paused(self, paused: bool) -> None:
        """Show ``paused`` (the action then offers Run) and ask for it, unless syncing with the runner."""
        changed = paused != self.paused
        self.paused = paused
        self.pause_action.setText("▶ Run" if paused else "❚❚ Pause")
        if changed and not self._syncing:
            self.pauseToggled.emit(paused)

    def sync(self, paused: bool, speed: float | None) -> None:
        """Reflect the runner's real state (it pauses itself after an engine failure) without emitting."""
        self._syncing = True
        try:
            if self.paused != paused:
                self.set_paused(paused)
            index = next((i for i, (_, v) in enumerate(SPEEDS) if v == speed), None)
            if index is not None and index != self.speed.currentIndex():
                self.speed.blockSignals(True)
                self.speed.setCurrentIndex(index)
                self.speed.blockSignals(False)
        finally:
            self._syncing = False
