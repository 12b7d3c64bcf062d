"""A block's own history from block events (explorer.model.block_history), followed through relocations."""
import pytest
from PySide6 import QtCore

from kvstream.events import BlockEvent, EventKind, PoolModel
from explorer.widgets.block_history_view import MAX_LINES, BlockHistoryView
from explorer.model.block_history import BlockStory, HistoryLine, block_history

K = EventKind


def story():
    """(seq, event) pairs of a small pool's life; replayed onto a PoolModel so the story is one a pool can have."""
    events = [
        (1, BlockEvent(1, K.ALLOCATED, 1, (5, 6))),
        (2, BlockEvent(2, K.STORED, 1, (5,), block_hashes=(0xABC,), token_ids=(1, 2, 3, 4))),
        (3, BlockEvent(3, K.CONVERSATION_ADDED, 2, other_id=1, reason="fork")),
        (3, BlockEvent(3, K.SHARED, 2, (5, 6), other_id=1, reason="fork")),
        (4, BlockEvent(4, K.COPIED_ON_WRITE, 2, (6,), (9,))),
        (5, BlockEvent(4, K.RELOCATED, -1, (5, 6, 9), (12, 3, 5))),  # a frame of its own between steps
        (6, BlockEvent(5, K.CONVERSATION_FINISHED, 1, reason="length")),
        (6, BlockEvent(5, K.RELEASED, 1, (12,))),
        (6, BlockEvent(5, K.FREED, 1, (3,))),
        (7, BlockEvent(6, K.CONVERSATION_ENDED, 2)),
        (7, BlockEvent(6, K.CACHED, 2, (12,))),
        (7, BlockEvent(6, K.FREED, 2, (5,))),
        (8, BlockEvent(7, K.EVICTED, 4, (12,), block_hashes=(0xABC,))),
        (8, BlockEvent(7, K.ALLOCATED, 4, (12,))),
    ]
    pool = PoolModel(16)
    for _, e in events:
        pool.apply(e)  # raises on an impossible event
    return events


def texts(lines):
    return [(line.seq, line.step_id, line.text) for line in lines]


def test_follows_content_through_relocation():
    lines = block_history(story(), 12)
    assert all(isinstance(line, HistoryLine) for line in lines)
    assert texts(lines) == [
        (1, 1, "allocated to conversation 1"),
        (2, 2, "full and hashed for conversation 1 (hash 0000000000000abc): a prompt with this prefix can reuse it"),
        (3, 3, "shared with conversation 2, a fork of conversation 1"),
        (5, 4, "moved from 5 to 12 (every block moved)"),
        (6, 5, "conversation 1 let go of it; others still hold it"),
        (7, 6, "conversation 2 let go of it: free, KV kept cached for reuse"),
        (8, 7, "evicted: its cached KV dropped so conversation 4 could have it"),
        (8, 7, "allocated to conversation 4"),
    ]


def test_copy_on_write_from_both_sides():
    events = story()
    assert texts(block_history(events, 3)) == [
        (1, 1, "allocated to conversation 1"),
        (3, 3, "shared with conversation 2, a fork of conversation 1"),
        (4, 4, "conversation 2 wrote into it while shared: copied to block 9, which conversation 2 holds instead"),
        (5, 4, "moved from 6 to 3 (every block moved)"),
        (6, 5, "conversation 1 let go of it: free"),
    ]
    assert texts(block_history(events, 5))[:2] == [
        (4, 4, "made for conversation 2 as a copy of block 6 (copy on write)"),
        (5, 4, "moved from 9 to 5 (every block moved)"),
    ]


def test_history_of_an_earlier_frame_uses_that_frames_ids():
    before_move = [(s, e) for s, e in story() if s <= 4]
    assert [t for _, _, t in texts(block_history(before_move, 5))][:1] == ["allocated to conversation 1"]


def test_a_block_whose_content_moved_away_starts_over():
    events = story()
    # Block 6's content went to 3 at the relocation; nothing moved into 6, so its story before is another's.
    assert texts(block_history(events, 6)) == [
        (5, 4, "every block moved: what block 6 held went to block 3; nothing moved in")]
    assert texts(block_history(events, 0)) == [(5, 4, "every block moved; block 0 was free and stayed free")]


def test_prefix_hits_preemption_and_reset():
    events = [
        (1, BlockEvent(1, K.ALLOCATED, 1, (2,))),
        (1, BlockEvent(1, K.STORED, 1, (2,), block_hashes=(7,))),
        (2, BlockEvent(2, K.SHARED, 3, (2,), reason="prefix_hit")),
        (3, BlockEvent(3, K.PREEMPTED, 3, (2,))),
        (3, BlockEvent(3, K.RELEASED, 3, (2,))),
        (4, BlockEvent(4, K.CACHED, 1, (2,))),
        (5, BlockEvent(5, K.CLEARED)),
        (6, BlockEvent(6, K.CLEARED)),  # nothing left to drop: no line
    ]
    pool = PoolModel(4)
    for _, e in events:
        pool.apply(e)
    assert [t for _, _, t in texts(block_history(events, 2))] == [
        "allocated to conversation 1",
        "full and hashed for conversation 1 (hash 0000000000000007): a prompt with this prefix can reuse it",
        "conversation 3 reused it for its prompt (prefix cache hit)",
        "conversation 3 preempted: lost it (to be recomputed)",
        "conversation 3 let go of it; others still hold it",
        "conversation 1 let go of it: free, KV kept cached for reuse",
        "prefix cache cleared: its hash dropped",
    ]


def test_bad_input():
    with pytest.raises(ValueError, match="block id"):
        block_history(story(), -1)
    with pytest.raises(ValueError, match="block id"):
        block_history(story(), True)
    with pytest.raises(TypeError, match="BlockEvent"):
        block_history([(1, "allocated")], 3)


def test_widget_lists_lines_and_emits_on_click(qtbot):
    view = BlockHistoryView()
    qtbot.addWidget(view)
    view.resize(300, 240)
    view.set_block(12, story())
    assert view.list.count() == 8 and "Block 12: 8 events" in view.title.text()
    assert view.list.item(3).text() == "step 4: moved from 5 to 12 (every block moved)"
    item = view.list.item(3)
    rect = view.list.visualItemRect(item)
    with qtbot.waitSignal(view.lineActivated) as blocker:
        qtbot.mouseClick(view.list.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=rect.center())
    assert blocker.args == [5, 4]
    with pytest.raises(ValueError):
        view.set_block(-3, story())
    assert view.block_id == 12 and view.list.count() == 8  # bad input changed nothing
    view.set_block(None)
    assert view.list.count() == 0 and "select a block" in view.title.text()
    many = [(i, BlockEvent(i, K.ALLOCATED if i % 2 == 0 else K.FREED, 1, (0,))) for i in range(MAX_LINES + 100)]
    view.set_block(0, many)
    assert view.list.count() == MAX_LINES and "the newest 500 listed" in view.title.text()
    assert view.list.item(MAX_LINES - 1).text().startswith(f"step {MAX_LINES + 99}:")



def test_a_story_extended_frame_by_frame_reads_as_one_computed_at_once():
    events = story()
    relocation = next(i for i, (_, e) in enumerate(events) if e.kind == K.RELOCATED)
    for block in (12, 3, 7):  # 12 and 3 are where content moved to; 7 was free all along
        live = BlockStory(block, events[:relocation + 1])
        for k in range(relocation + 1, len(events)):
            assert live.extend(events[k:k + 1]) is not None
        assert live.lines == block_history(events, block)
    before = BlockStory(5, events[:relocation])  # what 5 held moves to 12: the story cannot go on as block 5
    assert before.extend(events[relocation:]) is None and before.lines == block_history(events[:relocation], 5)
    with pytest.raises(TypeError, match="BlockEvent"):
        before.extend([(9, "freed")])
    many = [(i, BlockEvent(i, K.ALLOCATED if i % 2 == 0 else K.FREED, 1, (0,))) for i in range(40)]
    bounded = BlockStory(0, many[:30], limit=25)
    assert bounded.extend(many[30:]) == block_history(many, 0)[30:]
    assert bounded.lines == block_history(many, 0)[-25:] and bounded.dropped == 15 and bounded.total == 40


def test_widget_appends_new_lines_without_rebuilding(qtbot):
    view = BlockHistoryView()
    qtbot.addWidget(view)
    many = [(i, BlockEvent(i, K.ALLOCATED if i % 2 == 0 else K.FREED, 1, (0,))) for i in range(MAX_LINES + 10)]
    live = BlockStory(0, many[:MAX_LINES - 5])
    view.show_story(0, live)
    first = view.list.item(0)
    assert view.list.count() == MAX_LINES - 5 and f"Block 0: {MAX_LINES - 5} events" in view.title.text()
    view.add_lines(live.extend(many[MAX_LINES - 5:MAX_LINES - 2]), live.total)
    assert view.list.item(0) is first and view.list.count() == MAX_LINES - 2  # appended, nothing rebuilt
    view.add_lines(live.extend(many[MAX_LINES - 2:]), live.total)
    assert view.list.count() == MAX_LINES and "510 events; the newest 500 listed" in view.title.text()
    assert view.list.item(MAX_LINES - 1).text().startswith(f"step {MAX_LINES + 9}:")
    assert view.list.item(0).text().startswith("step 10:")


def test_widget_says_when_its_block_or_lines_change(qtbot):
    """The inspector's short form follows the view through ``changed``: a new block, new lines, no block."""
    view = BlockHistoryView()
    qtbot.addWidget(view)
    seen = []
    view.changed.connect(lambda: seen.append((view.block_id, len(view.lines), view.total)))
    view.set_block(12, story())
    view.add_lines([HistoryLine(9, 8, "freed")], 9)
    view.add_lines([])  # nothing new: nothing said
    view.set_block(None)
    assert seen == [(12, 8, 8), (12, 9, 9), (None, 0, 0)]


@pytest.fixture(scope="module")
def real():
    from tests.event_workload import engine_frames
    return engine_frames()


def test_real_engine_histories_agree_with_the_pool(real):
    """Replaying each block's own events (followed through the relocation) gives exactly the references the
    engine's block tables hold at the end, for every block of the pool."""
    from collections import Counter

    from explorer.model.block_history import block_events
    eng, pairs = real
    snap = eng.snapshot()
    held = Counter(b for table in snap.block_tables.values() for b in table)
    kinds = {e.kind for _, e in pairs}
    assert {K.RELOCATED, K.COPIED_ON_WRITE, K.EVICTED, K.PREEMPTED, K.SHARED} <= kinds  # the workload did its job
    moved = 0
    for block in range(snap.num_blocks):
        holders = Counter()
        for _, e, bid in block_events(pairs, block):
            if e.kind == K.ALLOCATED:
                holders = Counter({e.conversation_id: 1})
            elif e.kind == K.SHARED:
                holders[e.conversation_id] += e.block_ids.count(bid)
            elif e.kind == K.COPIED_ON_WRITE:
                if bid == e.new_block_ids[0]:
                    holders = Counter({e.conversation_id: 1})
                else:
                    holders[e.conversation_id] -= 1
            elif e.kind in (K.RELEASED, K.CACHED, K.FREED):
                holders[e.conversation_id] -= e.block_ids.count(bid)
            elif e.kind == K.EVICTED:
                holders = Counter()
            elif e.kind == K.RELOCATED:
                moved += bid in e.new_block_ids
        assert sum(holders.values()) == held[block] == int(snap.ref_count[block]), block
        lines = block_history(pairs, block)
        assert all(line.text for line in lines)
        assert [line.seq for line in lines] == sorted(line.seq for line in lines)
    assert moved == len(next(e for _, e in pairs if e.kind == K.RELOCATED).block_ids)
