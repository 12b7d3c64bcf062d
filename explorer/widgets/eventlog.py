"""The event log: a dock that lists the pool's block events in words, newest at the bottom, filterable by kind,
conversation and block; clicking a line asks the window to jump there.

The engine can report hundreds of events a second, so the log keeps them in a plain list with its own index of
the lines the filter lets through (no per-row Python call into a proxy model), appends in batches, and keeps at
most ``max_rows`` lines, dropping the oldest and saying so. By default it shows the notable kinds
(:data:`kvstream.events.NOTABLE_KINDS`); allocation, release and the rest are one tick away in the Kinds menu.
It is given (seq, event) pairs, never a source, so it works the same for the live engine, a recording and an
attached stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Iterable

from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.events import NOTABLE_KINDS, BlockEvent, EventKind

from ..model.event_colours import KIND_COLOURS, KIND_NAMES
from ..model.event_text import EventLine, group
from .kind_menu import KindMenu

DEFAULT_MAX_ROWS = 10_000  # lines kept; the oldest go first
FILTER_DELAY_MS = 150  # typing in a filter field applies after this pause
DISPLAY = QtCore.Qt.ItemDataRole.DisplayRole
COLUMNS = ("step", "event")


@dataclass(frozen=True)
class LogFilter:
    """Which lines the log shows: any of ``kinds``, and (when given) naming one of the conversations and blocks."""

    kinds: frozenset = frozenset(NOTABLE_KINDS)  # EventKind; a line shows if any of its events is of one of them
    conversations: frozenset | None = None  # conversation ids; None: any
    blocks: frozenset | None = None  # block ids; None: any

    def matches(self, line: EventLine) -> bool:
        if self.kinds.isdisjoint(line.kinds):
            return False
        if self.conversations is not None and self.conversations.isdisjoint(line.conversation_ids):
            return False
        return self.blocks is None or not self.blocks.isdisjoint(line.block_ids)

    @property
    def narrowed(self) -> bool:
        """True when it hides more than the default does."""
        return self.kinds != NOTABLE_KINDS or self.conversations is not None or self.blocks is not None


def parse_ids(text: str, what: str) -> frozenset | None:
    """'7' or '7, 9 12' -> frozenset({7, 9, 12}); '' -> None (no filter); ValueError naming the bad part."""
    parts = text.replace(",", " ").split()
    if not parts:
        return None
    ids = set()
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"not a {what} id: {part!r} (type numbers, separated by commas)")
        ids.add(int(part))
    return frozenset(ids)


class EventLogModel(QtCore.QAbstractTableModel):
    """Every line kept (``entries``: (seq, EventLine), oldest first) and the rows the filter shows (``visible``)."""

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, not {max_rows!r}")
        self.max_rows = max_rows
        self.entries: list[tuple[int, EventLine]] = []  # (seq, line), oldest first
        self.base = 0  # absolute number of entries[0] (entries dropped so far)
        self.visible: list[int] = []  # absolute numbers of the entries shown, ascending
        self.filter = LogFilter()
        self.num_events = 0  # block events received since the last clear (merged lines count each)
        self.unlisted = 0  # of them, events of frames too old to make a kept line (never worded)
        self.served = ()  # the served traffic's conversation ids: their replies and ends are their client's

    # --- Qt model ---
    def rowCount(self, parent=QtCore.QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.visible)

    def columnCount(self, parent=QtCore.QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=DISPLAY):
        if role == DISPLAY and orientation == QtCore.Qt.Orientation.Horizontal:
            return COLUMNS[section]
        return None

    def data(self, index, role=DISPLAY):
        if not index.isValid():
            return None
        seq, line = self.entry(index.row())
        if role == DISPLAY:
            return f"{line.step_id:,}" if index.column() == 0 else line.text
        if role == QtCore.Qt.ItemDataRole.ToolTipRole:
            kinds = ", ".join(KIND_NAMES[k] for k in sorted(line.kinds, key=lambda k: k.value))
            return f"{line.sentence}\n(frame {seq:,}; {kinds})"
        if role == QtCore.Qt.ItemDataRole.DecorationRole and index.column() == 1:
            return QtGui.QColor(*KIND_COLOURS[line.kind])
        if role == QtCore.Qt.ItemDataRole.TextAlignmentRole and index.column() == 0:
            return int(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        return None

    # --- content ---
    def entry(self, row: int) -> tuple[int, EventLine]:
        """(seq, line) shown in ``row``."""
        return self.entries[self.visible[row] - self.base]

    def append(self, pairs: Iterable[tuple[int, BlockEvent]]) -> int:
        """Add (seq, event) pairs, oldest first (events of one frame are merged into lines); returns lines added.

        Only the newest frames that fill ``max_rows`` lines are turned into lines: a recording's whole history (a
        million events for 10,000 frames of 65,536 blocks) would be worded only to be dropped at once, which held
        the window for 4 s."""
        pairs = pairs if isinstance(pairs, list) else list(pairs)
        frames: list[tuple[int, list[EventLine]]] = []  # (seq, lines) of the newest frames, newest first
        end, made = len(pairs), 0
        while end and made < self.max_rows:
            seq = pairs[end - 1][0]
            start = end - 1
            while start and pairs[start - 1][0] == seq:
                start -= 1
            lines = group([e for _, e in pairs[start:end]], self.served)  # raises TypeError before anything changes
            frames.append((seq, lines))
            made += len(lines)
            end = start
        for kind in set(map(type, map(itemgetter(1), pairs[:end]))):  # the older ones would make lines dropped
            if not issubclass(kind, BlockEvent):  # at once; they are still checked
                raise TypeError(f"the event log takes kvstream.events.BlockEvent items, not {kind.__name__}")
        new = [(seq, line) for seq, lines in reversed(frames) for line in lines]
        self.unlisted += end
        self.num_events += len(pairs)
        if not new:
            return 0
        start = self.base + len(self.entries)
        shown = [start + i for i, (_, line) in enumerate(new) if self.filter.matches(line)]
        self.entries.extend(new)
        if shown:
            self.beginInsertRows(QtCore.QModelIndex(), len(self.visible), len(self.visible) + len(shown) - 1)
            self.visible.extend(shown)
            self.endInsertRows()
        self._trim()
        return len(new)

    def _trim(self) -> None:
        excess = len(self.entries) - self.max_rows
        if excess <= 0:
            return
        self.base += excess
        del self.entries[:excess]
        gone = 0
        while gone < len(self.visible) and self.visible[gone] < self.base:
            gone += 1
        if gone:
            self.beginRemoveRows(QtCore.QModelIndex(), 0, gone - 1)
            del self.visible[:gone]
            self.endRemoveRows()

    def clear(self) -> None:
        self.beginResetModel()
        self.entries, self.visible, self.base, self.num_events, self.unlisted = [], [], 0, 0, 0
        self.endResetModel()

    def set_filter(self, log_filter: LogFilter) -> None:
        if log_filter == self.filter:
            return
        self.beginResetModel()
        self.filter = log_filter
        self.visible = [self.base + i for i, (_, line) in enumerate(self.entries) if log_filter.matches(line)]
        self.endResetModel()


class EventLog(QtWidgets.QDockWidget):
    """The event log dock; see the module docstring.

    Feed it with :meth:`append_events` as frames arrive (and :meth:`clear` when the source changes); connect
    ``eventActivated`` to move the timeline to the line's frame and select its block or conversation.
    """

    eventActivated = QtCore.Signal(int, int, int, int)  # seq, step_id, conversation_id (-1 none), block_id (-1 none)

    def __init__(self, parent: QtWidgets.QWidget | None = None, max_rows: int = DEFAULT_MAX_ROWS):
        super().__init__("Event log", parent)
        self.setObjectName("EventLog")
        self.model = EventLogModel(max_rows, self)
        body = QtWidgets.QWidget()
        self.kinds_button = QtWidgets.QToolButton()
        self.kinds_button.setText("Kinds")
        self.kinds_button.setToolTip("Which kinds of event to list (notable ones by default)")
        self.kinds_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
        self.kinds_button.setMinimumWidth(self.kinds_button.sizeHint().width())  # the text and its arrow
        self.kinds_menu = KindMenu(self.kinds_button, NOTABLE_KINDS)
        self.kinds_menu.kindsChanged.connect(lambda _kinds: self.apply_filters())
        self.kinds_button.setMenu(self.kinds_menu)
        self.conversation_edit = QtWidgets.QLineEdit()
        self.conversation_edit.setPlaceholderText("conversation")
        self.conversation_edit.setToolTip("Only events of these conversations (ids, separated by commas)")
        self.block_edit = QtWidgets.QLineEdit()
        self.block_edit.setPlaceholderText("block")
        self.block_edit.setToolTip("Only events that touch these blocks (ids, separated by commas)")
        self._filter_timer = QtCore.QTimer(self)
        self._filter_timer.setSingleShot(True)
        self._filter_timer.setInterval(FILTER_DELAY_MS)
        self._filter_timer.timeout.connect(self.apply_filters)
        for edit in (self.conversation_edit, self.block_edit):
            edit.setClearButtonEnabled(True)
            edit.textChanged.connect(lambda _text: self._filter_timer.start())
            edit.returnPressed.connect(self.apply_filters)
        self.view = _LogView()
        self.view.setModel(self.model)
        self.view.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.view.setShowGrid(False)
        self.view.setWordWrap(True)  # rows are one or two lines high, uniform (see _LogView)
        self.view.setTextElideMode(QtCore.Qt.TextElideMode.ElideRight)
        self.view.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.view.setVerticalScrollMode(QtWidgets.QAbstractItemView.ScrollMode.ScrollPerPixel)
        rows = self.view.verticalHeader()
        rows.hide()
        rows.setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Fixed)  # uniform rows: no per-row sizing
        self.view.fit_rows()
        columns = self.view.horizontalHeader()
        columns.setSectionResizeMode(0, QtWidgets.QHeaderView.ResizeMode.Fixed)  # never measure every row
        columns.resizeSection(0, self.fontMetrics().horizontalAdvance("step") + 16)  # grows with the steps seen
        columns.setSectionResizeMode(1, QtWidgets.QHeaderView.ResizeMode.Stretch)
        columns.setHighlightSections(False)
        self.view.setIconSize(QtCore.QSize(10, 10))
        self.view.clicked.connect(self._activated)
        self.view.activated.connect(self._activated)
        self.status = QtWidgets.QLabel()
        self.status.setWordWrap(True)
        top = QtWidgets.QHBoxLayout()
        top.setSpacing(3)
        top.addWidget(self.kinds_button)
        top.addWidget(self.conversation_edit, 1)
        top.addWidget(self.block_edit, 1)
        layout = QtWidgets.QVBoxLayout(body)
        layout.setContentsMargins(3, 3, 3, 3)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.status)
        self.setWidget(body)
        self._error = ""  # the last filter field's complaint, shown until it is fixed
        self._refresh_status()

    # --- data in ---
    def append_events(self, pairs: Iterable[tuple[int, BlockEvent]]) -> None:
        """Add (seq, event) pairs, oldest first: a new frame's events, or history's at start. Follows the newest
        line if the list was scrolled to the bottom."""
        bar = self.view.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 2
        if self.model.append(pairs):
            self._fit_step_column()
            if at_bottom:
                self.view.scrollToBottom()
        self._refresh_status()

    def append_frame(self, seq: int, events: Iterable[BlockEvent]) -> None:
        """The events of one frame (kvstream.poolstream.Frame.seq / .events)."""
        self.append_events((seq, e) for e in events)

    def clear(self) -> None:
        """Forget every line (a new source)."""
        self.model.clear()
        self._refresh_status()

    def _fit_step_column(self) -> None:
        """Widen the step column to the newest step's digits (steps only grow), never by measuring every row."""
        if self.model.entries:
            step = self.model.entries[-1][1].step_id
            need = self.fontMetrics().horizontalAdvance(f"{step:,}") + 16
            header = self.view.horizontalHeader()
            if need > header.sectionSize(0):
                header.resizeSection(0, need)

    # --- filters ---
    def set_filter(self, kinds: Iterable[EventKind] | None = None, conversations: Iterable[int] | str | None = None,
                   blocks: Iterable[int] | str | None = None) -> None:
        """Set the filter from code (the fields and the menu follow): None leaves a part as it is."""
        if kinds is not None:
            self.kinds_menu.set_kinds(kinds, emit=False)
        for value, edit in ((conversations, self.conversation_edit), (blocks, self.block_edit)):
            if value is not None:
                edit.setText(value if isinstance(value, str) else ", ".join(str(int(i)) for i in value))
        self.apply_filters()

    def apply_filters(self) -> None:
        """Read the menu and the two fields; a field that does not parse is marked, and the filter keeps its
        previous value for it."""
        self._filter_timer.stop()
        current = self.model.filter
        errors = []
        parsed = {}
        for name, edit, what in (("conversations", self.conversation_edit, "conversation"),
                                 ("blocks", self.block_edit, "block")):
            try:
                parsed[name] = parse_ids(edit.text(), what)
                edit.setStyleSheet("")
                edit.setToolTip(f"Only events that name these {name} (ids, separated by commas)")
            except ValueError as exc:
                parsed[name] = getattr(current, name)
                errors.append(str(exc))
                edit.setStyleSheet("QLineEdit { border: 1px solid #e0524a; }")
                edit.setToolTip(str(exc))
        self._error = "; ".join(errors)
        before = self.model.filter
        self.model.set_filter(LogFilter(kinds=self.kinds_menu.kinds(), **parsed))
        if self.model.filter != before:
            self.view.scrollToBottom()  # the newest matching lines
        self._refresh_status()

    # --- out ---
    def _activated(self, index: QtCore.QModelIndex) -> None:
        if not index.isValid():
            return
        seq, line = self.model.entry(index.row())
        block = line.block_id
        wanted = self.model.filter.blocks
        if wanted and not wanted.isdisjoint(line.block_ids):  # the block the user filtered for, as it is after
            block = _block_after(line, min(wanted & set(line.block_ids)))
        conversation = line.conversation_id
        wanted = self.model.filter.conversations
        if wanted and conversation not in wanted and not wanted.isdisjoint(line.conversation_ids):
            conversation = min(wanted & line.conversation_ids)
        self.eventActivated.emit(seq, line.step_id, conversation, block)

    def _refresh_status(self) -> None:
        m = self.model
        total, shown = len(m.entries), len(m.visible)
        if not total:
            text = "No events yet."
        elif shown == total:
            text = f"{total:,} lines"
        else:
            text = f"showing {shown:,} of {total:,} lines" + ("" if shown else ": none match the filter")
        if m.unlisted:
            text += (f" · {m.unlisted:,} older events" + (f" and {m.base:,} lines" if m.base else "") +
                     f" dropped (keeps the newest {m.max_rows:,})")
        elif m.base:
            text += f" · oldest {m.base:,} dropped (keeps the newest {m.max_rows:,})"
        if self._error:
            text = f"<span style='color:#e0524a'>{self._error}</span><br>{text}"
        self.status.setText(text)


class _LogView(QtWidgets.QTableView):
    """The log's table: rows two lines high when the text column is narrow (a 300-px dock), else one; uniform
    heights either way, so a long log never measures its rows."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._row_lines = 0  # lines per row now
        self._to_bottom = QtCore.QTimer(self)  # scrolls once the new row heights are laid out
        self._to_bottom.setSingleShot(True)
        self._to_bottom.setInterval(0)
        self._to_bottom.timeout.connect(self.scrollToBottom)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit_rows()

    def fit_rows(self) -> None:
        text_width = self.viewport().width() - self.horizontalHeader().sectionSize(0)
        lines = 2 if text_width < 420 else 1
        if lines == self._row_lines:
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 2
        self._row_lines = lines
        self.verticalHeader().setDefaultSectionSize(lines * self.fontMetrics().lineSpacing() + 6)
        if at_bottom:
            self._to_bottom.start()


def _block_after(line: EventLine, block: int) -> int:
    """Where ``block`` is once the line's frame is applied: a relocation renames it (old id -> new id). A block's
    old id is often another block's new id (3 -> 7 while 5 -> 3): the old id decides, whatever moved into it."""
    for e in line.events:
        if e.kind == EventKind.RELOCATED and block in e.block_ids:
            block = e.new_block_ids[e.block_ids.index(block)]
    return block
