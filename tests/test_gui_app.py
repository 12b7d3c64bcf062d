"""The main window on a real engine: add, inspect, end, share, errors (pytest-qt, offscreen)."""
import numpy as np
from PySide6 import QtCore, QtWidgets

from kvstream.views import BlockState
from explorer.model import palette
from explorer.window.dialogs import SYSTEM_PROMPT
from test_gui_support import open_add_dialog, seeded, wait_for_snapshot


def colour_of(cid, window):
    """The colour of conversation ``cid`` in the window's source's colour book (what its grid draws)."""
    return tuple(int(c) for c in palette.conversation_colours(np.array([cid]), window.source.colours)[0][:3])


def click_block(qtbot, window, block):
    qtbot.mouseClick(window.grid.view.viewport(), QtCore.Qt.MouseButton.LeftButton,
                     pos=window.grid.cell_center(block))


def test_add_conversation_through_dialog_shows_blocks_and_text(qtbot, make_window):
    window = make_window(speed=20)
    dialog = open_add_dialog(window, "Hello, paged attention!", max_new_tokens=40, temperature=0)
    qtbot.mouseClick(dialog.buttons.button(QtWidgets.QDialogButtonBox.StandardButton.Ok),
                     QtCore.Qt.MouseButton.LeftButton)
    snap = wait_for_snapshot(qtbot, window, lambda s: any(s.block_tables.values()), timeout=5000)
    (cid, table), = snap.block_tables.items()
    assert window.grid.cell_colour(table[0]) == colour_of(cid, window)  # its blocks are drawn in its colour
    qtbot.waitUntil(lambda: window.conversations.selected_conversation() == cid, timeout=3000)
    wait_for_snapshot(qtbot, window, lambda s: len(s.conversation(cid).output_text) >= 3)
    qtbot.waitUntil(lambda: window.snapshot.conversation(cid).output_text in window.conversations.detail.plain_text())
    text = window.conversations.detail.plain_text()
    assert text.startswith("Hello, paged attention!") and len(text) > len("Hello, paged attention!")
    assert "Block table (logical → physical)" in window.conversations.detail.table_label.text()
    assert window.conversations.model.rowCount() == 1


def test_click_used_cell_shows_its_tokens_and_free_cell_says_free(qtbot, make_window):
    window = make_window(setup=seeded(["The pool is paged."], steps=2), paused=True)
    snap = window.snapshot
    (cid, table), = snap.block_tables.items()
    info = snap.conversation(cid)
    tokens = info.prompt_token_ids + info.output_token_ids
    block = table[1]
    click_block(qtbot, window, block)
    assert window.inspector.block_id == block
    qtbot.waitUntil(lambda: len(window.inspector.slot_rows()) == 4, timeout=3000)
    rows = window.inspector.slot_rows()
    assert [r[1] for r in rows] == [4, 5, 6, 7]  # block size 4: logical block 1 holds positions 4..7
    assert [r[2] for r in rows] == list(tokens[4:8])
    assert f"conv {cid} (logical block 1)" in window.inspector.fields["owners"].text()
    assert "in use by conversation" in window.inspector.note.text()
    assert window.grid.selected_block == block and window.grid.highlight.isVisible()

    free = int(np.nonzero(np.asarray(snap.state) == BlockState.FREE)[0][-1])
    click_block(qtbot, window, free)
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.block_id == free, timeout=3000)
    assert "is free" in window.inspector.note.text()
    assert window.inspector.slot_rows() == []
    assert window.inspector.fields["state"].text() == "free"


def test_inspector_says_when_its_block_is_freed_or_cached(qtbot, make_window):
    window = make_window(setup=seeded(["Short one, two."], steps=1), paused=True)
    snap = window.snapshot
    (cid, table), = snap.block_tables.items()
    tail, full = table[-1], table[0]
    assert int(snap.num_filled[tail]) < 4  # a partial tail is freed, a full block stays cached
    click_block(qtbot, window, tail)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    window.conversations.select_conversation(cid)
    qtbot.mouseClick(window.conversations.buttons["end"], QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "has been freed" in window.inspector.note.text(), timeout=3000)
    qtbot.wait(500)  # later answers about the unchanged block keep the message
    assert "has been freed" in window.inspector.note.text()
    click_block(qtbot, window, full)
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.block_id == full, timeout=3000)
    assert "is cached" in window.inspector.note.text()
    assert window.inspector.fields["hash"].text()[:4] != "none"  # a full cached block has a prefix hash


def test_end_frees_blocks_in_the_next_frame(qtbot, make_window):
    window = make_window(setup=seeded(["First conversation here.", "Second one, also here."]), paused=True)
    snap = window.snapshot
    first, second = sorted(snap.block_tables)
    blocks = snap.block_tables[first]
    assert all(window.grid.cell_colour(b) == colour_of(first, window) for b in blocks)
    window.conversations.select_conversation(first)
    window.window_actions.end.trigger()
    after = wait_for_snapshot(qtbot, window, lambda s: first not in s.block_tables, timeout=3000)
    assert str(after.conversation(first).status) == "ended"
    assert window.grid.snapshot is after and window.grid.image is not None
    assert not window.grid._dirty  # drawn in the same frame that received the snapshot
    states = np.asarray(after.state)[list(blocks)]
    assert (states != BlockState.USED).all()
    for b in blocks:
        assert window.grid.cell_colour(b) != colour_of(first, window)
    assert second in after.block_tables
    model = window.conversations.model  # the table follows within a fraction of a second
    qtbot.waitUntil(lambda: model.data(model.index(model.row_of(first), 1)) == "ended", timeout=2000)


def test_shared_system_prompt_gives_ref_count_two(qtbot, make_window):
    window = make_window(speed=15, num_blocks=128)
    ids = []
    for question in ("First question?", "Second question?"):
        dialog = open_add_dialog(window, question, max_new_tokens=60, system=True)
        dialog.try_accept()
        qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=3000)
        snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == len(ids) + 1
                                 and s.conversations[-1].num_computed_tokens > 0)
        ids.append(snap.conversations[-1].conversation_id)
    snap = window.snapshot
    a, b = (snap.block_tables[i] for i in ids)
    common = [x for x, y in zip(a, b) if x == y]
    full_system_blocks = len(window.runner.engine.tokenize(SYSTEM_PROMPT)) // 4
    assert len(common) >= full_system_blocks - 1 > 0
    assert all(int(snap.ref_count[x]) == 2 for x in common)
    model = window.conversations.model
    qtbot.waitUntil(lambda: model.row_of(ids[1]) is not None, timeout=2000)
    qtbot.waitUntil(lambda: model.data(model.index(model.row_of(ids[1]), 5)) == str(len(common)), timeout=2000)
    # ref-count labels appear on shared cells when few enough cells are visible
    window.grid.box.setRange(QtCore.QRectF(0, 0, 8, 8), padding=0)
    window.grid._update_labels()
    texts = [label.textItem.toPlainText() for label in window.grid._labels if label.isVisible()]
    assert any(t.endswith("×2") for t in texts)


def test_engine_exception_reaches_a_dialog_and_app_keeps_running(qtbot, make_window, monkeypatch):
    window = make_window(setup=seeded(["Something to decode."], steps=0), paused=True)

    def boom():
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(window.runner.engine, "step", boom)
    window.runner.resume()
    qtbot.waitUntil(lambda: len(window.errors) > 0, timeout=3000)
    title, text = window.errors[-1]
    assert title == "Engine error" and "simulated kernel failure" in text
    box = window.message_boxes[-1]
    assert box.isVisible() and "RuntimeError" in box.detailedText()
    qtbot.waitUntil(lambda: window.controls.paused, timeout=2000)  # runner paused itself
    monkeypatch.undo()
    window.controls.pause_action.trigger()  # the user presses Run
    before = window.snapshot.step_id
    wait_for_snapshot(qtbot, window, lambda s: s.step_id > before + 2)
    assert window.timer.isActive()


def test_command_error_is_shown(qtbot, make_window):
    window = make_window(setup=seeded(["Soon finished."], max_new_tokens=2, steps=4), paused=True)
    cid = window.snapshot.conversations[0].conversation_id
    assert str(window.snapshot.conversation(cid).status) == "finished"
    window.fork_conversation(cid)  # forking a finished conversation is an EngineError
    qtbot.waitUntil(lambda: len(window.errors) > 0, timeout=3000)
    assert window.errors[-1][0] == "Command refused"
    assert window.message_boxes[-1].isVisible()


def test_reply_to_finished_conversation_reuses_its_blocks(qtbot, make_window):
    window = make_window(setup=seeded(["Tell me about pages and tables."], max_new_tokens=3, steps=6), paused=True)
    cid = window.snapshot.conversations[0].conversation_id
    window.conversations.select_conversation(cid)
    qtbot.waitUntil(lambda: window.conversations.buttons["reply"].isEnabled(), timeout=2000)
    dialog = window.open_reply_dialog(cid)
    dialog.message.setPlainText(" And then?")
    dialog.max_new_tokens.setText("4")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=3000)
    window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.conversation(cid).num_cached_tokens > 0, timeout=5000)
    assert snap.conversation(cid).prompt_text.endswith(" And then?")


def test_pause_step_and_speed_controls(qtbot, make_window):
    window = make_window(setup=seeded(["Control me."], steps=0, max_new_tokens=30), paused=True)
    start = window.snapshot.step_id
    window.controls.step_action.trigger()
    wait_for_snapshot(qtbot, window, lambda s: s.step_id == start + 1, timeout=3000)
    qtbot.wait(150)
    assert window.snapshot.step_id == start + 1  # paused: exactly one step
    window.controls.speed.setCurrentIndex(window.controls.speed.findData(30.0))
    qtbot.waitUntil(lambda: window.runner.max_steps_per_second == 30.0, timeout=2000)
    window.controls.pause_action.trigger()
    wait_for_snapshot(qtbot, window, lambda s: s.step_id > start + 3)
    qtbot.waitUntil(lambda: "live" in window.status_labels["live"].text(), timeout=2000)
    assert "steps/s" in window.status_labels["engine"].text() and "fps" in window.status_labels["gui"].text()


def test_engine_pause_is_a_command_not_a_checkbox(qtbot, make_window):
    """Engine > Pause showed a checkbox and a pause glyph: the action says what pressing it does instead."""
    window = make_window(paused=True)
    action = window.controls.pause_action
    assert not action.isCheckable() and action.text() == "▶ Run" and window.controls.paused
    action.trigger()
    qtbot.waitUntil(lambda: not window.runner.paused, timeout=3000)
    assert action.text() == "❚❚ Pause"
    action.trigger()
    qtbot.waitUntil(lambda: window.runner.paused, timeout=3000)
