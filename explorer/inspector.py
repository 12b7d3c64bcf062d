"""The block inspector: what one physical block holds and who refers to it, kept live while it changes.

It first shows what the snapshot already knows (state, ref count, fill) so a click answers at once, then fills in
the slot table and the K/V heatmap when the engine answers ``inspect_block``. Comparing consecutive answers lets it
say plainly when the block was freed, cached, or taken over by another conversation.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from engine.snapshot import BlockInfo, BlockState, PoolSnapshot

from .grid_view import block_owners
from .table_model import RowsModel

SLOT_COLUMNS = ("slot", "position", "token id", "token text")


class SlotsModel(RowsModel):
    """One row per filled slot of the inspected block."""

    COLUMNS = SLOT_COLUMNS

    def set_block(self, info: BlockInfo | None) -> None:
        self.set_rows([] if info is None else [(i, p, t, token_label(s)) for i, (p, t, s) in
                                               enumerate(zip(info.positions, info.token_ids, info.token_texts))])


def token_label(text: str) -> str:
    """A token's text as one visible line: escapes for control characters, '␣' for spaces (else a space token
    looks like an empty cell)."""
    return repr(text)[1:-1].replace(" ", "␣")


def change_note(previous: BlockInfo | None, info: BlockInfo) -> str:
    """A sentence about what happened to the block since the previous answer (or what it is now)."""
    cids = sorted({c for c, _ in info.owners})
    before = sorted({c for c, _ in previous.owners}) if previous is not None else []
    if info.state == BlockState.FREE:
        if before:
            return (f"Block {info.block_id} has been freed: {_conversations(before)} released it "
                    "and no one refers to it now.")
        return f"Block {info.block_id} is free: no conversation refers to it and it holds nothing reusable."
    if info.state == BlockState.CACHED:
        who = f" (last filled by conversation {info.last_owner})" if info.last_owner >= 0 else ""
        lead = f"Block {info.block_id} has been released but stays cached" if before else \
            f"Block {info.block_id} is cached"
        return f"{lead}: no owner now, but it keeps a full prefix block of KV{who} that a matching prompt can reuse."
    if previous is not None and before and not set(before) & set(cids):
        return (f"Block {info.block_id} has been reused: it now belongs to {_conversations(cids)} "
                f"(before: {', '.join(map(str, before))}).")
    if previous is not None and previous.state != BlockState.USED:
        return f"Block {info.block_id} is in use again, now by {_conversations(cids)}."
    shared = f", shared by {info.ref_count} references" if info.ref_count > 1 else ""
    return f"Block {info.block_id} is in use by {_conversations(cids)}{shared}."


def _first_few(items: list[str], limit: int = 6) -> str:
    """The first ``limit`` items joined by commas, then ' and N more' for the rest."""
    text = ", ".join(items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _conversations(ids, limit: int = 6) -> str:
    """'conversation 3' or 'conversations 0, 1, ... and 4 more'."""
    ids = sorted(ids)
    return f"conversation{'s' if len(ids) > 1 else ''} {_first_few([str(c) for c in ids], limit)}"


class Inspector(QtWidgets.QWidget):
    """Panel for the selected block."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.block_id: int | None = None
        self.info: BlockInfo | None = None
        self.note = QtWidgets.QLabel("Click a cell in the grid to inspect its block.")
        self.note.setWordWrap(True)
        self.note.setStyleSheet("font-weight: bold;")
        self.fields: dict[str, QtWidgets.QLabel] = {}
        form = QtWidgets.QFormLayout()
        for key in ("block", "state", "ref count", "filled", "hash", "owners"):
            label = QtWidgets.QLabel("-")
            label.setWordWrap(True)
            label.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
            form.addRow(key + ":", label)
            self.fields[key] = label
        self.slots = SlotsModel(self)
        self.slots_view = QtWidgets.QTableView()
        self.slots_view.setModel(self.slots)
        self.slots_view.verticalHeader().hide()
        self.slots_view.horizontalHeader().setStretchLastSection(True)
        self.kind = QtWidgets.QComboBox()
        self.kind.addItems(["K", "V"])
        self.layer = QtWidgets.QSpinBox()
        self.head = QtWidgets.QSpinBox()
        for widget in (self.kind, self.layer, self.head):
            signal = widget.currentIndexChanged if isinstance(widget, QtWidgets.QComboBox) else widget.valueChanged
            signal.connect(self._draw_heatmap)
        controls = QtWidgets.QHBoxLayout()
        for text, widget in (("show", self.kind), ("layer", self.layer), ("kv head", self.head)):
            controls.addWidget(QtWidgets.QLabel(text))
            controls.addWidget(widget)
        controls.addStretch(1)
        self.plot = pg.PlotWidget()
        self.plot.setLabel("bottom", "head dim")
        self.plot.setLabel("left", "filled slot")
        self.plot.getViewBox().invertY(True)
        self.plot.setMinimumHeight(120)
        self.plot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
        self.heat = pg.ImageItem(axisOrder="row-major")
        self.heat.setColorMap(pg.colormap.get("viridis"))
        self.plot.addItem(self.heat)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.note)
        layout.addLayout(form)
        layout.addWidget(self.slots_view, 2)
        layout.addLayout(controls)
        layout.addWidget(self.plot, 2)

    def select(self, block_id: int | None, snapshot: PoolSnapshot | None) -> None:
        """A new block was clicked: show the snapshot's view of it now; details follow from the engine."""
        if block_id != self.block_id:
            self.info = None
            self.slots.set_block(None)
            self.heat.clear()
            self.plot.setTitle("")
        self.block_id = block_id
        if block_id is None:
            self.note.setText("Click a cell in the grid to inspect its block.")
            for label in self.fields.values():
                label.setText("-")
            return
        if snapshot is not None and block_id < snapshot.num_blocks:
            self.show_summary(snapshot)

    def show_summary(self, snapshot: PoolSnapshot, *, owners: list[tuple[int, int]] | None = None) -> None:
        """Fields the snapshot already has; used for instant feedback between engine answers.

        ``owners``: the block's (conversation, logical block) pairs when the caller already has them from
        ``block_owners``; computed here otherwise."""
        b = self.block_id
        if b is None or b >= snapshot.num_blocks:
            return
        state = BlockState(int(snapshot.state[b]))
        self.fields["block"].setText(str(b))
        self.fields["state"].setText(state.name.lower())
        self.fields["ref count"].setText(str(int(snapshot.ref_count[b])))
        self.fields["filled"].setText(f"{int(snapshot.num_filled[b])} of {snapshot.block_size} slots")
        if owners is None:
            owners = block_owners(snapshot, b)
        self.fields["owners"].setText(_owners_text(owners))
        if self.info is None:
            if state == BlockState.FREE:
                self.note.setText(f"Block {b} is free: no conversation refers to it.")
            elif state == BlockState.CACHED:
                self.note.setText(f"Block {b} is cached: no owner, but it keeps reusable prefix KV.")
            else:
                self.note.setText(f"Block {b} is in use by {_conversations({c for c, _ in owners})}.")

    def show_block(self, info: BlockInfo) -> None:
        """The engine's answer to inspect_block for the selected block."""
        if info.block_id != self.block_id:
            return  # an answer for a block the user has since left
        previous = self.info
        self.info = info
        if previous is None or (previous.state, previous.owners) != (info.state, info.owners):
            self.note.setText(change_note(previous, info))  # otherwise keep saying what last changed
        self.fields["block"].setText(str(info.block_id))
        self.fields["state"].setText(info.state.name.lower())
        self.fields["ref count"].setText(str(info.ref_count))
        self.fields["filled"].setText(f"{info.num_filled} of {info.block_size} slots")
        self.fields["hash"].setText(_hash_text(info))
        self.fields["owners"].setText(_owners_text(info.owners))
        self.slots.set_block(info)
        if previous is not None and previous.num_filled == info.num_filled \
                and previous.token_ids == info.token_ids and np.array_equal(previous.keys, info.keys):
            return  # same contents: leave the heatmap alone (repainting plots is what costs)
        layers = info.keys.shape[0] if info.keys.ndim == 4 else 0
        heads = info.keys.shape[2] if info.keys.ndim == 4 else 0
        self.layer.setMaximum(max(layers - 1, 0))
        self.head.setMaximum(max(heads - 1, 0))
        self._draw_heatmap()

    def _draw_heatmap(self, *_):
        info = self.info
        if info is None or info.num_filled == 0 or info.keys.ndim != 4:
            self.heat.clear()
            self.plot.setTitle("no K/V: the block holds no filled slots" if info is not None else "")
            return
        data = info.keys if self.kind.currentText() == "K" else info.values
        layer = min(self.layer.value(), data.shape[0] - 1)
        head = min(self.head.value(), data.shape[2] - 1)
        image = np.asarray(data[layer, :, head, :], np.float32)  # [filled, head_dim]
        self.plot.setTitle(f"{self.kind.currentText()} of layer {layer}, kv head {head}: "
                           f"{image.shape[0]} slots × {image.shape[1]} dims")
        self.heat.setImage(image, autoLevels=True)
        self.heat.setRect(QtCore.QRectF(0, 0, image.shape[1], image.shape[0]))
        self.plot.setRange(xRange=(0, image.shape[1]), yRange=(0, max(image.shape[0], 1)), padding=0)

    def slot_rows(self) -> list[tuple]:
        return self.slots.rows()


def _hash_text(info: BlockInfo) -> str:
    """The prefix hash as 16 hex digits (with the engine's note, if any), or why there is none."""
    if info.block_hash is None:
        return f"none — {info.hash_note}"
    digits = f"{info.block_hash & (2**64 - 1):016x}"
    return f"{digits} ({info.hash_note})" if info.hash_note else digits


def _owners_text(owners, limit: int = 6) -> str:
    if not owners:
        return "none"
    return _first_few([f"conv {c} (logical block {i})" for c, i in owners], limit)
