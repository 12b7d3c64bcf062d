"""The window's seam: one PoolSource owns the local engine; panels follow its signals (pytest-qt, offscreen)."""
import numpy as np
import pytest
from PySide6 import QtWidgets

from explorer.feeds.snapshot_block import block_info_from_snapshot
from explorer.window.status_bar import CounterRate
from kvstream.views import BlockState
from test_gui_support import make_config, open_add_dialog, seeded, wait_for_snapshot


def test_local_engine_source_says_what_it_can_do_and_delivers_views(qtbot, make_window):
    # a conversation that outlasts the wait (on a busy machine the first view drawn came after 40 tokens: done)
    window = make_window(setup=seeded(["Capabilities of the local engine."], max_new_tokens=200, ignore_eos=True),
                         speed=30)
    source = window.source
    caps = source.capabilities
    assert caps.can_command and caps.has_kv_values and caps.has_physical_pool
    assert source.command_blocked_reason == "" and source.feed.kind == "engine"
    views = []
    source.viewChanged.connect(views.append)
    start = window.snapshot.step_id
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= start + 3)
    assert views and views[-1] is window.snapshot is window.grid.snapshot
    assert [v.step_id for v in views] == sorted(v.step_id for v in views)  # oldest first, never a stale one after
    assert "local engine: builtin, 64 blocks × 4 slots" in window.windowTitle()
    acts = window.window_actions
    selection_bound = (acts.record, acts.fork, acts.reply, acts.end)  # these follow the selected conversation: none
    assert all(action.isEnabled() for action in acts.commands if action not in selection_bound)


def test_restart_swaps_the_feed_and_panels_reset_through_the_signal(qtbot, make_window):
    window = make_window(setup=seeded(["Before the restart, two.", "And another one."]), paused=True)
    old_feed, old_runner = window.source.feed, window.runner
    snap = window.snapshot
    block = next(iter(snap.block_tables.values()))[0]
    window.select_block(block)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    window.conversations.select_conversation(sorted(snap.block_tables)[0])
    qtbot.waitUntil(lambda: window.conversations.model.rowCount() == 2, timeout=2000)
    window.metrics.redraw()
    assert window.metrics.history.count > 0
    changes = []
    window.source.sourceChanged.connect(changes.append)
    window.restart_engine(make_config(num_blocks=32, block_size=8))
    qtbot.waitUntil(lambda: window.source.feed is not old_feed, timeout=15000)
    assert changes == [window.source.feed] and not old_runner.alive
    assert window.block_watch.block_id is None and window.inspector.block_id is None
    assert window.grid.selected_block is None
    wait_for_snapshot(qtbot, window, lambda s: s.num_blocks == 32)
    assert window.conversations.model.rowCount() == 0  # the old engine's conversations are gone from the table
    assert window.metrics.history.count <= 1  # started over (the new engine's first frame at most)
    assert "32 blocks × 8 slots" in window.windowTitle() and window.runner.paused  # pause kept


def test_inspector_polls_through_the_source_at_most_five_times_a_second(qtbot, make_window):
    window = make_window(setup=seeded(["A block that keeps changing while it fills."], steps=0,
                                       max_new_tokens=200), speed=60)
    snap = window.snapshot
    (cid, table), = snap.block_tables.items()
    window.select_block(table[-1])  # the tail: it changes every step
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    before = window.block_watch.requests
    qtbot.wait(1500)
    asked = window.block_watch.requests - before
    assert 2 <= asked <= 9  # 5 Hz over 1.5 s (timer phase): follows the changes, never once per frame
    assert window.inspector.info.block_id == table[-1]


def test_snapshot_block_rebuilds_the_inspectors_view_without_kv(qtbot, make_window):
    window = make_window(setup=seeded(["Tokens come from the owner."], steps=2), paused=True)
    snap = window.snapshot
    (cid, table), = snap.block_tables.items()
    live = window.runner.submit("inspect_block", table[1]).result(5)  # (the engine takes one caller: its thread)
    rebuilt = block_info_from_snapshot(snap, table[1], token_text=window.source.feed.token_text)
    for field in ("block_id", "state", "ref_count", "num_filled", "token_ids", "positions", "owners", "last_owner",
                  "token_texts"):
        assert getattr(rebuilt, field) == getattr(live, field), field
    assert rebuilt.keys is None and rebuilt.values is None
    free = int(np.nonzero(np.asarray(snap.state) == BlockState.FREE)[0][0])
    assert block_info_from_snapshot(snap, free).token_ids == ()
    with pytest.raises(IndexError, match="block ids run from 0 to 63"):
        block_info_from_snapshot(snap, snap.num_blocks)


def test_parallel_samples_are_made_without_a_race(qtbot, make_window):
    """Issue 13, defect 1: shared system prompt, 3 samples, 200 new tokens gave 'conversation 0 is finished'."""
    window = make_window(num_blocks=128, speed=200)
    dialog = open_add_dialog(window, "Say more.", max_new_tokens=200, temperature=0.8, samples=3, system=True)
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=5000)
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 3, timeout=8000)
    qtbot.wait(300)
    assert window.errors == []
    first, *samples = sorted(c.conversation_id for c in snap.conversations)
    assert len(samples) == 2
    prompts = {snap.conversation(c).prompt_token_ids for c in [first, *samples]}
    assert len(prompts) == 1  # all three answer the same prompt


def test_a_refused_command_becomes_one_problem(qtbot, make_window):
    window = make_window(setup=seeded(["Done quickly."], max_new_tokens=2, steps=4), paused=True)
    cid = window.snapshot.conversations[0].conversation_id
    problems = []
    window.source.problem.connect(problems.append)
    window.fork_conversation(cid)  # forking a finished conversation is an EngineError
    qtbot.waitUntil(lambda: len(problems) == 1, timeout=3000)
    assert problems[0].title == "Command refused" and "finished" in problems[0].text
    assert window.errors[-1][0] == "Command refused"


def test_counter_rate_reads_running_counts_and_restarts_on_a_new_source():
    clock = [0.0]
    steps = CounterRate(window_s=2.0, clock=lambda: clock[0])
    for i in range(5):  # a slow counter: one step every 0.7 s reads about 1.4 steps/s
        clock[0] = 10 + 0.7 * i
        steps.add(100 + i)
    assert 1.0 < steps.per_second() < 1.6
    for i in range(20):  # 30 tokens a step at 10 steps/s
        clock[0] = 20 + 0.1 * i
        steps.add(1000 + 30 * i)
    assert 250 < steps.per_second() < 310
    clock[0] = 30.0  # nothing for 8 s: the rate has decayed to 0
    assert steps.per_second() == 0.0
    steps.add(0)  # a new source counts from 0: no negative rate
    clock[0] = 30.5
    steps.add(5)
    assert steps.per_second() >= 0.0
    with pytest.raises(ValueError, match="positive"):
        CounterRate(window_s=0)


def test_pool_source_without_history_refuses_to_seek(qtbot, make_window):
    window = make_window(paused=True)
    source = window.source
    if source.history is not None:
        return  # this engine's runner keeps history: the scrubbing tests cover seeking
    with pytest.raises(LookupError, match="no history"):
        source.seek(0)
    assert source.viewing is None and window.pane.timeline.isHidden()


def test_a_status_message_gets_room_to_be_read(qtbot, make_window):
    """Found in a screenshot: the crowd demo's 'Demo: ... requests were lowered' never showed, because the
    permanent labels (rates, pool, model) took the whole status bar and left the message no width."""
    window = make_window(paused=True, size=(1366, 768))
    message = "Demo: 21 of 32 requests were lowered to fit the pool or the model (conversation 2: ...)"
    window.hide()  # main.py says it before the window is first shown
    window.status.showMessage(message, 5000)
    window.show()
    qtbot.waitExposed(window)
    QtWidgets.QApplication.processEvents()
    shown = [label for label in window.status.labels.values() if label.isVisible()]
    room = min(label.geometry().left() for label in shown) if shown else window.status.width()
    assert room >= window.status.fontMetrics().horizontalAdvance(message)
    window.status.clearMessage()
    QtWidgets.QApplication.processEvents()
    assert all(label.isVisible() for label in window.status.labels.values())  # the rates are back


def test_commands_are_enabled_on_changes_not_on_every_frame(qtbot, make_window, monkeypatch):
    """The panels refresh ten times a second while decoding; the command controls are set only when the source,
    the frame on view or the selection changes."""
    window = make_window(setup=lambda e: e.add_conversation("Enabled once, not per frame.", max_new_tokens=200,
                                                            temperature=0.0, ignore_eos=True), speed=40)
    calls = []
    enable = window._enable_commands
    monkeypatch.setattr(window, "_enable_commands", lambda: (calls.append(1), enable()))
    start = window.snapshot.step_id
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= start + 10)
    qtbot.wait(300)  # several panel refreshes
    assert calls == []
    window.conversations.select_conversation(0)
    assert calls == [1]
