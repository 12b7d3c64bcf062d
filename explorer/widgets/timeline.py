"""The timeline under the grid: scrub through the frames history keeps, see where things happened, play, go live.

A user who notices a block turn from shared to private wants to go back to the step where it happened. The
timeline is the time axis for that: a strip over the kept frames (``first_seq..last_seq``) with a coloured mark
wherever an event of interest landed (copy-on-write, eviction, preemption, relocation, a conversation added or
finished: :data:`kvstream.events.NOTABLE_KINDS` by default, any kind on request), a cursor the user drags, left and
right keys (Shift: to the previous or next mark), play/pause at a chosen speed, and a clear banner: "live" while it
follows the newest frame, "viewing step N of M" with a "Back to live" button otherwise. Below, what history keeps
and the memory budget the user can change.

It is data-driven: the window feeds it ranges, markers and byte counts; the step on view is a
:class:`~explorer.model.cursor.StepCursor`'s (its own, or the source's it is given with :meth:`Timeline.follow`), which
it draws and moves, and a source given the same cursor follows it. It never touches History or the source itself. Markers live in two numpy arrays and are drawn as one image row stretched over
the strip (one pixel column per mark, the most telling kind winning), so tens of thousands of marks and 30
updates a second cost well under a millisecond of painting.
"""
from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Callable, Iterable, Sequence

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.events import NOTABLE_KINDS, BlockEvent, EventKind

from ..model.cursor import StepCursor
from ..model.event_colours import ALL_KINDS, KIND_CODE, KIND_COLOURS, KIND_NAMES, KIND_PRIORITY
from .kind_menu import KindMenu, as_kind

MIB = 1 << 20
SPEEDS = (1, 2, 5, 10, 30, 60, 120, 300)  # play speeds offered, frames per second
DEFAULT_SPEED = 10  # frames per second
TICK_MS = 33  # play timer period at most (about 30 Hz); faster speeds advance several frames per tick
BUDGET_RANGE_MIB = (16, 65536)  # what the budget spin box accepts
LIVE_COLOUR = QtGui.QColor(70, 200, 110)
VIEWING_COLOUR = QtGui.QColor(250, 190, 50)
REGRET_RGB = (255, 60, 40)  # a regretted eviction's tick: an eviction a later prompt wanted back
REGRET_COLOUR = QtGui.QColor(*REGRET_RGB)
GROOVE = QtGui.QColor(44, 46, 56)
GROOVE_PAST = QtGui.QColor(62, 66, 80)
CONTROL_HEIGHT = 20  # px: buttons and the budget box, so three rows fit in 60 px
HANDLE = 5  # px: half the cursor handle's width; the strip is inset by it

_RANK = np.full(len(ALL_KINDS), len(ALL_KINDS), np.int16)  # kind code -> priority rank (0 wins a pixel column)
for _r, _kind in enumerate(KIND_PRIORITY):
    _RANK[KIND_CODE[_kind]] = _r
_RANK_COLOURS = np.zeros((len(ALL_KINDS) + 1, 4), np.uint8)  # rank -> RGBA; the last row (no mark) transparent
for _r, _kind in enumerate(KIND_PRIORITY):
    _RANK_COLOURS[_r, :3], _RANK_COLOURS[_r, 3] = KIND_COLOURS[_kind], 255


def size_text(nbytes: int) -> str:
    """Bytes for people: '640 KiB', '3.2 MiB', '212 MiB', '1,536 MiB' (MiB above 1 MiB: the budget's unit)."""
    if nbytes < MIB:
        return f"{nbytes / 1024:,.0f} KiB"
    if nbytes < 10 * MIB:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / MIB:,.0f} MiB"


_pair_seq, _pair_event, _event_kind = itemgetter(0), itemgetter(1), attrgetter("kind")  # of (seq, event) pairs


def _check_seq(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer frame number, not {value!r}")
    return int(value)


class Markers:
    """Marks on the time axis as two growing arrays (frame seq, kind code), for cheap appends and one-pass drawing.

    Appends normally arrive in frame order; one out of order marks the arrays for a sort before the next read.
    """

    def __init__(self):
        self.seq = np.zeros(1024, np.int64)  # frame of each mark (first self.n entries valid)
        self.code = np.zeros(1024, np.int8)  # KIND_CODE of each mark
        self.n = 0  # marks stored
        self._sorted = True  # seq[:n] is non-decreasing

    def clear(self) -> None:
        self.n, self._sorted = 0, True

    def extend(self, seqs: np.ndarray, codes: np.ndarray) -> None:
        if not len(seqs):
            return
        need = self.n + len(seqs)
        if need > len(self.seq):
            size = max(need, 2 * len(self.seq))
            self.seq = np.resize(self.seq, size)
            self.code = np.resize(self.code, size)
        if self._sorted and (np.any(np.diff(seqs) < 0) or (self.n and seqs[0] < self.seq[self.n - 1])):
            self._sorted = False
        self.seq[self.n:need], self.code[self.n:need] = seqs, codes
        self.n = need

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(seqs, codes) sorted by seq (views; do not keep them across appends)."""
        if not self._sorted:
            order = np.argsort(self.seq[:self.n], kind="stable")
            self.seq[:self.n], self.code[:self.n] = self.seq[:self.n][order], self.code[:self.n][order]
            self._sorted = True
        return self.seq[:self.n], self.code[:self.n]

    def drop_before(self, first_seq: int) -> None:
        """Forget marks of frames history no longer keeps (only when they are many: it costs a copy)."""
        seqs, _ = self.arrays()
        cut = int(np.searchsorted(seqs, first_seq, "left"))
        if cut > 4096 and cut * 2 > self.n:
            keep = self.n - cut
            self.seq[:keep], self.code[:keep] = self.seq[cut:self.n].copy(), self.code[cut:self.n].copy()
            self.n = keep


class _FitLabel(QtWidgets.QLabel):
    """A one-line label given several wordings, longest first: it shows the longest that fits its width (the last
    one elided if none does), so the timeline stays readable at 300 px. The tooltip holds the longest."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._variants: tuple[str, ...] = ("",)

    def minimumSizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(24, super().minimumSizeHint().height())

    def sizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(min(super().sizeHint().width(), 360), super().sizeHint().height())

    def set_variants(self, *variants: str) -> None:
        if variants == self._variants:
            return  # setText lays the label out again: only for new words
        self._variants = variants
        self.setText(variants[0])
        self.setToolTip(variants[0])

    def shown_text(self) -> str:
        """The wording painted at the current width."""
        width = self.contentsRect().width() - 2 * self.margin()
        metrics = self.fontMetrics()
        for text in self._variants:
            if metrics.horizontalAdvance(text) <= width:
                return text
        return metrics.elidedText(self._variants[-1], QtCore.Qt.TextElideMode.ElideRight, width)

    def paintEvent(self, event) -> None:
        painter = QtGui.QPainter(self)
        if self.autoFillBackground():
            painter.fillRect(self.rect(), self.palette().color(QtGui.QPalette.ColorRole.Window))
        rect = self.contentsRect().adjusted(self.margin(), 0, -self.margin(), 0)
        painter.setPen(self.palette().color(QtGui.QPalette.ColorRole.WindowText))
        painter.drawText(rect, int(self.alignment() | QtCore.Qt.AlignmentFlag.AlignVCenter), self.shown_text())


class _Track(QtWidgets.QWidget):
    """The strip itself: groove, marks, cursor; turns clicks and drags into frame numbers."""

    picked = QtCore.Signal(int)  # frame under the mouse while pressed

    def __init__(self, timeline: "Timeline"):
        super().__init__(timeline)
        self.timeline = timeline
        self.setFocusPolicy(QtCore.Qt.FocusPolicy.StrongFocus)
        self.setMinimumSize(60, 14)
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Expanding, QtWidgets.QSizePolicy.Policy.Expanding)
        self.setCursor(QtCore.Qt.CursorShape.PointingHandCursor)
        self._image_key = None  # what the cached marker image was drawn for
        self._image: QtGui.QImage | None = None
        self._image_rgba = None  # keeps the image's pixel buffer alive
        self.dragging = False  # the left button is down on the strip

    def sizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(400, 26)

    def strip(self) -> QtCore.QRect:
        return self.rect().adjusted(HANDLE, 2, -HANDLE - 1, -3)

    def x_of(self, seq: int) -> int:
        t = self.timeline
        r = self.strip()
        span = max(1, t.last_seq - t.first_seq)
        return r.left() + ((seq - t.first_seq) * (r.width() - 1) + span // 2) // span  # as marker_columns

    def seq_at(self, x: float) -> int:
        t = self.timeline
        r = self.strip()
        span = t.last_seq - t.first_seq
        frac = (x - r.left()) / max(1, r.width() - 1)
        return int(round(t.first_seq + min(1.0, max(0.0, frac)) * span))

    def marker_columns(self) -> np.ndarray:
        """Rank of the winning enabled mark in each pixel column of the strip (len(ALL_KINDS): none)."""
        t = self.timeline
        width = self.strip().width()
        best = np.full(max(1, width), len(ALL_KINDS), np.int16)
        seqs, codes = t.markers.arrays()
        lo, hi = int(np.searchsorted(seqs, t.first_seq, "left")), int(np.searchsorted(seqs, t.last_seq, "right"))
        seqs, codes = seqs[lo:hi], codes[lo:hi]
        if len(seqs):
            keep = t.enabled_mask[codes]
            seqs, codes = seqs[keep], codes[keep]
        if len(seqs):
            span = max(1, t.last_seq - t.first_seq)
            cols = ((seqs - t.first_seq) * (width - 1) + span // 2) // span  # same rounding as x_of
            np.minimum.at(best, cols, _RANK[codes])
        return best

    def _marker_image(self) -> QtGui.QImage | None:
        t = self.timeline
        key = (t.first_seq, t.last_seq, self.strip().width(), t.markers.n, t.enabled_mask.tobytes())
        if key != self._image_key:
            rgba = np.ascontiguousarray(_RANK_COLOURS[self.marker_columns()][None, :, :])  # [1, width, 4]
            self._image_rgba = rgba
            self._image = QtGui.QImage(rgba.data, rgba.shape[1], 1, rgba.shape[1] * 4,
                                       QtGui.QImage.Format.Format_RGBA8888)
            self._image_key = key
        return self._image

    def paintEvent(self, event) -> None:
        t = self.timeline
        painter = QtGui.QPainter(self)
        r = self.strip()
        painter.fillRect(r, GROOVE)
        if t.empty:
            painter.setPen(self.palette().color(QtGui.QPalette.ColorRole.PlaceholderText))
            painter.drawText(r, int(QtCore.Qt.AlignmentFlag.AlignCenter), "no history yet")
            return
        x = self.x_of(t.position)
        painter.fillRect(QtCore.QRect(r.left(), r.top(), x - r.left(), r.height()), GROOVE_PAST)
        mark_height = max(6, int(r.height() * 0.7))
        painter.drawImage(QtCore.QRect(r.left(), r.top(), r.width(), mark_height), self._marker_image())
        if t.regrets:  # regretted evictions: a red tick over the marks, above the strip
            painter.setPen(QtGui.QPen(REGRET_COLOUR, 2))
            for seq, _note in t.regrets:
                if t.first_seq <= seq <= t.last_seq:
                    rx = self.x_of(seq)
                    painter.drawLine(QtCore.QPointF(rx, r.top() - 2), QtCore.QPointF(rx, r.top() + mark_height // 2))
        colour = LIVE_COLOUR if t.is_live else VIEWING_COLOUR
        painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        painter.setPen(QtGui.QPen(colour, 2))
        painter.drawLine(QtCore.QPointF(x, r.top() - 1), QtCore.QPointF(x, r.bottom() + 1))
        handle = QtGui.QPolygonF([QtCore.QPointF(x - HANDLE, r.bottom() + 2),
                                  QtCore.QPointF(x + HANDLE, r.bottom() + 2), QtCore.QPointF(x, r.bottom() - HANDLE)])
        painter.setBrush(colour)
        painter.setPen(QtCore.Qt.PenStyle.NoPen)
        painter.drawPolygon(handle)
        if self.hasFocus():
            painter.setPen(QtGui.QPen(self.palette().color(QtGui.QPalette.ColorRole.Highlight), 1))
            painter.setBrush(QtCore.Qt.BrushStyle.NoBrush)
            painter.drawRect(self.rect().adjusted(0, 0, -1, -1))

    def mousePressEvent(self, event: QtGui.QMouseEvent) -> None:
        if event.button() == QtCore.Qt.MouseButton.LeftButton and not self.timeline.empty:
            self.setFocus()
            self.dragging = True
            self.picked.emit(self.seq_at(event.position().x()))

    def mouseReleaseEvent(self, event: QtGui.QMouseEvent) -> None:
        if event.button() == QtCore.Qt.MouseButton.LeftButton:
            self.dragging = False

    def hideEvent(self, event) -> None:  # hidden mid-drag: no release will come
        self.dragging = False
        super().hideEvent(event)

    def mouseMoveEvent(self, event: QtGui.QMouseEvent) -> None:
        if event.buttons() & QtCore.Qt.MouseButton.LeftButton and not self.timeline.empty:
            self.picked.emit(self.seq_at(event.position().x()))

    def event(self, event: QtCore.QEvent) -> bool:
        if event.type() == QtCore.QEvent.Type.ToolTip:
            QtWidgets.QToolTip.showText(event.globalPos(), self.timeline.tooltip_at(event.pos().x()), self)
            return True
        return super().event(event)


class Timeline(QtWidgets.QWidget):
    """The history strip with its controls and banner; see the module docstring.

    Feed it with :meth:`set_range` (every new frame: cheap, only the words and the strip follow),
    :meth:`add_markers` (the new frame's events) and :meth:`set_kept`; act on ``seekRequested`` (show that frame), ``liveRequested`` (follow the newest again)
    and ``budgetChanged`` (resize history). :meth:`seek` and :meth:`go_live` are the same moves made by code
    (an event clicked in the log), and emit the same signals.
    """

    seekRequested = QtCore.Signal(int)  # the user (or play, or seek()) moved to this frame: show it
    liveRequested = QtCore.Signal()  # back to following the newest frame
    budgetChanged = QtCore.Signal(object)  # new history budget in bytes (object: may pass 2**31)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.first_seq = 0  # oldest frame kept
        self.last_seq = 0  # newest frame kept
        self.empty = True  # no frames yet
        self.cursor = StepCursor()  # the step on view (its seq; None: following the newest frame): see follow()
        self.cursor.subscribe(self._cursor_moved)
        self.live_source = True  # False for a recording: the end is fixed, "live" reads "the end"
        self.markers = Markers()
        self.regrets: list[tuple[int, str]] = []  # (frame, what it cost): evictions a later prompt wanted back
        self.enabled_mask = np.zeros(len(ALL_KINDS), bool)  # kind code -> marked on the strip
        for kind in NOTABLE_KINDS:
            self.enabled_mask[KIND_CODE[kind]] = True
        self.kept_bytes = 0  # what history holds now
        self.budget_bytes = 256 * MIB  # what it may hold
        self._step_of: Callable[[int], int] | None = None
        self._speed = DEFAULT_SPEED
        self._carry = 0.0  # fractional frames owed by the play timer
        self._play_timer = QtCore.QTimer(self)
        self._play_timer.timeout.connect(self._tick)
        self._build()
        self.set_speed(DEFAULT_SPEED)
        self._refresh()

    # ----- layout -----------------------------------------------------------------------------------------------
    def _build(self) -> None:
        style = self.style()
        self.play_button = QtWidgets.QToolButton()
        self.play_button.setCheckable(True)
        self._play_icon = style.standardIcon(QtWidgets.QStyle.StandardPixmap.SP_MediaPlay)
        self._pause_icon = style.standardIcon(QtWidgets.QStyle.StandardPixmap.SP_MediaPause)
        self.play_button.setIcon(self._play_icon)
        self.play_button.setToolTip("Play forward through history (Space); from the oldest step kept when live")
        self.play_button.toggled.connect(self._play_toggled)
        self.speed_button = QtWidgets.QToolButton()  # narrower than a combo box
        self.speed_button.setToolTip("Play speed, frames per second")
        self.speed_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
        speed_menu = QtWidgets.QMenu(self.speed_button)
        self.speed_actions = QtGui.QActionGroup(self)
        for fps in SPEEDS:
            action = speed_menu.addAction(f"{fps} frames/s")
            action.setCheckable(True)
            action.setData(fps)
            self.speed_actions.addAction(action)
        self.speed_actions.triggered.connect(lambda action: self.set_speed(action.data()))
        self.speed_button.setMenu(speed_menu)
        self.banner = _FitLabel()
        self.banner.setMargin(3)
        self.live_button = QtWidgets.QToolButton()
        self.live_button.setText("Back to live")
        self.live_button.setToolTip("Follow the newest frame again (End)")
        self.live_button.clicked.connect(self.go_live)
        self.track = _Track(self)
        self.track.picked.connect(self._picked)
        self.setFocusProxy(self.track)
        self.kept_label = _FitLabel()
        self.markers_button = QtWidgets.QToolButton()
        self.markers_button.setText("Marks")
        self.markers_button.setToolTip("Which events are marked on the strip, and their colours")
        self.markers_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
        self.markers_menu = KindMenu(self.markers_button, NOTABLE_KINDS)
        self.markers_menu.kindsChanged.connect(self._kinds_changed)
        self.markers_button.setMenu(self.markers_menu)
        self.budget_box = QtWidgets.QSpinBox()
        self.budget_box.setRange(*BUDGET_RANGE_MIB)
        self.budget_box.setSuffix(" MiB")
        self.budget_box.setKeyboardTracking(False)  # one signal when typing is done, not one per digit
        self.budget_box.setValue(self.budget_bytes // MIB)
        self.budget_box.setToolTip("History budget: the memory history may use; the oldest steps are dropped first")
        self.budget_box.valueChanged.connect(self._budget_edited)

        top = QtWidgets.QHBoxLayout()
        top.setSpacing(3)
        top.addWidget(self.play_button)
        top.addWidget(self.speed_button)
        top.addWidget(self.banner, 1)
        top.addWidget(self.live_button)
        bottom = QtWidgets.QHBoxLayout()
        bottom.setSpacing(3)
        bottom.addWidget(self.markers_button)
        bottom.addWidget(self.kept_label, 1)  # right-aligned: "... 69 KiB of" runs into the budget box it names
        bottom.addWidget(self.budget_box)
        self.kept_label.setAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(3, 1, 3, 1)
        layout.setSpacing(2)
        layout.addLayout(top)
        layout.addWidget(self.track, 1)
        layout.addLayout(bottom)
        for w in (self.play_button, self.speed_button, self.live_button, self.markers_button):
            w.setSizePolicy(QtWidgets.QSizePolicy.Policy.Fixed, QtWidgets.QSizePolicy.Policy.Fixed)
        for w in (self.play_button, self.speed_button, self.live_button, self.markers_button, self.budget_box):
            w.setFixedHeight(CONTROL_HEIGHT)
        for w in (self.speed_button, self.markers_button):
            w.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0px; }")  # room for the words

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        """Narrow (a 1024-px window's side panel): shorter button words so the banner keeps its room."""
        narrow = event.size().width() < 420
        self.live_button.setText(("Live" if narrow else "Back to live") if self.live_source else
                                 ("End" if narrow else "To the end"))
        self.markers_button.setText("◆" if narrow else "Marks")
        super().resizeEvent(event)

    # ----- the cursor -------------------------------------------------------------------------------------------
    def follow(self, cursor: StepCursor) -> None:
        """Draw and move ``cursor`` (a source's) instead of the timeline's own: one step on view, held once."""
        if cursor is self.cursor:
            return
        self.cursor.unsubscribe(self._cursor_moved)
        self.cursor = cursor
        cursor.subscribe(self._cursor_moved)
        self._refresh()

    def _cursor_moved(self, cursor: StepCursor) -> None:
        if cursor.seq is None:
            self._stop()
        self._refresh()

    @property
    def is_live(self) -> bool:
        """Following the newest frame."""
        return self.cursor.seq is None

    @property
    def viewed_seq(self) -> int:
        """The frame on view while not live (the newest while live)."""
        return self.last_seq if self.cursor.seq is None else self.cursor.seq

    # ----- data in ----------------------------------------------------------------------------------------------
    def set_range(self, first_seq: int, last_seq: int,
                  step_of: Callable[[int], int] | Sequence[int] | np.ndarray | None = None) -> None:
        """The frames history keeps now, and how to tell a frame's step: a callable seq -> step_id, or an array of
        the step of every frame first_seq..last_seq, or None (step = seq); a callable may raise LookupError for
        frames in a gap (History.step_of does), which the cursor then skips. While live the cursor follows
        ``last_seq``; a viewed frame history dropped moves to ``first_seq`` (and says so with seekRequested)."""
        first, last = _check_seq(first_seq, "first_seq"), _check_seq(last_seq, "last_seq")
        if first > last:
            raise ValueError(f"first_seq ({first}) is after last_seq ({last})")
        if step_of is None:
            lookup = None
        elif callable(step_of):
            lookup = step_of
        else:
            steps = np.asarray(step_of)
            if steps.ndim != 1 or len(steps) != last - first + 1:
                raise ValueError(f"step_of has {len(steps) if steps.ndim == 1 else steps.shape} entries; frames "
                                 f"{first}-{last} need {last - first + 1}")
            lookup = lambda seq, steps=steps, first=first: int(steps[seq - first])  # noqa: E731
        was_empty = self.empty
        self.first_seq, self.last_seq, self._step_of, self.empty = first, last, lookup, False
        self.markers.drop_before(first)
        moved = None
        if not self.is_live and not first <= self.viewed_seq <= last:
            moved = min(max(self.viewed_seq, first), last)
        if was_empty:  # the first frames: the banner's colours and the buttons change too
            self._refresh()
        else:  # a new frame (30 a second): only the words that name the range, and the strip
            self._refresh_text()
        if moved is not None:
            self.cursor.move(moved, self.cursor.running)
            self.seekRequested.emit(moved)

    def clear(self) -> None:
        """No history (a new source): empty strip, no marks, live."""
        self._stop()
        self.markers.clear()
        self.regrets = []
        self.first_seq = self.last_seq = 0
        self.empty, self._step_of = True, None
        self.cursor.move(None)  # nothing kept to view: the present
        self._refresh()

    def set_markers(self, marks: Iterable[tuple[int, EventKind | str]]) -> None:
        """Replace every mark with (seq, kind) pairs (kinds as EventKind or their string values)."""
        seqs, codes = self._parse_marks(marks)
        self.markers.clear()
        self.markers.extend(seqs, codes)
        self.track.update()

    def add_markers(self, marks: Iterable[tuple[int, EventKind | str]]) -> None:
        """Append marks (normally the newest frame's events); cheap for thousands of marks."""
        seqs, codes = self._parse_marks(marks)
        self.markers.extend(seqs, codes)
        if len(seqs):
            self.track.update()

    def add_event_markers(self, pairs: list[tuple[int, BlockEvent]]) -> None:
        """Marks for (seq, event) pairs as a history hands them out, read in C-level passes: a long recording's
        whole history took half a second through :meth:`add_markers` (figures: docs/performance.md, "Timeline")."""
        n = len(pairs)
        if not n:
            return
        try:
            seqs = np.fromiter(map(_pair_seq, pairs), np.int64, n)
            codes = np.fromiter(map(KIND_CODE.__getitem__, map(_event_kind, map(_pair_event, pairs))), np.int8, n)
        except (TypeError, KeyError, AttributeError, OverflowError, ValueError):
            return self.add_markers((seq, event.kind) for seq, event in pairs)  # says what is wrong
        if int(seqs.min()) < 0:
            return self.add_markers((seq, event.kind) for seq, event in pairs)
        self.markers.extend(seqs, codes)
        self.track.update()

    def add_regrets(self, marks: Iterable[tuple[int, str]]) -> None:
        """Mark regretted evictions: (frame of the eviction, what it later cost, in words), drawn as red ticks
        above the strip's marks and listed in its tooltip."""
        new = [(_check_seq(seq, "a regret's frame"), str(note)) for seq, note in marks]
        if new:
            self.regrets = sorted(self.regrets + new, key=itemgetter(0))
            self.track.update()

    def regrets_near(self, lo: int, hi: int) -> list[str]:
        """What the regretted evictions of frames ``lo..hi`` cost."""
        return [note for seq, note in self.regrets if lo <= seq <= hi]

    @staticmethod
    def _parse_marks(marks) -> tuple[np.ndarray, np.ndarray]:
        pairs = list(marks)
        seqs = np.fromiter((_check_seq(s, "a mark's frame") for s, _ in pairs), np.int64, len(pairs))
        codes = np.fromiter((KIND_CODE[as_kind(k)] for _, k in pairs), np.int8, len(pairs))
        return seqs, codes

    def set_kept(self, nbytes: int, budget_bytes: int) -> None:
        """What history holds and may hold, in bytes (shown under the strip; the budget box follows)."""
        for value, what in ((nbytes, "kept bytes"), (budget_bytes, "budget")):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{what} must be a non-negative number of bytes, not {value!r}")
        if (int(nbytes), int(budget_bytes)) == (self.kept_bytes, self.budget_bytes):
            return
        self.kept_bytes, self.budget_bytes = int(nbytes), int(budget_bytes)
        mib = max(BUDGET_RANGE_MIB[0], min(BUDGET_RANGE_MIB[1], self.budget_bytes // MIB))
        if self.budget_box.value() != mib:
            self.budget_box.blockSignals(True)
            self.budget_box.setValue(mib)
            self.budget_box.blockSignals(False)
        self._refresh_kept()

    def set_live_source(self, live: bool) -> None:
        """False for a recording: its end does not move, so the banner and button speak of 'the end'."""
        self.live_source = bool(live)
        self.budget_box.setVisible(self.live_source)  # a recording's frames stay in its file: no budget to set
        self.resizeEvent(QtGui.QResizeEvent(self.size(), self.size()))  # the button's words
        self.live_button.setToolTip("Follow the newest frame again (End)" if self.live_source else
                                    "Go to the last frame (End)")
        self._refresh()
        self._refresh_kept()

    def set_marked_kinds(self, kinds: Iterable[EventKind | str]) -> None:
        """Mark exactly these kinds on the strip (the Marks menu follows)."""
        self.markers_menu.set_kinds(kinds)

    # ----- moves ------------------------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The frame on view: the newest while live."""
        return self.last_seq if self.is_live else self.viewed_seq

    def step_of(self, seq: int) -> int:
        """The step of frame ``seq``; for a frame in a gap, the step of the kept frame before it."""
        if self._step_of is None:
            return seq
        try:
            return int(self._step_of(seq))
        except LookupError:
            return int(self._step_of(self._snap(seq)))

    def _snap(self, seq: int, direction: int = -1) -> int:
        """``seq``, or the nearest frame history keeps, looking first towards ``direction`` (-1 older, +1 newer).

        Frames are contiguous except after a resync (a subscriber that missed frames starts again at a keyframe);
        ``step_of`` raising LookupError tells a frame in such a gap. The ends of the range are always kept."""
        if self._step_of is None:
            return seq
        for way in (direction, -direction):
            probe = seq
            while self.first_seq <= probe <= self.last_seq:
                try:
                    self._step_of(probe)
                    return probe
                except LookupError:
                    probe += way
        return self.last_seq

    def seek(self, seq: int) -> None:
        """View frame ``seq`` (leaving live) and emit seekRequested; ValueError if it is outside the range kept
        (inside, a frame in a gap moves to the kept one before it)."""
        seq = _check_seq(seq, "seq")
        if self.empty or not self.first_seq <= seq <= self.last_seq:
            kept = "nothing yet" if self.empty else f"frames {self.first_seq:,}-{self.last_seq:,}"
            raise ValueError(f"frame {seq:,} is not in the history kept ({kept})")
        self._view(seq)

    def go_live(self) -> None:
        """Follow the newest frame again and emit liveRequested."""
        self._stop()
        if self.cursor.move(None):
            self.liveRequested.emit()

    def step_frames(self, delta: int) -> None:
        """Move ``delta`` steps the user can see (one key press): to the nearest frame, that way, whose step differs
        from the one on view. Two frames may share a step (a command answered between two engine steps publishes
        one), and moving one frame then changed nothing on screen. Past the newest frame goes live; the oldest
        frame kept is the floor."""
        if self.empty:
            return
        way = 1 if delta > 0 else -1
        target = self.position
        for _ in range(abs(delta)):
            target = self._next_step_frame(target, way)
            if target is None:
                self.go_live()
                return
        self._view(target, way)

    def _next_step_frame(self, seq: int, way: int) -> int | None:
        """The nearest kept frame after (``way`` +1) or before (-1) ``seq`` whose step is not ``seq``'s; before the
        oldest frame, the oldest; past the newest, None (live)."""
        here = self.step_of(seq)
        probe = seq + way
        while self.first_seq <= probe <= self.last_seq:
            try:
                step = probe if self._step_of is None else int(self._step_of(probe))
            except LookupError:  # a frame in a gap (after a resync): not kept
                probe += way
                continue
            if step != here:
                return probe
            probe += way
        return None if way > 0 else self.first_seq

    def next_marker(self, direction: int) -> None:
        """Move to the nearest marked frame before (-1) or after (+1) the one on view, if there is one."""
        if self.empty:
            return
        seqs, codes = self.markers.arrays()
        seqs = seqs[self.enabled_mask[codes]]
        seqs = seqs[(seqs >= self.first_seq) & (seqs <= self.last_seq)]
        pos = self.position
        if direction > 0:
            i = int(np.searchsorted(seqs, pos, "right"))
            if i < len(seqs):
                self._view(int(seqs[i]))
        else:
            i = int(np.searchsorted(seqs, pos, "left")) - 1
            if i >= 0:
                self._view(int(seqs[i]))

    def set_speed(self, frames_per_second: int) -> None:
        if frames_per_second not in SPEEDS:
            raise ValueError(f"play speed must be one of {', '.join(map(str, SPEEDS))} frames per second")
        self._speed = frames_per_second
        self.speed_button.setText(f"{frames_per_second}/s")
        self.speed_actions.actions()[SPEEDS.index(frames_per_second)].setChecked(True)
        self._play_timer.setInterval(max(TICK_MS, 1000 // frames_per_second))

    @property
    def playing(self) -> bool:
        return self._play_timer.isActive()

    def play(self) -> None:
        self.play_button.setChecked(True)

    def pause(self) -> None:
        self.play_button.setChecked(False)

    @property
    def scrubbing(self) -> bool:
        """The cursor is being dragged or plays: many moves in a row, of which the latest is what matters (the
        pane shows them as soon as they are decoded rather than each one in turn)."""
        return self.track.dragging or self._play_timer.isActive()

    def _view(self, seq: int, direction: int = -1) -> None:
        seq = self._snap(seq, direction)  # never onto a frame history does not have
        changed = self.is_live or seq != self.viewed_seq
        self.cursor.move(seq, running=self.scrubbing)  # a drag or play: a run of moves (a source decodes the last)
        if changed:
            self.seekRequested.emit(seq)

    def _picked(self, seq: int) -> None:
        self._stop()
        self._view(seq)

    def _play_toggled(self, on: bool) -> None:
        self.play_button.setIcon(self._pause_icon if on else self._play_icon)
        if not on:
            self._play_timer.stop()
            return
        if self.empty:
            self.play_button.setChecked(False)
            return
        if self.is_live:
            self._view(self.first_seq)  # nothing ahead of live: replay what is kept
        self._carry = 0.0
        self._play_timer.setInterval(max(TICK_MS, 1000 // self._speed))
        self._play_timer.start()

    def _tick(self) -> None:
        self._carry += self._speed * self._play_timer.interval() / 1000.0
        frames = int(self._carry)
        if frames < 1:
            return
        self._carry -= frames
        target = self.viewed_seq + frames
        if self.is_live or target > self.last_seq:
            self.go_live()  # caught up with the newest frame
        else:
            self._view(target, 1)

    def _stop(self) -> None:
        if self.play_button.isChecked():
            self.play_button.setChecked(False)

    def _kinds_changed(self, kinds: frozenset) -> None:
        self.enabled_mask[:] = False
        for kind in kinds:
            self.enabled_mask[KIND_CODE[kind]] = True
        self.track.update()

    def _budget_edited(self, mib: int) -> None:
        self.budget_bytes = mib * MIB
        self._refresh_kept()
        self.budgetChanged.emit(self.budget_bytes)

    # ----- keys -------------------------------------------------------------------------------------------------
    def keyPressEvent(self, event: QtGui.QKeyEvent) -> None:
        key, shift = event.key(), bool(event.modifiers() & QtCore.Qt.KeyboardModifier.ShiftModifier)
        Key = QtCore.Qt.Key
        if key in (Key.Key_Left, Key.Key_Right):
            self._stop()
            direction = -1 if key == Key.Key_Left else 1
            self.next_marker(direction) if shift else self.step_frames(direction)
        elif key == Key.Key_Home and not self.empty:
            self._stop()
            self._view(self.first_seq)
        elif key == Key.Key_End:
            self.go_live()
        elif key == Key.Key_Space:
            self.play_button.toggle()
        else:
            super().keyPressEvent(event)
            return
        event.accept()

    # ----- text -------------------------------------------------------------------------------------------------
    def banner_variants(self) -> tuple[str, ...]:
        """The banner's wordings, longest first ("viewing step 212 of 9,880" ... "212 / 9,880")."""
        if self.empty:
            return ("no history yet",)
        newest = self.step_of(self.last_seq)
        if self.is_live:
            word = "● live" if self.live_source else "at the end"
            return f"{word} · step {newest:,}", word
        step = self.step_of(self.viewed_seq)
        return f"viewing step {step:,} of {newest:,}", f"step {step:,} of {newest:,}", f"{step:,} / {newest:,}"

    def banner_text(self) -> str:
        return self.banner_variants()[0]

    def kept_text(self) -> str:
        """What history keeps, in one sentence: 'history: steps 1,204-9,880 kept, 212 MiB of 256 MiB'."""
        if self.empty:
            return f"history: nothing kept yet, budget {size_text(self.budget_bytes)}"
        first, last = self.step_of(self.first_seq), self.step_of(self.last_seq)
        if not self.live_source:
            return f"recording: steps {first:,}-{last:,}, {size_text(self.kept_bytes)} read from the file as needed"
        return f"history: steps {first:,}-{last:,} kept, {size_text(self.kept_bytes)} of {size_text(self.budget_bytes)}"

    def _kept_variants(self) -> tuple[str, ...]:
        """The words before the budget box (which shows the budget itself), longest first."""
        if self.empty:
            return "history: nothing kept yet · budget", "budget"
        first, last = self.step_of(self.first_seq), self.step_of(self.last_seq)
        if not self.live_source:  # a recording keeps every frame on disk: no budget applies (the box is hidden)
            size = size_text(self.kept_bytes)
            return (f"recording: steps {first:,}-{last:,} · {size} on disk", f"steps {first:,}-{last:,} · {size}", size)
        used = f"{size_text(self.kept_bytes)} of"
        return f"history: steps {first:,}-{last:,} kept · {used}", f"steps {first:,}-{last:,} · {used}", used

    def tooltip_at(self, x: float) -> str:
        """What is under the mouse on the strip: the frame and step, and the marks in that pixel column."""
        if self.empty:
            return "No history yet: frames appear here as the engine runs."
        seq = self.track.seq_at(x)
        lo, hi = self.track.seq_at(x - 2), self.track.seq_at(x + 2)
        seqs, codes = self.markers.arrays()
        a, b = np.searchsorted(seqs, lo, "left"), np.searchsorted(seqs, hi, "right")
        near = codes[a:b][self.enabled_mask[codes[a:b]]]
        head = f"step {self.step_of(seq):,} (frame {seq:,})"
        regrets = self.regrets_near(lo, hi)
        regret_html = "".join(f"<br>{_html_swatch(REGRET_RGB)} regretted eviction: {note}" for note in regrets[:6])
        if len(regrets) > 6:
            regret_html += f"<br>and {len(regrets) - 6:,} more regretted evictions"
        if not len(near):
            return head + regret_html + "<br>" + self.legend_html()
        counts = np.bincount(near, minlength=len(ALL_KINDS))
        parts = [f"{_html_swatch(KIND_COLOURS[k])} {KIND_NAMES[k]}" + (f" ×{counts[KIND_CODE[k]]}"
                 if counts[KIND_CODE[k]] > 1 else "") for k in KIND_PRIORITY if counts[KIND_CODE[k]]]
        span = f"steps {self.step_of(lo):,}-{self.step_of(hi):,}" if hi > lo else head
        return f"{span}<br>" + "<br>".join(parts) + regret_html

    def legend_html(self) -> str:
        kinds = [k for k in KIND_PRIORITY if self.enabled_mask[KIND_CODE[k]]]
        return "Marks: " + ", ".join(f"{_html_swatch(KIND_COLOURS[k])} {KIND_NAMES[k]}" for k in kinds)

    def visible_marker_count(self) -> int:
        """Marks of enabled kinds within the kept range (what the strip can show)."""
        if self.empty:
            return 0
        seqs, codes = self.markers.arrays()
        inside = (seqs >= self.first_seq) & (seqs <= self.last_seq)
        return int(np.count_nonzero(inside & self.enabled_mask[codes]))

    def _refresh(self) -> None:
        """Everything that follows the state (live, viewing, empty): the banner's colours and font, the buttons,
        and the words. Called on state changes only; a new frame calls :meth:`_refresh_text`."""
        live = self.is_live or self.empty
        pal = self.palette()  # empty: the window's own colours
        if not live:  # viewing the past: dark text on amber, hard to miss
            pal.setColor(QtGui.QPalette.ColorRole.Window, VIEWING_COLOUR)
            pal.setColor(QtGui.QPalette.ColorRole.WindowText, QtGui.QColor(20, 20, 20))
        elif not self.empty:
            pal.setColor(QtGui.QPalette.ColorRole.WindowText, LIVE_COLOUR)
        self.banner.setAutoFillBackground(not live)
        self.banner.setPalette(pal)
        font = self.banner.font()
        font.setBold(not self.empty)
        self.banner.setFont(font)
        self.live_button.setEnabled(not live)
        self.play_button.setEnabled(not self.empty)
        self._refresh_text()

    def _refresh_text(self) -> None:
        """The banner's words, the kept-history line and the strip (what a new frame changes)."""
        self.banner.set_variants(*self.banner_variants())
        self._refresh_kept()
        self.track.update()

    def _refresh_kept(self) -> None:
        self.kept_label.set_variants(*self._kept_variants())
        tip = self.kept_text()
        if self.kept_label.toolTip() != tip:
            self.kept_label.setToolTip(tip)


def _html_swatch(rgb: tuple[int, int, int]) -> str:
    return f"<span style='color:#{rgb[0]:02x}{rgb[1]:02x}{rgb[2]:02x}'>■</span>"
