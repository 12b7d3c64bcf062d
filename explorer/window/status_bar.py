"""The status line: what the source is doing, how fast it and the GUI go, and how full the pool is.

Rates come from the project's one rate helper (``kvstream.rules.Rate``), fed with what the source delivers (step ids
and generated-token counts of its frames) and with the window's own frame ticks, so they read the same for every
kind of source.
Labels never ask for more width than they get: at 1024 pixels the line elides instead of widening the window.
"""
from __future__ import annotations

import os

import time

from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.rules import Rate

from ..feeds.engine_feed import model_name
from ..model.pacer import MACHINE_SHARE
from ..model.pool_counts import pool_counts
from ..widgets.elided_label import ElidedLabel

KEYS = ("live", "engine", "gui", "pool", "model")
STRETCH = {"live": 2, "engine": 4, "gui": 3, "pool": 6, "model": 0}  # about the length of each label's text
STREAM_STRETCH = {"live": 6, "engine": 4, "gui": 2, "pool": 5, "model": 0}  # a KV-event source: its status line
# ("tcp://host:5557: live · seq 41 · lost 3 batches", one per instance) is the longest
PERMANENT = ("model",)  # always shown; the others give way to a transient message while it shows
MODEL_WIDTH = 320  # pixels the model label may take (a long checkpoint path is elided)
WIDTH_STEP = 24  # a label's wanted width is its text's, rounded up to this: a rate's changing digits do not move it
LEAST_WIDTH = 40  # what a label keeps when the texts do not all fit


class CounterRate:
    """Growth per second of a running count (a step id, a token counter), through a :class:`Rate`.

    ``add(count)`` gives the count's current value; the growth since the previous value is ticked into the rate.
    A count that goes backwards (a new source counting from 0) starts the rate over instead of going negative.
    """

    def __init__(self, window_s: float = 1.0, clock=time.perf_counter):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.rate = Rate(window=window_s, clock=clock)  # the shared helper that does the arithmetic
        self._last: float | None = None  # the count given last, None before the first

    def add(self, count: float, now: float | None = None) -> None:
        if self._last is None or count < self._last:
            self.rate.clear()
            self.rate.tick(0, now)
        else:
            self.rate.tick(int(count - self._last), now)
        self._last = count

    def per_second(self, now: float | None = None) -> float:
        return self.rate.per_second(now)

    def reset(self) -> None:
        self.rate.clear()
        self._last = None


class StatusBar(QtWidgets.QStatusBar):
    """Labels (live, engine rate, GUI rate, pool, model) plus Qt's transient messages.

    The live, rate and pool labels are normal status-bar widgets, which a transient message covers while it shows;
    the model's is permanent, at its own width. With every label permanent (and stretching), a message ("Demo: 21
    of 32 requests were lowered ...") got the 2 pixels they left and was never seen."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.labels: dict[str, QtWidgets.QLabel] = {}
        for key in KEYS:
            label = ElidedLabel()
            if key in PERMANENT:  # its own width (at most MODEL_WIDTH), no stretch: the rest is the message's
                label.setSizePolicy(QtWidgets.QSizePolicy.Policy.Preferred, QtWidgets.QSizePolicy.Policy.Preferred)
                label.setMaximumWidth(MODEL_WIDTH)
                self.addPermanentWidget(label, 0)
            else:
                self.addWidget(label, STRETCH[key])
            self.labels[key] = label
        self.stretch = STRETCH  # the labels' shares of the bar now
        self._message: tuple[str, int, float] | None = None  # (text, timeout ms, when shown) of the last message
        self.frames = Rate()  # frame-timer ticks: how often the GUI can show a new state
        self.redraws = Rate()  # grid redraws: how often it did
        self.steps = CounterRate(window_s=2.0)  # step ids of arriving frames
        self.tokens = CounterRate(window_s=2.0)  # generated-token counter of arriving frames
        self.batches = CounterRate(window_s=2.0)  # event batches a stream without pool views has applied
        self.stored = CounterRate(window_s=2.0)  # blocks such a stream reported stored

    def fit_to(self, capabilities) -> None:
        """Share the bar out for the source: a KV-event source's status line gets the most room."""
        stretch = STRETCH if capabilities.has_physical_pool else STREAM_STRETCH
        if stretch is self.stretch:
            return
        self.stretch = stretch
        keys = [k for k in KEYS if k not in PERMANENT]
        for key in keys:
            self.removeWidget(self.labels[key])  # a status bar widget's stretch is fixed when it is added
        for index, key in enumerate(keys):
            self.insertWidget(index, self.labels[key], stretch[key])
            self.labels[key].setVisible(not self.currentMessage())  # a message showing keeps them hidden

    def showMessage(self, text: str, timeout: int = 0) -> None:
        self._message = (text, int(timeout), time.perf_counter())
        super().showMessage(text, timeout)

    def showEvent(self, event: QtGui.QShowEvent) -> None:
        """A message shown before the bar was (main.py's demo notes) found the labels not yet visible, so Qt did not
        hide them, and the two were drawn over each other: say it again now, for the time it has left."""
        super().showEvent(event)
        if self._message is not None and self.currentMessage() == self._message[0]:
            text, timeout, start = self._message
            left = timeout - int(1000 * (time.perf_counter() - start)) if timeout else 0
            if not timeout or left > 0:
                QtCore.QTimer.singleShot(0, lambda: self._say_again(text, max(left, 1) if timeout else 0))

    def _say_again(self, text: str, timeout: int) -> None:
        if self.currentMessage() == text:
            super().clearMessage()  # Qt ignores a message equal to the one it shows: clear it first
            super().showMessage(text, timeout)

    # ---- what is counted ---------------------------------------------------------------------------------------
    def frame_ticked(self, now: float | None = None) -> None:
        self.frames.tick(1, now)

    def redrawn(self, now: float | None = None) -> None:
        self.redraws.tick(1, now)

    def frame_arrived(self, snapshot, now: float | None = None) -> None:
        """A live frame from the source (not a history frame being viewed)."""
        now = time.perf_counter() if now is None else now
        self.steps.add(snapshot.step_id, now)
        self.tokens.add(snapshot.metrics.num_generated_tokens, now)

    def reset_source(self) -> None:
        """A new source: its counters start again."""
        self.steps.reset()
        self.tokens.reset()
        self.batches.reset()
        self.stored.reset()

    # ---- what is shown ----------------------------------------------------------------------------------------
    def show_state(self, source, now: float | None = None, live_gap: float = 0.0) -> None:
        """The status line for ``source`` now; ``live_gap``: the least time the window leaves between two live
        frames (explorer.model.pacer; 0: it takes every one)."""
        now = time.perf_counter() if now is None else now
        feed = source.feed
        live = feed.status_text()
        if source.viewing is not None and source.view is not None:
            live = f"◀ viewing step {source.view.step_id:,} · {live}"
        recording = recording_text(feed)
        if recording:  # lasting, while it records: the transient "Recording to ..." message went after 5 s
            live = f"{live} · {recording}"
        self._set("live", live)
        counts = None if source.capabilities.has_physical_pool else feed.stream_counts()
        if counts is not None:  # a KV-event source: no pool views, so its own counts instead of "waiting"
            self._show_stream_counts(counts, now)
        else:
            self._set("engine", f"engine {self.steps.per_second(now):.1f} steps/s · "
                                f"{self.tokens.per_second(now):.0f} tokens/s")
        paced = f" · live frames {1000 * live_gap:.0f} ms apart" if live_gap > 0 else ""
        self._set("gui", f"GUI {self.frames.per_second(now):.0f} fps · {self.redraws.per_second(now):.0f} redraws/s"
                         f"{paced}")
        if paced:
            self.labels["gui"].setToolTip(
                f"The window shows a new live frame at most every {1000 * live_gap:.0f} ms, the newest each time, "
                "with every event of the frames in between: drawing every one would take the GUI thread past "
                f"{MACHINE_SHARE:.1%} of this machine's CPU time, which decoding needs. Scrubbing and clicks are not "
                "slowed.")
        snap = source.view
        if snap is not None:
            self.show_pool(snap)
        elif counts is None:
            self._set("pool", "waiting for the first frame…")
        where = f" on {snap.device}{kv_text(snap)}" if snap is not None and snap.model_name else ""
        self._set("model", f"{model_name(snap.model_name)}{where}" if where else "",  # a checkpoint by its folder:
                  tip=f"{snap.model_name}{where}" if where else "")  # its whole path (elided, only the cache's showed)
        reason = source.command_blocked_reason
        self.labels["live"].setToolTip(f"read-only: {reason}" if reason else "commands go to this engine")

    def show_pool(self, snapshot) -> None:
        """The pool figures of the view on show, counted as the grid's header counts them (the window calls this
        with every new view, so the two always name the same frame)."""
        self._set("pool", pool_counts(snapshot).status_text())

    def _show_stream_counts(self, counts: dict, now: float) -> None:
        """What a KV-event source is doing: batches and stored blocks per second, and what its caches hold."""
        self.batches.add(counts["batches"], now)
        self.stored.add(counts["stored"], now)
        self._set("engine", f"KV events {self.batches.per_second(now):.1f} batches/s · "
                            f"{self.stored.per_second(now):.0f} blocks stored/s")
        instances, batches = counts["instances"], counts["batches"]
        self._set("pool", f"{counts['cached']} blocks cached on {instances} instance{'s' if instances != 1 else ''}"
                          f" · {batches} batch{'es' if batches != 1 else ''} · {counts['stored']} stored, "
                          f"{counts['removed']} removed")

    def _set(self, key: str, text: str, tip: str | None = None) -> None:
        label = self.labels[key]
        if label.text() != text:
            label.setText(text)
            if key != "live":  # the live label's tooltip says whether commands reach the source
                label.setToolTip(text if tip is None else tip)
            self._fit_widths()

    def minimumSizeHint(self) -> QtCore.QSize:
        """As narrow as the least widths: the widths the texts want (:meth:`_fit_widths`) never keep the window
        from being made narrower; a narrower bar sets them again."""
        return QtCore.QSize(LEAST_WIDTH * len(KEYS), super().minimumSizeHint().height())

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit_widths()

    def _fit_widths(self) -> None:
        """Where the whole texts fit side by side, each label gets at least its text's width (the stretch shares
        only what is left); where they do not (1024 px), the shares alone, and the labels elide. By the shares
        alone, 'GUI 29 fps · 2 redraws/s · live frames 250 ms apart' was cut with '…' at 1600 px while the pool's
        label had room to spare."""
        keys = [k for k in KEYS if k not in PERMANENT]
        want = {}
        for key in keys:
            label = self.labels[key]
            margins = label.contentsMargins()
            text = label.fontMetrics().horizontalAdvance(label.text()) + margins.left() + margins.right() + 2
            want[key] = max(LEAST_WIDTH, -(-text // WIDTH_STEP) * WIDTH_STEP)
        taken = sum(self.labels[k].sizeHint().width() for k in PERMANENT if self.labels[k].isVisible())
        spacing = max(self.layout().spacing(), 0) if self.layout() is not None else 6
        room = self.width() - taken - spacing * (len(KEYS) + 2) - 24  # 24: the size grip and the bar's margins
        fits = sum(want.values()) <= room
        for key in keys:
            least = want[key] if fits else LEAST_WIDTH
            if self.labels[key].minimumWidth() != least:
                self.labels[key].setMinimumWidth(least)

    def gui_fps(self, now: float | None = None) -> float:
        return self.frames.per_second(now)

    def redraws_per_second(self, now: float | None = None) -> float:
        return self.redraws.per_second(now)


def kv_text(snapshot) -> str:
    """' · KV fp8_e4m3, 90 KiB a block': what the pool stores and a block's bytes, where the source says ('' where it
    says neither)."""
    memory = snapshot.memory
    size = "" if memory is None else _bytes(memory.bytes_per_block) + " a block"
    dtype = snapshot.kv_cache_dtype
    return f" · KV {dtype}{', ' + size if size else ''}" if dtype else (f" · {size}" if size else "")


def _bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def recording_text(feed) -> str:
    """'● REC run.kvpool, 1.2 MiB' while ``feed`` records (File > Record, --record), else ''."""
    recorders = [r for r, _ in getattr(feed, "recorders", ())] + [
        o for o in getattr(feed, "outputs", ()) if hasattr(o, "bytes_written") and hasattr(o, "path")]
    if not recorders:
        return ""
    parts = []
    for recorder in recorders:
        size = recorder.bytes_written
        amount = f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size / 1024:.0f} KiB"
        parts.append(f"{os.path.basename(recorder.path)}, {amount}")
    return "● REC " + "; ".join(parts)
