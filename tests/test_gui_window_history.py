"""History in the window: scrubbing shows a past frame everywhere while the engine keeps decoding, Back to live,
clicking an event jumps and selects, the selection follows a relocation (pytest-qt, offscreen, real engine)."""
import numpy as np
from PySide6 import QtCore

from kvstream.events import EventKind
from kvstream.views import BlockState
from test_gui_support import wait_for_snapshot


def three_conversations(engine):
    engine.add_conversation("History keeps every step of the pool.", max_new_tokens=120, temperature=0.0)
    engine.step()
    engine.add_conversation("A second voice joins.", max_new_tokens=120, temperature=0.0)


def test_scrubbing_shows_the_past_everywhere_and_the_engine_keeps_decoding(qtbot, make_window):
    window = make_window(setup=three_conversations, speed=40, history=True)
    source, history = window.source, window.source.history
    assert source.capabilities.has_history and history is not None
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 12)
    timeline = window.pane.timeline
    qtbot.waitUntil(lambda: timeline.last_seq >= 10, timeout=3000)
    assert timeline.isVisible() and timeline.first_seq == history.first_seq
    seq = history.first_seq + 4
    past = history.snapshot_at(seq)
    (cid, table), *_ = sorted(past.block_tables.items())
    timeline.seek(seq)  # what a drag on the strip does
    assert source.viewing == seq and window.snapshot.step_id == past.step_id
    live_then = source.live.step_id
    qtbot.waitUntil(lambda: window.grid.snapshot.step_id == past.step_id, timeout=2000)
    assert f"step {past.step_id:,}" in timeline.banner_text()
    qtbot.waitUntil(lambda: f"viewing step {past.step_id}" in window.status_labels["live"].text(), timeout=2000)
    # the inspector shows the block as it was at that frame, from the view (no K/V in history)
    block = table[-1]
    window.select_block(block)
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.block_id == block,
                    timeout=3000)
    info = window.inspector.info
    assert info.num_filled == int(past.num_filled[block]) and info.keys is None
    assert info.token_ids == past.conversation(cid).token_ids[(len(table) - 1) * past.block_size:][:info.num_filled]
    # conversations show their text as it was
    window.conversations.select_conversation(cid)
    qtbot.waitUntil(lambda: window.conversations.selected_conversation() == cid, timeout=2000)
    old_text = past.conversation(cid).output_text
    qtbot.waitUntil(lambda: old_text in window.conversations.detail.plain_text(), timeout=2000)
    # the engine kept decoding behind the past view
    qtbot.waitUntil(lambda: source.live.step_id >= live_then + 4, timeout=5000)
    assert window.snapshot.step_id == past.step_id and window.grid.snapshot.step_id == past.step_id
    # back to live
    timeline.go_live()
    assert source.viewing is None
    wait_for_snapshot(qtbot, window, lambda s: s.step_id > past.step_id + 4)
    assert window.snapshot is source.live
    qtbot.waitUntil(lambda: window.grid.snapshot is source.live or window.grid.snapshot.step_id > past.step_id,
                    timeout=2000)
    assert window.errors == []


def test_back_to_live_from_the_view_menu_and_keys_step_frames(qtbot, make_window):
    window = make_window(setup=three_conversations, paused=True, history=True)
    for _ in range(6):
        window.runner.step_once()
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 7)
    timeline = window.pane.timeline
    qtbot.waitUntil(lambda: timeline.last_seq == window.source.history.last_seq, timeout=2000)
    timeline.setFocus()
    qtbot.keyClick(timeline.track, QtCore.Qt.Key.Key_Left)
    last = window.source.history.last_seq
    assert window.source.viewing == last - 1
    assert window.window_actions.back_to_live.isEnabled()
    window.window_actions.back_to_live.trigger()
    assert window.source.viewing is None and timeline.is_live
    assert not window.window_actions.back_to_live.isEnabled()


def test_clicking_an_event_jumps_to_its_frame_and_selects(qtbot, make_window):
    def fork_later(engine):
        three_conversations(engine)
        engine.step()
        engine.step()
        engine.fork_conversation(0)
    window = make_window(setup=fork_later, speed=40, history=True)
    log = window.event_log
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 10)
    qtbot.waitUntil(lambda: log.model.rowCount() > 0, timeout=3000)
    model = log.model
    rows = [r for r in range(model.rowCount()) if model.entry(r)[1].block_id >= 0]
    assert rows, [model.entry(r)[1] for r in range(model.rowCount())]
    row = rows[0]
    seq, line = model.entry(row)
    index = model.index(row, 1)
    log.view.scrollTo(index)
    qtbot.mouseClick(log.view.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=log.view.visualRect(index).center())
    assert window.source.viewing == seq
    assert window.snapshot.step_id == window.source.history.step_of(seq)
    assert window.block_watch.block_id == line.block_id and window.grid.selected_block == line.block_id
    assert window.pane.timeline.position == seq


def test_selection_follows_a_relocation(qtbot, make_window):
    window = make_window(setup=three_conversations, paused=True, history=True)
    window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 2)
    (cid, table), *_ = sorted(snap.block_tables.items())
    block = table[0]
    window.select_block(block)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    window.relocate(False)  # scramble
    qtbot.waitUntil(lambda: len(window.relocation.reports) == 1, timeout=5000)
    history = window.source.history
    moves = [e for _, e in history.events(kinds=(EventKind.RELOCATED,))]
    assert moves
    mapping = dict(zip(moves[-1].block_ids, moves[-1].new_block_ids))
    new = mapping[block]
    qtbot.waitUntil(lambda: window.block_watch.block_id == new, timeout=3000)
    assert window.grid.selected_block == new and window.block_watch.moved_from == block
    assert f"moved from {block}" in window.inspector.fields["block"].text()
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.block_id == new,
                    timeout=3000)
    after = window.snapshot
    assert int(after.state[new]) == BlockState.USED and (cid, 0) in window.inspector.info.owners
    assert np.asarray(after.block_tables[cid])[0] == new


def test_new_frames_are_read_once_and_the_block_history_grows_without_a_recompute(qtbot, make_window):
    """The source hands each new frame's events out once for the timeline, the event log, the inspector and the
    block history, as the feed's frame carried them: the History is not read for them (it serves the past only);
    the selected block's history is extended with them while live, not computed again from every event."""
    from explorer.model.block_history import block_history
    window = make_window(setup=three_conversations, paused=True, history=True)
    source, history = window.source, window.source.history
    reads, emitted = [], []
    events = history.events
    history.events = lambda *a, **k: reads.append(a) or events(*a, **k)
    source.eventsArrived.connect(lambda pairs, restarted: emitted.append((len(pairs), restarted)))
    window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 2)
    tail = sorted(snap.block_tables.items())[0][1][-1]  # conversation 0's tail block: filled, then hashed
    window.select_block(tail)
    panels = window.history_panels
    computed, shown = panels.recomputed, window.block_history.list.count()
    assert computed >= 1 and shown > 0
    reads.clear(), emitted.clear()
    for _ in range(8):
        window.runner.step_once()
    qtbot.waitUntil(lambda: window.block_history.list.count() > shown, timeout=5000)
    qtbot.waitUntil(lambda: source.events_seq == history.last_seq, timeout=2000)
    assert panels.recomputed == computed  # extended frame by frame
    assert reads == [] and len(emitted) > 0 and not any(restarted for _, restarted in emitted)
    lines = block_history(events(), tail)
    assert [window.block_history.list.item(i).text() for i in range(window.block_history.list.count())] == \
        [f"step {line.step_id:,}: {line.text}" for line in lines]
    assert any("full and hashed" in line.text for line in lines)
    assert window.event_log.model.num_events == len(events())  # every kept event logged once
    assert window.pane.timeline.markers.n == len(events())


def test_scrubbing_tells_the_block_story_once_the_timeline_rests(qtbot, make_window):
    """Dragging the timeline past many frames does not walk every kept event for each one (0.3 s a frame in a
    10,000-step recording): the selected block's story is told once, up to the frame the timeline rests on."""
    from explorer.model.block_history import block_history
    from explorer.widgets.history_panels import SETTLE_MS
    window = make_window(setup=three_conversations, paused=True, history=True)
    source, history, panels = window.source, window.source.history, window.history_panels
    for _ in range(12):
        window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 12)
    qtbot.waitUntil(lambda: source.events_seq == history.last_seq and timeline_caught_up(window, history),
                    timeout=3000)
    block = sorted(snap.block_tables.items())[0][1][0]
    window.select_block(block)
    computed = panels.recomputed
    timeline = window.pane.timeline
    first = history.first_seq + 1
    for seq in range(history.last_seq - 1, first - 1, -1):  # one frame back per call, as a drag does
        timeline.seek(seq)
    assert panels.recomputed == computed  # nothing told while moving
    qtbot.waitUntil(lambda: panels.recomputed == computed + 1, timeout=SETTLE_MS * 20)
    qtbot.wait(SETTLE_MS * 2)
    assert panels.recomputed == computed + 1  # once
    lines = block_history(history.events(None, first), block)
    assert [window.block_history.list.item(i).text() for i in range(window.block_history.list.count())] == \
        [f"step {line.step_id:,}: {line.text}" for line in lines]
    timeline.go_live()  # back to live: told at once
    assert panels.recomputed == computed + 2


def test_a_jump_to_before_the_selected_conversation_existed_drops_the_selection(qtbot, make_window):
    """Selecting a conversation dims every other block. A jump to a step before it existed makes the table's rows
    again without it: the grid must stop dimming (nothing selected), and a jump to where the selected conversation
    is still listed keeps it selected."""
    window = make_window(setup=lambda e: e.add_conversation("The first one.", max_new_tokens=80), paused=True,
                         history=True)
    history, timeline = window.source.history, window.pane.timeline
    for _ in range(4):
        window.runner.step_once().result(timeout=10)
    later = window.runner.submit("add_conversation", "The second one arrives later.", max_new_tokens=80).result(
        timeout=10)
    for _ in range(4):
        window.runner.step_once().result(timeout=10)
    qtbot.waitUntil(lambda: timeline_caught_up(window, history), timeout=3000)
    only_one = next(seq for seq in range(history.first_seq, history.last_seq + 1)
                    if history.snapshot_at(seq).conversation(later) is None and history.snapshot_at(seq).block_tables)
    qtbot.waitUntil(lambda: window.conversations.model.row_of(later) is not None, timeout=3000)
    window.conversations.select_conversation(later)
    qtbot.waitUntil(lambda: window.grid.selected_conversation == later, timeout=2000)
    timeline.seek(only_one)
    qtbot.waitUntil(lambda: window.grid.snapshot.step_id == history.snapshot_at(only_one).step_id, timeout=3000)
    qtbot.waitUntil(lambda: window.conversations.model.row_of(later) is None, timeout=3000)
    assert window.selected_conversation() is None
    assert window.grid.selected_conversation is None  # before the fix: still ``later``, every block dimmed
    # the first conversation, selected at the last step, stays selected at an earlier one that lists it
    timeline.go_live()
    qtbot.waitUntil(lambda: window.conversations.model.row_of(later) is not None, timeout=3000)
    (older,) = [c for c in window.snapshot.block_tables if c != later]
    window.conversations.select_conversation(older)
    qtbot.waitUntil(lambda: window.grid.selected_conversation == older, timeout=2000)
    timeline.seek(only_one)
    qtbot.waitUntil(lambda: window.conversations.model.row_of(later) is None, timeout=3000)
    assert window.selected_conversation() == older and window.grid.selected_conversation == older
    assert window.errors == []


def timeline_caught_up(window, history) -> bool:
    """The window's timeline has every frame of the history."""
    return len(history) > 0 and window.pane.timeline.last_seq == history.last_seq


def test_after_a_relocation_the_inspector_never_shows_the_old_id_in_the_new_frame(qtbot, make_window, monkeypatch):
    """The grid's frame and its events come as one unit: the window never shows the relocated frame with the
    selection still on the old id (whose new contents belong to another block), and it does not wait for the
    History for it (its frame is held here on the encoder's thread: the window follows the relocation first)."""
    import threading
    window = make_window(setup=three_conversations, paused=True, history=True)
    window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 2)
    (cid, table), *_ = sorted(snap.block_tables.items())
    block = table[0]
    window.select_block(block)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    history = window.source.history
    write, late = history.write, threading.Event()

    def slow_write(frame):  # the encoder thread is late with the relocation's frame: until the test is done
        if any(e.kind == EventKind.RELOCATED for e in frame.events):
            late.wait(30)
        write(frame)
    monkeypatch.setattr(history, "write", slow_write)
    shown = []  # (selected id, frame) of every summary the inspector was given
    summary = window.inspector.show_summary
    monkeypatch.setattr(window.inspector, "show_summary",
                        lambda snapshot, **kw: shown.append((window.block_watch.block_id, snapshot))
                        or summary(snapshot, **kw))
    arrived = []  # the relocations the window was handed with their frames
    window.source.eventsArrived.connect(
        lambda pairs, _restarted: arrived.extend(e for _, e in pairs if e.kind == EventKind.RELOCATED))
    try:
        before = window.runner.latest.version
        window.relocate(False)  # scramble
        qtbot.waitUntil(lambda: len(window.relocation.reports) == 1, timeout=5000)
        qtbot.waitUntil(lambda: window.block_watch.block_id != block, timeout=5000)
        assert not [e for _, e in history.events(kinds=(EventKind.RELOCATED,))]  # still on its way to the History
        moved = arrived[-1]
        new = dict(zip(moved.block_ids, moved.new_block_ids))[block]
        assert window.block_watch.block_id == new
        relocated = [(b, s) for b, s in shown if s.version > before]
        assert relocated and all(b == new for b, _ in relocated), [(b, s.version) for b, s in relocated]
    finally:
        late.set()


def test_step_numbers_are_written_one_way():
    """"step 2,100" in the grid's header beside "step 2100" in the status bar: one number format everywhere."""
    from explorer.model.pool_counts import PoolCounts
    counts = PoolCounts(num_blocks=4, used=1, cached=1, free=2, filled_slots=3, allocated_slots=4)
    assert counts.header_text(2100).startswith("step 2,100 ·")


def test_the_inspector_describes_a_past_step_as_of_that_step(qtbot, make_window):
    """Issue 33: a block selected live, then a jump to a step before its conversation arrived: the inspector said
    'has been freed: conversation N released it' of a conversation that did not exist yet at that step."""
    window = make_window(setup=lambda e: e.add_conversation("The first one.", max_new_tokens=80), paused=True,
                         history=True)
    history, timeline = window.source.history, window.pane.timeline
    for _ in range(3):
        window.runner.step_once().result(timeout=10)
    later = window.runner.submit("add_conversation", "The second one arrives later.", max_new_tokens=80).result(
        timeout=10)
    for _ in range(3):
        window.runner.step_once().result(timeout=10)
    qtbot.waitUntil(lambda: timeline_caught_up(window, history), timeout=3000)
    live = history.snapshot_at(history.last_seq)
    block = live.block_tables[later][-1]  # its own block (the first is a shared prefix)
    before = next(seq for seq in range(history.first_seq, history.last_seq + 1)
                  if history.snapshot_at(seq).conversation(later) is None and history.snapshot_at(seq).block_tables
                  and int(history.snapshot_at(seq).state[block]) == BlockState.FREE)
    window.select_block(block)
    qtbot.waitUntil(lambda: f"conversation {later}" in window.inspector.note.text(), timeout=3000)
    timeline.seek(before)
    qtbot.waitUntil(lambda: window.inspector.fields["state"].text() == "free", timeout=3000)
    qtbot.wait(300)  # the frame's own details come too
    note = window.inspector.note.text()
    assert f"conversation {later}" not in note and "released" not in note and "freed" not in note, note
    assert window.errors == []
