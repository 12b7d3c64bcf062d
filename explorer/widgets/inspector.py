"""The block inspector: what one physical block holds and who refers to it, kept live while it changes.

It first shows what the snapshot already knows (state, ref count, fill) so a click answers at once, then fills in
the slot table and the K/V heatmap when the engine answers ``inspect_block``. Comparing consecutive answers lets it
say plainly when the block was freed, cached, or taken over by another conversation.

A relocation gives every block a new physical id. The selection follows the content, not the number
(:meth:`Inspector.follow_relocation`, called with a RELOCATED event's old -> new ids), and the note says "moved
from 35 to 12"; a block is never said to have been "freed" by a conversation that still holds its content
elsewhere.

Owners are named as their source names them: a vLLM request id ("request cmpl-abc-0") where the conversation has
a label, the explorer's conversation number otherwise. Under the owners, the block's newest few events (from the
Block history dock's view, :meth:`Inspector.follow_history`) say what happened to it, each a link to its frame.
"""
from __future__ import annotations

import html
from typing import Mapping

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from kvstream.views import BlockInfo, BlockState, PoolSnapshot

from ..model.block_words import hash_note
from ..model.groups import block_group_of, hash_words
from ..model.outcome_text import block_prompt_lines
from .elided_label import ElidedLabel
from .table_model import RowsModel

# the value each fp8 byte stands for, by the pool dtype's name (what the inspector shows of a stored code)
FP8_VALUES = {
    "fp8_e4m3": np.array([(-1) ** (b >> 7) * ((b & 7) / 8 * 2.0 ** -6 if (b >> 3) & 15 == 0 else
                                               (1 + (b & 7) / 8) * 2.0 ** (((b >> 3) & 15) - 7))
                          if b & 0x7F != 0x7F else np.nan for b in range(256)]),
    "fp8_e5m2": np.array([(-1) ** (b >> 7) * ((b & 3) / 4 * 2.0 ** -14 if (b >> 2) & 31 == 0 else
                                               (1 + (b & 3) / 4) * 2.0 ** (((b >> 2) & 31) - 15))
                          if (b >> 2) & 31 != 31 else (np.inf * (-1) ** (b >> 7) if b & 3 == 0 else np.nan)
                          for b in range(256)]),
}

SLOT_COLUMNS = ("slot", "position", "token id", "token text")
PREFERRED_SLOT_ROWS = 16  # slot rows the inspector asks room for: a whole block at the default block size
SLOTS_SHARE = 0.72  # of the height below the fields, what the slot table gets before the user drags the splitter
MIN_TICK_PIXELS = {"left": 14, "bottom": 26}  # least screen distance between two labelled heatmap ticks
HISTORY_LINES = 3  # newest lines of the block's own history the inspector lists (the Block history dock has all)


class SlotsModel(RowsModel):
    """One row per filled slot of the inspected block."""

    COLUMNS = SLOT_COLUMNS

    def set_block(self, info: BlockInfo | None) -> None:
        if info is None:
            self.set_rows([])
            return
        texts = tuple(info.token_texts) + ("",) * (len(info.token_ids) - len(info.token_texts))
        # no text (no tokenizer): the id; no position (a cached block whose last holder no longer lists it): "?"
        self.set_rows([(i, p if p >= 0 else "?", t, token_label(s) if s else f"<{t}>") for i, (p, t, s) in
                       enumerate(zip(info.positions, info.token_ids, texts))])


class _SlotsView(QtWidgets.QTableView):
    """The slot table; its preferred height is a whole block of 16 slots (a scroll area that holds the inspector
    sizes it by its preferred height)."""

    def sizeHint(self) -> QtCore.QSize:
        rows = self.verticalHeader().defaultSectionSize() * PREFERRED_SLOT_ROWS
        return QtCore.QSize(260, rows + self.horizontalHeader().sizeHint().height() + 2 * self.frameWidth())


class _HeatPlot(pg.PlotWidget):
    """The K/V heatmap; a modest preferred size (a PlotWidget asks for 600 x 480, which made the inspector
    twice as tall as the slots need)."""

    def sizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(260, 160)


def token_label(text: str) -> str:
    """A token's text as one visible line: escapes for control characters, '␣' for spaces (else a space token
    looks like an empty cell)."""
    return repr(text)[1:-1].replace(" ", "␣")


def change_note(previous: BlockInfo | None, info: BlockInfo, *, moved_from: int | None = None,
                elsewhere: dict[tuple[int, int], int] | None = None, names: Mapping[int, str] | None = None) -> str:
    """A sentence about what happened to the block since the previous answer (or what it is now).

    ``moved_from``: the id the block's content had before a relocation moved it here. ``elsewhere``: for the
    previous owners' (conversation, logical index) entries, the block that holds that entry now, where it is not
    this one (a relocation or a recompute put the content elsewhere: the conversation did not release it).
    ``names``: the source's own name of a conversation (``ConversationInfo.label``: a vLLM request id), said as
    "request <label>" instead of the explorer's number where there is one."""
    cids = sorted({c for c, _ in info.owners})
    before = sorted({c for c, _ in previous.owners}) if previous is not None else []
    here = f"Block {info.block_id}"
    if moved_from is not None and moved_from != info.block_id:
        here = f"Block {info.block_id} (moved from {moved_from} to {info.block_id} by a relocation)"
        if info.state == BlockState.USED:
            shared = f", shared by {info.ref_count} references" if info.ref_count > 1 else ""
            return f"{here} is in use by {_conversations(cids, names=names)}{shared}."
    if info.state == BlockState.FREE:
        if elsewhere:
            (cid, index), block = next(iter(sorted(elsewhere.items())))
            return (f"{here} is free now, but {_conversations([cid], names=names)} did not release its content: its "
                    f"logical block {index} is in block {block} now (moved there by a relocation, or recomputed).")
        if before:
            return (f"{here} has been freed: {_conversations(before, names=names)} released it "
                    "and no one refers to it now.")
        return f"{here} is free: no conversation refers to it and it holds nothing reusable."
    if info.state == BlockState.CACHED:
        who = f" (last filled by {_conversations([info.last_owner], names=names)})" if info.last_owner >= 0 else ""
        lead = f"{here} has been released but stays cached" if before else f"{here} is cached"
        return f"{lead}: no owner now, but it keeps a full prefix block of KV{who} that a matching prompt can reuse."
    shared = f", shared by {info.ref_count} references" if info.ref_count > 1 else ""
    if previous is not None and before and not set(before) & set(cids):
        return (f"{here} has been reused: it now belongs to {_conversations(cids, names=names)}{shared} "
                f"(before: {_first_few([_short_name(c, names) for c in before])}).")
    if previous is not None and previous.state != BlockState.USED:
        return f"{here} is in use again, now by {_conversations(cids, names=names)}{shared}."
    return f"{here} is in use by {_conversations(cids, names=names)}{shared}."


def summary_info(snapshot: PoolSnapshot, block_id: int, owners) -> BlockInfo:
    """The facts a frame gives about a block at once (state, ref count, fill, owners, last owner) as a BlockInfo
    without tokens or K/V: what the note is written from between detail answers."""
    b = block_id
    return BlockInfo(block_id=b, state=BlockState(int(snapshot.state[b])), ref_count=int(snapshot.ref_count[b]),
                     num_filled=int(snapshot.num_filled[b]), block_size=snapshot.block_size, token_ids=(),
                     token_texts=(), positions=(), owners=tuple(owners), block_hash=None, hash_reason=None,
                     last_owner=int(snapshot.owner[b]), keys=None, values=None)


def content_elsewhere(previous: BlockInfo | None, snapshot: PoolSnapshot | None,
                      block_id: int) -> dict[tuple[int, int], int]:
    """For each (conversation, logical index) the previous answer listed, the block that holds it in
    ``snapshot`` when that is another block than ``block_id`` (and the conversation still holds blocks)."""
    if previous is None or snapshot is None:
        return {}
    out = {}
    for cid, index in previous.owners:
        table = snapshot.block_tables.get(cid, ())
        if index < len(table) and table[index] != block_id:
            out[(cid, index)] = int(table[index])
    return out


def _first_few(items: list[str], limit: int = 6) -> str:
    """The first ``limit`` items joined by commas, then ' and N more' for the rest."""
    text = ", ".join(items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _conversations(ids, limit: int = 6, names: Mapping[int, str] | None = None) -> str:
    """'conversation 3' or 'conversations 0, 1, ... and 4 more'; where ``names`` labels them all (a vLLM
    source's request ids), 'request cmpl-a' or 'requests cmpl-a, cmpl-b'; a mix names each on its own."""
    ids = sorted(ids)
    labelled = [c for c in ids if names and names.get(c)]
    if not labelled:
        return f"conversation{'s' if len(ids) > 1 else ''} {_first_few([str(c) for c in ids], limit)}"
    if len(labelled) == len(ids):
        return f"request{'s' if len(ids) > 1 else ''} {_first_few([names[c] for c in ids], limit)}"
    return _first_few([_owner_name(c, names) for c in ids], limit)


def _owner_name(cid: int, names: Mapping[int, str] | None) -> str:
    """'request cmpl-a' for a conversation the source names, else 'conversation 3'."""
    label = names.get(cid) if names else None
    return f"request {label}" if label else f"conversation {cid}"


def _short_name(cid: int, names: Mapping[int, str] | None) -> str:
    """The label alone where there is one, else the number: for lists already introduced by a noun."""
    label = names.get(cid) if names else None
    return label or str(cid)


def conversation_names(snapshot: PoolSnapshot | None, cids) -> dict[int, str]:
    """{conversation id: its label} for those of ``cids`` the snapshot knows under a label of their source's."""
    if snapshot is None:
        return {}
    out = {}
    for cid in cids:
        conv = snapshot.conversation(int(cid)) if cid >= 0 else None
        if conv is not None and conv.label:
            out[int(cid)] = conv.label
    return out


_LIVE = float("inf")  # the frame number of the newest (live) view: after every history frame

DEFAULT_KV_REASON = ("this source keeps its K/V values to itself (they never leave its device or process); tokens, "
                     "owners and hashes above come from its block tables")


class Inspector(QtWidgets.QWidget):
    """Panel for the selected block: a note in words, its fields, its slots and a K/V heatmap.

    Laid out to stay usable in a narrow dock: the fields take two columns, and the slot table and the heatmap
    share a splitter that gives the table most of the height (16 slots show at once in about 480 px)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.kv_reason = DEFAULT_KV_REASON  # why K/V values are missing when a block comes without them
        self.block_id: int | None = None
        self.info: BlockInfo | None = None
        self.moved_from: int | None = None  # the id the selected content had before the last relocation
        self._moved_seq: int | None = None  # the history frame of that relocation (None: not known)
        self._seq: float = _LIVE  # the history frame shown (_LIVE: the newest)
        self._note_seq: float = _LIVE  # the frame whose facts the note describes
        self._snapshot: PoolSnapshot | None = None  # the last view seen, to tell "moved" from "released"
        self._note_facts: BlockInfo | None = None  # the facts the note describes (a frame's or an answer's)
        self._note_key: tuple | None = None  # (block, state, ref count, owners) of those facts
        self._names: dict[int, str] = {}  # the source's names (vLLM request ids) of the block's owners, past ones too
        self.note = QtWidgets.QLabel("Click a cell in the grid to inspect its block.")
        self.note.setWordWrap(True)
        self.note.setStyleSheet("font-weight: bold;")
        self.fields: dict[str, QtWidgets.QLabel] = {}
        form = QtWidgets.QGridLayout()
        form.setHorizontalSpacing(6)
        form.setVerticalSpacing(2)
        places = {"block": (0, 0, 1), "state": (0, 2, 1), "ref count": (1, 0, 1), "filled": (1, 2, 1),
                  "hash": (2, 0, 3), "owners": (3, 0, 3)}  # key -> (row, column, value columns spanned)
        for key, (row, column, span) in places.items():
            name = QtWidgets.QLabel(key + ":")
            name.setAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignTop)
            label = QtWidgets.QLabel("-")
            label.setWordWrap(True)
            label.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
            label.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
            form.addWidget(name, row, column)
            form.addWidget(label, row, column + 1, 1, span)
            self.fields[key] = label
        self.history_name = QtWidgets.QLabel("history:")
        self.history_name.setAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignTop)
        self.history = QtWidgets.QLabel()  # the block's newest events, each a link to its frame
        self.history.setWordWrap(True)
        self.history.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.history.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextBrowserInteraction)
        self.history.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        self.history.linkActivated.connect(self._history_link)
        self.history.installEventFilter(self)
        form.addWidget(self.history_name, 4, 0)
        form.addWidget(self.history, 4, 1, 1, 3)
        self.prompt_name = QtWidgets.QLabel("prompt:")  # what each owner's admission did with this prompt block
        self.prompt_name.setAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignTop)
        # one line (each owner's part after a ';', the whole in the tooltip): a wrapped label's height follows its
        # width, and in the dock's scroll area a line more or less as its scroll bar came and went resized the
        # inspector again and again until the stack ran out (a segfault in the GUI tests)
        self.prompt = ElidedLabel(min_width=0)
        self.prompt.setContentsMargins(0, 0, 0, 0)
        form.addWidget(self.prompt_name, 5, 0)
        form.addWidget(self.prompt, 5, 1, 1, 3)
        self.step_clock = None  # a StepClock (idle seconds where the window saw the steps), set by the window
        self._show_prompt([])
        self.history_view = None  # the BlockHistoryView whose newest lines the history field shows
        self.history_lines: list = []  # the HistoryLines the history field lists now
        self._history_earlier = 0  # lines of the block's story before those
        self._show_history_row(False)
        form.setColumnStretch(1, 1)
        form.setColumnStretch(3, 1)
        self.slots = SlotsModel(self)
        self.slots_view = _SlotsView()
        self.slots_view.setModel(self.slots)
        self.slots_view.verticalHeader().hide()
        row_height = self.slots_view.fontMetrics().height() + 3
        self.slots_view.verticalHeader().setDefaultSectionSize(row_height)
        self.slots_view.verticalHeader().setMinimumSectionSize(row_height)
        header = self.slots_view.horizontalHeader()
        header.setStretchLastSection(True)
        for column, width in enumerate((40, 64, 64)):
            header.resizeSection(column, width)
        self.slots_view.setMinimumHeight(4 * row_height)
        self.kind = QtWidgets.QComboBox()
        self.kind.addItems(["K", "V"])
        self.layer = QtWidgets.QSpinBox()
        self.head = QtWidgets.QSpinBox()
        for widget in (self.kind, self.layer, self.head):
            signal = widget.currentIndexChanged if isinstance(widget, QtWidgets.QComboBox) else widget.valueChanged
            signal.connect(self._draw_heatmap)
        controls = QtWidgets.QHBoxLayout()
        controls.setContentsMargins(0, 0, 0, 0)
        for text, widget in (("show", self.kind), ("layer", self.layer), ("kv head", self.head)):
            controls.addWidget(QtWidgets.QLabel(text))
            controls.addWidget(widget)
        controls.addStretch(1)
        self.plot = _HeatPlot()
        self.plot.setLabel("bottom", "head dim")
        self.plot.setLabel("left", "slot")
        self.plot.getViewBox().invertY(True)
        self.plot.getViewBox().setMouseEnabled(x=False, y=False)
        self.plot.setMenuEnabled(False)
        self.plot.setMinimumHeight(90)
        self.heat = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.heat)
        self.colorbar = pg.ColorBarItem(values=(-1.0, 1.0), colorMap=pg.colormap.get("viridis"), interactive=False,
                                        width=12)
        self.colorbar.setImageItem(self.heat, insert_in=self.plot.getPlotItem())
        # an fp8 pool: its stored codes (as the values they stand for) beside the values attention reads
        self.stored_plot = _HeatPlot()
        self.stored_plot.setLabel("bottom", "head dim")
        self.stored_plot.getViewBox().invertY(True)
        self.stored_plot.getViewBox().setMouseEnabled(x=False, y=False)
        self.stored_plot.setMenuEnabled(False)
        self.stored_plot.setMinimumHeight(90)
        self.stored_heat = pg.ImageItem(axisOrder="row-major")
        self.stored_plot.addItem(self.stored_heat)
        self.stored_plot.hide()
        self.readout = QtWidgets.QLabel()  # the stored byte and the value read under the pointer (fp8 pools)
        self.readout.hide()
        for plot in (self.plot, self.stored_plot):
            plot.scene().sigMouseMoved.connect(lambda pos, plot=plot: self._read_at(plot, pos))
        self.heat_title = QtWidgets.QLabel()  # what the heatmap shows (a plot title would set its minimum width)
        self.heat_title.setWordWrap(True)
        self.kv_note = QtWidgets.QLabel()  # why there is no heatmap, when there is none
        self.kv_note.setWordWrap(True)
        self.kv_note.hide()
        self._head_dim = 1  # columns of the heatmap shown last
        self._block_size = 16  # slots of the block shown last (the default block size until one is shown)
        self.plot.getViewBox().sigResized.connect(self._retick)

        heat_box = QtWidgets.QWidget()
        heat_layout = QtWidgets.QVBoxLayout(heat_box)
        heat_layout.setContentsMargins(0, 0, 0, 0)
        heat_layout.setSpacing(2)
        heat_layout.addLayout(controls)
        heat_layout.addWidget(self.heat_title)
        heat_layout.addWidget(self.kv_note)
        plots = QtWidgets.QHBoxLayout()
        plots.setContentsMargins(0, 0, 0, 0)
        plots.addWidget(self.stored_plot, 1)
        plots.addWidget(self.plot, 1)
        heat_layout.addLayout(plots, 1)
        heat_layout.addWidget(self.readout)
        self.split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        self.split.addWidget(self.slots_view)
        self.split.addWidget(heat_box)
        self.split.setStretchFactor(0, 3)
        self.split.setStretchFactor(1, 2)
        self.split.setChildrenCollapsible(False)
        self._split_by_user = False  # once the user drags the splitter, resizing keeps their choice
        self.split.splitterMoved.connect(lambda *_: setattr(self, "_split_by_user", True))
        self.set_block_size(self._block_size)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(4)
        layout.addWidget(self.note)
        layout.addLayout(form)
        layout.addWidget(self.split, 1)

    def heightForWidth(self, width: int) -> int:
        """The least height the inspector needs at ``width`` (its wrapped note and fields whole), not its preferred
        one: the dock's scroll area made it as tall as a whole block of slots plus the heatmap's own preference, and
        the heatmap fell below the dock's edge (rows 0-8 of 16 at 1920x1080). It takes the dock's height, the
        splitter shares it, and it scrolls only below that least height."""
        layout = self.layout()
        return layout.minimumHeightForWidth(width) if layout is not None else super().heightForWidth(width)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._place_splitter()

    def eventFilter(self, watched, event) -> bool:
        if watched is self.history and event.type() == QtCore.QEvent.Type.Resize:
            self._draw_history()  # its lines are cut to its width
        return super().eventFilter(watched, event)

    def _place_splitter(self) -> None:
        """The slot table gets most of the height (no more than a whole block needs), the heatmap the rest."""
        if self._split_by_user:
            return
        total = max(self.split.height(), 1)
        view = self.slots_view
        whole_block = (view.verticalHeader().defaultSectionSize() * self._block_size
                       + view.horizontalHeader().sizeHint().height() + 2 * view.frameWidth() + 2)
        table = min(int(total * SLOTS_SHARE), whole_block)
        self.split.setSizes([table, total - table])

    def _retick(self, *_) -> None:
        """Whole-slot and whole-dim ticks, labelled as densely as the plot's size allows."""
        box = self.plot.getViewBox()
        height, width = box.height(), box.width()
        self.plot.getAxis("left").setTicks(_integer_ticks(self._block_size, height, MIN_TICK_PIXELS["left"]))
        self.plot.getAxis("bottom").setTicks(_integer_ticks(self._head_dim, width, MIN_TICK_PIXELS["bottom"]))

    def select(self, block_id: int | None, snapshot: PoolSnapshot | None, *, moved_from: int | None = None,
               seq: int | None = None) -> None:
        """A new block was clicked: show the snapshot's view of it now; details follow from the engine.

        ``moved_from``: the block is the selected content's new id after a relocation (its old id). ``seq``: the
        history frame ``snapshot`` is (None: the newest, live)."""
        if block_id != self.block_id and moved_from is None:
            self.info = None
            self._note_facts = self._note_key = None  # another block: its note starts afresh
            self._names = {}
            self.history_lines = []
            self._show_history_row(False)  # until the history view tells this block's story
            self.slots.set_block(None)
            self.heat.clear()
            self.heat_title.setText("")
        self.moved_from = moved_from
        self._moved_seq = None
        self.block_id = block_id
        if block_id is None:
            self.note.setText("Click a cell in the grid to inspect its block.")
            for label in self.fields.values():
                label.setText("-")
            for widget in (self.plot, self.stored_plot, self.readout, self.kv_note):  # no block: no axes of one
                widget.hide()
            self._show_prompt([])
            return
        if snapshot is not None and block_id < snapshot.num_blocks:
            self.show_summary(snapshot, seq=seq)

    def show_tier_slot(self, tier: str, slot: int, facts: list[str], token_ids, token_text) -> None:
        """A slot of a lower tier (host, disk), clicked in its grid: what the window knows of it (``facts``, from
        explorer.model.tiers) and its tokens with their text (``token_text(id)``; None: ids only), as a device
        block's slots are listed. No K/V is read back from a tier: no heatmap."""
        self.select(None, None)
        self.block_id = None  # no device block is selected: a frame's view does not redraw the slot over this
        state = facts[0].rsplit(": ", 1)[-1] if facts else "-"
        self.fields["block"].setText(f"{tier} slot {slot}")
        self.fields["state"].setText(state)
        for fact in facts[1:]:
            if fact.startswith("hash "):
                self.fields["hash"].setText(fact[len("hash "):])
            elif fact.startswith("content of "):
                self.fields["owners"].setText(fact[len("content of "):])
        self.fields["filled"].setText(f"{len(token_ids)} tokens" if token_ids is not None else "-")
        self.note.setText(f"{tier.capitalize()} tier slot {slot}: "
                          + "; ".join(f for f in facts[1:] if not f.startswith(("hash ", "tokens "))) + ".")
        texts = [token_text(t) if token_text is not None else None for t in (token_ids or ())]
        self.slots.set_rows([(i, "?", t, token_label(x) if x else f"<{t}>")
                             for i, (t, x) in enumerate(zip(token_ids or (), texts))])

    # ---- the block's own history, in short ------------------------------------------------------------------
    def follow_history(self, view) -> None:
        """List the newest few lines of ``view`` (the window's :class:`~explorer.model.block_history.BlockHistoryView`,
        which the source's history feeds) under the owners while it shows the selected block; a click on one jumps
        to its frame, as a click in the dock does. Calling it again with the same view changes nothing."""
        if view is self.history_view:
            return
        if self.history_view is not None:
            self.history_view.changed.disconnect(self._history_changed)
        self.history_view = view
        if view is not None:
            view.changed.connect(self._history_changed)
        self._history_changed()

    def _history_changed(self) -> None:
        view = self.history_view
        if view is None or self.block_id is None or view.block_id != self.block_id or not view.lines:
            self.history_lines = []
            self._show_history_row(False)
            return
        self.history_lines = list(view.lines[-HISTORY_LINES:])
        self._history_earlier = view.total - len(self.history_lines)
        self._show_history_row(True)
        self._draw_history()

    def _draw_history(self) -> None:
        """One line an event, cut to the field's width with '…' (the whole sentence in the tooltip and the dock):
        three events take three lines, and the slot table keeps its room at 1024 x 640."""
        lines = self.history_lines
        if not lines:
            return
        metrics = self.history.fontMetrics()
        width = max(self.history.width() - 6, 60)
        items = []
        for line in lines:
            step = f"step {line.step_id:,}"
            rest = metrics.elidedText(f": {line.text}", QtCore.Qt.TextElideMode.ElideRight,
                                      width - metrics.horizontalAdvance(step))
            items.append(f'<a href="{line.seq}:{line.step_id}">{step}</a>{html.escape(rest)}')
        if self._history_earlier > 0:
            items.insert(0, f"<i>{self._history_earlier:,} earlier in Block history</i>")
        text = "<br>".join(items)
        if text != self.history.text():
            self.history.setText(text)
            self.history.setToolTip("\n".join(f"step {line.step_id:,}: {line.text}" for line in lines))

    def _show_history_row(self, shown: bool) -> None:
        self.history_name.setVisible(shown)
        self.history.setVisible(shown)

    def _history_link(self, href: str) -> None:
        seq, step = (int(part) for part in href.split(":"))
        if self.history_view is not None:
            self.history_view.lineActivated.emit(seq, step)  # the dock's own jump: the timeline follows

    def follow_relocation(self, mapping, seq: int | None = None) -> int | None:
        """A relocation moved blocks (``mapping``: old id -> new id, as a RELOCATED event's block_ids ->
        new_block_ids): keep the selected content selected under its new id. Returns the new id, or None if the
        selected block did not move (the caller moves the grid's highlight to it).

        ``seq``: the history frame that holds the relocation; a frame before it is described without the move
        (the block had not moved yet then)."""
        old = self.block_id
        if old is None or old not in mapping or int(mapping[old]) == old:
            return None
        new = int(mapping[old])
        self.block_id = new
        self.moved_from = old
        self._moved_seq = seq
        self.fields["block"].setText(f"{new} (moved from {old})")
        self.note.setText(f"Block {new} (moved from {old} to {new} by a relocation): the selection followed "
                          "its content to its new physical id.")
        return new

    def show_summary(self, snapshot: PoolSnapshot, *, owners: list[tuple[int, int]] | None = None,
                     seq: int | None = None) -> None:
        """Fields the snapshot already has; used for instant feedback between engine answers.

        ``owners``: the block's (conversation, logical block) pairs when the caller already has them from
        ``snapshot.owners_of``; looked up here otherwise. ``seq``: the history frame ``snapshot`` is, when the
        user views a past one (None: the newest); everything said is then of that frame."""
        self._snapshot = snapshot
        self._seq = _LIVE if seq is None else seq
        b = self.block_id
        if b is None or b >= snapshot.num_blocks:
            return
        if snapshot.block_size != self._block_size:
            self.set_block_size(snapshot.block_size)
        state = BlockState(int(snapshot.state[b]))
        self.fields["block"].setText(self._block_text(b))
        self.fields["state"].setText(state.name.lower())
        self.fields["ref count"].setText(str(int(snapshot.ref_count[b])))
        self.fields["filled"].setText(f"{int(snapshot.num_filled[b])} of {snapshot.block_size} slots")
        if owners is None:
            owners = snapshot.owners_of(b)
        facts = summary_info(snapshot, b, owners)
        self._learn_names(snapshot, facts)
        self.fields["owners"].setText(_owners_text(owners, names=self._names))
        self._show_prompt(block_prompt_lines(snapshot, owners, self.step_clock))
        self._describe(facts, snapshot)

    def _show_prompt(self, lines: list[str]) -> None:
        """Why this block's prompt content hit or missed, per owner; the row hides when nothing is known."""
        text = "; ".join(lines)
        if self.prompt.text() != text:
            self.prompt.setText(text)
            self.prompt.setToolTip("\n".join(lines))
        self.prompt_name.setVisible(bool(lines))
        self.prompt.setVisible(bool(lines))

    def _learn_names(self, snapshot: PoolSnapshot | None, facts: BlockInfo) -> None:
        """Remember the source's names of the block's owners and last owner (kept for the note's "before")."""
        if snapshot is not None and snapshot.conversations:
            self._names.update(conversation_names(snapshot, {c for c, _ in facts.owners} | {facts.last_owner}))

    def _moved_from_here(self) -> int | None:
        """The id the block had before a relocation, where the frame shown comes after that relocation: a frame
        from before it shows the block as it was then, unmoved."""
        if self.moved_from is None or self._moved_seq is None or self._seq >= self._moved_seq:
            return self.moved_from
        return None

    def _describe(self, facts: BlockInfo, snapshot: PoolSnapshot | None) -> None:
        """Write the note from the same facts the fields were just given (a frame's, or an answer's), whenever they
        differ from those it describes: the note and the fields never disagree. Written only from the fields'
        own facts, it once kept an older answer's 'shared by 17 references' under a frame's 'ref count: 12'.

        What "happened" to the block is told only against facts of an earlier frame: viewing a past step after a
        later one, the note says what the block is at that step ("has been freed: conversation 5 released it"
        was once said at step 120 of a conversation that arrived at step 241)."""
        moved_from = self._moved_from_here()
        key = (facts.block_id, facts.state, facts.ref_count, tuple(tuple(o) for o in facts.owners), moved_from)
        earlier = self._seq >= self._note_seq
        if key == self._note_key and earlier:
            return
        previous = self._note_facts if earlier else None
        elsewhere = content_elsewhere(previous, snapshot, facts.block_id) \
            if facts.state == BlockState.FREE else {}
        self.note.setText(change_note(previous, facts, moved_from=moved_from, elsewhere=elsewhere,
                                      names=self._names))
        self._note_facts, self._note_key, self._note_seq = facts, key, self._seq

    def show_block(self, info: BlockInfo) -> None:
        """The engine's answer to inspect_block for the selected block."""
        if info.block_id != self.block_id:
            return  # an answer for a block the user has since left
        previous = self.info
        self.info = info
        moved = previous is not None and previous.block_id != info.block_id
        self._learn_names(self._snapshot, info)
        self._describe(info, self._snapshot)
        if info.block_size != self._block_size:
            self.set_block_size(info.block_size)
        self.fields["block"].setText(self._block_text(info.block_id))
        self.fields["state"].setText(info.state.name.lower())
        self.fields["ref count"].setText(str(info.ref_count))
        self.fields["filled"].setText(f"{info.num_filled} of {info.block_size} slots")
        self.fields["hash"].setText(_hash_text(info, self._snapshot) + _also_in_tiers(self._snapshot, info.block_hash))
        self.fields["owners"].setText(_owners_text(info.owners, names=self._names))
        self.slots.set_block(info)
        if previous is not None and not moved and previous.num_filled == info.num_filled \
                and previous.token_ids == info.token_ids and _same_kv(previous, info):
            return  # same contents: leave the heatmap alone (repainting plots is what costs)
        keys = info.keys
        layers = keys.shape[0] if keys is not None and keys.ndim == 4 else 0
        heads = keys.shape[2] if keys is not None and keys.ndim == 4 else 0
        self.layer.setMaximum(max(layers - 1, 0))
        self.head.setMaximum(max(heads - 1, 0))
        self._draw_heatmap()

    def _block_text(self, block_id: int) -> str:
        moved_from = self._moved_from_here()
        return f"{block_id} (moved from {moved_from})" if moved_from is not None else str(block_id)

    def set_kv_reason(self, reason: str) -> None:
        """Why blocks come without K/V values now (a history frame, a recording, another process); shown in place of
        the heatmap when they do."""
        reason = reason or DEFAULT_KV_REASON
        if reason != self.kv_reason:
            self.kv_reason = reason
            if self.info is not None and self.info.keys is None:
                self._draw_heatmap()

    def set_block_size(self, block_size: int) -> None:
        """Slot axis of the heatmap: one row per slot of a block, integer ticks (follows an engine restart)."""
        self._block_size = block_size
        self._retick()
        self.plot.setRange(yRange=(0, block_size), padding=0)
        self._place_splitter()

    def _draw_heatmap(self, *_):
        info = self.info
        keys = info.keys if info is not None else None
        if info is None or keys is None or info.num_filled == 0 or keys.ndim != 4:
            self.heat.clear()
            self.heat_title.setText("")
            text = ""
            if info is not None and keys is None:
                text = f"No K/V heatmap: {self.kv_reason}."
            elif info is not None:
                text = "No K/V heatmap: the block holds no filled slots."
            self.kv_note.setText(text)
            self.kv_note.setVisible(bool(text))
            self.plot.setVisible(self.block_id is not None and (not text or info is None or keys is not None))
            return
        self.kv_note.hide()
        self.plot.show()
        data = keys if self.kind.currentText() == "K" else info.values
        layer = min(self.layer.value(), data.shape[0] - 1)
        head = min(self.head.value(), data.shape[2] - 1)
        image = np.asarray(data[layer, :, head, :], np.float32)  # [filled, head_dim]
        title = (f"{self.kind.currentText()} of layer {layer}, kv head {head}: {image.shape[0]} of "
                 f"{info.block_size} slots × {image.shape[1]} dims")
        stored = self._stored_image(info, layer, head)
        low, high = float(image.min()), float(image.max())
        if high <= low:
            low, high = low - 0.5, high + 0.5
        if stored is not None:
            scale = info.kv_scales[layer][0 if self.kind.currentText() == "K" else 1] if info.kv_scales else 1.0
            title += (f". Left: the {info.kv_cache_dtype} bytes stored, as the values they stand for; right: those "
                      f"values times the layer's {self.kind.currentText()} scale ({scale:g}), what attention reads")
            values = stored.astype(np.float32)
            self.stored_heat.setImage(values, autoLevels=False,
                                      levels=(min(low, float(values.min())), max(high, float(values.max()))))
            self.stored_heat.setRect(QtCore.QRectF(0, 0, image.shape[1], image.shape[0]))
            self.stored_plot.setRange(xRange=(0, image.shape[1]), yRange=(0, info.block_size), padding=0)
        self.stored_plot.setVisible(stored is not None)
        self.readout.setVisible(stored is not None)
        self.heat_title.setText(title)
        self.heat.setImage(image, autoLevels=False)
        self.colorbar.setLevels((low, high))
        self.heat.setRect(QtCore.QRectF(0, 0, image.shape[1], image.shape[0]))
        self._head_dim = image.shape[1]
        self._retick()
        self.plot.setRange(xRange=(0, image.shape[1]), yRange=(0, info.block_size), padding=0)

    def _stored_image(self, info: BlockInfo, layer: int, head: int) -> np.ndarray | None:
        """The stored fp8 codes of one layer and head as the values they stand for (before the scale), float64
        [filled, head_dim]; None for a block without stored codes (a pool of the model's dtype)."""
        codes = info.stored_keys if self.kind.currentText() == "K" else info.stored_values
        if codes is None or codes.ndim != 4 or info.kv_cache_dtype not in FP8_VALUES:
            return None
        return FP8_VALUES[info.kv_cache_dtype][np.asarray(codes[layer, :, head, :], np.uint8)]

    def stored_cell(self, slot: int, dim: int) -> str:
        """What the readout says for one cell: the stored byte, its value and the value attention reads ('' where the
        block has no stored codes there)."""
        info = self.info
        if info is None or info.stored_keys is None or info.keys is None:
            return ""
        kind = self.kind.currentText()
        codes, data = (info.stored_keys, info.keys) if kind == "K" else (info.stored_values, info.values)
        layer = min(self.layer.value(), codes.shape[0] - 1)
        head = min(self.head.value(), codes.shape[2] - 1)
        if not (0 <= slot < codes.shape[1] and 0 <= dim < codes.shape[3]):
            return ""
        code = int(codes[layer, slot, head, dim])
        value = FP8_VALUES[info.kv_cache_dtype][code]
        return (f"slot {slot}, dim {dim}: {kind} stored as byte 0x{code:02x} = {value:g} ({info.kv_cache_dtype}); "
                f"read as {float(data[layer, slot, head, dim]):g}")

    def _read_at(self, plot, pos) -> None:
        if not self.readout.isVisible():
            return
        point = plot.getViewBox().mapSceneToView(pos)
        text = self.stored_cell(int(np.floor(point.y())), int(np.floor(point.x())))
        if text:
            self.readout.setText(text)

    def slot_rows(self) -> list[tuple]:
        return self.slots.rows()

    def visible_slot_rows(self) -> int:
        """Slot rows the table shows whole without scrolling at its current size."""
        view = self.slots_view
        height = view.viewport().height()
        return int(height // view.verticalHeader().defaultSectionSize())


def _integer_ticks(count: int, pixels: float, min_spacing: float) -> list[list[tuple[float, str]]]:
    """Ticks at the middle of each of ``count`` cells spread over ``pixels``, labelled 0, 1, ...: every cell when
    labels ``min_spacing`` apart fit, else every 2nd, 4th, ... (labelled), with every cell as an unlabelled minor
    tick. Never a fractional slot, whatever the size (block size 1 included)."""
    stride = 1
    per_cell = pixels / max(count, 1)
    while stride < count and stride * per_cell < min_spacing:
        stride *= 2
    major = [(i + 0.5, str(i)) for i in range(0, count, stride)]
    minor = [(i + 0.5, "") for i in range(count) if i % stride] if stride > 1 and count <= 512 else []
    return [major, minor]


def _same_kv(a: BlockInfo, b: BlockInfo) -> bool:
    if a.keys is None or b.keys is None:
        return a.keys is None and b.keys is None
    return a.keys.shape == b.keys.shape and np.array_equal(a.keys, b.keys)


def _hash_text(info: BlockInfo, snapshot: PoolSnapshot | None = None) -> str:
    """The prefix hash as 16 hex digits, as the event log names it (and its KV cache group in a pool of several),
    with why, if the source said; or why there is none."""
    note = hash_note(info)
    if info.block_hash is None:
        return f"none — {note}"
    digits = hash_words(snapshot, info.block_hash, block_group_of(snapshot, info.block_id))
    return f"{digits} ({note})" if note else digits


def _also_in_tiers(snapshot: PoolSnapshot | None, block_hash: int | None) -> str:
    """'; also in host slot 3, disk slot 9' when a lower tier holds the same content now ('' otherwise)."""
    if snapshot is None or block_hash is None or not snapshot.tiers:
        return ""
    from ..model.tiers import place_text, where_held
    places = [p for p in where_held(snapshot, block_hash) if p[0] != "device"]
    return "; also in " + ", ".join(place_text(p) for p in places) if places else ""


def _owners_text(owners, limit: int = 6, names: Mapping[int, str] | None = None) -> str:
    """'conv 3 (logical block 0), ...'; a conversation its source names (a vLLM request id) by that name:
    'request cmpl-a-0 (logical block 0)'."""
    if not owners:
        return "none"
    return _first_few([f"request {names[c]} (logical block {i})" if names and names.get(c)
                       else f"conv {c} (logical block {i})" for c, i in owners], limit)
