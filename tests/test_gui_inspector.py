"""The block inspector on hand-built views and on a real engine: relocation, ids without text, heatmap, size."""
import numpy as np
import pytest

from kvstream.views import BlockInfo, BlockState, PoolSnapshot
from explorer.inspector import Inspector


def info(block_id, state=BlockState.USED, owners=((5, 2),), filled=4, block_size=4, texts=None, keys=True,
         tokens=None):
    tokens = tuple(range(10, 10 + filled)) if tokens is None else tokens
    kv = np.arange(2 * filled * 2 * 3, dtype=np.float32).reshape(2, filled, 2, 3) if keys else None
    return BlockInfo(block_id=block_id, state=state, ref_count=len(owners), num_filled=filled, block_size=block_size,
                     token_ids=tokens,
                     token_texts=tuple(chr(97 + i) for i in range(filled)) if texts is None else texts,
                     positions=tuple(range(8, 8 + filled)), owners=tuple(owners), block_hash=None, hash_note="",
                     last_owner=owners[0][0] if owners else -1, keys=kv, values=None if kv is None else -kv)


def view(tables, num_blocks=64, block_size=4, used=()):
    n = num_blocks
    state = np.zeros(n, np.int8)
    ref = np.zeros(n, np.int32)
    for table in tables.values():
        for b in table:
            state[b] = BlockState.USED
            ref[b] += 1
    return PoolSnapshot(step_id=3, block_size=block_size, num_blocks=n, ref_count=ref,
                        num_filled=np.where(state > 0, block_size, 0).astype(np.int32), state=state,
                        owner=np.full(n, -1, np.int32), last_access=np.zeros(n, np.int64), block_tables=tables,
                        conversations=())


@pytest.fixture
def inspector(qtbot):
    widget = Inspector()
    qtbot.addWidget(widget)
    widget.resize(420, 560)
    widget.show()
    qtbot.waitExposed(widget)
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
    from explorer.inspector import _integer_ticks
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
