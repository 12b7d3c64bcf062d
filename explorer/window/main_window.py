"""The main window: layout and wiring around one or more pool sources.

The window owns no engine logic. A :class:`~explorer.model.pool_source.PoolSource` owns what is watched (the local engine, an
attached stream, a recording) and says what it can do; the centre is one :class:`~explorer.widgets.pool_pane.PoolPane` per
source (several ``--attach`` sit side by side, each with its own header); the docks around it (inspector, legend,
memory, conversations, metrics, event log, block history) follow the active source through its signals. A 30 Hz
timer only polls the sources and repaints; commands go through :mod:`explorer.window.commands`, the inspector follows its
block through :mod:`explorer.widgets.block_watch`, the event log and block history live in :mod:`explorer.widgets.history_panels`,
rates and pool figures in :mod:`explorer.window.status_bar`, dock arrangement in :mod:`explorer.window.layout`.
"""
from __future__ import annotations

import sys

import time

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine import EngineConfig
from kvstream.views import PoolSnapshot

from ..feeds.engine_feed import EngineFeed
from ..feeds.feed import Feed, Problem
from ..model.pacer import FramePace, LivePacer, engine_has_slack
from ..model.pool_source import PoolSource
from ..widgets.block_watch import BlockWatch
from ..widgets.capacity import CapacityPanel
from ..widgets.controls import EngineControls
from ..widgets.conversations import ConversationsPanel
from ..widgets.history_panels import HistoryPanels
from ..widgets.inspector import Inspector
from ..widgets.legend import Legend
from ..widgets.metrics import MetricsPanel
from ..widgets.metrics_backfill import MetricsBackfill
from ..widgets.pool_pane import PoolPane
from ..widgets.relocation import RelocationPanel
from .commands import Commands
from .qt_source import qt_pool_source
from .dialogs import RestartDialog
from .layout import MIN_HEIGHT, MIN_WIDTH, LayoutMemory, arrange, keep_proportions, make_dock
from .loader import EngineLoader, progress_dialog
from .actions import WindowActions
from . import files, traces
from .menus import build_menus
from .status_bar import StatusBar
from .why import WhyViews

FRAME_MS = 30  # the frame timer: 33 ticks a second, so that a late tick on a busy machine still leaves 30 (at 33 ms
#                the rate could not pass 30.3, and any late tick showed below 30: docs/gui.md)
POOL_DOCKS = ("inspector", "legend", "memory", "conversations", "metrics", "events", "block-history")  # docks that
# show a physical pool's blocks, conversations or history: empty for a source without one
EMPTY_POOL_HINT = ("The pool is empty: press Add… (Ctrl+N) to start a conversation, or pick one of the Demos "
                   "menu's workloads.")
FRAME_FIT_MS = 300  # after the first show, once the window manager has framed the window


def framed_length(length: int, room: int, frame: int, smallest: int, needed: int) -> int:
    """The window's height (without its frame) that keeps the framed window inside ``room``: ``length``
    where it fits; never below ``smallest`` (the smallest supported screen) while the screen has room for it framed;
    on a screen smaller than that, whatever fits it, down to what the window's contents ``needed``."""
    floor = min(smallest, max(room - frame, needed))
    return max(min(length, room - frame), floor)


class MainWindow(QtWidgets.QMainWindow):
    """Layout + wiring. ``MainWindow(runner, config)`` watches a running local engine; ``feed=`` any other feed.

    Owns its feeds: closing the window closes them (stops the engine thread, closes sockets and files).
    ``settings``: a QSettings that keeps the layout between launches (None, the default: nothing is kept).
    """

    metrics_export = None  # --metrics-port: the local engine's /metrics, which a restarted engine feeds too (owned)

    def __init__(self, runner=None, config: EngineConfig | None = None, parent: QtWidgets.QWidget | None = None, *,
                 feed: Feed | None = None, extra_feeds=(), settings: QtCore.QSettings | None = None,
                 size: tuple[int, int] | None = None, fit_size: bool = False):
        super().__init__(parent)
        if feed is None and runner is not None:
            feed = EngineFeed(runner, config or EngineConfig())
        self.engine_config = config or getattr(feed, "config", None) or EngineConfig()  # what a restart starts from
        self.config_before_demo: EngineConfig | None = None  # the user's settings while a demo runs its own
        self.source = qt_pool_source(feed, self)
        self.panes = [PoolPane(self.source)] + [PoolPane(qt_pool_source(f, self)) for f in extra_feeds]
        self.errors: list[tuple[str, str]] = []  # (title, text) of every error shown, newest last
        self.message_boxes: list[QtWidgets.QMessageBox] = []
        self.lesson_window = None
        self.help_window = None
        self.restart_progress: QtWidgets.QProgressDialog | None = None
        self.restart_dialog: RestartDialog | None = None  # the newest restart dialog opened
        self.demo_notes: tuple[str, ...] = ()  # what the running demo lowered to fit the pool, one note each
        self.outputs_note = ""  # what the last restart did to the outputs (publishing on, a recording ended)
        self.traffic = None  # the served traffic (a TrafficDriver) of the running demo, or None
        self.trace_replay = None  # the trace replay feeding the local engine (engine.TraceReplay), or None
        self.trace_settings = None  # how it replays (explorer.window.traces.ReplaySettings), for a restart
        self.trace_export = None  # --export-trace's exporter (explorer.feeds.trace_export): every local engine's steps
        self._loader: EngineLoader | None = None
        self._select_when_present: int | None = None
        self._stale_view: PoolSnapshot | None = None  # the view the panels have not shown yet (None: up to date)
        self.pace = FramePace(LivePacer(tick_s=FRAME_MS / 1000))  # what each tick does, and what waits
        self._closed = False
        self._shown_once = False
        self.docks_hidden_for_source: list[str] = []  # docks hidden because the source has nothing for them
        self.layout_memory = LayoutMemory(settings)
        self.commands = Commands(self)
        self._build_panels()
        self._build_centre()
        self.why = WhyViews(self)  # why prompts missed: detail, inspector, grid marks, regrets, prompt checks
        self.controls = EngineControls(self)
        self.addToolBar(self.controls)
        self.status = StatusBar(self)
        self.setStatusBar(self.status)
        self.status_labels = self.status.labels
        self.window_actions = WindowActions(self, self.controls)  # menus, toolbar and keys all use these
        build_menus(self, self.window_actions)
        self._wire()
        self.block_watch.selectionChanged.connect(self._on_block_selected)
        # fit the frame to the screen once shown: a --geometry too (``fit_size``, the command line's window) where it
        # is larger than the screen's free area; tests and --screenshot (drawn off screen) keep the size asked
        self._fit_frame = size is None or fit_size
        self.asked_size = size
        self.geometry_note = ""  # what the fit did to a --geometry that did not fit ("" when it fitted)
        self._place_window(size)
        self._on_source_changed(self.source.feed)
        self.setAcceptDrops(True)  # a trace or a recording dropped on the window opens it (explorer.window.traces)
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(FRAME_MS)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    # ---- construction -------------------------------------------------------------------------------------
    def _build_panels(self) -> None:
        self.inspector = Inspector()
        self.legend = Legend()
        self.relocation = RelocationPanel()
        self.conversations = ConversationsPanel()
        self.metrics = MetricsPanel()
        self.metrics_backfill = MetricsBackfill(self.metrics, self)
        self.block_watch = BlockWatch(self.source, self.inspector, self)  # the inspector follows its block
        self.history_panels = HistoryPanels(self, self.block_watch)  # event log and the block's own history
        self.history_panels.set_source(self.source)
        self.event_log = self.history_panels.event_log
        self.block_history = self.history_panels.block_history
        self.inspector.follow_history(self.block_history)  # the inspector lists the block's newest events
        self.capacity = CapacityPanel()  # a trace's hit rate against pool size (explorer.window.traces wires it)
        self.capacity.restartRequested.connect(lambda policy, blocks: traces.restart_replay(self, policy, blocks))
        self.docks = {
            "inspector": make_dock(self, "inspector", "Inspector", self.inspector, min_width=300,
                                   min_height=420),
            "legend": make_dock(self, "legend", "Legend", self.legend, min_width=240, min_height=300),
            "memory": make_dock(self, "memory", "Memory", self.relocation, min_width=260,
                                min_height=360),
            "conversations": make_dock(self, "conversations", "Conversations", self.conversations, min_width=520,
                                       min_height=160),
            "metrics": make_dock(self, "metrics", "Metrics", self.metrics, scroll=False),
            "events": self.event_log,
            "block-history": make_dock(self, "block-history", "Block history", self.block_history, scroll=False),
            "capacity": make_dock(self, "capacity", "Capacity", self.capacity, min_width=320, min_height=180),
        }
        self.right_docks = ["inspector", "legend", "memory", "block-history"]
        self.bottom_docks = ["conversations", "metrics", "events", "capacity"]

    def _build_centre(self) -> None:
        if len(self.panes) == 1:
            self.setCentralWidget(self.panes[0])
            return
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        for pane in self.panes:
            split.addWidget(pane)
            pane.activated.connect(self.activate_pane)
        self.setCentralWidget(split)

    def _wire(self) -> None:
        controls = self.controls
        controls.pauseToggled.connect(lambda pause: self.source.submit("pause" if pause else "resume"))
        controls.stepRequested.connect(lambda: self.source.submit("step_once"))
        controls.speedChanged.connect(lambda speed: self.source.submit("set_speed", speed))
        controls.restartRequested.connect(self.open_restart_dialog)
        controls.rateChanged.connect(lambda rate: self.traffic is not None and self.traffic.set_rate(rate))
        self.conversations.selectionChanged.connect(self._on_conversation_selected)
        self.conversations.buttonsChanged.connect(self._sync_conversation_actions)
        self.conversations.addRequested.connect(self.open_add_dialog)
        self.conversations.forkRequested.connect(self.fork_conversation)
        self.conversations.replyRequested.connect(self.open_reply_dialog)
        self.conversations.endRequested.connect(self.end_conversation)
        self.relocation.relocateRequested.connect(self.relocate)
        for pane in self.panes:
            pane.grid.blockClicked.connect(self.select_block)
            pane.tier_grids.slotClicked.connect(lambda name, slot, p=pane: self.inspect_tier_slot(p, name, slot))
            pane.color_by.currentIndexChanged.connect(
                lambda _i, p=pane: p is self.pane and self.legend.set_mode(p.color_by.currentData()))
            pane.source.problem.connect(self._on_problem)
        self._connect_source(self.source)

    def _source_slots(self) -> dict:
        """What the window itself follows of its active source (the tiers' durations come from the events)."""
        return dict(sourceChanged=self._on_source_changed, viewChanged=self._on_view, frameArrived=self._on_frame,
                    viewingChanged=self._on_viewing, eventsArrived=self.metrics.tiers.add_events)

    def _connect_source(self, source: PoolSource) -> None:
        self.conversations.set_colour_book(source.colours)  # its conversations in its grid's colours
        source.connect(**self._source_slots())
        self.why.follow(source)

    def _disconnect_source(self, source: PoolSource) -> None:
        source.disconnect(**self._source_slots())
        self.why.unfollow(source)

    def _place_window(self, size: tuple[int, int] | None) -> None:
        """Arrange the docks for the size the window gets, restore a saved layout over it, apply --geometry."""
        screen = QtGui.QGuiApplication.primaryScreen()
        available = screen.availableGeometry().size() if screen is not None else QtCore.QSize(1600, 1000)
        width, height = size or (min(max(available.width(), MIN_WIDTH), 1600),
                                 min(max(available.height(), MIN_HEIGHT), 1000))
        self.resize(width, height)
        self.layout_kind = arrange(self, [self.docks[k] for k in self.right_docks],
                                   [self.docks[k] for k in self.bottom_docks], width, height)
        self.layout_restored = self.layout_memory.restore(self, geometry=size is None, size=size)
        if size is not None:
            self.resize(*size)

    def reset_layout(self) -> None:
        """The first-launch arrangement for the current window size."""
        self.layout_kind = arrange(self, [self.docks[k] for k in self.right_docks],
                                   [self.docks[k] for k in self.bottom_docks], self.width(), self.height())
        if self.capacity.key is not None:  # a trace is replayed: its curves in front of the tab group they share
            self.docks["capacity"].raise_()

    # ---- compatibility names (tests, bench and dialogs use them) -------------------------------------------
    @property
    def pane(self) -> PoolPane:
        """The pane whose source the side panels follow."""
        return next(p for p in self.panes if p.source is self.source)

    @property
    def grid(self):
        return self.pane.grid

    @property
    def sources(self) -> list[PoolSource]:
        return [pane.source for pane in self.panes]

    @property
    def feed(self) -> Feed:
        return self.source.feed

    @property
    def runner(self):
        """The local engine's runner, or None when the active source is not the local engine."""
        return getattr(self.source.feed, "runner", None)

    @property
    def config(self) -> EngineConfig | None:
        return getattr(self.source.feed, "config", None)

    @property
    def snapshot(self):
        """The view every panel shows now (the live frame, or the history frame scrubbed to)."""
        return self.source.view

    @property
    def add_dialog(self):
        return self.commands.add_dialog

    @property
    def reply_dialog(self):
        return self.commands.reply_dialog

    def gui_fps(self, now: float | None = None) -> float:
        return self.status.gui_fps(now)

    def redraws_per_second(self, now: float | None = None) -> float:
        return self.status.redraws_per_second(now)

    # ---- the frame timer ----------------------------------------------------------------------------------
    @property
    def pacer(self) -> LivePacer:
        return self.pace.pacer

    def _tick(self) -> None:
        """One frame: each source polls its feed, and its signals hand the new view to the panes and to the side
        panels (``_on_view`` keeps it for them); then the grids draw, and the panels and plots follow as their pace
        allows (:class:`~explorer.model.pacer.FramePace`). Nothing here reads a view back out of a source."""
        now = time.perf_counter()
        self.status.frame_ticked(now)
        # live frames as often as the GUI thread's budget allows (explorer.model.pacer)
        gap = self.pace.tick(engine_has_slack(self.source.feed.speed, self.status.steps.per_second(now)))
        for source in self.sources:
            source.poll(gap)
        for pane in self.panes:
            if pane.render():
                self.status.redrawn(now)
        if self._stale_view is not None and self.pace.panels_due(now):
            started = time.perf_counter()
            self._refresh_panels(self._stale_view)
            self.pace.panels_refreshed(now, time.perf_counter() - started)
        if self.pace.plots_due(now):
            self.metrics.redraw()
            traces.show_live(self)  # the live replay's marker on the Capacity dock
            for pane in self.panes:
                pane.refresh_header()
            feed = self.source.feed
            if self.source.capabilities.can_command:
                self.controls.sync(feed.paused, feed.speed)
            self.status.show_state(self.source, now, gap)

    def _on_frame(self, snapshot) -> None:
        """A new live frame of the active source: metrics follow the present (history frames are not samples,
        except a recording's, read back by the backfill); the event log gets the new frames' events."""
        if not self.metrics_backfill.active:
            self.metrics.record(snapshot, timed=self.source.capabilities.is_live)
        self.status.frame_arrived(snapshot)

    def _on_view(self, snapshot) -> None:
        self._stale_view = snapshot  # the panels show it at their next refresh
        self.status.show_pool(snapshot)  # with the grid's header, from the same frame
        self.metrics.show_until(snapshot.step_id if self.source.viewing is not None else None)
        if self.source.viewing is not None:
            self.metrics_backfill.hold()  # a frame of history on view: the user scrubs (or plays); they go first

    def _on_viewing(self, seq) -> None:
        if not self.source.cursor.running:
            self.pace.moved()  # a move: its tables at the next frame (a drag's at their pace)
        self.window_actions.back_to_live.setEnabled(seq is not None)
        self.inspector.set_kv_reason(self._kv_reason())
        self._enable_commands()

    def _kv_reason(self) -> str:
        """Why the inspector has no K/V values now ("" when it has them)."""
        caps = self.source.capabilities
        if not caps.has_kv_values:
            return caps.kv_values_reason
        if self.source.viewing is not None:
            return ("K/V values are not kept over time, only the present's (Back to live shows them); tokens, owners "
                    "and hashes above are this step's")
        return ""

    def _refresh_panels(self, snap) -> None:
        """Conversations table, text, readouts: a few times a second is enough for reading."""
        self._stale_view = None
        self.conversations.refresh(snap)
        if self._select_when_present is not None and snap.conversation(self._select_when_present) is not None:
            self.conversations.select_conversation(self._select_when_present)
            self._select_when_present = None
        self.relocation.update_memory(snap.memory, snap.kv_cache_dtype)
        self.relocation.update_groups(snap)  # blocks per KV cache group, what a sliding window saved

    def _on_source_changed(self, feed: Feed) -> None:
        """A new feed took over the active source: every panel starts over, commands follow its capabilities."""
        self.commands.close_dialogs()
        if self.traffic is not None and self.traffic.feed is not feed:  # traffic belongs to the engine it fed
            self.stop_traffic()
        self._select_when_present = None
        self._stale_view = None  # the new feed's first view comes with its first poll
        self.pace.reset()
        self.relocation.reset()
        self.metrics.clear()
        self.metrics.show_server(getattr(feed, "server", None), feed.capabilities.has_physical_pool)
        if not feed.capabilities.is_live:  # its frames are all in its history already: no live frame brings them
            self.metrics_backfill.start(feed.history)
        else:
            self.metrics_backfill.stop()
        self.status.reset_source()
        latest = feed.latest()
        if feed.capabilities.can_command and latest is not None and not latest.conversations:
            self.status.showMessage(EMPTY_POOL_HINT)  # a new user's first question: how does anything start?
        self.conversations.set_detokenizer(feed.detokenizer)  # the text of earlier turns (None: split as seen)
        self.conversations.forget_selection()  # ids name another source's conversations now: the grid undims
        self.conversations.refresh(_empty_view(feed))
        self.setWindowTitle(f"Paged KV-cache explorer — {feed.title}")
        self.inspector.set_kv_reason(self._kv_reason())
        self.why.source_changed(feed)
        self.window_actions.stop_record.setEnabled(bool(getattr(feed, "recorders", None)))  # a new feed records nothing
        self._fit_docks_to(feed)
        self.status.fit_to(feed.capabilities)
        traces.follow_source(self, feed)  # the Capacity dock sweeps the trace this feed replays, if any
        self._enable_commands()

    def _fit_docks_to(self, feed: Feed) -> None:
        """Docks that have nothing to show for the source are hidden, so its view gets the room: every pool panel
        (inspector, legend, memory, conversations, metrics, event log, block history), and Capacity with no trace
        swept, for a source without a physical pool (KV events). They come back, as they were, for a source with
        one; View shows them at any time, and they are saved as shown (:meth:`closeEvent`), so the next launch has
        them."""
        if not feed.capabilities.has_physical_pool:
            for key in (*POOL_DOCKS, "capacity"):
                if key == "metrics" and getattr(feed, "server", None) is not None:
                    continue  # the server's own figures (--attach-metrics) are shown there
                if key == "capacity" and self.capacity.key is not None:
                    continue  # a trace's curves (an empty Capacity dock took a third of a KV-event window)
                dock = self.docks.get(key)
                if dock is not None and not dock.isHidden() and key not in self.docks_hidden_for_source:
                    self.docks_hidden_for_source.append(key)
                    dock.hide()
        else:
            self._show_docks_hidden_for_source()

    def _show_docks_hidden_for_source(self) -> None:
        hidden, self.docks_hidden_for_source = self.docks_hidden_for_source, []
        for key in hidden:
            self.docks[key].show()

    def _enable_commands(self) -> None:
        """Commands are enabled only where the active source takes them; disabled ones say why. Called when the
        source, the frame on view or the selection changes (not per frame): every control's state and tooltip are
        set here, in both directions, so none keeps an "Unavailable" tooltip once it is usable again."""
        reason = self.source.command_blocked_reason
        tip = f"Unavailable: {reason}" if reason else ""
        busy = self.relocation.busy  # a relocation in flight keeps its buttons disabled until it answers
        controls = [(action, True) for action in self.window_actions.commands] + [
            (self.controls.speed, True), (self.relocation.scramble, not busy), (self.relocation.compact, not busy)]
        for widget, usable in controls:
            widget.setEnabled(usable and not reason)
            _explain(widget, tip)
        self.conversations.set_read_only(reason)
        self._sync_conversation_actions()
        self._enable_demos()
        self.window_actions.restart.setEnabled(True)
        self.window_actions.restart.setToolTip("Start a local engine (the current source is closed)" if reason else
                                       "Restart the engine with another configuration")

    def _enable_demos(self) -> None:
        """The demos write text prompts: with a model that has no tokenizer (a checkpoint without tokenizer.json)
        they are disabled and say why, instead of a failed restart speaking of prompt_token_ids."""
        feed = self.source.feed
        textless = isinstance(feed, EngineFeed) and not feed.takes_text
        why = (f"Unavailable: the demos write text prompts, and this model ({feed.config.model}) has no tokenizer "
               "(no tokenizer.json). Restart with the built-in model (Engine > Restart) to run them." if textless
               else "")
        for name, action in self.window_actions.demos.items():
            if name == "lesson":
                continue
            action.setEnabled(not textless)
            if not hasattr(action, "usable_tip"):
                action.usable_tip = action.toolTip()
            action.setToolTip(why or action.usable_tip)
            action.setStatusTip(why or action.usable_tip)

    def _sync_conversation_actions(self) -> None:
        """Fork, Reply and End (menus, Ctrl+F, Ctrl+R, Ctrl+E) are usable exactly when the conversation panel's
        buttons are: a shortcut never offers what its greyed button refuses ("Command refused" on Ctrl+F)."""
        actions = self.window_actions
        for key, action in (("fork", actions.fork), ("reply", actions.reply), ("end", actions.end)):
            action.setEnabled(self.conversations.buttons[key].isEnabled())

    # ---- selection ------------------------------------------------------------------------------------------
    def activate_pane(self, pane: PoolPane) -> None:
        """Make ``pane``'s source the one the side panels follow."""
        if pane.source is self.source:
            return
        self._disconnect_source(self.source)
        self.source = pane.source
        self._connect_source(self.source)
        self.block_watch.set_source(self.source)
        self.history_panels.set_source(self.source)
        for p in self.panes:
            p.setProperty("active", p is pane)
        self._on_source_changed(self.source.feed)
        if self.source.view is not None:
            self._refresh_panels(self.source.view)

    def select_block(self, block_id: int | None) -> None:
        self.block_watch.select(block_id)

    def _on_block_selected(self, block_id) -> None:
        self.grid.set_selected_block(block_id)
        moved = self.block_watch.moved_from
        if block_id is not None and moved is not None:
            self.status.showMessage(f"Block {moved} moved to {block_id} (relocation); the inspector followed it.",
                                    5000)

    def inspect_tier_slot(self, pane: PoolPane, tier: str, slot: int) -> None:
        """A tier slot was clicked: the Inspector shows it (its facts, its tokens with their text) in place of a
        device block."""
        self.block_watch.select(None)
        grids = pane.tier_grids
        text = getattr(pane.source.feed, "token_text", None)
        self.inspector.show_tier_slot(tier, slot, grids.facts(tier, slot), grids.tokens(tier, slot), text)

    def select_conversation_when_present(self, cid: int) -> None:
        """Select conversation ``cid`` in the table as soon as a view lists it (it may still be queued)."""
        self._select_when_present = cid

    def _on_conversation_selected(self, cid: int | None) -> None:
        self.grid.set_selected_conversation(cid)
        self.pane.tier_grids.set_selected_conversation(cid)  # its content in the host and disk tiers too
        self.why.conversation_selected(cid)  # its missed blocks marked, where asked
        self._enable_commands()

    def selected_conversation(self) -> int | None:
        return self.conversations.selected_conversation()

    def with_selected(self, handler) -> None:
        cid = self.conversations.selected_conversation()
        if cid is None:
            self.status.showMessage("Select a conversation first.", 3000)
            return
        handler(cid)

    # ---- commands (kept as window methods: menus, panels and tests call them) ----------------------------------
    def open_add_dialog(self):
        return self.commands.open_add_dialog()

    def fork_conversation(self, cid: int) -> None:
        self.commands.fork(cid)

    def end_conversation(self, cid: int) -> None:
        self.commands.end(cid)

    def open_reply_dialog(self, cid: int):
        return self.commands.open_reply_dialog(cid)

    def relocate(self, compact: bool) -> None:
        self.commands.relocate(compact)

    def open_check_prompt(self):
        """Pool > Check a prompt...: would this prompt hit the active source's pool now?"""
        return self.why.open_dialog()

    def open_lesson(self):
        try:
            from .lesson import LessonWindow  # built separately; imported only when asked for
        except ImportError as exc:
            self.show_error("Lesson unavailable", f"The lesson could not be loaded: {exc}")
            return None
        if self.lesson_window is None:
            config = self.config or self.engine_config
            self.lesson_window = LessonWindow(parent=self, kv_cache_dtype=config.kv_cache_dtype)
        self.lesson_window.show()
        self.lesson_window.raise_()
        return self.lesson_window

    # ---- restart: a new local engine replaces the active source's feed ----------------------------------------
    def open_restart_dialog(self) -> RestartDialog:
        """The restart dialog: asks before discarding the engine's conversations, stays open (values kept) while
        the new engine loads, shows a failure at the field it concerns, and closes once the new engine runs."""
        view = self.source.live
        local = self.source.capabilities.can_command  # the local engine: the one source that takes commands
        count = len(view.conversations) if (local and view is not None) else 0
        dialog = RestartDialog(self.config or self.engine_config, self, num_conversations=count,
                               submit=lambda cfg: self.restart_engine(cfg, dialog=dialog),  # bound below, called later
                               engine_running=local, snapshot=view if local else None)
        self.restart_dialog = dialog
        dialog.open()
        return dialog

    def restart_engine(self, cfg: EngineConfig, setup=None, demo: str | None = None,
                       dialog: RestartDialog | None = None, config_before_demo: EngineConfig | None = None,
                       build=None, trace_settings=None, failed_title: str = "Engine restart failed") -> None:
        """Build the new engine in a worker thread; swap it in only once it loaded, else keep the old feed.
        ``dialog``: the restart dialog that asked, told how it went (else a failure is a message box).
        ``config_before_demo``: the user's settings, when ``cfg`` is a demo's own (the next demo goes back to them).
        ``build``: makes a trace replay instead of a bare engine (explorer.window.traces), replayed as
        ``trace_settings`` say; ``failed_title``: the message box's title if it fails."""
        if self._loader is not None:
            if dialog is not None:
                dialog.restart_failed("An engine is already being loaded; try again when it is up")
            else:
                self.show_error("Restart in progress", "An engine is already being loaded.")
            return
        loader = self._loader = EngineLoader(self)
        progress = self.restart_progress = progress_dialog(self, f"Loading {cfg.model}…", loader)
        released = self._release_kv_events_for(cfg)

        def done() -> None:
            """The load is over: its dialog and loader go with it (children of the window, each restart's would
            stay until the window closed, with what the loader last carried), and nothing keeps them."""
            progress.close()
            progress.deleteLater()
            loader.deleteLater()
            self._loader = self.restart_progress = None

        def loaded(engine) -> None:
            done()
            if self._closed:  # a closed window must not start an engine thread that nothing would stop
                return
            self.swap_engine(engine, cfg, demo=demo, driver=loader.driver, trace_settings=trace_settings)
            self.config_before_demo = config_before_demo
            self.show_demo_notes(loader.setup_result)
            if dialog is not None:
                dialog.restart_succeeded()

        def failed(message: str, details: str) -> None:
            done()
            if dialog is not None and not self._closed:
                dialog.restart_failed(message)
                return
            previous = "engine" if self.source.capabilities.can_command else "source"
            note = (f" It no longer publishes KV events on {released[0]}: they were released for the new engine."
                    if released is not None else "")
            self.show_error(failed_title, f"{message}\n\nThe previous {previous} keeps running.{note}", details)

        loader.loaded.connect(loaded)
        loader.failed.connect(failed)
        progress.show()
        loader.start(cfg, setup, after=released[1] if released is not None else None, build=build)

    def _release_kv_events_for(self, cfg: EngineConfig):
        """When the new engine would bind the KV-event endpoint the running one holds (a restart with the same
        --kv-events), ask the running one to let go of it first, so the new one does not fail with "address in
        use"; returns (endpoint, the Future of the release) or None. The status bar says so."""
        feed = self.source.feed
        clash = feed.kv_events_clash(cfg) if isinstance(feed, EngineFeed) and cfg.kv_events_endpoint else None
        if clash is None:
            return None
        self.status.showMessage(f"Releasing the KV-event endpoint {clash} for the new engine (the running engine "
                                "stops publishing KV events there).", 8000)
        return clash, feed.release_kv_events()

    def show_demo_notes(self, seeded) -> None:
        """Say in the status bar what a demo lowered to fit the pool (``seeded``: a demo's Seeded, or None); the
        full list is kept in ``demo_notes`` and in the status bar's tooltip. What the restart said about the
        outputs (publishing goes on, a recording ended) stays in the message."""
        notes = tuple(getattr(seeded, "notes", ()) or ())
        self.demo_notes = notes
        summary = seeded.summary() if notes else ""
        if summary:
            self.status.showMessage(f"{summary} {self.outputs_note}".strip(), 20000)
        self.status.setToolTip("\n".join(notes))

    def swap_engine(self, engine, cfg: EngineConfig, demo: str | None = None, driver=None,
                    trace_settings=None) -> None:
        """Run ``engine`` instead of the active feed, keeping pause and speed; answers in flight are dropped.
        ``driver``: the trace replay that feeds ``engine`` (replayed as ``trace_settings`` say), or None.

        The old engine is stopped first. Its --publish publishers go on with the new engine (subscribers see the
        source restart); its recordings (--record, File > Record) end with it, since a recording holds one
        engine's run. The status bar says both, and Stop recording is disabled."""
        from ..feeds.demo import DEMO_SPEED
        old = self.source.feed
        # a recording or a watched stream has no engine speed: the new engine takes the speed box's, as shown
        speed = DEMO_SPEED if demo else (old.speed if old.capabilities.can_command else self.controls.speed.currentData())
        if trace_settings is not None and trace_settings.steps_per_second is not None:
            speed = trace_settings.steps_per_second  # a traffic demo's pace
        paused = old.paused if (old.capabilities.can_command and not demo) else False
        carried, ended = old.hand_over() if isinstance(old, EngineFeed) else ([], [])
        export = self.metrics_export  # --metrics-port follows the new engine
        observers = [export.observer(cfg)] if export is not None else []
        if self.trace_export is not None:  # so does --export-trace (each engine's conversations kept apart)
            observers.append(self.trace_export.observer())
        self.trace_replay, self.trace_settings = driver, trace_settings if driver is not None else None
        feed = EngineFeed.start(engine, cfg, max_steps_per_second=speed, start_paused=paused, extra_sinks=carried,
                                observers=observers, driver=driver)
        self.engine_config = cfg
        self.source.set_feed(feed)
        if demo:
            self.start_traffic(demo)
        self.outputs_note = outputs_note(carried, ended)
        self.status.showMessage(f"Engine restarted: {cfg.model}, {cfg.num_blocks} blocks of {cfg.block_size}. "
                                f"{self.outputs_note}".strip(), 15000 if self.outputs_note else 5000)

    def start_traffic(self, demo: str) -> None:
        """Served traffic for ``demo`` on the local engine: at once for serve, after the first screen for the others
        (they keep living instead of going idle). The toolbar's arrivals slider sets its rate."""
        from ..feeds.demo import DEMOS, SERVED_AT_ONCE
        from ..feeds.traffic import TrafficDriver
        self.stop_traffic()
        feed = self.source.feed
        if demo not in DEMOS or not isinstance(feed, EngineFeed) or not feed.takes_text:
            return
        self.traffic = TrafficDriver(feed, rate=self.controls.rate_value(),
                                     wait_until_idle=demo not in SERVED_AT_ONCE).start()
        self.controls.show_rate(True)
        self.conversations.set_served(self.traffic.own)  # what its clients do is worded as theirs
        self.event_log.model.served = self.traffic.own

    def stop_traffic(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()
            self.traffic = None
        self.controls.show_rate(False)
        self.conversations.set_served(())
        self.event_log.model.served = ()

    def set_contiguous(self, on: bool) -> None:
        """View > Contiguous side by side, for every pane."""
        for pane in self.panes:
            pane.set_contiguous(on)
        if self.window_actions.contiguous.isChecked() != on:
            self.window_actions.contiguous.setChecked(on)

    def set_feed(self, feed: Feed) -> None:
        """Watch ``feed`` in the active pane instead (File > Open, attach)."""
        self.source.set_feed(feed)

    # ---- errors and closing ----------------------------------------------------------------------------------
    TRANSIENT_PROBLEMS = frozenset({"Attached pool silent"})  # states the pane's header shows, and clears itself

    def _on_problem(self, problem: Problem) -> None:
        """A problem opens a message box, unless it is a passing state: an attached stream gone silent is said in
        its pane's header ("↔ silent for 12 s"), which says "live" again once frames come, and briefly here; a
        box stayed open after the stream had resumed."""
        if problem.title in self.TRANSIENT_PROBLEMS:
            for pane in self.panes:
                pane.refresh_header()
            self.status.showMessage(f"{problem.title}: {problem.text}", 8000)
            return
        self.show_error(problem.title, problem.text, problem.details or None)

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

    def showEvent(self, event: QtGui.QShowEvent) -> None:
        super().showEvent(event)
        if not self._shown_once and self._fit_frame:
            QtCore.QTimer.singleShot(FRAME_FIT_MS, self.fit_frame_to_screen)
        if not self._shown_once and not self.layout_restored:
            # the arrangement made before the window was shown had no real dock sizes to share out (a first launch
            # left the conversations a few rows: docs/gui.md): made again once shown, as View > Reset layout
            QtCore.QTimer.singleShot(0, self._first_layout)
        self._shown_once = True

    def _first_layout(self) -> None:
        if not self._closed and not self.layout_restored:
            self.reset_layout()
            for key in self.docks_hidden_for_source:  # the arrangement shows every dock; a KV-event source has
                self.docks[key].hide()  # nothing for these (they stay listed, to come back with a pool source)

    def fit_frame_to_screen(self) -> bool:
        """Keep the whole window on its screen, title bar included: sized to the screen's area without --geometry,
        the window manager's frame pushed the status bar below the screen's edge. Never below the smallest supported
        size, except in height on a screen no taller than that, where the title bar pushed the status bar below its
        edge too (docs/gui.md). Returns whether it resized."""
        screen = self.screen()
        if screen is None or self.isMaximized() or self.isFullScreen():
            return False
        room, frame = screen.availableGeometry(), self.frameGeometry()
        extra_w, extra_h = frame.width() - self.width(), frame.height() - self.height()  # the frame's own size
        width = max(min(self.width(), room.width() - extra_w), MIN_WIDTH)  # narrower screens are not supported
        height = framed_length(self.height(), room.height(), extra_h, MIN_HEIGHT, self.minimumSizeHint().height())
        if self.asked_size is not None:  # --geometry is only ever made smaller, to fit the screen
            width, height = min(width, self.width()), min(height, self.height())
        if (width, height) == (self.width(), self.height()):
            return False
        self.resize(width, height)
        self.move(max(room.left(), min(frame.left(), room.right() - width - extra_w)),
                  max(room.top(), min(frame.top(), room.bottom() - height - extra_h)))
        if self.asked_size is not None:
            asked = "x".join(map(str, self.asked_size))
            self.geometry_note = (f"--geometry {asked} does not fit the screen's free area ({room.width()}x"
                                  f"{room.height()}, window frame included): the window is {width}x{height}")
            print(self.geometry_note, file=sys.stderr, flush=True)
            self.status.showMessage(self.geometry_note, 10000)
        return True

    def dragEnterEvent(self, event: QtGui.QDragEnterEvent) -> None:
        if traces.dropped_files(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event: QtGui.QDropEvent) -> None:
        paths = traces.dropped_files(event.mimeData())
        if paths:
            event.acceptProposedAction()
            files.open_dropped(self, paths[0])

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        if self._shown_once and event.oldSize().isValid():
            keep_proportions(self, event.oldSize(), event.size())

    def closeEvent(self, event: QtGui.QCloseEvent) -> None:
        if not self._closed:
            self._show_docks_hidden_for_source()  # saved as the user left them, not as this source needed them
            self.layout_memory.save(self)
        self._closed = True
        self.timer.stop()
        self.capacity.shutdown()
        if self.traffic is not None:
            self.traffic.stop()
        self.metrics_backfill.stop()
        self.block_watch.stop()
        for source in self.sources:
            source.close()
        if self.metrics_export is not None:
            self.metrics_export.close()
        if self.restart_progress is not None:
            self.restart_progress.close()
        for window in (self.lesson_window, self.help_window):
            if window is not None:
                window.close()
        event.accept()


def outputs_note(carried, ended) -> str:
    """What a restart did to the old engine's outputs, in words ("" when it had none)."""
    parts = [f"Still publishing the pool stream on {getattr(p, 'endpoint', p)} (subscribers see the source restart)."
             for p in carried]
    parts += [f"Recording {path} ended with the old engine ({frames:,} frames): a recording holds one engine's run; "
              "File > Record starts a new one." for path, frames in ended]
    return " ".join(parts)


def _explain(widget, tip: str) -> None:
    """``tip`` as the tooltip of a disabled control, its own tooltip again when ``tip`` is ""."""
    base = widget.property("base_tip")
    if base is None:  # the control's own tooltip, kept the first time it is explained
        base = widget.toolTip()
        widget.setProperty("base_tip", base)
    if widget.toolTip() != (tip or base):
        widget.setToolTip(tip or base)


def _empty_view(feed: Feed):
    """The feed's newest view, or an empty pool so tables start over before the first frame."""
    latest = feed.latest()
    if latest is not None:
        return latest
    zeros = np.zeros(0, np.int32)
    return PoolSnapshot(step_id=0, block_size=1, num_blocks=0, ref_count=zeros, num_filled=zeros,
                        state=zeros.astype(np.int8), owner=zeros, last_access=zeros.astype(np.int64),
                        block_tables={}, conversations=())
