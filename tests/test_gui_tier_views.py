"""The window's views of tiers and KV cache groups (pytest-qt, offscreen).

VIEW tests: every snapshot and event here is built by hand to the contract of DESIGN.md "Beyond one pool" (see
tests/tier_view_helpers.py), because the engine sides of tiers and groups are written on other branches; tests of
the same views over a real engine with tiers and groups come after the merge.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PySide6 import QtCore

from explorer.model import palette
from explorer.model.event_colours import KIND_COLOURS
from explorer.widgets.eventlog import EventLog
from explorer.feeds.feed import Capabilities, Feed
from explorer.render.grid import block_colours
from explorer.widgets.grid_view import GridView
from explorer.window.main_window import MainWindow
from explorer.render.groups import GROUP_COLOURS
from explorer.widgets.timeline import Timeline
from explorer.widgets.tier_grids import TierGrids
from explorer.widgets.tier_metrics import TierMetrics
from kvstream.events import EventKind
from tests.tier_view_helpers import H0, H5, HA, tier, tier_events, tiered_snapshot

LEFT = QtCore.Qt.MouseButton.LeftButton
K = EventKind


def rgb(colour) -> tuple[int, int, int]:
    return tuple(int(c) for c in colour[:3])


@pytest.fixture
def tiers(qtbot):
    widget = TierGrids()
    qtbot.addWidget(widget)
    widget.resize(300, 600)
    widget.add_events([(i, e) for i, e in enumerate(tier_events())], tiered_snapshot())
    widget.set_snapshot(tiered_snapshot())
    widget.show()
    qtbot.waitExposed(widget)
    widget.render()
    return widget


def test_each_tier_that_is_on_gets_its_own_grid_in_the_device_grids_colours(tiers):
    assert list(tiers.grids) == ["host", "disk"] and tiers.isVisible()
    snap = tiered_snapshot()
    device, _ = block_colours(snap, "owner")
    host = tiers.grids["host"]
    assert host.geometry_.num_blocks == 4 and tiers.grids["disk"].geometry_.num_blocks == 2
    assert host.cell_colour(0) == rgb(device[5])  # conversation 2's content: its cached colour, as on the device
    assert host.cell_colour(1) == rgb(palette.FREE)
    assert tiers.grids["disk"].cell_colour(1) == rgb(palette.UNOWNED)  # owner never announced
    assert "2 of 4 slots hold KV" in tiers.titles["host"].text()
    tiers.set_snapshot(dataclasses.replace(snap, tiers={}))
    assert not tiers.isVisible() and not tiers.grids  # no tier on: nothing beside the device grid


def test_a_tier_grid_is_redrawn_only_when_its_arrays_change(tiers):
    host = tiers.grids["host"]
    drawn, rebuilt = host.frames_drawn, tiers.tier_redraws
    same = tiered_snapshot(step_id=21, version=2)  # a new step, new TierView objects, the same slots
    tiers.set_snapshot(same)
    assert not tiers.render() and host.frames_drawn == drawn and tiers.tier_redraws == rebuilt
    moved = tiered_snapshot(step_id=22, version=3, host=tier(4, {0: HA, 2: H0, 3: H0}))
    tiers.set_snapshot(moved)
    assert tiers.render() and host.frames_drawn == drawn + 1
    assert host.cell_colour(3) == host.cell_colour(2) != rgb(palette.FREE)  # the new slot, coloured by its owner


def test_clicking_a_tier_slot_inspects_it(qtbot, tiers):
    host = tiers.grids["host"]
    clicked = []
    tiers.slotClicked.connect(lambda name, slot: clicked.append((name, slot)))
    qtbot.mouseClick(host.view.viewport(), LEFT, pos=host.cell_center(2))
    assert clicked == [("host", 2)] and host.selected_block == 2
    text = tiers.inspector_text()
    assert text.startswith(f"host slot 2: cached\nhash {H0:016x}, group 0\n")
    assert "content of conversation 1" in text and "tokens 1 2 3 4" in text
    assert "held now by device block 0, host slot 2" in text
    assert "step 15: offloaded to host slot 2 from device block 7" in text
    assert text.endswith("step 18: loaded from host slot 2 into device block 0")
    assert "hash" in host.tooltip_at(host.cell_center(2))


def test_group_colour_mode_and_group_filter_on_the_device_grid(qtbot):
    grid = GridView()
    qtbot.addWidget(grid)
    grid.resize(400, 400)
    grid.show()
    snap = tiered_snapshot()
    grid.set_snapshot(snap)
    grid.set_color_by("group")
    grid.render()
    assert grid.cell_colour(0) == rgb(GROUP_COLOURS[0]) and grid.cell_colour(3) == rgb(GROUP_COLOURS[1])
    grid.set_color_by("state")
    grid.set_group_filter(1)
    grid.render()
    assert grid.cell_colour(3) == rgb(palette.STATE_USED)
    assert grid.cell_colour(0) == rgb(palette.scale(palette.STATE_USED, palette.DIM_LEVEL))
    # a block that changes group alone (same state, fill, ref count, owner) is drawn again
    swapped = dataclasses.replace(snap, version=2, group_block_tables=({1: (3, 1, 2)}, {1: (-1, 0, 4)}))
    grid.set_snapshot(swapped)
    grid.render()
    assert grid.cell_colour(0) == rgb(palette.STATE_USED)
    assert grid.cell_colour(3) == rgb(palette.scale(palette.STATE_USED, palette.DIM_LEVEL))


def test_tier_and_window_events_are_marked_on_the_timeline_and_logged(qtbot):
    t = Timeline()
    qtbot.addWidget(t)
    t.resize(600, 84)
    t.show()
    t.set_range(0, 40, lambda seq: seq)
    t.add_event_markers([(i, e) for i, e in enumerate(tier_events())])
    kinds = {K.EVICTED, K.OFFLOADED, K.LOADED, K.WINDOW_RELEASED}
    assert t.visible_marker_count() == sum(1 for e in tier_events() if e.kind in kinds)  # shown by default
    assert "offloaded" in t.tooltip_at(t.track.x_of(4))
    log = EventLog()
    qtbot.addWidget(log)
    log.append_events([(i, e) for i, e in enumerate(tier_events())])
    lines = [log.model.data(log.model.index(r, 1)) for r in range(log.model.rowCount())]
    assert "block 6 (hash ab12) offloaded to host slot 0" in lines
    assert "host slot 2 (hash 1111) loaded into block 0 for conversation 1: a prefix hit, not recomputed" in lines
    assert ("conversation 1's sliding window (group 1) let go of block 7: out of the window, never read again"
            in lines)
    assert KIND_COLOURS[K.OFFLOADED] != KIND_COLOURS[K.LOADED]


def test_tier_metrics_plot_hit_rates_and_duration_histograms(qtbot):
    m = TierMetrics()
    qtbot.addWidget(m)
    m.redraw()
    assert m.isHidden() and not m.has_data()  # nothing to plot yet: hidden
    m.record(tiered_snapshot())
    m.add_events([(i, e) for i, e in enumerate(tier_events())])
    m.redraw()
    assert m.has_data() and not m.isHidden()
    x, y = m.hit_curves["host"].getData()
    assert x.tolist() == [20.0] and y.tolist() == [25.0]
    assert m.histogram_counts("device", "lifetime").sum() == 3
    assert m.histogram_counts("host", "reuse_gap").sum() == 1


# ---- the window, fed hand-built views -------------------------------------------------------------------------
class ViewsFeed(Feed):
    """A read-only source handing out the views a test gives it (as an attached stream does)."""

    kind = "stream"
    capabilities = Capabilities(can_command=False, has_kv_values=False, has_history=False, has_physical_pool=True,
                                read_only_reason="test views", kv_values_reason="test views")

    def __init__(self, snapshot):
        self.current = snapshot

    @property
    def title(self) -> str:
        return "attached: tier views"

    def latest(self):
        return self.current


def test_the_window_shows_tiers_groups_sources_and_the_window_saving(qtbot):
    window = MainWindow(feed=ViewsFeed(tiered_snapshot()), size=(1600, 1000))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    qtbot.waitUntil(lambda: window.pane.tier_grids.isVisible(), timeout=3000)
    pane = window.pane
    assert list(pane.tier_grids.grids) == ["host", "disk"]
    assert pane.outer.indexOf(pane.tier_grids) == pane.outer.indexOf(pane.split) + 1  # beside the device grid
    assert pane.group_filter.isVisible() and pane.group_filter.count() == 3
    pane.group_filter.setCurrentIndex(2)
    assert pane.grid.group_filter == 1
    qtbot.waitUntil(lambda: window.conversations.model.rowCount() == 2, timeout=3000)
    model = window.conversations.model
    column = model.COLUMNS.index("prompt from")
    assert model.data(model.index(0, column)) == "dev 4 · host 4"
    assert model.data(model.index(1, column)) == "comp 8"
    window.conversations.select_conversation(1)
    detail = window.conversations.detail
    qtbot.waitUntil(lambda: "Per KV cache group" in detail.table_label.text(), timeout=3000)
    assert "0→∅" in detail.table_label.text()
    assert "prompt tokens by source: device 4, host 4, disk 0, computed 0" in detail.title.text()
    qtbot.waitUntil(lambda: window.relocation.groups_label.isVisible(), timeout=3000)
    assert "saved 1 block against full attention" in window.relocation.groups_label.text()
    window.close()


class TextViewsFeed(ViewsFeed):
    """Hand-built views with a tokenizer's text for token ids 1-4."""

    def token_text(self, token_id: int) -> str | None:
        return {1: "The", 2: " pool", 3: " is", 4: " paged"}.get(token_id)


def test_a_clicked_tier_slot_opens_in_the_inspector_with_its_token_text(qtbot):
    """Issue 49: a tier slot's token ids were shown only in a small box under the tier grid while the Inspector
    still said 'Click a cell'."""
    window = MainWindow(feed=TextViewsFeed(tiered_snapshot()), size=(1600, 1000))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    grids = window.pane.tier_grids
    qtbot.waitUntil(lambda: grids.isVisible() and "host" in grids.grids, timeout=3000)
    grids.add_events([(i, e) for i, e in enumerate(tier_events())], tiered_snapshot())
    host = grids.grids["host"]
    qtbot.waitUntil(lambda: host.geometry_ is not None, timeout=3000)
    qtbot.mouseClick(host.view.viewport(), LEFT, pos=host.cell_center(2))
    inspector = window.inspector
    assert inspector.fields["block"].text() == "host slot 2" and inspector.fields["state"].text() == "cached"
    assert inspector.fields["hash"].text() == f"{H0:016x}, group 0"
    assert inspector.fields["owners"].text() == "conversation 1"
    assert inspector.note.text().startswith("Host tier slot 2: ") and "Click a cell" not in inspector.note.text()
    rows = [tuple(inspector.slots.data(inspector.slots.index(r, c)) for c in range(4))
            for r in range(inspector.slots.rowCount())]
    assert [(r[2], r[3]) for r in rows] == [("1", "The"), ("2", "␣pool"), ("3", "␣is"), ("4", "␣paged")]
    assert not inspector.plot.isVisible() and window.grid.selected_block is None
    window.close()


def test_the_device_inspector_says_which_tiers_hold_the_same_content(qtbot):
    from explorer.widgets.inspector import Inspector
    from kvstream.views import BlockInfo, BlockState
    inspector = Inspector()
    qtbot.addWidget(inspector)
    snap = tiered_snapshot()
    inspector.select(0, snap)
    inspector.show_block(BlockInfo(block_id=0, state=BlockState.USED, ref_count=1, num_filled=4, block_size=4,
                                   token_ids=(1, 2, 3, 4), token_texts=("a", "b", "c", "d"), positions=(0, 1, 2, 3),
                                   owners=((1, 0),), block_hash=H0, hash_reason=None, last_owner=1))
    assert inspector.fields["hash"].text() == f"{H0:016x}, group 0; also in host slot 2"


def test_the_device_inspector_names_a_group_ones_hash_as_its_events_do(qtbot):
    """A grouped engine keys a group-1 block by its group's cache key (kvstream.rules.group_key); its events, and
    the event log, name the plain hash and the group. The inspector names it the same way, not by the key."""
    import dataclasses
    from explorer.widgets.inspector import Inspector
    from kvstream.rules import group_key
    from kvstream.views import BlockInfo, BlockState
    inspector = Inspector()
    qtbot.addWidget(inspector)
    snap = tiered_snapshot()
    hashes = np.asarray(snap.block_hash).copy()
    hashes[3] = key = group_key(H5, 1)
    snap = dataclasses.replace(snap, block_hash=hashes)
    inspector.select(3, snap)
    inspector.show_block(BlockInfo(block_id=3, state=BlockState.USED, ref_count=1, num_filled=4, block_size=4,
                                   token_ids=(1, 2, 3, 4), token_texts=("a", "b", "c", "d"), positions=(4, 5, 6, 7),
                                   owners=((1, 1),), block_hash=key, hash_reason=None, last_owner=1))
    assert inspector.fields["hash"].text() == f"{H5:016x}, group 1"


def test_the_blocks_column_counts_every_groups_blocks_and_no_window_holes():
    """Conversation 1 holds (0, 1, 2) in the full group and (-1, 3, 4) in the sliding one: five blocks, not
    group 0's three; a window's -1 is a released place, not a block (nor a read of the pool's last block)."""
    from explorer.widgets.conversations import ConversationsModel, conversation_row
    snap = tiered_snapshot()
    row = conversation_row(snap.conversation(1), snap)
    assert row[4] == 5 and row[5] == 0 and row[6] == "2/4"
    sliding_only = dataclasses.replace(snap, block_tables={1: (-1, 3, 4)},
                                       group_block_tables=({1: (-1, 3, 4)},), kv_cache_groups=snap.kv_cache_groups[1:],
                                       block_group=np.zeros(8, np.int8))
    sliding_only.ref_count[7] = 2  # a shared block elsewhere: table[-1] read as an index would count it
    row = conversation_row(sliding_only.conversation(1), sliding_only)
    assert row[4] == 2 and row[5] == 0
    model = ConversationsModel()
    model.refresh(snap)
    assert model.rows()[0][4] == 5
