"""How the window wires its panels (docs/gui.md): dialogs that send their own requests (token
ids go out as ids), the restart dialog that asks, stays open and reports at its field, the detokenizer for earlier
turns, demo notes in the status bar, read-only conversation buttons, metrics up to the scrubbed step, and pan
limits that never crop a fit (pytest-qt, offscreen, real engine, small pools)."""
import numpy as np
from PySide6 import QtCore, QtWidgets

from explorer.window import files
from explorer.widgets.conversations import PLACEHOLDER, REPLY_MARK, USER_MARK, ConversationsPanel
from explorer.widgets.grid_view import GridView
from kvstream.views import PoolSnapshot
from test_gui_support import wait_for_snapshot

ACCEPTED = QtWidgets.QDialog.DialogCode.Accepted


def finished_one(engine):
    engine.add_conversation("Pages and tables.", max_new_tokens=3, temperature=0.0)
    engine.run_until_idle()


def test_reply_with_token_ids_goes_out_as_ids_and_a_refusal_stays_at_the_field(qtbot, make_window):
    window = make_window(setup=finished_one, paused=True)
    cid = window.snapshot.conversations[0].conversation_id
    history = window.snapshot.conversation(cid).token_ids
    dialog = window.open_reply_dialog(cid)
    dialog.set_ids_mode(True)
    dialog.message.setPlainText("72 105 999")  # 999: outside the built-in model's 258 ids
    dialog.max_new_tokens.setText("2")
    dialog.try_accept()
    qtbot.waitUntil(lambda: "outside the vocabulary" in dialog.error_text("message"), timeout=3000)
    assert dialog.isVisible() and window.errors == []  # shown at the field, not in a second message box
    assert str(window.runner.submit("conversation", cid).result(5).status) == "finished"  # nothing changed
    dialog.message.setPlainText("72, 105")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == ACCEPTED, timeout=3000)
    info = window.runner.submit("conversation", cid).result(5)  # through the runner: the engine takes one caller
    assert info.prompt_token_ids == tuple(history) + (72, 105) and len(info.turns) == 2
    assert window.errors == []


def test_parallel_samples_from_the_window_select_the_first(qtbot, make_window):
    window = make_window(num_blocks=128, speed=100)
    dialog = window.open_add_dialog()
    dialog.prompt.setPlainText("Three at once.")
    dialog.max_new_tokens.setText("200")
    dialog.samples.setText("3")
    dialog.use_system.setChecked(True)
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == ACCEPTED, timeout=5000)
    first, *rest = dialog.answer
    assert len(rest) == 2
    qtbot.waitUntil(lambda: window.conversations.selected_conversation() == first, timeout=3000)
    snap = window.snapshot
    assert [snap.conversation(c).parent_id for c in rest] == [first, first] and window.errors == []


def test_restart_from_the_window_asks_keeps_values_on_failure_and_closes_once_loaded(qtbot, make_window, tmp_path):
    window = make_window(setup=finished_one, paused=True)
    old = window.runner
    dialog = window.open_restart_dialog()
    assert dialog.num_conversations == 1
    (tmp_path / "empty").mkdir()
    dialog.block_size.setText("8")
    dialog.checkpoint.setChecked(True)
    dialog.path.setText(str(tmp_path / "empty"))  # a directory without a checkpoint: the load fails
    dialog.try_accept()
    assert "1 conversation will be discarded" in dialog.confirm.text()
    restart = next(b for b in dialog.confirm.buttons() if b.text() == "Restart")
    qtbot.mouseClick(restart, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "previous engine keeps running" in dialog.error_text("model"), timeout=10000)
    assert dialog.isVisible() and window.errors == [] and window.runner is old and old.alive
    assert (dialog.block_size.text(), dialog.path.text()) == ("8", str(tmp_path / "empty"))
    dialog.builtin.setChecked(True)
    dialog.try_accept()
    restart = next(b for b in dialog.confirm.buttons() if b.text() == "Restart")
    qtbot.mouseClick(restart, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.result() == ACCEPTED, timeout=10000)
    assert window.runner is not old and not old.alive and not dialog.isVisible()
    assert wait_for_snapshot(qtbot, window, lambda s: s.block_size == 8).conversations == ()


def test_earlier_turns_read_as_text_through_the_engines_detokenizer(qtbot, make_window):
    window = make_window(setup=finished_one, paused=True)
    detokenize = window.source.feed.detokenizer
    assert window.conversations.detail._detokenize is not None
    engine = window.runner.engine
    cid = window.snapshot.conversations[0].conversation_id
    assert detokenize(engine.tokenize("Pages", continuation=True)) == "Pages"
    first_reply = engine.conversation(cid).output_text
    window.conversations.select_conversation(cid)
    dialog = window.open_reply_dialog(cid)
    dialog.message.setPlainText(" More?")
    dialog.max_new_tokens.setText("2")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == ACCEPTED, timeout=3000)
    window.runner.step_once()
    wait_for_snapshot(qtbot, window, lambda s: len(s.conversation(cid).output_token_ids) >= 1)
    window.conversations.detail._seen.clear()  # nothing remembered from watching: only the detokenizer can split
    window.conversations.detail._key = None
    qtbot.waitUntil(lambda: USER_MARK in window.conversations.detail.plain_text(), timeout=3000)
    text = window.conversations.detail.plain_text()
    assert text.count(REPLY_MARK) == 2 and first_reply in text and " More?" in text.split(USER_MARK)[1]


def test_a_demo_from_the_menu_says_what_it_lowered_in_the_status_bar(qtbot, make_window):
    window = make_window(paused=True)  # 64 blocks of 4: the busy demo's long asks cannot fit
    old = window.runner
    files.start_demo(window, "busy")  # an empty engine: no question
    qtbot.waitUntil(lambda: window.runner is not old, timeout=10000)
    assert window.demo_notes and all("lowered from" in n for n in window.demo_notes)
    assert window.status.currentMessage().startswith("Demo: ") and "lowered" in window.status.currentMessage()
    assert window.demo_notes[0] in window.status.toolTip()


def test_read_only_buttons_stay_disabled_through_selection_and_refresh(qtbot):
    panel = ConversationsPanel()
    qtbot.addWidget(panel)
    from engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model="builtin", num_blocks=32, block_size=4))
    finished_one(engine)
    snap = engine.snapshot()
    panel.refresh(snap)
    panel.select_conversation(snap.conversations[0].conversation_id)
    assert panel.buttons["reply"].isEnabled() and panel.buttons["add"].isEnabled()
    panel.set_read_only("a recording is read-only")
    panel.refresh(snap)
    panel.view.clearSelection()
    panel.select_conversation(snap.conversations[0].conversation_id)  # selection re-enabled them before
    assert not any(b.isEnabled() for b in panel.buttons.values())
    assert panel.buttons["reply"].toolTip() == "Unavailable: a recording is read-only"
    panel.set_read_only("")
    assert panel.buttons["reply"].isEnabled() and not panel.buttons["fork"].isEnabled()
    assert panel.buttons["reply"].toolTip() == "Reply (Ctrl+R)"


def test_metrics_show_up_to_the_scrubbed_step_then_all_again(qtbot, make_window):
    def decoding(engine):
        engine.add_conversation("Metrics over time.", max_new_tokens=200, temperature=0.0, ignore_eos=True)

    window = make_window(setup=decoding, speed=40, history=True)
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 12)
    qtbot.waitUntil(lambda: window.metrics.history.count >= 8, timeout=3000)
    history, steps = window.source.history, window.metrics.history.series("step")
    middle = int(steps[len(steps) // 2])  # a step the metrics sampled, with later samples after it
    seq = history.seq_of_step(middle)
    view = window.source.seek(seq)
    window.metrics.redraw()
    x, _ = window.metrics.curves[0][1].getData()
    assert len(x) > 0 and x.max() <= view.step_id < window.metrics.history.series("step").max()
    window.source.go_live()
    window.metrics.redraw()
    x, _ = window.metrics.curves[0][1].getData()
    assert x.max() == window.metrics.history.series("step").max()


def pool_of(num_blocks):
    zeros = np.zeros(num_blocks, np.int32)
    return PoolSnapshot(step_id=1, block_size=4, num_blocks=num_blocks, ref_count=zeros, num_filled=zeros,
                        state=zeros.astype(np.int8), owner=zeros - 1, last_access=zeros.astype(np.int64),
                        block_tables={}, conversations=())


def test_a_fit_in_a_view_much_wider_than_the_pool_shows_every_row(qtbot):
    view = GridView()
    qtbot.addWidget(view)
    view.resize(677, 320)  # the view box about 677 x 295, as in the window's bottom-heavy layouts
    view.show()
    qtbot.waitExposed(view)
    view.set_snapshot(pool_of(64))
    view.render()
    geo = view.geometry_
    for size in ((677, 320), (1400, 300), (300, 900)):
        view.resize(*size)
        qtbot.wait(20)
        view.fit_whole_pool()
        rect = view.box.viewRect()
        assert rect.top() <= 0 and rect.bottom() >= geo.rows, (size, rect)
        assert rect.left() <= 0 and rect.right() >= geo.cols, (size, rect)


def test_a_restart_clears_the_detail_of_the_old_engines_conversation(qtbot, make_window):
    """Found in the X window: after Demos > Busy the detail kept showing the old engine's conversation 7."""
    def four(engine):
        for i in range(4):
            engine.add_conversation(f"Old engine {i}.", max_new_tokens=2)
        engine.run_until_idle()

    window = make_window(setup=four, paused=True)
    qtbot.waitUntil(lambda: window.conversations.model.rowCount() == 4, timeout=3000)
    window.conversations.select_conversation(3)
    assert "Conversation 3" in window.conversations.detail.title.text()
    old = window.runner
    window.restart_engine(window.config, setup=lambda engine: engine.add_conversation("New.", max_new_tokens=2))
    qtbot.waitUntil(lambda: window.runner is not old, timeout=10000)
    qtbot.waitUntil(lambda: window.conversations.model.rowCount() == 1, timeout=3000)
    assert window.conversations.selected_conversation() is None
    assert window.conversations.detail.title.text() == PLACEHOLDER
    assert window.conversations.detail.plain_text() == ""


def test_a_history_frame_says_why_the_inspector_has_no_heatmap(qtbot, make_window):
    """Found in the X window: scrubbed back on the local engine, the inspector said 'this source keeps its K/V
    values to itself (they never leave its device or process)', which is the story of another process's pool."""
    def decoding(engine):
        engine.add_conversation("Heatmaps now and then.", max_new_tokens=100, temperature=0.0, ignore_eos=True)
        engine.step()

    window = make_window(setup=decoding, speed=30, history=True)
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 4)
    block = next(iter(window.snapshot.block_tables.values()))[0]
    window.select_block(block)
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.keys is not None,
                    timeout=3000)
    window.source.seek(window.source.history.first_seq + 1)
    qtbot.waitUntil(lambda: window.inspector.info.keys is None, timeout=3000)
    note = window.inspector.kv_note.text()
    assert "not kept over time" in note and "device or process" not in note
    window.source.go_live()
    qtbot.waitUntil(lambda: window.inspector.info.keys is not None, timeout=3000)
    assert not window.inspector.kv_note.isVisible()


def test_the_panels_follow_their_pace_and_the_grid_every_frame(qtbot, make_window, monkeypatch):
    """Tables and readouts refresh when the window's FramePace says they are due (how often, for a cheap or a costly
    refresh and under paced live frames, is tested on its own clocks: tests/test_pacer.py); the grid draws every new
    frame meanwhile, and the panels show the newest view once they refresh."""
    def setup(engine):
        for i in range(3):
            engine.add_conversation(prompt_token_ids=list(range(3, 20 + i)), max_new_tokens=200, ignore_eos=True)
    window = make_window(setup=setup, speed=30)
    shown, refresh = [], window.conversations.refresh
    monkeypatch.setattr(window.conversations, "refresh",
                        lambda snap: (shown.append((snap, window.snapshot)), refresh(snap)))
    monkeypatch.setattr(window.pace, "panels_due", lambda now: False)  # a refresh far too costly to come yet
    drawn = window.grid.frames_drawn
    qtbot.waitUntil(lambda: window.grid.frames_drawn >= drawn + 3, timeout=10000)  # the grid did not wait
    assert shown == []
    monkeypatch.setattr(window.pace, "panels_due", lambda now: True)
    qtbot.waitUntil(lambda: bool(shown), timeout=5000)
    assert all(table is grid for table, grid in shown)  # the tables show the very frame the grid shows


def test_live_frames_are_paced_to_the_gui_budget_and_no_event_is_lost(qtbot, make_window, monkeypatch):
    """Where following every live frame costs the GUI thread more than its budget (explorer.model.pacer), the window
    takes a new live frame only every ``pacer.interval`` (the newest each time), says so in the status line, and
    still hands every frame's events to the panels, in order; with the budget back, it follows every frame again and
    says nothing. Nothing is paced while the engine keeps up with a speed limit. (How often each thing happens is
    tested on the pacer's own clocks: tests/test_pacer.py.)"""
    from explorer.model import pacer

    def setup(engine):
        for i in range(3):
            engine.add_conversation(prompt_token_ids=list(range(3, 20 + i)), max_new_tokens=600, ignore_eos=True)
    window = make_window(setup=setup, speed=10, history=True, num_blocks=512)
    source, history = window.source, window.source.history
    # the engine's rate as the status bar measures it, held at its limit (a loaded test machine makes it waver)
    monkeypatch.setattr(window.status.steps, "per_second", lambda now=None: 10.0)
    window.pacer.budget = 0.0  # any CPU use is over it
    # but an engine that keeps up with its speed limit has time to spare: a whole measuring window, nothing paced
    qtbot.waitUntil(lambda: window.pacer.share is not None, timeout=15000)
    assert window.pacer.interval == 0.0
    import explorer.window.main_window as main_window  # an engine that falls behind its limit would take what the
    monkeypatch.setattr(main_window, "engine_has_slack", lambda speed, rate: False)  # window gives up
    window.runner.set_speed(40).result(timeout=5)
    qtbot.waitUntil(lambda: window.pacer.interval == pacer.MAX_INTERVAL, timeout=15000)
    said = f"live frames {pacer.MAX_INTERVAL * 1000:.0f} ms apart"
    qtbot.waitUntil(lambda: said in window.status_labels["gui"].text(), timeout=5000)
    seqs, shown = [], []
    source.eventsArrived.connect(lambda pairs, restarted: seqs.extend(seq for seq, _ in pairs))
    source.viewChanged.connect(shown.append)
    first = history.last_seq
    qtbot.waitUntil(lambda: bool(seqs) and seqs[-1] >= first + 30 and history.last_seq >= seqs[-1], timeout=30000)
    # every frame's events went out, in order, though not every frame was shown
    with_events = [seq for seq in range(first + 1, seqs[-1] + 1) if history.events(seq, seq)]
    assert sorted(set(seqs) & set(with_events)) == with_events and seqs == sorted(seqs)
    steps = [snap.step_id for snap in shown]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # each shown frame newer than the last
    window.pacer.budget = 100.0  # no budget to speak of: every frame again
    qtbot.waitUntil(lambda: window.pacer.interval == 0.0, timeout=15000)
    qtbot.waitUntil(lambda: "apart" not in window.status_labels["gui"].text(), timeout=5000)
    assert window.errors == []


def test_the_tiers_and_window_demos_start_from_the_menu_and_busy_goes_back_to_the_users_pool(qtbot, make_window):
    """The Demos menu offers every demo the command line has: tiers starts its small device pool and host tier,
    window the mixed sliding-window checkpoint (tiers off: its story is the window's releases), and busy afterwards runs
    on the settings the user started with, not the last demo's."""
    window = make_window(paused=True, num_blocks=96)
    demos_menu = [a.menu() for a in window.menuBar().actions() if a.text() == "&Demos"][0]
    offered = {name for name, action in window.window_actions.demos.items() if action in demos_menu.actions()}
    assert {"busy", "crowd", "serve", "tiers", "window"} <= offered
    user = window.engine_config
    assert user.host_tier_blocks == 0 and user.num_blocks == 96
    for demo in ("tiers", "window", "busy"):
        old = window.runner
        files.start_demo(window, demo, confirm=False)
        qtbot.waitUntil(lambda: window.runner is not old and window.source.live is not None
                        and window.source.live.num_blocks == window.engine_config.num_blocks, timeout=60000)
        cfg, snap = window.engine_config, window.source.live
        if demo == "tiers":
            assert cfg.num_blocks == 64 and cfg.host_tier_blocks == 1024 and "host" in snap.tiers
        elif demo == "window":
            assert cfg.host_tier_blocks == 0 and not snap.tiers
            assert {g.kind for g in snap.kv_cache_groups} == {"full_attention", "sliding_window"}
        else:
            assert (cfg.model, cfg.num_blocks, cfg.host_tier_blocks) == (user.model, user.num_blocks, 0)
            assert window.config_before_demo is None
