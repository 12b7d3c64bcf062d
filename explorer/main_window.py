"""The main window: the pool grid in the middle, the block inspector, conversations and metrics around it.

A 30 Hz timer does all the work on the GUI thread: it polls finished command futures, shows engine failures,
takes ``runner.latest`` and redraws only when a new snapshot was published (or a view option changed). The engine
thread is reached only through ``runner.submit``, whose futures are checked by that same timer, so nothing here
ever waits on the engine.
"""
from __future__ import annotations

import random
import time
from collections import deque

from PySide6 import QtCore, QtGui, QtWidgets

from engine.config import EngineConfig
from engine.runner import EngineRunner
from engine.snapshot import PoolSnapshot

from .controls import EngineControls
from .conversations import ConversationsPanel
from .dialogs import AddConversationDialog, ReplyDialog, RestartDialog
from .futures import FutureWatcher
from .grid import COLOR_BY, COLOR_BY_LABELS
from .grid_view import GridView, block_owners
from .inspector import Inspector
from .legend import Legend
from .loader import EngineLoader, progress_dialog
from .metrics import MetricsPanel
from .relocation import RelocationPanel

FRAME_MS = 33
INSPECT_INTERVAL = 0.2  # seconds between live inspect_block requests (at most 5 Hz)
PANEL_INTERVAL = 0.1  # tables, text and readouts follow at most 10 times a second; the grid at every frame
PLOT_INTERVAL = 0.5  # metric plots: repainting axes is the costliest thing the GUI does


def _group(title: str, widget: QtWidgets.QWidget) -> QtWidgets.QGroupBox:
    box = QtWidgets.QGroupBox(title)
    layout = QtWidgets.QVBoxLayout(box)
    layout.setContentsMargins(4, 4, 4, 4)
    layout.addWidget(widget)
    return box


class MainWindow(QtWidgets.QMainWindow):
    """Owns the runner it was given (and any runner a restart creates); closing the window stops it."""

    def __init__(self, runner, config: EngineConfig, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.runner = runner
        self.config = config
        self.futures = FutureWatcher(on_error=lambda exc: self.show_error("Command refused", str(exc)))
        self.message_boxes: list[QtWidgets.QMessageBox] = []
        self.errors: list[tuple[str, str]] = []  # (title, text) of every error shown, newest last
        self.snapshot: PoolSnapshot | None = None
        self.lesson_window = None
        self.add_dialog: AddConversationDialog | None = None
        self.reply_dialog: ReplyDialog | None = None
        self._select_when_present: int | None = None
        self._inspect_future = None
        self._inspect_due = False
        self._inspected_key = None
        self._last_inspect = 0.0
        self._ticks: deque[float] = deque(maxlen=120)
        self._frames: deque[float] = deque(maxlen=120)
        self._last_slow = 0.0
        self._last_panels = 0.0
        self._panels_stale = False
        self._loader: EngineLoader | None = None
        self.restart_progress: QtWidgets.QProgressDialog | None = None
        self._closed = False
        self._build_widgets()
        self._build_actions()
        self._build_status_bar()
        self.resize(1600, 1000)
        self._update_title()
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(FRAME_MS)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    # ---- construction -------------------------------------------------------------------------------------
    def _build_widgets(self) -> None:
        self.grid = GridView()
        self.color_by = QtWidgets.QComboBox()
        for mode in COLOR_BY:
            self.color_by.addItem(COLOR_BY_LABELS[mode], mode)
        self.color_by.currentIndexChanged.connect(self._on_color_by)
        fit = QtWidgets.QPushButton("Fit")
        fit.setToolTip("Show the whole pool (pan: drag, zoom: wheel)")
        fit.clicked.connect(lambda: self.grid.box.autoRange(padding=0.02))
        top = QtWidgets.QHBoxLayout()
        top.addWidget(QtWidgets.QLabel("Colour by:"))
        top.addWidget(self.color_by)
        top.addWidget(fit)
        self.pool_label = QtWidgets.QLabel()
        top.addWidget(self.pool_label, 1)
        grid_column = QtWidgets.QWidget()
        column = QtWidgets.QVBoxLayout(grid_column)
        column.setContentsMargins(0, 0, 0, 0)
        column.addLayout(top)
        column.addWidget(self.grid, 1)

        self.legend = Legend()
        self.relocation = RelocationPanel()
        side = QtWidgets.QWidget()
        side_layout = QtWidgets.QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(_group("Legend", self.legend))
        side_layout.addWidget(_group("Relocation and memory", self.relocation), 1)
        side.setMinimumWidth(280)
        side.setMaximumWidth(400)

        self.inspector = Inspector()
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        split.addWidget(grid_column)
        split.addWidget(side)
        split.addWidget(_group("Block inspector", self.inspector))
        split.setStretchFactor(0, 3)
        split.setStretchFactor(2, 2)
        split.setSizes([800, 350, 450])
        self.setCentralWidget(split)

        self.conversations = ConversationsPanel()
        self.metrics = MetricsPanel()
        conv_dock = QtWidgets.QDockWidget("Conversations", self)
        conv_dock.setObjectName("conversations")
        conv_dock.setWidget(self.conversations)
        metrics_dock = QtWidgets.QDockWidget("Metrics", self)
        metrics_dock.setObjectName("metrics")
        metrics_dock.setWidget(self.metrics)
        self.addDockWidget(QtCore.Qt.DockWidgetArea.BottomDockWidgetArea, conv_dock)
        self.splitDockWidget(conv_dock, metrics_dock, QtCore.Qt.Orientation.Horizontal)
        self.resizeDocks([conv_dock, metrics_dock], [760, 840], QtCore.Qt.Orientation.Horizontal)
        self.resizeDocks([conv_dock], [330], QtCore.Qt.Orientation.Vertical)

        self.controls = EngineControls(self)
        self.addToolBar(self.controls)
        self.controls.pauseToggled.connect(lambda pause: self.runner.pause() if pause else self.runner.resume())
        self.controls.stepRequested.connect(lambda: self.runner.step_once())
        self.controls.speedChanged.connect(lambda speed: self.runner.set_speed(speed))
        self.controls.restartRequested.connect(self.open_restart_dialog)

        self.grid.blockClicked.connect(self.select_block)
        self.conversations.selectionChanged.connect(self._on_conversation_selected)
        self.conversations.addRequested.connect(self.open_add_dialog)
        self.conversations.forkRequested.connect(self.fork_conversation)
        self.conversations.replyRequested.connect(self.open_reply_dialog)
        self.conversations.endRequested.connect(self.end_conversation)
        self.relocation.relocateRequested.connect(self.relocate)

    def _action(self, menu: QtWidgets.QMenu, text: str, shortcut: str | None, slot) -> QtGui.QAction:
        action = QtGui.QAction(text, self)
        if shortcut:
            action.setShortcut(QtGui.QKeySequence(shortcut))
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _build_actions(self) -> None:
        bar = self.menuBar()
        engine_menu = bar.addMenu("&Engine")
        engine_menu.addAction(self.controls.pause_action)
        engine_menu.addAction(self.controls.step_action)
        engine_menu.addAction(self.controls.restart_action)
        engine_menu.addSeparator()
        self._action(engine_menu, "Quit", "Ctrl+Q", self.close)
        conv = bar.addMenu("&Conversation")
        self.add_action = self._action(conv, "Add…", "Ctrl+N", self.open_add_dialog)
        self.fork_action = self._action(conv, "Fork", "Ctrl+F", lambda: self._with_selected(self.fork_conversation))
        self.reply_action = self._action(conv, "Reply…", "Ctrl+R",
                                         lambda: self._with_selected(self.open_reply_dialog))
        self.end_action = self._action(conv, "End", "Ctrl+E", lambda: self._with_selected(self.end_conversation))
        pool = bar.addMenu("&Pool")
        relocate = pool.addMenu("Relocate blocks")
        self.scramble_action = self._action(relocate, "Scramble", "Ctrl+Shift+S", lambda: self.relocate(False))
        self.compact_action = self._action(relocate, "Compact to low ids", "Ctrl+Shift+C", lambda: self.relocate(True))
        self.lesson_action = self._action(bar.addMenu("&Lesson"), "Lesson…", "Ctrl+L", self.open_lesson)
        self.controls.addSeparator()
        self.controls.addAction(self.add_action)
        self.controls.addSeparator()
        self.controls.addWidget(QtWidgets.QLabel(" Relocate blocks: "))
        self.controls.addAction(self.scramble_action)
        self.controls.addAction(self.compact_action)
        self.controls.addSeparator()
        self.controls.addAction(self.lesson_action)

    def _build_status_bar(self) -> None:
        self.status_labels = {key: QtWidgets.QLabel() for key in ("live", "engine", "gui", "pool", "model")}
        for key, label in self.status_labels.items():
            self.statusBar().addPermanentWidget(label, 1 if key == "pool" else 0)

    def _update_title(self) -> None:
        cfg = self.config
        self.setWindowTitle(f"Paged KV-cache explorer — {cfg.model}, {cfg.num_blocks} blocks × {cfg.block_size} "
                            f"slots, {cfg.device}")

    # ---- the frame timer ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.perf_counter()
        self._ticks.append(now)
        self.futures.poll()
        for failure in self.runner.take_failures():
            self.show_error("Engine error", f"The engine failed after step {failure.step_id}: {failure.message}\n\n"
                            "The engine is paused; press Run to try again, or restart it.", failure.traceback)
        snap = self.runner.latest
        if snap is not self.snapshot:
            self._on_snapshot(snap)
        if self.grid.render():
            self._frames.append(now)
        if self._panels_stale and self.snapshot is not None and now - self._last_panels >= PANEL_INTERVAL:
            self._refresh_panels(self.snapshot)
            self._last_panels = now
        self._request_inspection(now)
        if now - self._last_slow >= PLOT_INTERVAL:
            self._last_slow = now
            self.metrics.redraw()
            self._update_status(now)

    def _on_snapshot(self, snap: PoolSnapshot) -> None:
        self.snapshot = snap
        self.grid.set_snapshot(snap)
        self.metrics.record(snap)
        self._panels_stale = True
        self._follow_inspected_block(snap)

    def _follow_inspected_block(self, snap: PoolSnapshot) -> None:
        """Refresh the inspector's summary; ask the engine for details again only when the block changed (never
        in a loop: inspect_block itself publishes a snapshot)."""
        b = self.inspector.block_id
        if b is None:
            return
        if b >= snap.num_blocks:
            self.select_block(None)
            return
        owners = block_owners(snap, b)
        self.inspector.show_summary(snap, owners=owners)
        key = (int(snap.state[b]), int(snap.ref_count[b]), int(snap.num_filled[b]), int(snap.owner[b]),
               int(snap.last_access[b]), tuple(owners))
        if key != self._inspected_key:
            self._inspected_key = key
            self._inspect_due = True

    def _refresh_panels(self, snap: PoolSnapshot) -> None:
        """Conversations table, text, readouts: a few times a second is enough for reading."""
        self._panels_stale = False
        self.conversations.refresh(snap)
        if self._select_when_present is not None and snap.conversation(self._select_when_present) is not None:
            self.conversations.select_conversation(self._select_when_present)
            self._select_when_present = None
        self.relocation.update_memory(snap.memory)
        mem = snap.memory
        if mem is not None:
            self.pool_label.setText(f"step {snap.step_id} · {mem.num_used_blocks} used, {mem.num_cached_blocks} "
                                    f"cached, {mem.num_free_blocks} free of {snap.num_blocks} blocks")

    def _request_inspection(self, now: float) -> None:
        block = self.inspector.block_id
        if block is None or not self._inspect_due or self._inspect_future is not None:
            return
        if now - self._last_inspect < INSPECT_INTERVAL:
            return
        self._inspect_due = False
        self._last_inspect = now
        future = self.runner.submit("inspect_block", block)
        self._inspect_future = future

        def done(info):
            self._inspect_future = None
            self.inspector.show_block(info)

        def failed(exc):
            self._inspect_future = None
            self.inspector.note.setText(f"Could not inspect block {block}: {exc}")

        self.futures.watch(future, done, failed)

    def _update_status(self, now: float) -> None:
        paused = self.runner.paused
        self.controls.sync(paused, self.runner.max_steps_per_second)
        idle = self.snapshot is not None and not any(
            str(c.status) in ("waiting", "running", "preempted") for c in self.snapshot.conversations)
        self.status_labels["live"].setText("❚❚ paused" if paused else ("● live (idle)" if idle else "● live"))
        self.status_labels["engine"].setText(f"engine {self.runner.steps_per_second():.1f} steps/s")
        self.status_labels["gui"].setText(f"GUI {self.gui_fps(now):.0f} fps, {self.redraws_per_second(now):.0f} "
                                          "redraws/s")
        snap = self.snapshot
        if snap is not None and snap.memory is not None:
            mem = snap.memory
            self.status_labels["pool"].setText(
                f"pool {mem.num_used_blocks}/{snap.num_blocks} blocks used "
                f"({100 * mem.num_used_blocks / snap.num_blocks:.0f}%), {mem.num_cached_blocks} cached, "
                f"{mem.num_filled_slots}/{mem.num_allocated_slots} slots filled")
            self.status_labels["model"].setText(f"{snap.model_name} on {snap.device}")

    def gui_fps(self, now: float | None = None) -> float:
        """Frame-timer ticks per second over the last second: how often the GUI can show a new state."""
        return _rate(self._ticks, time.perf_counter() if now is None else now)

    def redraws_per_second(self, now: float | None = None) -> float:
        return _rate(self._frames, time.perf_counter() if now is None else now)

    # ---- selection ------------------------------------------------------------------------------------------
    def select_block(self, block_id: int | None) -> None:
        self.grid.set_selected_block(block_id)
        self.inspector.select(block_id, self.snapshot)
        self._inspect_due = block_id is not None
        self._inspected_key = None
        self._last_inspect = 0.0

    def select_conversation_when_present(self, cid: int) -> None:
        """Select conversation ``cid`` in the table as soon as a snapshot lists it (it may still be queued)."""
        self._select_when_present = cid

    def _on_conversation_selected(self, cid: int | None) -> None:
        self.grid.set_selected_conversation(cid)

    def _on_color_by(self, _index: int) -> None:
        mode = self.color_by.currentData()
        self.grid.set_color_by(mode)
        self.legend.set_mode(mode)

    def _with_selected(self, handler) -> None:
        cid = self.conversations.selected_conversation()
        if cid is None:
            self.statusBar().showMessage("Select a conversation first.", 3000)
            return
        handler(cid)

    # ---- commands ---------------------------------------------------------------------------------------------
    def _tokenize(self, text: str, continuation: bool = False):
        return self.runner.submit("tokenize", text, continuation)

    def open_add_dialog(self) -> AddConversationDialog:
        snap = self.runner.latest
        dialog = AddConversationDialog(self._tokenize, self.futures.watch, snap, self)
        dialog.accepted.connect(lambda: self._submit_add(dialog.request))
        self.add_dialog = dialog
        dialog.open()
        return dialog

    def _submit_add(self, request) -> None:
        future = self.runner.submit("add_conversation", prompt=request.prompt,
                                    max_new_tokens=request.max_new_tokens, temperature=request.temperature)

        def added(cid: int) -> None:
            self.select_conversation_when_present(cid)
            for _ in range(request.samples - 1):
                self.futures.watch(self.runner.submit("fork_conversation", cid))

        self.futures.watch(future, added)

    def fork_conversation(self, cid: int) -> None:
        self.futures.watch(self.runner.submit("fork_conversation", cid), self.select_conversation_when_present)

    def end_conversation(self, cid: int) -> None:
        self.futures.watch(self.runner.submit("end_conversation", cid))

    def open_reply_dialog(self, cid: int) -> ReplyDialog | None:
        snap = self.runner.latest
        info = snap.conversation(cid)
        if info is None:
            return None
        if info.status != "finished":
            self.show_error("Cannot reply", f"Conversation {cid} is {info.status}; only a finished conversation "
                            "can get a follow-up message.")
            return None
        dialog = ReplyDialog(cid, info.num_tokens, lambda text: self._tokenize(text, continuation=True),
                             self.futures.watch, snap, self)
        dialog.accepted.connect(lambda: self.futures.watch(self.runner.submit(
            "continue_conversation", dialog.request.conversation_id, prompt=dialog.request.message,
            max_new_tokens=dialog.request.max_new_tokens)))
        self.reply_dialog = dialog
        dialog.open()
        return dialog

    def relocate(self, compact: bool) -> None:
        """Move blocks between two decode steps and show the before/after attention difference."""
        self.relocation.set_busy(True)
        future = self.runner.submit("relocate_and_verify", seed=random.randrange(1 << 30), compact=compact)

        def failed(exc):
            self.relocation.show_failure(str(exc))
            self.show_error("Relocation refused", str(exc))

        self.futures.watch(future, lambda report: self.relocation.show_report(report, compact), failed)

    def open_lesson(self):
        try:
            from .lesson import LessonWindow  # built separately; imported only when asked for
        except ImportError as exc:
            self.show_error("Lesson unavailable", f"The lesson could not be loaded: {exc}")
            return None
        if self.lesson_window is None:
            self.lesson_window = LessonWindow(parent=self)
        self.lesson_window.show()
        self.lesson_window.raise_()
        return self.lesson_window

    # ---- restart -----------------------------------------------------------------------------------------------
    def open_restart_dialog(self) -> RestartDialog:
        dialog = RestartDialog(self.config, self)
        dialog.accepted.connect(lambda: self.restart_engine(dialog.config))
        dialog.open()
        return dialog

    def restart_engine(self, cfg: EngineConfig) -> None:
        """Build the new engine in a worker thread; swap it in only once it loaded, else keep the old one."""
        if self._loader is not None:
            self.show_error("Restart in progress", "An engine is already being loaded.")
            return
        loader = self._loader = EngineLoader(self)
        progress = self.restart_progress = progress_dialog(self, f"Loading {cfg.model}…", loader)

        def loaded(engine) -> None:
            progress.close()
            self._loader = None
            if not self._closed:  # a closed window must not start an engine thread that nothing would stop
                self.swap_engine(engine, cfg)

        def failed(message: str, details: str) -> None:
            progress.close()
            self._loader = None
            self.show_error("Engine restart failed", f"{message}\n\nThe previous engine keeps running.", details)

        loader.loaded.connect(loaded)
        loader.failed.connect(failed)
        progress.show()
        loader.start(cfg)

    def swap_engine(self, engine, cfg: EngineConfig) -> None:
        """Run ``engine`` instead of the current one, keeping pause and speed; commands in flight are dropped."""
        old = self.runner
        self.runner = EngineRunner(engine, max_steps_per_second=old.max_steps_per_second,
                                   start_paused=old.paused).start()
        old.stop(timeout=1.0)
        self.config = cfg
        self.futures.clear()
        self._inspect_future = None
        self._select_when_present = None
        self.relocation.reset()  # a relocation in flight on the old engine will never answer
        for dialog in (self.add_dialog, self.reply_dialog):  # they were sized for, and wait on, the old engine
            if dialog is not None and dialog.isVisible():
                dialog.reject()
        self.select_block(None)
        self.grid.reset_view()
        self.metrics.clear()
        self.snapshot = None
        self._update_title()
        self.statusBar().showMessage(f"Engine restarted: {cfg.model}, {cfg.num_blocks} blocks of {cfg.block_size}.",
                                     5000)

    # ---- errors and closing ----------------------------------------------------------------------------------
    def show_error(self, title: str, text: str, details: str | None = None) -> QtWidgets.QMessageBox:
        """A non-blocking message box (the frame timer keeps running behind it)."""
        self.errors.append((title, text))
        box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Warning, title, text,
                                    QtWidgets.QMessageBox.StandardButton.Ok, self)
        if details:
            box.setDetailedText(details)
        box.setModal(False)
        self.message_boxes.append(box)
        del self.message_boxes[:-20]
        box.show()
        return box

    def closeEvent(self, event: QtGui.QCloseEvent) -> None:
        self._closed = True
        self.timer.stop()
        self.runner.stop(timeout=1.0)
        if self.restart_progress is not None:
            self.restart_progress.close()
        if self.lesson_window is not None:
            self.lesson_window.close()
        event.accept()


def _rate(times: deque, now: float) -> float:
    recent = [t for t in times if now - t <= 1.0]
    if len(recent) < 2:
        return 0.0
    return (len(recent) - 1) / max(now - recent[0], 1e-6)
