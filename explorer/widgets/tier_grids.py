"""The lower tiers (host memory, disk) beside the device pool grid: one grid per tier that is on, and what a clicked
slot holds.

Each tier grid is the device grid's own widget (:class:`~explorer.widgets.grid_view.GridView`: one ImageItem, hover,
click) fed a tier made into a pool of CACHED / FREE slots (:func:`explorer.model.tiers.tier_snapshot`), so the
colour rules are the device grid's. A tier's image is rebuilt only when its arrays change (or when the content book
learns an owner that colours it); the device pool's other changes leave it alone. Clicking a slot lists what the
window knows of it (:func:`explorer.model.tiers.tier_block_facts`): hash, whose content, tokens when known, every
place holding the same content now, and its story across tiers from the events.
"""
from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from kvstream.views import PoolSnapshot, TierView

from .grid_view import GridView
from ..model.groups import groups_of
from ..model.tiers import (ContentBook, TierOwners, TierStories, same_tier, tier_block_facts, tier_names,
                           tier_snapshot)

TOOLTIP_FACTS = 8  # facts a tier slot's tooltip lists (the inspector below lists them all)


class TierGrid(GridView):
    """One tier's grid: a GridView whose hover and tooltip speak of tier slots."""

    def __init__(self, name: str, owner: "TierGrids", parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.name = name
        self._owner = owner
        self.hover_hint = f"{name} tier: hover a slot for details; click to inspect it."
        self.hover_label.setText(self.hover_hint)

    def facts(self, slot: int) -> list[str]:
        return self._owner.facts(self.name, slot)

    def tooltip_at(self, viewport_pos: QtCore.QPoint) -> str:
        slot = self.block_at_scene(self.view.mapToScene(viewport_pos))
        return "" if slot is None or self.snapshot is None else "\n".join(self.facts(slot)[:TOOLTIP_FACTS])

    def _describe_hovered(self) -> None:
        slot = self.hovered_block
        if slot is not None and self.snapshot is not None and slot < self.snapshot.num_blocks:
            self.hover_label.setText(", ".join(self.facts(slot)[:3]))

    def _on_mouse_moved(self, scene_pos: QtCore.QPointF) -> None:
        slot = self.hovered_block = self.block_at_scene(scene_pos)
        if slot is None or self.snapshot is None:
            QtWidgets.QToolTip.hideText()
            return
        self._describe_hovered()


class TierGrids(QtWidgets.QWidget):
    """A column of tier grids (top to bottom: host, disk) and the inspected slot's facts; hidden while no tier is
    on."""

    slotClicked = QtCore.Signal(str, int)  # tier name, slot

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.book = ContentBook()
        self.stories = TierStories()
        self.grids: dict[str, TierGrid] = {}
        self.titles: dict[str, QtWidgets.QLabel] = {}
        self.snapshot: PoolSnapshot | None = None
        self.color_by = "owner"
        self.selected_conversation: int | None = None
        self.selected: tuple[str, int] | None = None  # the inspected slot
        self.detokenize = None
        self._tiers: dict[str, TierView] = {}  # the tier views last drawn
        self._owners: dict[str, TierOwners] = {}  # each tier's slot owners, kept up to date incrementally
        self._versions: dict[str, int] = {}  # the synthetic version of each tier's pool (bumped on a change)
        self._fitted: dict[str, object] = {}  # the view box size each grid was last fitted to
        self._user_moved: set[str] = set()  # grids the user panned or zoomed: no longer refitted
        self.tier_redraws = 0  # tier pools rebuilt (tests read it: unchanged arrays draw nothing)
        self._column = QtWidgets.QVBoxLayout()
        self._column.setContentsMargins(0, 0, 0, 0)
        self.inspector = QtWidgets.QLabel("Click a slot of a tier to inspect it.")
        self.inspector.setWordWrap(True)
        self.inspector.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.inspector.setAlignment(QtCore.Qt.AlignmentFlag.AlignTop | QtCore.Qt.AlignmentFlag.AlignLeft)
        scroll = QtWidgets.QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        scroll.setWidget(self.inspector)
        scroll.setMaximumHeight(150)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(self._column, 1)
        layout.addWidget(scroll)
        self.setVisible(False)

    # ---- feeding ------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new source: forget every tier, every owner and every story."""
        for name in list(self.grids):
            self._remove(name)
        self.book.clear()
        self.stories.clear()
        self.snapshot, self.selected = None, None
        self._tiers.clear()
        self._owners.clear()
        self.inspector.setText("Click a slot of a tier to inspect it.")
        self.setVisible(False)

    def add_events(self, pairs, snapshot: PoolSnapshot | None = None) -> None:
        """(seq, BlockEvent) pairs of new frames: owners and tokens of stored content, and each content's story.

        Only a pool with a tier needs them (nothing else reads the book or the stories): the events of a pool
        without one (``snapshot``, the frame they came with, or else the one shown) are not kept, or an hour of
        served traffic would fill both with every block ever stored (tens of MiB)."""
        pool = snapshot if snapshot is not None else self.snapshot
        if pool is not None and not pool.tiers:
            return
        events = [e for _, e in pairs]
        self.book.add_events(events, grouped=pool is not None and len(groups_of(pool)) > 1)
        self.stories.add_events(events)

    def set_snapshot(self, snapshot: PoolSnapshot) -> None:
        self.snapshot = snapshot
        self.book.observe(snapshot)
        names = tier_names(snapshot)
        for name in [n for n in self.grids if n not in names]:
            self._remove(name)
        for name in names:
            tier = snapshot.tiers[name]
            grid = self.grids.get(name) or self._add(name)
            owners = self._owners.setdefault(name, TierOwners())
            recoloured = owners.update(tier, self.book)  # an owner learnt for content the tier holds
            changed = not same_tier(self._tiers.get(name), tier) or recoloured
            if changed:
                self._versions[name] = self._versions.get(name, 0) + 1
                self._tiers[name] = tier
                self.tier_redraws += 1
            if changed or grid.snapshot is None or (self.color_by == "age" and  # ages move with every step
                                                    grid.snapshot.step_id != snapshot.step_id):
                grid.set_snapshot(tier_snapshot(snapshot, name, tier, self.book, self._versions[name],
                                                owners.owner))
            used = int((tier.state != 0).sum())
            self.titles[name].setText(f"<b>{name.capitalize()} tier</b> ({MEDIUM_WORDS.get(name, name)}): "
                                      f"{used:,} of {tier.num_blocks:,} slots hold KV")
        self.setVisible(bool(names))
        if self.selected is not None and self.selected[0] in self.grids:
            self._inspect(*self.selected)

    def set_color_by(self, mode: str) -> None:
        self.color_by = mode
        for grid in self.grids.values():
            grid.set_color_by(mode)

    def set_selected_conversation(self, conversation_id: int | None) -> None:
        self.selected_conversation = conversation_id
        for grid in self.grids.values():
            grid.set_selected_conversation(conversation_id)

    def render(self) -> bool:
        """Redraw the tier grids that changed; each is kept fitted whole to its size until the user pans or zooms
        it (as the device grid is)."""
        drawn = False
        for name, grid in self.grids.items():
            drawn = grid.render() or drawn
            size = grid.box.size()
            if grid.geometry_ is not None and name not in self._user_moved and size != self._fitted.get(name) \
                    and size.width() > 0 and size.height() > 0:
                self._fitted[name] = size
                grid.fit_whole_pool()
        return drawn

    # ---- inspecting ---------------------------------------------------------------------------------------------
    def facts(self, name: str, slot: int) -> list[str]:
        if self.snapshot is None:
            return []
        return tier_block_facts(self.snapshot, name, slot, self.book, self.stories, self.detokenize)

    def tokens(self, name: str, slot: int) -> tuple[int, ...] | None:
        """The token ids tier ``name``'s ``slot`` holds, where the window saw them stored (None: not known)."""
        view = self.snapshot.tiers.get(name) if self.snapshot is not None else None
        if view is None or not 0 <= slot < view.num_blocks:
            return None
        tokens = self.book.tokens(int(view.block_hash[slot]))
        return None if tokens is None else tuple(tokens)

    def inspect(self, name: str, slot: int) -> None:
        """Show what tier ``name``'s ``slot`` holds (a click does this)."""
        self.selected = (name, slot)
        for n, grid in self.grids.items():
            grid.set_selected_block(slot if n == name else None)
        self._inspect(name, slot)
        self.slotClicked.emit(name, slot)

    def _inspect(self, name: str, slot: int) -> None:
        text = "\n".join(self.facts(name, slot))
        if self.inspector.text() != text:
            self.inspector.setText(text)

    def inspector_text(self) -> str:
        return self.inspector.text()

    # ---- grids --------------------------------------------------------------------------------------------------
    def _add(self, name: str) -> TierGrid:
        title = QtWidgets.QLabel()
        title.setTextFormat(QtCore.Qt.TextFormat.RichText)
        grid = TierGrid(name, self)
        grid.set_color_by(self.color_by)
        grid.set_selected_conversation(self.selected_conversation)
        grid.blockClicked.connect(lambda slot, n=name: self.inspect(n, slot))
        grid.box.sigRangeChangedManually.connect(lambda *_, n=name: self._user_moved.add(n))
        self._column.addWidget(title)
        self._column.addWidget(grid, 1)
        self.grids[name], self.titles[name] = grid, title
        return grid

    def _remove(self, name: str) -> None:
        for widget in (self.grids.pop(name), self.titles.pop(name)):
            self._column.removeWidget(widget)
            widget.setParent(None)
            widget.deleteLater()
        self._tiers.pop(name, None)
        self._owners.pop(name, None)
        self._fitted.pop(name, None)
        self._user_moved.discard(name)


MEDIUM_WORDS = {"host": "CPU memory", "disk": "storage"}
