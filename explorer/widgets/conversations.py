"""The conversations table, and the detail view of the selected conversation (block table and streaming text).

The table model is updated in place from each snapshot (rows inserted, changed cells signalled) rather than
rebuilt, so selection and scroll position survive 30 updates a second. A finished conversation says why it
stopped (end-of-sequence, max new tokens, context limit, ended by user).

The detail shows a conversation turn by turn (``ConversationInfo.turns``): each user message, then a "reply"
separator, then the model's reply, so a follow-up message is never glued to the reply before it. The text of
earlier turns needs a detokenizer (:meth:`ConversationDetail.set_detokenizer`, e.g. the local engine's); without
one, the turns the panel watched live are split as they were seen, and anything else is shown whole, still
separated from the reply being generated.
"""
from __future__ import annotations

import numpy as np
from ..model.words import count, number
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.views import ConversationInfo, PoolSnapshot

from ..model import palette
from ..model.event_text import finish_words
from ..model.palette import conversation_colour
from ..model.conversation_text import group_tables_html, sources_cell, sources_sentence
from ..model.outcome_text import outcome_names, outcomes_sentence
from ..model.groups import conversation_group_tables
from ..model.trace_rows import outcome_cell
from .table_model import RowsModel

COLUMNS = ("id", "status", "prompt", "generated", "blocks", "shared", "tail fill", "prompt blocks", "trace request",
           "stopped by", "prompt from")
ID_DIGITS = 5  # the id column fits ids this long beside the colour swatch
COLUMN_WIDTHS = (44, 66, 56, 72, 48, 54, 58, 170, 190, 110, 150)  # fixed: resizing to contents re-reads every cell
#                                                                   each update
TRACE_COLUMN = COLUMNS.index("trace request")  # shown only while a trace replay feeds the conversations
REPLY_MARK = "── reply ──"  # the line between a user message and the model's reply in the detail
USER_MARK = "── user ──"  # the line before a follow-up message
PLACEHOLDER = "Select a conversation to see its block table and text."
TABLE_LINES = 4  # lines of block table shown before it scrolls
WHY_LINES = 8  # and lines of why its prompt hit or missed, with its checkbox, above it
SORT_ROLE = QtCore.Qt.ItemDataRole.UserRole  # what the table sorts by
MAX_REMEMBERED = 512  # conversations whose turns the detail keeps as it saw them


def stop_reason(info: ConversationInfo, served=()) -> str:
    """Why a conversation stopped, in words ('max new tokens', 'ended by user', 'the client left' for one of
    ``served``, the served traffic's conversations); '' while it is live or when the source does not say."""
    if info.finish_reason is None:
        return ""
    return finish_words(info.finish_reason, info.conversation_id in served)


def status_text(info: ConversationInfo, served=()) -> str:
    """'running', 'finished (max new tokens)', 'ended by user', ..."""
    reason = stop_reason(info, served)
    if not reason:
        return str(info.status)
    return reason if reason.startswith(str(info.status)) else f"{info.status} ({reason})"


def held_blocks(snapshot: PoolSnapshot, conversation_id: int) -> tuple[int, ...]:
    """Every device block the conversation holds, in every KV cache group, a sliding window's -1 places left out:
    what its "blocks" cell counts (group 0's table alone undercounts a hybrid model and counts a window's holes)."""
    if not snapshot.carries_group_tables:
        return snapshot.block_tables.get(conversation_id, ())
    return tuple(b for tables in snapshot.group_block_tables for b in tables.get(conversation_id, ()) if b >= 0)


def conversation_row(info: ConversationInfo, snapshot: PoolSnapshot, served=(), trace_requests=None) -> tuple:
    """The table cells of one conversation, derived from the snapshot's block tables (every group's), its prompt
    blocks' outcomes and, for a trace replay's request, what the trace says of it (``trace_requests``: an
    explorer.model.trace_rows.TraceRequests)."""
    held = held_blocks(snapshot, info.conversation_id)
    table = snapshot.block_tables.get(info.conversation_id, ())  # group 0's: where the conversation's tail is
    shared = int((np.asarray(snapshot.ref_count)[list(held)] > 1).sum()) if held else 0
    tail = f"{int(snapshot.num_filled[table[-1]])}/{snapshot.block_size}" if table and table[-1] >= 0 else "-"
    request = trace_requests.cell(info.conversation_id) if trace_requests is not None else ""
    return (info.conversation_id, str(info.status), len(info.prompt_token_ids), len(info.output_token_ids),
            len(held), shared, tail, outcome_cell(info.prompt_block_outcomes), request, stop_reason(info, served),
            sources_cell(info))


def ids_text(token_ids) -> str:
    """Token ids as text, for sources that give no text (a checkpoint without a tokenizer)."""
    return " ".join(str(t) for t in token_ids)


def turn_segments(info: ConversationInfo, detokenize=None, seen=None) -> list[tuple[str, str]]:
    """The conversation as (role, text) pairs, oldest first: ("user", message), ("reply", text), ...

    The last reply is ``output_text`` (what is being generated). Earlier pieces come from ``detokenize`` (token ids
    -> text) when given, else from ``seen`` (the (user, reply) texts of earlier turns as the panel saw them live),
    else the whole prompt is one user piece."""
    prompt = info.prompt_text or ids_text(info.prompt_token_ids)
    output = info.output_text or (ids_text(info.output_token_ids) if not info.prompt_text else "")
    turns = [t for t in info.turns if 0 <= t[0] <= t[1] <= len(info.prompt_token_ids)]
    if len(turns) <= 1:
        return [("user", prompt), ("reply", output)]
    ids = info.token_ids
    if detokenize is not None:
        out = []
        bounds = [u for u, _ in turns] + [len(info.prompt_token_ids)]
        for k, (user, reply) in enumerate(turns):
            out.append(("user", detokenize(ids[user:reply])))
            out.append(("reply", detokenize(ids[reply:bounds[k + 1]]) if k + 1 < len(turns) else output))
        return out
    if seen and len(seen) == len(turns) - 1:
        earlier = "".join(user + reply for user, reply in seen)
        if prompt.startswith(earlier):
            out = []
            for user, reply in seen:
                out += [("user", user), ("reply", reply)]
            return out + [("user", prompt[len(earlier):]), ("reply", output)]
    return [("user", prompt), ("reply", output)]


def _same_row_input(a: ConversationInfo, b: ConversationInfo) -> bool:
    """Whether two infos of one conversation give the same row: the same object, or the same fields the row reads
    (a stream rebuilds infos every frame; comparing lengths, not token lists, keeps this cheap)."""
    return a is b or (a.status == b.status and a.finish_reason == b.finish_reason
                      and len(a.prompt_token_ids) == len(b.prompt_token_ids)
                      and len(a.output_token_ids) == len(b.output_token_ids)
                      and a.prompt_token_sources == b.prompt_token_sources
                      and a.prompt_block_outcomes == b.prompt_block_outcomes)


class ConversationsModel(RowsModel):
    """One row per conversation ever added, in id order."""

    COLUMNS = COLUMNS

    def __init__(self, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self._row_cache: dict[int, tuple] = {}  # conversation id -> (info, block table, row) it was made from
        self._made_from: PoolSnapshot | None = None  # the snapshot of the last refresh
        self.rows_made = 0  # rows computed (not reused) so far (tests read it)
        self.colours = palette.ColourBook()  # the colour book of the source shown (ConversationsPanel.set_colour_book)
        self.served = ()  # the served traffic's conversation ids (ConversationsPanel.set_served)
        self.trace_requests = None  # the trace replay's requests behind the conversations (set_trace_requests)

    def set_trace_requests(self, requests) -> None:
        """What a trace replay says of each conversation (explorer.model.trace_rows.TraceRequests), or None; the
        rows are made again."""
        if requests is not self.trace_requests:
            self.trace_requests = requests
            self._row_cache.clear()
            self._made_from = None

    def cell_data(self, row: tuple, column: int, role):
        if role == SORT_ROLE:  # the value itself: ids sort as numbers, not as their text
            return row[column]
        if role == QtCore.Qt.ItemDataRole.DecorationRole and column == 0:
            return QtGui.QColor(*conversation_colour(row[0], self.colours))
        if role == QtCore.Qt.ItemDataRole.TextAlignmentRole and 2 <= column < 7:
            return int(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        return super().cell_data(row, column, role)

    def conversation_id(self, row: int) -> int:
        return self._rows[row][0]

    def _remove_rows_gone(self, new_ids: list[int]) -> bool:
        """Remove the rows of conversations no longer listed (the oldest finished ones leave the engine's window
        of 256), each run of rows with one signal, so the views keep their selection and scroll; False when the
        rows that stay are not the first of ``new_ids`` in order (another source, a restart): a reset then."""
        listed = set(new_ids)
        staying = [row[0] for row in self._rows if row[0] in listed]
        if staying != new_ids[:len(staying)]:
            return False
        gone = [i for i, row in enumerate(self._rows) if row[0] not in listed]
        while gone:  # the last run first, so the earlier rows keep their numbers
            end = start = gone.pop()
            while gone and gone[-1] == start - 1:
                start = gone.pop()
            self.beginRemoveRows(QtCore.QModelIndex(), start, end)
            del self._rows[start:end + 1]
            self.endRemoveRows()
        return True

    def refresh_colours(self) -> None:
        """The colour book changed (another source shown): repaint the swatches, keep the rows."""
        if self._rows:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self._rows) - 1, 0),
                                  [QtCore.Qt.ItemDataRole.DecorationRole])

    def row_of(self, conversation_id: int) -> int | None:
        for i, row in enumerate(self._rows):
            if row[0] == conversation_id:
                return i
        return None

    def refresh(self, snapshot: PoolSnapshot) -> None:
        """Bring the rows up to date with ``snapshot`` (conversations only ever get added, never removed).

        A row is made again only when what it shows may have changed: its conversation's info (the engine hands
        out the same object while a conversation is unchanged; a stream rebuilds them, so the fields the row reads
        are compared), its block table, or the ref counts and fills of the pool (one array comparison a refresh)."""
        self.colours.observe(snapshot)  # the same colours as the grid, whichever draws first
        last = self._made_from
        pool_same = last is not None and (last is snapshot or (
            np.array_equal(last.ref_count, snapshot.ref_count) and np.array_equal(last.num_filled, snapshot.num_filled)))
        cache = self._row_cache
        new_rows = []
        for info in snapshot.conversations:
            cid = info.conversation_id
            table = held_blocks(snapshot, cid)
            kept = cache.get(cid)
            if kept is not None and _same_row_input(kept[0], info) and kept[1] == table and (pool_same or not table):
                new_rows.append(kept[2])
                continue
            row = conversation_row(info, snapshot, self.served, self.trace_requests)
            self.rows_made += 1
            cache[cid] = (info, table, row)
            new_rows.append(row)
        self._made_from = snapshot
        if len(cache) > 2 * len(new_rows) + 64:  # conversations gone from the views: forget them
            listed = {row[0] for row in new_rows}
            self._row_cache = {cid: v for cid, v in cache.items() if cid in listed}
        if not self._remove_rows_gone([row[0] for row in new_rows]):
            self.set_rows(new_rows)  # a different engine (restart): start over
            return
        old = len(self._rows)
        changed = [i for i in range(old) if self._rows[i] is not new_rows[i] and self._rows[i] != new_rows[i]]
        if changed:  # one signal for the span of changed rows, not one per row
            self._rows[:old] = new_rows[:old]
            self.dataChanged.emit(self.index(changed[0], 0), self.index(changed[-1], len(COLUMNS) - 1))
        if len(new_rows) > old:
            self.beginInsertRows(QtCore.QModelIndex(), old, len(new_rows) - 1)
            self._rows.extend(new_rows[old:])
            self.endInsertRows()


class FittedScrollArea(QtWidgets.QScrollArea):
    """A scroll area that asks for its content's height at its width (up to its maximum height), so a layout gives
    it what it holds and the rest to its stretching neighbours; where the room is short it shrinks and scrolls.
    QScrollArea's own size hint ignores how tall the content is."""

    def sizeHint(self) -> QtCore.QSize:
        hint = super().sizeHint()
        content = self.widget()
        if content is not None:
            width = self.viewport().width() if self.viewport().width() > 0 else hint.width()
            height = content.heightForWidth(width) if content.hasHeightForWidth() else -1
            if height < 0:
                height = content.sizeHint().height()
            hint.setHeight(min(height + 2 * self.frameWidth(), self.maximumHeight()))
        return hint

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if event.oldSize().width() != event.size().width():
            self.updateGeometry()  # another width wraps the content to another height


class ConversationDetail(QtWidgets.QWidget):
    """Block table (logical -> physical) and the text of one conversation, turn by turn: user messages dim, the
    model's replies normal, a separator line between them; and why its prompt hit or missed the prefix cache."""

    missesToggled = QtCore.Signal(bool)  # "mark its misses in the grid" was turned on or off

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.colours = palette.ColourBook()  # the colour book of the source shown (ConversationsPanel.set_colour_book)
        self.served = ()  # the served traffic's conversation ids (ConversationsPanel.set_served)
        self.title = QtWidgets.QLabel(PLACEHOLDER)
        self.title.setWordWrap(True)
        self.clock = None  # a StepClock: idle times in seconds where the window saw the steps go by
        self.why = QtWidgets.QLabel()  # "3 of 7 prompt blocks hit on the device; block 4 was evicted ..."
        self.why.setWordWrap(True)
        self.why.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.why.hide()
        self.mark_misses = QtWidgets.QCheckBox("Mark its missed prompt blocks in the grid")
        self.mark_misses.setToolTip("Outline the blocks it computed because its prompt missed the prefix cache "
                                    "(while it holds them)")
        self.mark_misses.toggled.connect(self.missesToggled)
        self.mark_misses.hide()
        self.table_label = QtWidgets.QLabel()
        self.table_label.setWordWrap(True)
        self.table_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        # The why sentence, its checkbox and a long block table scroll together instead of hiding under the text
        # (or squeezing the title) where the dock is short
        facts = QtWidgets.QWidget()
        facts_layout = QtWidgets.QVBoxLayout(facts)
        facts_layout.setContentsMargins(0, 0, 0, 0)
        facts_layout.addWidget(self.why)
        facts_layout.addWidget(self.mark_misses)
        facts_layout.addWidget(self.table_label)
        self.table_area = FittedScrollArea()
        self.table_area.setWidgetResizable(True)
        self.table_area.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.table_area.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table_area.setWidget(facts)
        line = self.fontMetrics().lineSpacing()
        self.table_area.setMinimumHeight(line + 4)
        self.table_area.setMaximumHeight((TABLE_LINES + WHY_LINES) * line + 6)
        self.text = QtWidgets.QTextBrowser()
        self.text.setMinimumHeight(2 * line + 8)  # it scrolls: the first to give up height in a short dock
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.title)
        layout.addWidget(self.table_area)
        layout.addWidget(self.text, 1)
        self._key = None  # what was drawn last (None: draw again)
        self._shown_id: int | None = None  # the conversation on display (None: the placeholder)
        self._shown: tuple[tuple[tuple[str, str], ...], str] = ((), "")  # (pieces before the last reply, that reply)
        self._detokenize = None  # token ids -> text, for the text of earlier turns (None: not available)
        self._seen: dict[int, list[tuple[int, str, str]]] = {}  # id -> (turn, user text, reply text) seen live
        self._prompt_format = QtGui.QTextCharFormat()
        self._prompt_format.setForeground(QtGui.QColor(138, 138, 150))
        self._output_format = QtGui.QTextCharFormat()
        self._mark_format = QtGui.QTextCharFormat()
        self._mark_format.setForeground(QtGui.QColor(110, 150, 200))
        self._mark_format.setFontWeight(QtGui.QFont.Weight.Bold)

    def set_detokenizer(self, detokenize) -> None:
        """``detokenize(token_ids) -> str`` for the text of earlier turns (None: the source has none)."""
        self._detokenize = detokenize
        self._key = None

    def _fit_title(self) -> None:
        """Keep the title as tall as its wrapped text: a layout squeezed a wrapping label below it, and at 800x600
        its last line ran under the block table; the text below gives up the height instead."""
        margins = self.layout().contentsMargins()  # the width the title gets (its own is not laid out yet here)
        needed = self.title.heightForWidth(max(self.width() - margins.left() - margins.right(), 1))
        if needed > 0 and needed != self.title.minimumHeight():
            self.title.setMinimumHeight(needed)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_title()

    def show_conversation(self, info: ConversationInfo | None, snapshot: PoolSnapshot) -> None:
        if info is None:
            if self._shown_id is not None:  # (not _key: a new detokenizer clears that, and the text must go too)
                self.title.setText(PLACEHOLDER)
                self._fit_title()
                self.why.hide()
                self.mark_misses.hide()
                self.table_label.clear()
                self.text.clear()
                self._shown = ((), "")
                self._key = self._shown_id = None
            return
        self._shown_id = info.conversation_id
        self._remember_turn(info)
        table = snapshot.block_tables.get(info.conversation_id, ())
        refs = [int(snapshot.ref_count[b]) for b in table]
        fills = [int(snapshot.num_filled[b]) for b in table]
        key = (info.conversation_id, str(info.status), info.finish_reason, len(info.prompt_token_ids),
               info.prompt_text, info.output_text, len(info.output_token_ids), info.turns, tuple(table), tuple(refs),
               tuple(fills), info.group_block_tables, tuple(sorted((info.prompt_token_sources or {}).items())),
               snapshot.carries_group_tables and conversation_group_tables(snapshot, info.conversation_id),
               info.prompt_block_outcomes)
        if key == self._key:
            return
        self._key = key
        self.colours.observe(snapshot)
        r, g, b = conversation_colour(info.conversation_id, self.colours)
        turns = f", turn {len(info.turns)}" if len(info.turns) > 1 else ""
        self.title.setText(
            f"<b style='color:rgb({r},{g},{b})'>■</b> <b>{info.name.capitalize()}</b> — "
            f"{status_text(info, self.served)}{turns}, "
            f"{number(len(info.prompt_token_ids))} prompt + {number(len(info.output_token_ids))} generated "
            f"token{'s' if len(info.prompt_token_ids) + len(info.output_token_ids) != 1 else ''} "
            f"(at most {number(info.max_new_tokens)} new)"
            + (f", forked from {info.parent_id}" if info.parent_id is not None else "")
            + (f", {count(info.num_cached_tokens, 'prompt token')} from the prefix cache" if info.num_cached_tokens
               else "")
            + (f"; {sources_sentence(info)}" if sources_sentence(info) else ""))
        self._fit_title()
        why = outcomes_sentence(info.prompt_block_outcomes, self.clock, outcome_names(snapshot))
        self.why.setText(f"Prompt cache: {why[:1].upper()}{why[1:]}." if why else "")
        self.why.setVisible(bool(why))
        self.mark_misses.setVisible(bool(why) and any(not o.hit for o in info.prompt_block_outcomes))
        if table:
            cells = []
            for i, (block, ref, fill) in enumerate(zip(table, refs, fills)):
                mark = f" <b>×{ref}</b>" if ref > 1 else ""
                partial = f" ({fill}/{snapshot.block_size})" if fill < snapshot.block_size else ""
                cells.append(f"<span style='white-space:nowrap'>{i}→<b>{block}</b>{mark}{partial}</span>")
            self.table_label.setText("Block table (logical → physical): " + ", &nbsp;".join(cells))
        else:
            self.table_label.setText("Block table: empty (it holds no blocks now)")
        groups = group_tables_html(snapshot, info)  # per KV cache group, the window's released entries as holes
        if groups:
            self.table_label.setText(self.table_label.text() + "<br>Per KV cache group:<br>" + groups)
        self.table_area.updateGeometry()  # its content's height changed: ask the layout again
        self._show_text(info)

    def _remember_turn(self, info: ConversationInfo) -> None:
        """Keep each turn's user message and finished reply as seen, to split the history without a
        detokenizer once a follow-up message makes them part of one long prompt."""
        if len(info.turns) != 1 and info.conversation_id not in self._seen:
            return  # joined after the first turn: what was said before cannot be split by watching
        seen = self._seen.setdefault(info.conversation_id, [])
        turn = len(info.turns) - 1
        earlier = "".join(user + reply for _, user, reply in seen if _ < turn)
        prompt = info.prompt_text
        if not prompt.startswith(earlier) or any(t > turn for t, _, _ in seen):
            self._seen.pop(info.conversation_id, None)  # the history does not match what was seen: forget it
            return
        entry = (turn, prompt[len(earlier):], info.output_text)
        if len(self._seen) > MAX_REMEMBERED:
            del self._seen[next(iter(self._seen))]  # the oldest conversation watched
        if seen and seen[-1][0] == turn:
            seen[-1] = entry
        else:
            seen.append(entry)

    def _segments(self, info: ConversationInfo) -> list[tuple[str, str]]:
        seen = [(user, reply) for turn, user, reply in self._seen.get(info.conversation_id, ())
                if turn < len(info.turns) - 1]
        return turn_segments(info, self._detokenize, seen)

    def _show_text(self, info: ConversationInfo) -> None:
        """User messages dim, replies normal, a separator before each; when only the last reply grew, append the
        new text instead of redrawing everything."""
        scrollbar = self.text.verticalScrollBar()
        at_end = scrollbar.value() >= scrollbar.maximum() - 4
        pieces = self._segments(info)
        head, (_, reply) = tuple(pieces[:-1]), pieces[-1]
        shown_head, shown_reply = self._shown
        redrawn = not (shown_head == head and reply.startswith(shown_reply))  # another conversation, a new turn
        cursor = QtGui.QTextCursor(self.text.document())
        if not redrawn:
            cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
            cursor.insertText(reply[len(shown_reply):], self._output_format)
        else:
            self.text.clear()
            cursor = QtGui.QTextCursor(self.text.document())
            for i, (role, text) in enumerate(pieces):
                if role == "reply":
                    self._insert_mark(cursor, REPLY_MARK)
                elif i > 0:
                    self._insert_mark(cursor, USER_MARK)
                cursor.insertText(text, self._output_format if role == "reply" else self._prompt_format)
        self._shown = (head, reply)
        if at_end or redrawn:  # the newest text in view; a reader who scrolled up while it streams stays there
            scrollbar.setValue(scrollbar.maximum())

    def _insert_mark(self, cursor: QtGui.QTextCursor, mark: str) -> None:
        """A separator line of its own: starts a new paragraph before and after it."""
        if not cursor.atBlockStart():
            cursor.insertBlock()
        cursor.insertText(mark, self._mark_format)
        cursor.insertBlock()

    def plain_text(self) -> str:
        return self.text.toPlainText()


class ConversationsPanel(QtWidgets.QWidget):
    """Table of conversations with add / fork / reply / end buttons; emits what the user asked for."""

    selectionChanged = QtCore.Signal(object)  # conversation id, or None
    buttonsChanged = QtCore.Signal()  # a button was enabled or disabled (the menus' actions follow the buttons)
    addRequested = QtCore.Signal()
    forkRequested = QtCore.Signal(int)
    replyRequested = QtCore.Signal(int)
    endRequested = QtCore.Signal(int)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.model = ConversationsModel(self)
        # newest first by default (the live rows of served traffic scrolled out of sight in id order); a click on
        # a header sorts by that column. The model keeps id order (its rows only ever get added at the end).
        self.proxy = QtCore.QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SORT_ROLE)
        self.view = QtWidgets.QTableView()
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.sortByColumn(0, QtCore.Qt.SortOrder.DescendingOrder)
        self.view.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.view.verticalHeader().hide()
        header = self.view.horizontalHeader()
        for column, width in enumerate(COLUMN_WIDTHS):
            header.resizeSection(column, width)
        icon = self.view.style().pixelMetric(QtWidgets.QStyle.PixelMetric.PM_SmallIconSize)
        header.resizeSection(0, max(COLUMN_WIDTHS[0], self.view.fontMetrics().horizontalAdvance(ID_DIGITS * "0")
                                    + icon + 16))  # the colour swatch and a five-digit id ("1…" at 44 px)
        header.setStretchLastSection(True)
        self.view.setColumnHidden(TRACE_COLUMN, True)
        self.view.verticalHeader().setDefaultSectionSize(22)
        self.view.setAlternatingRowColors(True)
        self.view.selectionModel().selectionChanged.connect(self._on_selection)
        self._selected_before_reset: int | None = None
        self.model.modelAboutToBeReset.connect(self._before_reset)
        self.model.modelReset.connect(self._after_reset)
        self.buttons = {}
        bar = QtWidgets.QHBoxLayout()
        for key, text, tip in (("add", "Add…", "Ctrl+N"), ("fork", "Fork", "Ctrl+F"), ("reply", "Reply…", "Ctrl+R"),
                               ("end", "End", "Ctrl+E")):
            button = QtWidgets.QPushButton(text)
            button.setToolTip(f"{text.rstrip('…')} ({tip})")
            bar.addWidget(button)
            self.buttons[key] = button
        bar.addStretch(1)
        self.buttons["add"].clicked.connect(self.addRequested)
        self.buttons["fork"].clicked.connect(lambda: self._emit_for_selected(self.forkRequested))
        self.buttons["reply"].clicked.connect(lambda: self._emit_for_selected(self.replyRequested))
        self.buttons["end"].clicked.connect(lambda: self._emit_for_selected(self.endRequested))
        self.detail = ConversationDetail()
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        left = QtWidgets.QWidget()
        left_layout = QtWidgets.QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        left_layout.addLayout(bar)
        left_layout.addWidget(self.view, 1)
        split.addWidget(left)
        split.addWidget(self.detail)
        split.setStretchFactor(0, 2)  # the table's columns need more width than the text (which wraps)
        split.setStretchFactor(1, 1)
        split.setSizes([640, 320])  # applied in proportion once the dock has its width
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(split)
        self._snapshot: PoolSnapshot | None = None
        self.read_only_reason = ""  # why the source takes no commands now ("": it does)
        self._tips = {key: button.toolTip() for key, button in self.buttons.items()}  # the tooltips when usable

    def set_read_only(self, reason: str) -> None:
        """Disable every button, with ``reason`` as their tooltip, while the source takes no commands (a
        recording, an attached stream); "" enables them again as the selection allows."""
        self.read_only_reason = reason or ""
        self._enable_buttons()

    def set_detokenizer(self, detokenize) -> None:
        """Token ids -> text for the detail's earlier turns (the local engine's ``detokenize``); None: none."""
        self.detail.set_detokenizer(detokenize)

    def set_served(self, served) -> None:
        """``served``: the ids of the conversations the served traffic sends (a set it keeps growing; () for
        none): their ends are worded as their client's, not the user's."""
        self.model.served = self.detail.served = served
        self.model._row_cache.clear()  # rows worded before are made again at the next refresh
        self.detail._key = None

    def set_trace_requests(self, requests) -> None:
        """The trace replay behind the conversations (its requests' arrivals and lengths in the table), or None."""
        self.model.set_trace_requests(requests)
        self.view.setColumnHidden(TRACE_COLUMN, requests is None)

    def set_colour_book(self, book) -> None:
        """Colour the rows and the detail from ``book``, the colour book of the source shown (conversation ids
        are per source: two sources' conversation 3 are two conversations)."""
        if book is not self.model.colours:
            self.model.colours = self.detail.colours = book
            self.detail._key = None  # drawn again in the new colours
            self.model.refresh_colours()

    def selected_conversation(self) -> int | None:
        rows = self.view.selectionModel().selectedRows()
        return self.model.conversation_id(self.proxy.mapToSource(rows[0]).row()) if rows else None

    def forget_selection(self) -> None:
        """Another source took over: its conversation 3 is not the one selected, so nothing is selected (said
        to everyone, as any change of selection is), and no model reset brings the old id back."""
        self._selected_before_reset = None
        if self.selected_conversation() is not None:
            self.view.selectionModel().clearSelection()  # said through _on_selection

    def select_conversation(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row is not None:
            self.view.selectRow(self.proxy.mapFromSource(self.model.index(row, 0)).row())

    def refresh(self, snapshot: PoolSnapshot) -> None:
        self._snapshot = snapshot
        before = self.selected_conversation()
        with QtCore.QSignalBlocker(self.view.selectionModel()):  # rows that go move Qt's selection to a neighbour
            self.model.refresh(snapshot)
        if self.selected_conversation() != before:  # the selected conversation's row went: nothing is selected
            if before is not None and self.model.row_of(before) is not None:
                self.select_conversation(before)
            elif self.selected_conversation() is not None:
                self.view.selectionModel().clearSelection()  # said through _on_selection
            else:
                self._on_selection()
        cid = self.selected_conversation()
        self.detail.show_conversation(snapshot.conversation(cid) if cid is not None else None, snapshot)
        self._enable_buttons()

    def _enable_buttons(self) -> None:
        """Each button as the selected conversation's status allows, unless the source is read-only."""
        if self.read_only_reason:
            for button in self.buttons.values():
                button.setEnabled(False)
                button.setToolTip(f"Unavailable: {self.read_only_reason}")
            self.buttonsChanged.emit()
            return
        for key, button in self.buttons.items():
            button.setToolTip(self._tips[key])
        cid = self.selected_conversation()
        info = self._snapshot.conversation(cid) if (cid is not None and self._snapshot) else None
        status = str(info.status) if info else ""
        before = [b.isEnabled() for b in self.buttons.values()]
        self.buttons["add"].setEnabled(True)
        self.buttons["fork"].setEnabled(status in ("waiting", "running", "preempted"))
        self.buttons["reply"].setEnabled(status == "finished")
        self.buttons["end"].setEnabled(status in ("waiting", "running", "preempted"))  # a finished one holds nothing
        if [b.isEnabled() for b in self.buttons.values()] != before:
            self.buttonsChanged.emit()

    def _on_selection(self, *_):
        cid = self.selected_conversation()
        if self._snapshot is not None:
            self.detail.show_conversation(self._snapshot.conversation(cid) if cid is not None else None,
                                          self._snapshot)
        self._enable_buttons()
        self.selectionChanged.emit(cid)

    def _before_reset(self) -> None:
        self._selected_before_reset = self.selected_conversation()

    def _after_reset(self) -> None:
        """The rows were made again (a jump in history to a step with fewer conversations, a new source): Qt
        drops the selection without a word, so the grid would go on dimming every block but a conversation the
        table no longer shows. The selection comes back if its conversation is still listed; else everyone hears
        that nothing is selected."""
        cid, self._selected_before_reset = self._selected_before_reset, None
        if cid is None:
            return
        self.select_conversation(cid)  # where still listed; emits through _on_selection
        if self.selected_conversation() != cid:
            self._on_selection()

    def _emit_for_selected(self, signal) -> None:
        cid = self.selected_conversation()
        if cid is not None:
            signal.emit(cid)
