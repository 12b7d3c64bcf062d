"""One frame, one unit in the window (issue 29): the events come with the frame that the feed hands out, not out of
the History, so a window without one still shows them, and the grid and its events agree (pytest-qt, offscreen,
real engine)."""

from kvstream.events import EventKind
from kvstream.views import BlockState
from test_gui_support import wait_for_snapshot
from test_gui_window_history import three_conversations


def test_a_window_without_history_still_shows_every_frames_events(qtbot, make_window):
    """No History (the engine feed started with ``history_bytes=None``): the event log, the block history and the
    selection's relocation-following still get every frame's events, from the feed's frames themselves; the
    grid's frame and its events agree (each block an ALLOCATED event names is in the frame's tables)."""
    window = make_window(setup=three_conversations, paused=True)  # a runner without a History
    source = window.source
    assert source.history is None and not source.capabilities.has_history
    frames = []  # (events, snapshot) of every frame the window was handed, as it was handed
    source.eventsArrived.connect(lambda pairs, _restarted: frames.append([list(pairs), None]))
    source.frameArrived.connect(lambda snap: frames[-1].__setitem__(1, snap))
    for step in range(1, 7):  # one frame at a time: each frame comes with its own step's events
        window.runner.step_once()
        snap = wait_for_snapshot(qtbot, window, lambda s, step=step: s.step_id >= step)
    qtbot.waitUntil(lambda: window.event_log.model.num_events > 0, timeout=3000)
    seqs = [seq for events, _ in frames for seq, _ in events]
    assert seqs == sorted(seqs)
    allocated = 0
    for events, frame in frames:
        assert all(e.step_id <= frame.step_id for _, e in events)  # never an event the grid does not show yet
        for _, e in events:
            if e.kind == EventKind.ALLOCATED and e.step_id == frame.step_id:
                allocated += 1
                assert all(frame.state[b] == BlockState.USED for b in e.block_ids)  # the grid shows them taken
    assert allocated > 0
    assert window.event_log.model.num_events == sum(len(events) for events, _ in frames)
    *_, (cid, table) = sorted(snap.block_tables.items())  # the second conversation: allocated under the runner
    block = int(table[0])
    window.select_block(block)
    qtbot.waitUntil(lambda: window.block_history.list.count() > 0, timeout=3000)  # its story from the kept events
    shown = window.block_history.list.count()
    arrived = []
    source.eventsArrived.connect(
        lambda pairs, _restarted: arrived.extend(e for _, e in pairs if e.kind == EventKind.RELOCATED))
    window.relocate(False)  # scramble
    qtbot.waitUntil(lambda: bool(arrived) and window.block_watch.block_id != block, timeout=5000)
    new = dict(zip(arrived[-1].block_ids, arrived[-1].new_block_ids))[block]
    assert window.block_watch.block_id == new
    qtbot.waitUntil(lambda: window.block_history.list.count() > shown, timeout=3000)  # "moved from ..."


def test_events_dropped_for_a_window_that_fell_behind_are_said(qtbot, make_window):
    """The engine feed holds a bounded number of events for a window that does not take them; past that the oldest
    go, and the window says how many, instead of a silent gap in the event log."""
    window = make_window(setup=three_conversations, paused=True)
    window.source.feed.frames.max_events = 2  # a tiny bound stands for a window stalled for a long time
    for _ in range(3):
        window.runner.step_once().result(timeout=10)
    qtbot.waitUntil(lambda: window.source.events_dropped > 0, timeout=5000)
    assert "events were dropped" in window.statusBar().currentMessage()
