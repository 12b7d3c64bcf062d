"""The event log dock (explorer.widgets.eventlog), offscreen: lines in words, notable kinds by default, filters by kind,
conversation and block, the row cap, clicking a line, and bad input refused without change."""
import pytest
from PySide6 import QtCore

from kvstream.events import NOTABLE_KINDS, BlockEvent, EventKind
from explorer.widgets.eventlog import EventLog, EventLogModel, LogFilter, parse_ids

K = EventKind
LEFT = QtCore.Qt.MouseButton.LeftButton


def frames():
    """(seq, event) pairs of a few frames: allocations every step, a fork, a copy-on-write, a relocation."""
    return [
        (1, BlockEvent(10, K.CONVERSATION_ADDED, 3)),
        (1, BlockEvent(10, K.ALLOCATED, 3, (4, 9))),
        (2, BlockEvent(11, K.ALLOCATED, 3, (17,))),
        (3, BlockEvent(12, K.CONVERSATION_ADDED, 7, other_id=3, reason="fork")),
        (3, BlockEvent(12, K.SHARED, 7, (4, 9, 17), other_id=3, reason="fork")),
        (4, BlockEvent(13, K.COPIED_ON_WRITE, 7, (17,), (42,))),
        (5, BlockEvent(13, K.RELOCATED, -1, (4, 9, 17, 42), (30, 31, 32, 33))),  # its own frame, same step
        (6, BlockEvent(14, K.CONVERSATION_FINISHED, 3, reason="eos")),
        (6, BlockEvent(14, K.RELEASED, 3, (30, 31))),
        (6, BlockEvent(14, K.FREED, 3, (32,))),
    ]


@pytest.fixture
def log(qtbot, shown):
    dock = shown(EventLog(), 320, 400)
    dock.append_events(frames())
    return dock


def texts(dock):
    m = dock.model
    return [m.data(m.index(r, 1)) for r in range(m.rowCount())]


def test_notable_lines_in_words_by_default(log):
    assert texts(log) == [
        "conversation 3 added",
        "conversation 7 forked from 3, shares blocks 4, 9, 17",
        "block 17 copied on write to 42 for conversation 7",
        "every block moved: 4 blocks to new ids",
        "conversation 3 finished (end-of-sequence), let go of blocks 30, 31, 32: 1 freed, 2 still held by others",
    ]
    m = log.model
    assert [m.data(m.index(r, 0)) for r in range(m.rowCount())] == ["10", "12", "13", "13", "14"]
    assert log.model.num_events == 10 and len(log.model.entries) == 7  # fork and finish merged into one line each
    assert log.status.text() == "showing 5 of 7 lines"
    assert "frame 3" in m.data(m.index(1, 1), QtCore.Qt.ItemDataRole.ToolTipRole)


def test_kinds_menu_shows_allocations_on_demand(qtbot, log):
    log.kinds_menu.kind_actions[K.ALLOCATED].setChecked(True)  # ticking it in the menu applies at once
    assert "conversation 3 took new blocks 4, 9" in texts(log) and len(texts(log)) == 7
    assert log.status.text() == "7 lines"
    log.kinds_menu.set_kinds([K.COPIED_ON_WRITE])
    assert texts(log) == ["block 17 copied on write to 42 for conversation 7"]
    log.kinds_menu.set_kinds([K.FREED])  # a merged line shows under any of its events' kinds
    assert texts(log) == [texts(log)[0]] and texts(log)[0].startswith("conversation 3 finished")
    log.kinds_menu.set_kinds(())
    assert texts(log) == [] and "none match the filter" in log.status.text()


def test_typing_a_conversation_or_block_filters(qtbot, log):
    qtbot.keyClicks(log.conversation_edit, "7")
    qtbot.waitUntil(lambda: log.model.filter.conversations == {7}, timeout=2000)
    assert texts(log) == ["conversation 7 forked from 3, shares blocks 4, 9, 17",
                          "block 17 copied on write to 42 for conversation 7"]
    log.conversation_edit.clear()
    log.set_filter(kinds=list(K), blocks="42")
    assert texts(log) == ["block 17 copied on write to 42 for conversation 7", "every block moved: 4 blocks to new ids"]
    log.set_filter(blocks=[4, 32])
    assert len(texts(log)) == 4  # allocation of 4, the fork, the relocation, the finish (32)


def test_bad_filter_text_is_marked_and_changes_nothing(qtbot, log):
    log.set_filter(conversations="7")
    before = texts(log)
    log.conversation_edit.setText("7, seven")
    log.apply_filters()
    assert texts(log) == before and log.model.filter.conversations == {7}
    assert "not a conversation id: 'seven'" in log.status.text()
    assert "e0524a" in log.conversation_edit.styleSheet()
    log.conversation_edit.setText("3")
    log.apply_filters()
    assert log.model.filter.conversations == {3} and "not a" not in log.status.text()
    assert log.conversation_edit.styleSheet() == ""
    assert parse_ids(" 1, 2 3 ", "block") == {1, 2, 3} and parse_ids("", "block") is None
    with pytest.raises(ValueError, match="not a block id: '-1'"):
        parse_ids("-1", "block")


def test_clicking_a_line_asks_to_jump_there(qtbot, log):
    def click(row):
        rect = log.view.visualRect(log.model.index(row, 1))
        with qtbot.waitSignal(log.eventActivated) as blocker:
            qtbot.mouseClick(log.view.viewport(), LEFT, pos=rect.center())
        return blocker.args

    assert click(1) == [3, 12, 7, 4]  # the fork: its frame, step, the new conversation, its first shared block
    assert click(2) == [4, 13, 7, 42]  # copy-on-write: the copy the conversation holds now
    assert click(3) == [5, 13, -1, -1]  # relocation: pool-wide
    log.set_filter(blocks="17")
    row = texts(log).index("every block moved: 4 blocks to new ids")
    assert click(row) == [5, 13, -1, 32]  # filtered for block 17: where 17 went
    log.set_filter(blocks="", conversations="3")
    assert click(1) == [3, 12, 3, 4]  # the fork names 3 as its parent: the filtered conversation is selected
    log.view.setFocus()
    log.view.setCurrentIndex(log.model.index(0, 1))
    with qtbot.waitSignal(log.eventActivated) as blocker:
        qtbot.keyClick(log.view, QtCore.Qt.Key.Key_Return)
    assert blocker.args == [1, 10, 3, -1]


def test_row_cap_drops_the_oldest_and_says_so(qtbot, qtmodeltester):
    dock = EventLog(max_rows=50)
    qtbot.addWidget(dock)
    qtmodeltester.check(dock.model)
    for seq in range(1, 31):  # 30 frames of 9 events: the engine at a few hundred events a second
        events = [BlockEvent(seq, K.ALLOCATED, c, (seq * 10 + c,)) for c in range(8)]
        events.append(BlockEvent(seq, K.EVICTED, 1, (seq,), block_hashes=(seq,)))
        dock.append_frame(seq, events)
    m = dock.model
    assert len(m.entries) == 50 and m.base == 270 - 50 and m.num_events == 270
    assert [m.entry(r)[0] for r in range(m.rowCount())] == list(range(25, 31))  # the evictions left in the cap
    assert dock.status.text() == "showing 6 of 50 lines · oldest 220 dropped (keeps the newest 50)"
    dock.set_filter(kinds=[K.ALLOCATED])
    # 9 lines a frame: the 221st of 270 is frame 25's fifth allocation.
    assert m.rowCount() == 44 and m.entry(0)[1].text == "conversation 4 took new block 254"
    qtmodeltester.check(m)
    dock.clear()
    assert m.rowCount() == 0 and dock.status.text() == "No events yet."


def test_a_long_history_at_once_words_only_the_lines_it_keeps(qtbot, monkeypatch):
    """Opening a long recording hands the log every event at once: it words only the newest frames that fill its
    cap, and ends up with the same lines as when the frames came one by one."""
    import explorer.widgets.eventlog as eventlog_module
    pairs = []
    for seq in range(1, 301):
        pairs += [(seq, BlockEvent(seq, K.ALLOCATED, c, (seq * 10 + c,))) for c in range(8)]
        pairs.append((seq, BlockEvent(seq, K.EVICTED, 1, (seq,), block_hashes=(seq,))))
    one_by_one = EventLogModel(max_rows=50)
    for seq in range(1, 301):
        one_by_one.append([p for p in pairs if p[0] == seq])
    worded = []
    real_group = eventlog_module.group
    monkeypatch.setattr(eventlog_module, "group",
                        lambda events, served=(): worded.append(len(events)) or real_group(events, served))
    dock = EventLog(max_rows=50)
    qtbot.addWidget(dock)
    dock.append_events(pairs)
    m = dock.model
    assert [(s, line.text) for s, line in m.entries] == [(s, line.text) for s, line in one_by_one.entries]
    assert m.num_events == 2700 and sum(worded) == 6 * 9  # 6 frames of 9 lines fill 50; the other 294 unworded
    assert dock.status.text() == "showing 6 of 50 lines · 2,646 older events and 4 lines dropped (keeps the newest 50)"
    with pytest.raises(TypeError, match="BlockEvent"):  # an old bad item is still refused, and changes nothing
        dock.append_events([(1, "evicted")] + pairs)
    assert m.num_events == 2700


def test_bad_input_changes_nothing(log):
    before = (texts(log), len(log.model.entries), log.model.num_events)
    with pytest.raises(TypeError, match="BlockEvent"):
        log.append_events([(7, BlockEvent(15, K.EVICTED, 1, (3,))), (7, "evicted")])
    assert (texts(log), len(log.model.entries), log.model.num_events) == before
    with pytest.raises(ValueError, match="not a block event kind"):
        log.set_filter(kinds=["exploded"])
    assert log.model.filter.kinds == NOTABLE_KINDS
    with pytest.raises(ValueError, match="max_rows"):
        EventLogModel(0)


def test_filter_value_object():
    f = LogFilter()
    assert not f.narrowed and f.kinds == NOTABLE_KINDS
    assert LogFilter(blocks=frozenset({3})).narrowed


def test_kinds_menu_stays_open_while_ticking(qtbot, log):
    menu = log.kinds_menu
    menu.popup(log.mapToGlobal(QtCore.QPoint(0, 0)))
    qtbot.waitUntil(menu.isVisible, timeout=2000)
    action = menu.kind_actions[K.ALLOCATED]
    with qtbot.waitSignal(menu.kindsChanged) as blocker:
        point = menu.actionGeometry(action).center()
        qtbot.mouseMove(menu, point)
        qtbot.mouseClick(menu, LEFT, pos=point)
    assert K.ALLOCATED in blocker.args[0] and action.isChecked() and menu.isVisible()
    assert len(texts(log)) == 7  # the allocations are listed at once
    qtbot.mouseClick(menu, LEFT, pos=menu.actionGeometry(menu.actions()[0]).center())  # "Notable kinds"
    assert menu.kinds() == NOTABLE_KINDS and len(texts(log)) == 5
    menu.close()


def test_a_filtered_block_is_followed_through_a_relocation_cycle(qtbot, shown):
    """3 -> 7, 5 -> 3, 7 -> 5: block 3's content went to 7, though 3 is also where 5's content went."""
    dock = shown(EventLog(), 320, 400)
    dock.append_events([(1, BlockEvent(4, K.ALLOCATED, 1, (3, 5, 7))),
                        (2, BlockEvent(4, K.RELOCATED, -1, (3, 5, 7), (7, 3, 5)))])
    for wanted, after in ((3, 7), (5, 3), (7, 5)):
        dock.set_filter(blocks=str(wanted))
        row = texts(dock).index("every block moved: 3 blocks to new ids")
        rect = dock.view.visualRect(dock.model.index(row, 1))
        with qtbot.waitSignal(dock.eventActivated) as blocker:
            qtbot.mouseClick(dock.view.viewport(), LEFT, pos=rect.center())
        assert blocker.args == [2, 4, -1, after]
