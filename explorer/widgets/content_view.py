"""The content view: what a KV-event stream can honestly show about each serving instance's prefix cache.

A vLLM or SGLang KV-event stream names block hashes, their parents and their tokens, never physical block ids. So
this view draws no pool grid; it says so in words, and shows instead, per instance, the prefix tree of stored
blocks (parent chains, tokens as text when a tokenizer is given), blocks stored and removed over time, and the
stream's status (live, silent, lost events); and across instances, which prefixes are cached where, with a box
that asks what a KV-aware router asks: for this prompt, how many leading blocks does each instance hold?

Given its model (the :class:`~kvstream.kv_events.KVCacheIndex` objects, read-only here) and polled by a QTimer
(:meth:`ContentView.attach` for a subscriber, or :meth:`ContentView.refresh` from the window's own timer). Trees
are rebuilt only when an index's version changed; expanded rows stay expanded across rebuilds.
"""
from __future__ import annotations

from ..model.words import count
from typing import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.kv_events import (LIVE, EndpointStatus, KVCacheIndex, KVEventSubscriber,
                                StoredBlock, hash_text, prefix_overlap, where_cached)
from kvstream.kv_events import CONTENT_SENT, prefix_overlap_by_tier

from ..feeds.stream_feed import load_tokenizer  # noqa: F401  (--tokenizer DIR; kept importable from here)

PLACEMENT_UNKNOWN = ("Physical placement unknown: a KV-event stream tells which blocks are cached (hashes, parents, "
                     "tokens), not where they lie in the pool, so no block grid is drawn for this source.")
TREE_COLUMNS = ("block tokens", "hash", "medium", "tokens", "stored at seq")
MAX_TREE_ROWS = 3000  # rows built per tree; past that a last row says how many were left out
HASH_CHARS = 16  # a hash column shows this many characters (the tooltip has all of it)
HASH_ROLE = QtCore.Qt.ItemDataRole.UserRole + 1  # item data: the block's hash text, to keep expansion across rebuilds
TOKENS_ROLE = QtCore.Qt.ItemDataRole.UserRole + 2  # item data: the block's own token ids (its prefix: its ancestors')
COPY_PREFIX = "Copy the prefix's token ids (first block to this one)"
ROUTE_PREFIX = "Route this prefix across instances"
MARK_COLOUR = QtGui.QColor(60, 170, 90, 110)  # a block a checked prompt would hit
STATUS_COLOURS = {"ok": "#50c878", "warn": "#f0a030", "bad": "#e0443e"}


def status_line(status: EndpointStatus | None) -> tuple[str, str]:
    """The stream status as (text, colour key): "ok" when live and whole, "warn" when silent or still catching up,
    "bad" when events were lost or messages were malformed, or the connection is down."""
    if status is None:
        return "Stream: not followed (this index is fed directly)", "warn"
    text = "Stream: " + status.text
    if status.last_error and (status.num_lost or status.num_malformed or status.replay_answering is False):
        text += f"\nLast problem: {status.last_error}"
    if status.num_lost or status.num_malformed or not status.connected:
        return text, "bad"
    return text, "ok" if status.state == LIVE else "warn"  # silent, or catching up


class _InstancePane(QtWidgets.QWidget):
    """One instance: status, counts, the prefix tree of its stored blocks, and stored / removed over time."""

    def __init__(self, index: KVCacheIndex, tokenizer, parent=None):
        super().__init__(parent)
        self.index, self.tokenizer = index, tokenizer
        self.built_version = -1  # index version the tree and plot show
        self.status_label = QtWidgets.QLabel(status_line(None)[0])
        self.status_label.setWordWrap(True)
        self.counts_label = QtWidgets.QLabel()
        self.model = QtGui.QStandardItemModel(0, len(TREE_COLUMNS))
        self.model.setHorizontalHeaderLabels(TREE_COLUMNS)
        self.tree = QtWidgets.QTreeView()
        self.tree.setModel(self.model)
        self.tree.setUniformRowHeights(True)
        self.tree.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.tree.header().setStretchLastSection(False)
        self.tree.header().setSectionResizeMode(0, QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.plot = pg.PlotWidget(title="Blocks stored / removed over time")
        self.plot.setLabel("bottom", "seconds since the first batch shown")
        self.plot.addLegend(offset=(4, 4), labelTextSize="7pt")
        self.curves = {name: self.plot.plot(pen=pg.mkPen(colour, width=2), name=label) for name, label, colour in (
            ("stored", "stored (total)", "#50c878"), ("removed", "removed (total)", "#e0443e"),
            ("live", "live", "#ffffff"))}
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        split.addWidget(self.tree)
        split.addWidget(self.plot)
        split.setSizes([400, 160])
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.status_label)
        layout.addWidget(self.counts_label)
        layout.addWidget(split, 1)

    def set_status(self, status: EndpointStatus | None) -> None:
        text, key = status_line(status)
        if self.status_label.text() != text:
            self.status_label.setText(text)
            self.status_label.setStyleSheet(f"color: {STATUS_COLOURS[key]}")

    def refresh(self) -> bool:
        """Rebuild the tree and the plot if the index changed; True if it did."""
        version = self.index.version
        if version == self.built_version:
            return False
        self.built_version = version
        index = self.index
        self.counts_label.setText(
            f"{len(index)} live blocks · {index.num_stored_total} stored · {index.num_removed_total} removed · "
            f"block size {index.block_size or '-'} · {index.num_batches} batches"
            + (f" · {index.num_unknown_removed} removals of blocks never seen stored" if index.num_unknown_removed
               else "") + tier_counts_text(index))
        self._rebuild_tree(index.blocks())
        self._redraw_plot()
        return True

    def block_text(self, block: StoredBlock) -> str:
        """A block's tokens as text (with a tokenizer) or as ids."""
        if self.tokenizer is not None:
            return repr(self.tokenizer.decode(list(block.token_ids), skip_special_tokens=False))[1:-1]
        ids = " ".join(map(str, block.token_ids[:12]))
        return ids + (" …" if len(block.token_ids) > 12 else "")

    marked: frozenset = frozenset()  # hash texts of the blocks a checked prompt would hit (lit up in the tree)

    def mark(self, hashes) -> int:
        """Light up the rows of ``hashes`` (hash texts) and open the tree down to them; returns the rows lit."""
        self.marked = frozenset(hashes)
        return self._paint_marks(self.model.invisibleRootItem())

    def _paint_marks(self, item: QtGui.QStandardItem) -> int:
        lit = 0
        for r in range(item.rowCount()):
            child = item.child(r, 0)
            if child is None:
                continue
            on = child.data(HASH_ROLE) in self.marked
            brush = QtGui.QBrush(MARK_COLOUR) if on else QtGui.QBrush()
            for c in range(self.model.columnCount()):
                cell = item.child(r, c)
                if cell is not None:
                    cell.setBackground(brush)
            below = self._paint_marks(child)
            if below:
                self.tree.setExpanded(child.index(), True)
            lit += below + on
        return lit

    def _rebuild_tree(self, blocks: tuple[StoredBlock, ...]) -> None:
        expanded = set()
        self._collect_expanded(self.model.invisibleRootItem(), expanded)
        kids: dict = {}
        live = {b.block_hash for b in blocks}
        for b in blocks:  # in store order, so children appear oldest first
            kids.setdefault(b.parent_hash if b.parent_hash in live else None, []).append(b)
        self.model.removeRows(0, self.model.rowCount())
        root = self.model.invisibleRootItem()
        stack = [(root, b) for b in reversed(kids.get(None, ()))]
        rows = 0
        while stack and rows < MAX_TREE_ROWS:
            parent, block = stack.pop()
            row = self._row(block, live)
            parent.appendRow(row)
            rows += 1
            stack.extend((row[0], c) for c in reversed(kids.get(block.block_hash, ())))
        if len(blocks) > rows:
            more = QtGui.QStandardItem(f"… {len(blocks) - rows} more blocks not shown")
            more.setEnabled(False)
            root.appendRow(more)
        self._expand(root, expanded)
        if self.marked:
            self._paint_marks(root)

    def _row(self, block: StoredBlock, live: set) -> list[QtGui.QStandardItem]:
        text = self.block_text(block) if block.token_ids else f"({block.content})"
        if block.parent_hash is not None and block.parent_hash not in live:
            text = "(parent not cached) " + text
        full_hash = hash_text(block.block_hash)
        items = [QtGui.QStandardItem(text), QtGui.QStandardItem(full_hash[:HASH_CHARS]),
                 QtGui.QStandardItem(medium_text(block)), QtGui.QStandardItem(str(len(block.token_ids))),
                 QtGui.QStandardItem("-" if block.stored_seq is None else str(block.stored_seq))]
        items[0].setData(full_hash, HASH_ROLE)  # text: a uint64 does not fit Qt's integer types
        items[0].setData(tuple(block.token_ids), TOKENS_ROLE)
        items[0].setToolTip(f"token ids: {list(block.token_ids)}\nparent: {hash_text(block.parent_hash)}"
                            + (f"\nLoRA: {block.lora_name}" if block.lora_name else ""))
        items[1].setToolTip(full_hash)
        items[2].setToolTip(residency_text(block))
        return items

    def _collect_expanded(self, item: QtGui.QStandardItem, out: set) -> None:
        for r in range(item.rowCount()):
            child = item.child(r, 0)
            if child is not None and child.hasChildren():
                if self.tree.isExpanded(child.index()):
                    out.add(child.data(HASH_ROLE))
                self._collect_expanded(child, out)

    def _expand(self, item: QtGui.QStandardItem, hashes: set) -> None:
        if not hashes:
            return
        for r in range(item.rowCount()):
            child = item.child(r, 0)
            if child is not None and child.hasChildren():
                if child.data(HASH_ROLE) in hashes:
                    self.tree.setExpanded(child.index(), True)
                self._expand(child, hashes)

    def _redraw_plot(self) -> None:
        tl = self.index.timeline()
        if not len(tl.ts):
            for curve in self.curves.values():
                curve.setData([], [])
            return
        x = tl.ts - tl.ts[0]  # [batches] seconds since the first batch kept
        self.curves["stored"].setData(x, np.cumsum(tl.stored))
        self.curves["removed"].setData(x, np.cumsum(tl.removed))
        self.curves["live"].setData(x, tl.live)


class _AcrossPane(QtWidgets.QWidget):
    """Every instance at once: which prefixes are cached where, and where a router would send a prompt."""

    def __init__(self, indexes: Sequence[KVCacheIndex], text_of, tokenizer, parent=None):
        super().__init__(parent)
        self.indexes, self.text_of, self.tokenizer = tuple(indexes), text_of, tokenizer
        self.built_versions: tuple = ()
        labels = [ix.name or f"instance {i}" for i, ix in enumerate(self.indexes)]
        self.model = QtGui.QStandardItemModel(0, 2 + len(labels))
        self.model.setHorizontalHeaderLabels(["prefix block", "held by"] + labels)
        self.tree = QtWidgets.QTreeView()
        self.tree.setModel(self.model)
        self.tree.setUniformRowHeights(True)
        self.tree.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QtWidgets.QHeaderView.ResizeMode.Stretch)
        for column in range(1, self.model.columnCount()):
            header.setSectionResizeMode(column, QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.prompt = QtWidgets.QLineEdit()
        self.prompt.setPlaceholderText("a prompt (text with --tokenizer, else token ids: 1 2 3 ...)"
                                       if tokenizer is not None else "token ids of a prompt: 1 2 3 ... (or right-click a "
                                       "cached block: route its prefix)")
        self.route_label = QtWidgets.QLabel("Route a prompt: enter it above to see how many of its leading blocks "
                                            "each instance holds.")
        self.route_label.setWordWrap(True)
        self.prompt.textChanged.connect(self.route)
        _prefix_menu(self.tree, self.route_ids)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(QtWidgets.QLabel("Prefixes cached on each instance, merged by token content (a block's "
                                          "whole chain must be cached to count):"))
        layout.addWidget(self.tree, 1)
        layout.addWidget(self.prompt)
        layout.addWidget(self.route_label)

    def refresh(self) -> bool:
        versions = tuple(ix.version for ix in self.indexes)
        if versions == self.built_versions:
            return False
        self.built_versions = versions
        self.model.removeRows(0, self.model.rowCount())
        n = len(self.indexes)
        stack = [(self.model.invisibleRootItem(), node) for node in reversed(where_cached(self.indexes))]
        rows = 0
        while stack and rows < MAX_TREE_ROWS:
            parent, node = stack.pop()
            items = [QtGui.QStandardItem(self.text_of(node.token_ids)),
                     QtGui.QStandardItem(f"{len(node.holders)} of {n}")]
            items[0].setData(tuple(node.token_ids), TOKENS_ROLE)
            items += [QtGui.QStandardItem(holder_text(node, i)) for i in range(n)]
            parent.appendRow(items)
            rows += 1
            stack.extend((items[0], c) for c in reversed(node.children))
        self.tree.expandToDepth(0)
        self.route()
        return True

    def route_ids(self, ids) -> None:
        """Route the prompt of token ``ids`` (a cached block's prefix, from a row's menu): the box shows them."""
        self.prompt.setText(" ".join(str(int(t)) for t in ids))

    def route(self) -> None:
        text = self.prompt.text().strip()
        if not text:
            return
        ids = _token_ids(text, self.tokenizer)
        if ids is None:
            self.route_label.setText("Not token ids: give numbers separated by spaces or commas "
                                     "(or start the explorer with --tokenizer DIR to type text).")
            return
        held = prefix_overlap(self.indexes, ids)
        parts = [f"{ix.name or f'instance {i}'}: {h} block{'s' if h != 1 else ''}"
                 for i, (ix, h) in enumerate(zip(self.indexes, held))]
        best = max(held) if held else 0
        target = [ix.name or f"instance {i}" for i, (ix, h) in enumerate(zip(self.indexes, held)) if h == best]
        verdict = (f"a KV-aware router sends it to {' or '.join(target)}" if best else "no instance holds its first "
                   "block: any instance will compute it from scratch")
        self.route_label.setText(f"{count(len(ids), 'token')}. Leading blocks cached: {'; '.join(parts)}. So {verdict}."
                                 + per_tier_route_text(self.indexes, ids))


def tier_counts_text(index: KVCacheIndex) -> str:
    """" · by tier: GPU 3, CPU 5, STORAGE 0" when the instance holds anything off its GPU pool, else ""."""
    counts = index.stored_hashes_by_medium()
    if not any(n for tier, n in counts.items() if tier != "GPU"):
        return ""
    return " · by tier: " + ", ".join(f"{tier} {n}" for tier, n in counts.items())


def medium_text(block: StoredBlock) -> str:
    """The medium column: the media as published, and where a tier knows the block by hash only, how its content
    is known ("GPU+CPU · content known from its GPU store")."""
    return block.medium if block.content == CONTENT_SENT else f"{block.medium} · {block.content}"


def residency_text(block: StoredBlock) -> str:
    """One line per residency: medium, group (and its cache spec), locality, ownership."""
    lines = []
    for r in sorted(block.residencies, key=lambda r: tuple(str(x) for x in r)):
        parts = [r.medium or "medium unspecified"]
        if r.group_idx is not None:
            parts.append(f"group {r.group_idx}")
        parts += [x for x in (r.locality, r.ownership and f"owner {r.ownership}") if x]
        lines.append(" · ".join(parts))
    if block.kv_cache_spec_kind:
        lines.append(f"cache spec: {block.kv_cache_spec_kind}"
                     + (f", window {block.kv_cache_spec_sliding_window}" if block.kv_cache_spec_sliding_window else ""))
    lines.append(f"content: {block.content}")
    return "\n".join(lines)


def holder_text(node, i: int) -> str:
    """An "Across instances" cell: the tiers instance ``i`` holds this prefix block in ("●" if none said)."""
    if i not in node.holders:
        return ""
    tiers = node.tiers[i] if i < len(node.tiers) else ()
    return "+".join(sorted(tiers)) or "●"


def per_tier_route_text(indexes: Sequence[KVCacheIndex], ids: Sequence[int]) -> str:
    """The per-tier longest match (as Dynamo's KV router reports it), said only where a lower tier holds more."""
    parts = []
    for i, (ix, tiers) in enumerate(zip(indexes, prefix_overlap_by_tier(indexes, ids))):
        if any(n > tiers.get("GPU", 0) for t, n in tiers.items() if t != "GPU"):
            parts.append(f"{ix.name or f'instance {i}'}: " + ", ".join(f"{t} {n}" for t, n in tiers.items()))
    return (" Per tier: " + "; ".join(parts) + ".") if parts else ""


def _token_ids(text: str, tokenizer) -> list[int] | None:
    parts = text.replace(",", " ").split()
    if all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    if tokenizer is not None:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        return list(getattr(encoded, "ids", encoded))  # a tokenizers Encoding, or the byte tokenizer's list
    return None


def prefix_token_ids(index: QtCore.QModelIndex) -> list[int]:
    """The token ids of the prefix a tree row stands for: its ancestors' blocks, then its own (a row holds only
    its block's tokens; a router matches a prompt from its first block)."""
    chain = []
    index = index.siblingAtColumn(0)
    while index.isValid():
        chain.append(index.data(TOKENS_ROLE) or ())
        index = index.parent()
    return [int(t) for block in reversed(chain) for t in block]


def _prefix_menu(tree: QtWidgets.QTreeView, route) -> None:
    """A right click on a block's row offers to copy its prefix's token ids, or to route that prefix (``route``
    takes the ids): the router box took typed ids only, with no way to bring a cached block's tokens to it."""
    tree.setContextMenuPolicy(QtCore.Qt.ContextMenuPolicy.CustomContextMenu)

    def menu_at(point: QtCore.QPoint) -> None:
        index = tree.indexAt(point)
        ids = prefix_token_ids(index) if index.isValid() else []
        if not ids:
            return
        menu = QtWidgets.QMenu(tree)
        menu.addAction(COPY_PREFIX, lambda: copy_token_ids(ids))
        menu.addAction(ROUTE_PREFIX, lambda: route(ids))
        menu.exec(tree.viewport().mapToGlobal(point))
    tree.customContextMenuRequested.connect(menu_at)


def copy_token_ids(ids) -> str:
    """Put ``ids`` on the clipboard as the router box reads them ("1 2 3"); returns that text."""
    text = " ".join(str(int(t)) for t in ids)
    QtWidgets.QApplication.clipboard().setText(text)
    return text


class ContentView(QtWidgets.QWidget):
    """The window's view of KV-event sources: one tab per instance, one across them, and the placement notice.

    Why a view of its own and not the pool grid: the stream has no physical block ids, and a grid would have to
    invent them. Small API: construct with the indexes (and a tokenizer), then either :meth:`attach` a
    :class:`~kvstream.kv_events.KVEventSubscriber` (a timer polls its status and the indexes) or call
    :meth:`set_status` and :meth:`refresh` from the window's own timer."""

    REFRESH_MS = 500  # attach(): how often the timer looks for changes (trees rebuild only when something changed)

    def __init__(self, indexes: Sequence[KVCacheIndex], tokenizer=None, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.indexes = tuple(indexes)
        if not self.indexes:
            raise ValueError("the content view needs at least one KVCacheIndex")
        self.tokenizer = tokenizer
        self.subscriber: KVEventSubscriber | None = None
        self.placement_label = QtWidgets.QLabel(PLACEMENT_UNKNOWN)
        self.placement_label.setWordWrap(True)
        self.placement_label.setStyleSheet("font-weight: bold")
        self.panes = [_InstancePane(ix, tokenizer) for ix in self.indexes]
        self.across = _AcrossPane(self.indexes, self._text_of_tokens, tokenizer)
        self.tabs = QtWidgets.QTabWidget()
        for i, (ix, pane) in enumerate(zip(self.indexes, self.panes)):
            self.tabs.addTab(pane, ix.name or f"instance {i}")
        self.tabs.addTab(self.across, "Across instances")
        for pane in self.panes:
            _prefix_menu(pane.tree, self.route_prefix)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(self.placement_label)
        layout.addWidget(self.tabs, 1)
        self.timer = QtCore.QTimer(self)
        self.timer.timeout.connect(self._poll)
        self.refresh()

    def attach(self, subscriber: KVEventSubscriber, interval_ms: int | None = None) -> None:
        """Follow ``subscriber`` (whose indexes must be this view's): poll its status and redraw on a timer."""
        if tuple(subscriber.indexes) != self.indexes:
            raise ValueError("attach a subscriber whose indexes this view was built with")
        self.subscriber = subscriber
        self.timer.start(interval_ms or self.REFRESH_MS)
        self._poll()

    def set_status(self, statuses: Sequence[EndpointStatus | None]) -> None:
        """Show each instance's stream status (in the order of the indexes)."""
        for pane, status in zip(self.panes, statuses):
            pane.set_status(status)

    def refresh(self) -> bool:
        """Redraw whatever changed since the last call; True if anything did."""
        changed = [pane.refresh() for pane in self.panes]
        return self.across.refresh() or any(changed)

    def _poll(self) -> None:
        if self.subscriber is not None:
            self.set_status(self.subscriber.status())
        self.refresh()

    def mark_prompt(self, checks) -> int:
        """Light up, in each instance's tree, the blocks a checked prompt would hit there (``checks``: one
        kvstream.prompt_check.PromptCheck per instance, in order; None clears); returns the rows lit."""
        lit = 0
        for i, pane in enumerate(self.panes):
            check = checks[i] if checks is not None and i < len(checks) else None
            hashes = () if check is None else (hash_text(b.held.block_hash) for b in check.hit_blocks)
            lit += pane.mark(hashes)
        return lit

    def route_prefix(self, ids) -> None:
        """Show where a router would send the prompt of token ``ids`` (an instance tree's row menu)."""
        self.tabs.setCurrentWidget(self.across)
        self.across.route_ids(ids)

    def _text_of_tokens(self, token_ids: tuple[int, ...]) -> str:
        if self.tokenizer is not None:
            return repr(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))[1:-1]
        return " ".join(map(str, token_ids[:12])) + (" …" if len(token_ids) > 12 else "")
