"""The block inspector on hand-built views and on a real engine: relocation, ids without text, heatmap, size."""
import dataclasses

import numpy as np
import pytest

from kvstream.views import BlockInfo, BlockState, PoolSnapshot
from explorer.widgets.inspector import Inspector
from test_gui_support import wait_for_snapshot
from tests.helpers import used_blocks


def info(block_id, state=BlockState.USED, owners=((5, 2),), filled=4, block_size=4, texts=None, keys=True,
         tokens=None):
    tokens = tuple(range(10, 10 + filled)) if tokens is None else tokens
    kv = np.arange(2 * filled * 2 * 3, dtype=np.float32).reshape(2, filled, 2, 3) if keys else None
    return BlockInfo(block_id=block_id, state=state, ref_count=len(owners), num_filled=filled, block_size=block_size,
                     token_ids=tokens,
                     token_texts=tuple(chr(97 + i) for i in range(filled)) if texts is None else texts,
                     positions=tuple(range(8, 8 + filled)), owners=tuple(owners), block_hash=None, hash_reason=None,
                     last_owner=owners[0][0] if owners else -1, keys=kv, values=None if kv is None else -kv)


def view(tables, num_blocks=64, block_size=4, used=()):
    n = num_blocks
    state, ref = used_blocks(tables, n)
    return PoolSnapshot(step_id=3, block_size=block_size, num_blocks=n, ref_count=ref,
                        num_filled=np.where(state > 0, block_size, 0).astype(np.int32), state=state,
                        owner=np.full(n, -1, np.int32), last_access=np.zeros(n, np.int64), block_tables=tables,
                        conversations=())


@pytest.fixture
def inspector(qtbot, shown):
    widget = shown(Inspector(), 420, 560)
    return widget


def test_selection_follows_a_relocation_and_says_so(inspector):
    before = view({5: (7, 9, 35)})
    inspector.select(35, before)
    inspector.show_block(info(35))
    assert "in use by conversation 5" in inspector.note.text()
    assert inspector.follow_relocation({7: 40, 9: 3, 35: 12, 12: 50}) == 12
    assert inspector.block_id == 12 and "moved from 35 to 12" in inspector.note.text()
    inspector.show_block(info(35, BlockState.FREE, owners=()))  # a late answer about the old id: ignored
    inspector.show_summary(view({5: (40, 3, 12)}))
    inspector.show_block(info(12))  # the engine's answer for the new id: same content
    note = inspector.note.text()
    assert "moved from 35 to 12" in note and "in use by conversation 5" in note and "freed" not in note
    assert inspector.fields["block"].text() == "12 (moved from 35)"
    assert [row[2] for row in inspector.slot_rows()] == [10, 11, 12, 13]
    assert inspector.follow_relocation({1: 2}) is None  # a move that did not touch the selection
    inspector.select(20, before)
    assert inspector.moved_from is None and inspector.fields["block"].text() == "20"


def test_a_block_whose_content_moved_is_not_said_to_be_freed(inspector):
    """Without the relocation event (the defect: 'conversation 5 released it' while 5 was still running)."""
    inspector.select(35, view({5: (7, 9, 35)}))
    inspector.show_block(info(35))
    inspector.show_summary(view({5: (40, 3, 12)}))  # after the move: conversation 5's logical block 2 is block 12
    inspector.show_block(info(35, BlockState.FREE, owners=()))
    note = inspector.note.text()
    assert "freed" not in note and "released it" not in note
    assert "did not release" in note and "logical block 2 is in block 12" in note
    inspector.show_summary(view({}))  # really released now (say conversation 6 held it and ended)
    inspector.select(36, view({6: (36,)}))
    inspector.show_block(info(36, owners=((6, 0),)))
    inspector.show_summary(view({}))
    inspector.show_block(info(36, BlockState.FREE, owners=()))
    assert "has been freed: conversation 6 released it" in inspector.note.text()


def test_tokens_without_text_show_as_ids(inspector):
    inspector.select(4, view({1: (4,)}))
    inspector.show_block(info(4, owners=((1, 0),), texts=("", "", "", ""), tokens=(12, 7, 99, 3)))
    assert [row[3] for row in inspector.slot_rows()] == ["<12>", "<7>", "<99>", "<3>"]
    inspector.select(5, view({1: (5,)}))
    inspector.show_block(info(5, owners=((1, 0),), texts=(), tokens=(1, 2, 3, 4)))  # a source with no texts at all
    assert [row[3] for row in inspector.slot_rows()] == ["<1>", "<2>", "<3>", "<4>"]


def test_a_source_without_kv_says_so_instead_of_a_heatmap(inspector):
    inspector.select(4, view({1: (4,)}))
    inspector.show_block(info(4, owners=((1, 0),), keys=False))
    assert inspector.kv_note.isVisible() and "keeps its K/V values to itself" in inspector.kv_note.text()
    assert not inspector.plot.isVisible()
    inspector.show_block(info(4, owners=((1, 0),), filled=3))
    assert not inspector.kv_note.isVisible() and inspector.plot.isVisible()


def ticks(inspector, side):
    major, _minor = inspector.plot.getAxis(side)._tickLevels
    return [label for _, label in major]


def test_integer_ticks_label_as_densely_as_the_size_allows():
    from explorer.widgets.inspector import _integer_ticks
    major, minor = _integer_ticks(16, 400, 14)  # 25 px per slot: every slot labelled
    assert major == [(i + 0.5, str(i)) for i in range(16)] and minor == []
    major, minor = _integer_ticks(16, 100, 14)  # 6.25 px per slot: every 4th
    assert [label for _, label in major] == ["0", "4", "8", "12"] and len(minor) == 12
    assert _integer_ticks(1, 5, 14)[0] == [(0.5, "0")]  # block size 1, however small: one whole slot


def test_heatmap_ticks_are_whole_slots_and_follow_the_block_size(inspector):
    inspector.select(0, view({1: (0,)}, block_size=1))
    inspector.show_block(info(0, owners=((1, 0),), filled=1, block_size=1))
    assert ticks(inspector, "left") == ["0"]  # block size 1: one slot, no fractional ticks
    assert ticks(inspector, "bottom") == ["0", "1", "2"]  # head dim 3
    assert inspector.heat_title.text().startswith("K of layer 0, kv head 0: 1 of 1 slots")
    assert inspector.plot.getViewBox().viewRange()[1] == [0, 1]
    inspector.select(1, view({1: (1,)}, block_size=8))  # after a restart with blocks of 8
    inspector.show_block(info(1, owners=((1, 0),), filled=5, block_size=8))
    labels = ticks(inspector, "left")  # whole slots, as many as fit 14 px apart
    height = inspector.plot.getViewBox().height()
    assert labels == [str(i) for i in range(0, 8, int(labels[1]) if len(labels) > 1 else 8)]
    assert height / 8 * (8 / len(labels)) >= 14 and inspector.plot.getViewBox().viewRange()[1] == [0, 8]
    inspector.select(2, view({1: (2,)}, block_size=16))
    inspector.show_block(info(2, owners=((1, 0),), filled=16, block_size=16))
    assert ticks(inspector, "left")[0] == "0" and all(t.isdigit() for t in ticks(inspector, "left"))
    low, high = inspector.colorbar.levels()
    keys = info(2, filled=16, block_size=16).keys[0, :, 0, :]
    assert (low, high) == (float(keys.min()), float(keys.max()))  # the colour bar spans the shown values


def test_slot_table_shows_a_whole_block_of_16(qtbot, inspector):
    inspector.select(2, view({1: (2,)}, block_size=16))
    inspector.show_block(info(2, owners=((1, 0),), filled=16, block_size=16))
    inspector.resize(400, inspector.sizeHint().height())  # what a scroll area (the window's dock) gives it
    qtbot.wait(20)
    assert inspector.visible_slot_rows() >= 16 and inspector.height() <= 640
    inspector.resize(400, 480)  # smaller: most of a block, with a scroll bar
    qtbot.wait(20)
    assert inspector.visible_slot_rows() >= 12


def test_real_relocation_keeps_the_selected_content(inspector):
    from engine import Engine, EngineConfig
    from kvstream.events import EventKind
    engine = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=4))
    cid = engine.add_conversation("Pages are not addresses.", max_new_tokens=20)
    for _ in range(4):
        engine.step()
    snap = engine.snapshot()
    block = snap.block_tables[cid][1]
    inspector.select(block, snap)
    before = engine.inspect_block(block)
    inspector.show_block(before)
    engine.take_events()
    engine.relocate_blocks(seed=3)
    moved = [e for e in engine.take_events() if e.kind == EventKind.RELOCATED]
    assert len(moved) == 1
    mapping = dict(zip(moved[0].block_ids, moved[0].new_block_ids))
    new = inspector.follow_relocation(mapping)
    assert new == mapping[block] != block
    after = engine.snapshot()
    inspector.show_summary(after)
    inspector.show_block(engine.inspect_block(new))
    assert f"moved from {block} to {new}" in inspector.note.text() and "freed" not in inspector.note.text()
    assert [r[1:3] for r in inspector.slot_rows()] == list(zip(before.positions, before.token_ids))
    assert after.block_tables[cid][1] == new


def test_select_with_moved_from_keeps_the_story(inspector):
    """The window may move the selection itself (select(new, view, moved_from=old)) instead of follow_relocation."""
    inspector.select(35, view({5: (7, 9, 35)}))
    inspector.show_block(info(35))
    inspector.select(12, view({5: (40, 3, 12)}), moved_from=35)
    assert inspector.fields["block"].text() == "12 (moved from 35)"
    inspector.show_block(info(12))
    assert "moved from 35 to 12" in inspector.note.text() and "freed" not in inspector.note.text()


# ---- a past step is described as of that step (issue 33) --------------------------------------------------------------
def test_a_past_step_is_not_described_against_a_later_one(inspector):
    """Issue 33: 'Block 62 has been freed: conversation 5 released it' at step 120, though conversation 5 arrived at
    step 241. Seen live first, then a frame from before its owner came: the note says what the block was then."""
    inspector.select(62, view({5: (62,)}))  # live: conversation 5 holds block 62
    assert "in use by conversation 5" in inspector.note.text()
    inspector.show_summary(view({}), seq=120)  # a frame from before conversation 5: block 62 is free
    note = inspector.note.text()
    assert "released" not in note and "freed" not in note and "conversation 5" not in note, note
    assert note == "Block 62 is free: no conversation refers to it and it holds nothing reusable."
    inspector.show_block(info(62, BlockState.FREE, owners=()))  # the frame's own details agree
    assert "conversation 5" not in inspector.note.text()
    inspector.show_summary(view({5: (62,)}), seq=130)  # forward again: now a change is news
    assert "in use again, now by conversation 5" in inspector.note.text()
    inspector.show_summary(view({}), seq=140)
    assert "has been freed: conversation 5 released it" in inspector.note.text()
    inspector.show_summary(view({}), seq=125)  # same facts as the note's, but of an earlier frame
    assert inspector.note.text().startswith("Block 62 is free:"), inspector.note.text()


def test_a_step_before_the_relocation_is_not_said_to_be_moved(inspector):
    """Issue 33: 'moved from 13 by a relocation' shown at a step before the relocation. The frames from before the
    relocation describe block 12 as it was then; the frames after it say the move again."""
    inspector.select(35, view({5: (7, 9, 35)}))
    assert inspector.follow_relocation({7: 40, 9: 3, 35: 12, 12: 50}, seq=500) == 12
    inspector.show_summary(view({5: (40, 3, 12)}))  # live, after the move
    assert "moved from 35 to 12" in inspector.note.text()
    assert inspector.fields["block"].text() == "12 (moved from 35)"
    inspector.show_summary(view({6: (12,)}), seq=300)  # before the relocation block 12 was conversation 6's
    note = inspector.note.text()
    assert "moved" not in note and "relocation" not in note and "in use by conversation 6" in note, note
    assert inspector.fields["block"].text() == "12"
    inspector.show_summary(view({5: (40, 3, 12)}), seq=500)  # the relocation's own frame
    assert "moved from 35 to 12" in inspector.note.text() and inspector.fields["block"].text() == "12 (moved from 35)"


# ---- the block's own history, in short, under the owners -------------------------------------------------------------
def test_inspector_lists_the_newest_lines_of_the_blocks_history(qtbot, inspector):
    """Issue 10: "the inspector of a block lists the block's own history"; it lived only in the Block history dock,
    tabbed behind the inspector. The inspector now lists the dock view's newest lines, each a link to its frame."""
    from explorer.widgets.block_history_view import BlockHistoryView
    from explorer.widgets.inspector import HISTORY_LINES
    from kvstream.events import BlockEvent, EventKind
    from test_block_history import story
    history = BlockHistoryView()
    qtbot.addWidget(history)
    inspector.follow_history(history)
    inspector.follow_history(history)  # again (the window may wire it too): still one connection
    inspector.select(12, view({4: (12,)}, num_blocks=16))
    history.set_block(12, story())
    assert inspector.history.isVisible() and len(inspector.history_lines) == HISTORY_LINES
    assert inspector.history_lines == history.lines[-HISTORY_LINES:]
    text = inspector.history.text()
    assert "5 earlier in Block history" in text and "step 7</a>: " in text and "evicted" in text, text
    inspector.resize(300, 560)  # a narrow dock: one line an event, cut with '…', the whole in the tooltip
    qtbot.wait(20)
    label = inspector.history
    rows = (HISTORY_LINES + 1) * label.fontMetrics().lineSpacing()  # the events and "5 earlier ..."
    assert label.heightForWidth(label.width()) <= rows + 4 and "…" in label.text()
    assert all(f"step {line.step_id}: {line.text}" in label.toolTip() for line in inspector.history_lines)
    with qtbot.waitSignal(history.lineActivated) as jumped:  # a click on a line's link: the dock's own jump
        inspector.history.linkActivated.emit(f"{history.lines[-1].seq}:{history.lines[-1].step_id}")
    assert jumped.args == [history.lines[-1].seq, history.lines[-1].step_id]
    history.add_lines([history.lines[-1]._replace(seq=9, step_id=8, text="freed <again>")], history.total + 1)
    assert inspector.history_lines[-1].step_id == 8 and "freed &lt;again&gt;" in inspector.history.text()
    assert "6 earlier" in inspector.history.text()
    inspector.select(3, view({4: (3,)}, num_blocks=16))  # another block: its lines are not block 12's
    assert not inspector.history.isVisible() and inspector.history_lines == []
    history.set_block(3, [(1, BlockEvent(1, EventKind.ALLOCATED, 4, (3,)))])
    assert inspector.history.isVisible() and "earlier" not in inspector.history.text()
    history.set_block(3, ())  # nothing kept: no row at all
    assert not inspector.history.isVisible()
    inspector.select(None, None)
    assert not inspector.history.isVisible()


def test_in_the_window_the_inspector_shows_the_docks_newest_lines_and_jumps(qtbot, make_window):
    """With a real engine and history: select a block, the inspector lists the Block history dock's newest lines
    as the engine decodes, and a click on one shows that frame."""
    window = make_window(setup=lambda e: e.add_conversation("History in the inspector, please.", max_new_tokens=60,
                                                           temperature=0.0), paused=True, history=True)
    window.inspector.follow_history(window.block_history)  # what the window wires (a second call changes nothing)

    def partial_tail(s):  # a tail block still filling: it will be full and hashed a few steps on
        table = next(iter(s.block_tables.values()), ())
        return bool(table) and int(s.num_filled[table[-1]]) < s.block_size

    for _ in range(3):
        window.runner.step_once()
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 3)
    while not partial_tail(window.snapshot):
        step = window.snapshot.step_id
        window.runner.step_once()
        wait_for_snapshot(qtbot, window, lambda s: s.step_id > step)
    tail = next(iter(window.snapshot.block_tables.values()))[-1]
    window.select_block(tail)
    inspector, dock = window.inspector, window.block_history
    qtbot.waitUntil(lambda: dock.block_id == tail and bool(dock.lines and inspector.history_lines), timeout=3000)
    shown = len(dock.lines)
    for _ in range(window.snapshot.block_size):  # until the tail block fills and is hashed: a new line, live
        window.runner.step_once()
    qtbot.waitUntil(lambda: len(dock.lines) > shown, timeout=5000)
    assert inspector.history.isVisible() and inspector.history_lines == dock.lines[-len(inspector.history_lines):]
    first = inspector.history_lines[0]
    inspector.history.linkActivated.emit(f"{first.seq}:{first.step_id}")
    qtbot.waitUntil(lambda: window.source.viewing == first.seq, timeout=3000)
    assert window.snapshot.step_id == first.step_id


def test_a_cached_block_whose_positions_are_unknown_says_so(inspector):
    """A recording's cached block whose last holder no longer lists it: its tokens are known from the block's STORED
    event, its positions are not; the slot table shows "?" there, not -1 (seen in the X window)."""
    cached = dataclasses.replace(info(6, state=BlockState.CACHED, owners=(), keys=False), positions=(-1,) * 4)
    inspector.select(6, view({}))
    inspector.show_block(cached)
    assert [row[1] for row in inspector.slot_rows()] == ["?"] * 4
    assert [row[2] for row in inspector.slot_rows()] == [10, 11, 12, 13]


def test_the_whole_heatmap_shows_in_the_inspector_dock_at_1920x1080(qtbot, make_window):
    """Issue 49: the dock's scroll area made the inspector as tall as its preferred height, and at 1920x1080 the
    heatmap's lower rows (8-15 of 16) were below the dock's edge. It now takes the dock's height."""
    def one(engine):
        engine.add_conversation("Write a poem about memory pages and more words here", max_new_tokens=40)
    window = make_window(setup=one, paused=True, num_blocks=128, block_size=16, size=(1918, 1055))
    for _ in range(3):
        window.runner.step_once()
    qtbot.waitUntil(lambda: window.snapshot is not None and window.snapshot.step_id >= 3, timeout=5000)
    window.select_block(0)
    inspector = window.inspector
    qtbot.waitUntil(lambda: inspector.info is not None and inspector.info.keys is not None
                    and inspector.plot.isVisible(), timeout=5000)
    viewport = inspector.parentWidget()  # the dock's scroll area's viewport
    qtbot.waitUntil(lambda: inspector.plot.mapTo(viewport, inspector.plot.rect().bottomLeft()).y()
                    <= viewport.height(), timeout=3000)
    assert inspector.height() <= viewport.height()
