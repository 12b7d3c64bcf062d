"""Relocation and memory readouts: the live proof that paging changes where KV lives, never what attention computes.

"Scramble" and "Compact" ask the engine to move blocks to other physical ids between two decode steps and to
recompute every running conversation's attention output before and after; the readout shows the difference
(expected 0.0). The memory readout puts bytes on the costs the source text names: KV in use, empty tail slots,
block tables, and what a contiguous max-length reservation would have taken.
"""
from __future__ import annotations

from ..model.words import count
from PySide6 import QtCore, QtWidgets

from kvstream.views import MemoryStats


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def report_text(report, mode: str) -> str:
    """One paragraph for a RelocationReport."""
    verdict = "identical" if report.max_abs_diff == 0.0 else "DIFFERENT"
    text = (f"{mode.capitalize()}: moved {report.num_moved} blocks to new physical ids. Attention output of "
            f"{report.num_conversations_checked} running conversation(s) recomputed before and after the move: "
            f"max |before − after| = {report.max_abs_diff:.3g} ({verdict}).")
    if report.lookahead_steps and report.num_tokens_compared:
        same = "the same" if report.tokens_identical else "DIFFERENT"
        text += (f" The next {report.lookahead_steps} steps decoded from the old and from the new layout gave "
                 f"{same} {count(report.num_tokens_compared, 'token')}.")
    return text


def memory_lines(mem: MemoryStats | None, kv_cache_dtype: str = "") -> list[tuple[str, str]]:
    """(label, value) rows of the memory readout (``kv_cache_dtype``: what the pool stores, where the source says)."""
    if mem is None:
        return []
    paged = mem.num_allocated_slots * mem.bytes_per_token
    stored = f"  (stored as {kv_cache_dtype})" if kv_cache_dtype else ""
    return [
        ("A block (K and V, every layer)", f"{human_bytes(mem.bytes_per_block)}{stored}"),
        ("KV in use (filled slots)", f"{human_bytes(mem.kv_bytes_used)}  ({mem.num_filled_slots} slots)"),
        ("Empty tail slots", f"{human_bytes(mem.tail_waste_bytes)}  ({mem.num_tail_empty_slots} slots)"),
        ("Block tables", f"{human_bytes(mem.block_table_bytes)}"),
        ("Paged total (used blocks)", f"{human_bytes(paged)}  ({mem.num_used_blocks} blocks)"),
        ("Saved by sharing", f"{human_bytes(mem.num_slots_saved_by_sharing * mem.bytes_per_token)}  "
                             f"({mem.num_slots_saved_by_sharing} slots)"),
        ("Contiguous reservation", f"{human_bytes(mem.contiguous_bytes)}  "
                                              f"({mem.num_contiguous_slots} slots)"),
    ]


IDLE_TEXT = "Relocate blocks to check that paging never changes the attention result."


class RelocationPanel(QtWidgets.QWidget):
    """Scramble / compact buttons, the last relocation's readout, and the memory readout."""

    relocateRequested = QtCore.Signal(bool)  # compact?

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.scramble = QtWidgets.QPushButton("Scramble blocks")
        self.scramble.setToolTip("Move every block to a random other physical id while decoding (Ctrl+Shift+S)")
        self.compact = QtWidgets.QPushButton("Compact to low ids")
        self.compact.setToolTip("Move blocks towards the lowest physical ids (Ctrl+Shift+C)")
        self.scramble.clicked.connect(lambda: self.relocateRequested.emit(False))
        self.compact.clicked.connect(lambda: self.relocateRequested.emit(True))
        self.readout = QtWidgets.QLabel(IDLE_TEXT)
        self.readout.setWordWrap(True)
        self.memory = QtWidgets.QFormLayout()
        self.memory.setContentsMargins(0, 4, 0, 0)
        # a narrow dock puts each value under its label instead of cutting the label ("Contiguous reservatio")
        self.memory.setRowWrapPolicy(QtWidgets.QFormLayout.RowWrapPolicy.WrapLongRows)
        self._memory_labels: dict[str, QtWidgets.QLabel] = {}
        buttons = QtWidgets.QHBoxLayout()
        buttons.addWidget(self.scramble)
        buttons.addWidget(self.compact)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        title = QtWidgets.QLabel("<b>Relocate blocks</b>")
        layout.addWidget(title)
        layout.addLayout(buttons)
        layout.addWidget(self.readout)
        layout.addWidget(QtWidgets.QLabel("<b>Memory of current conversations</b>"))
        layout.addLayout(self.memory)
        self.groups_label = QtWidgets.QLabel()  # blocks per KV cache group and what a window saved (several groups)
        self.groups_label.setWordWrap(True)
        self.groups_label.setVisible(False)
        layout.addWidget(self.groups_label)
        layout.addStretch(1)
        self.reports: list = []
        self.busy = False  # a relocation was sent and has not answered yet (its buttons wait)
        self._last_memory = None

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.scramble.setEnabled(not busy)
        self.compact.setEnabled(not busy)
        if busy:
            self.readout.setText("Relocating…")

    def reset(self) -> None:
        """Back to the first state (after an engine restart: a relocation in flight will never answer)."""
        self.set_busy(False)
        self.readout.setText(IDLE_TEXT)
        self.readout.setStyleSheet("")

    def show_report(self, report, compact: bool) -> None:
        self.reports.append(report)
        self.set_busy(False)
        self.readout.setText(report_text(report, "compact" if compact else "scramble"))
        ok = report.max_abs_diff == 0.0 and report.tokens_identical
        self.readout.setStyleSheet("color: #50c878;" if ok else "color: #e0443e; font-weight: bold;")

    def show_failure(self, message: str) -> None:
        self.set_busy(False)
        self.readout.setText(f"Relocation refused: {message}")
        self.readout.setStyleSheet("color: #e0443e;")

    def update_memory(self, mem: MemoryStats | None, kv_cache_dtype: str = "") -> None:
        if (mem, kv_cache_dtype) == self._last_memory:
            return
        self._last_memory = (mem, kv_cache_dtype)
        for label, value in memory_lines(mem, kv_cache_dtype):
            if label not in self._memory_labels:
                widget = QtWidgets.QLabel()
                widget.setWordWrap(True)  # a value grows as the pool fills ("776.0 KiB  (194 slots)"): wrap, not cut
                self._memory_labels[label] = widget
                self.memory.addRow(label + ":", widget)
            self._memory_labels[label].setText(value)

    def update_groups(self, snapshot) -> None:
        """Blocks per KV cache group, and what the sliding windows saved against full attention (hidden for a
        one-group pool)."""
        from ..model.groups import window_saving_text
        text = window_saving_text(snapshot)
        if text != self.groups_label.text():
            self.groups_label.setText(text)
        self.groups_label.setVisible(bool(text))

    def memory_text(self) -> dict[str, str]:
        return {label: widget.text() for label, widget in self._memory_labels.items()}
