"""Menus: File, Engine, Conversation, Pool, View, Demos, Help; demos and the lesson from the menu, help, shortcuts,
the contiguous view side by side (pytest-qt, offscreen, real engine)."""
from PySide6 import QtWidgets

from explorer.window import files
from explorer.window.help import HelpDialog
from test_gui_support import wait_for_snapshot


def menu_titles(window):
    return [a.text().replace("&", "") for a in window.menuBar().actions()]


def test_menus_are_all_there(qtbot, make_window):
    window = make_window(paused=True)
    assert menu_titles(window) == ["File", "Engine", "Conversation", "Pool", "View", "Demos", "Help"]
    rows = dict((text, keys) for keys, text in window.window_actions.shortcut_rows())
    assert rows["Add"] == "Ctrl+N" and rows["Lesson"] == "Ctrl+L" and rows["Quit"] == "Ctrl+Q"
    view = window.view_menu.actions()
    assert any(a.text() == "Inspector" for a in view) and any(a.text() == "Event log" for a in view)
    dialog = files.show_shortcuts(window)
    table = dialog.findChild(QtWidgets.QTableWidget)
    assert table.rowCount() == len(window.window_actions.shortcut_rows()) >= 10
    dialog.close()


def test_help_and_lesson_from_the_menus(qtbot, make_window):
    window = make_window(paused=True)
    window.window_actions.help.trigger()
    assert isinstance(window.help_window, HelpDialog) and window.help_window.isVisible()
    assert any("Ctrl+N" in text for text in window.help_window.texts())
    window.window_actions.demos["lesson"].trigger()
    assert window.lesson_window is not None and window.lesson_window.isVisible()
    assert window.errors == []


def test_busy_demo_from_the_menu_asks_before_ending_live_conversations(qtbot, make_window):
    def one_live(engine):
        engine.add_conversation("Still talking here.", max_new_tokens=100)
    window = make_window(setup=one_live, paused=True)
    feed = window.source.feed
    window.window_actions.demos["busy"].trigger()
    box = window.demo_question
    assert box.isVisible() and "ends 1 live conversation" in box.text()
    box.button(QtWidgets.QMessageBox.StandardButton.Cancel).click()
    qtbot.wait(100)
    assert window.source.feed is feed and window._loader is None  # cancelled: nothing restarted
    window.window_actions.demos["busy"].trigger()
    window.demo_question.button(QtWidgets.QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: window.source.feed is not feed, timeout=15000)
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 5)
    assert window.runner.max_steps_per_second == 10.0 and not window.runner.paused  # the demo's pace
    assert sum(1 for c in snap.conversations if c.parent_id is not None) == 1  # busy forks one
    assert not feed.runner.alive


def test_contiguous_view_side_by_side_toggles(qtbot, make_window):
    def three(engine):
        for prompt in ("One.", "Two, a bit longer.", "Three, the longest of them all."):
            engine.add_conversation(prompt, max_new_tokens=40)
        engine.step()
    window = make_window(setup=three, paused=True)
    window.window_actions.contiguous.trigger()
    pane = window.pane
    assert window.window_actions.contiguous.isChecked() and pane.contiguous is not None
    qtbot.waitUntil(lambda: pane.contiguous.isVisible() and pane.contiguous.image is not None, timeout=3000)
    assert "running" in pane.contiguous.summary_text()
    assert pane.split.indexOf(pane.contiguous) == 1 and pane.grid.isVisible()  # beside the grid, not instead
    grid, contiguous = pane.split.sizes()  # halves (found in the X window: the grid got a third)
    assert abs(grid - contiguous) <= 0.1 * (grid + contiguous), (grid, contiguous)
    window.window_actions.contiguous.trigger()
    assert pane.contiguous is None and not window.window_actions.contiguous.isChecked()


def test_a_demo_restart_leaves_no_view_with_a_selection_of_the_engine_before(qtbot, make_window):
    """Issue 49: after a restart from the Demos menu the table kept conversation 1 selected (the new engine has a
    conversation 1 too) while the grid was undimmed, and the inspector kept the previous block's heatmap axes with
    no block selected. Every view now agrees that nothing is selected."""
    def two(engine):
        engine.add_conversation("Hello there, a prompt long enough to take blocks", max_new_tokens=30)
        engine.add_conversation("Another prompt, also long enough to take blocks", max_new_tokens=30)
    window = make_window(setup=two, paused=True)
    window.runner.step_once()
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 1)
    window.conversations.select_conversation(1)
    window.select_block(snap.block_tables[1][0])
    qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.plot.isVisible(), timeout=5000)
    assert window.grid.selected_conversation == 1
    old = window.runner
    files.start_demo(window, "busy", confirm=False)
    qtbot.waitUntil(lambda: window.runner is not old and window.source.live is not None, timeout=30000)
    new = wait_for_snapshot(qtbot, window, lambda s: s.conversation(1) is not None)  # the new engine's own 1
    window._refresh_panels(new)
    assert window.conversations.selected_conversation() is None and window.grid.selected_conversation is None
    assert window.inspector.block_id is None and not window.inspector.plot.isVisible()
    assert window.conversations.detail.title.text().startswith("Select a conversation")


def test_an_empty_pool_says_how_to_start_and_a_full_one_does_not(qtbot, make_window):
    """Issue 49: `--model smollm2` without a demo opened an empty pool with no word on what to do."""
    from explorer.window.main_window import EMPTY_POOL_HINT
    empty = make_window(paused=True)
    assert empty.status.currentMessage() == EMPTY_POOL_HINT and "Add" in EMPTY_POOL_HINT
    busy = make_window(setup=lambda e: e.add_conversation("Hello", max_new_tokens=4), paused=True)
    assert busy.status.currentMessage() != EMPTY_POOL_HINT


def test_the_loading_dialog_says_which_model_loads_and_why(qtbot):
    """Issue 49: a demo switched to SmolLM2 once it was fetched, with 29 s of loading and no word in the window on
    which model or why; the progress dialog keeps that line above each progress message."""
    from explorer.window.loader import EngineLoader, progress_dialog
    loader = EngineLoader()
    why = "busy demo: running SmolLM2-135M-Instruct (fetched; --model builtin runs the built-in model)"
    dialog = progress_dialog(None, "Loading smollm2 model…", loader, why)
    qtbot.addWidget(dialog)
    assert dialog.labelText().startswith(why)
    loader.progress.emit("reading the weights", 0.5)
    assert dialog.labelText() == f"{why}\nreading the weights" and dialog.value() == 500


def test_a_demo_switch_leaves_nothing_behind(qtbot, make_window):
    """Issue 49: ten Demos-menu switches grew the window's memory. Each switch made a loader and a progress dialog
    as children of the window that stayed until it closed, the loader holding what it last carried (the traffic
    demo's replay, and with it the whole engine it fed). After a switch and a collection, no earlier engine is
    alive, no loader or progress dialog is left, and the window's children stay as many."""
    import gc
    import weakref

    from PySide6 import QtCore

    from explorer.window.loader import EngineLoader
    window = make_window(paused=True, num_blocks=256, block_size=16)
    engines, counts = [], []
    for demo in ("traffic", "busy", "traffic", "busy"):
        old = weakref.ref(window.runner)
        engines.append(weakref.ref(window.runner.engine))
        files.start_demo(window, demo, confirm=False)
        qtbot.waitUntil(lambda: window.runner is not old() and window.source.live is not None, timeout=60000)
        wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 1)
        qtbot.waitUntil(lambda: window._loader is None, timeout=5000)
        QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete)  # what deleteLater let go
        gc.collect()
        assert [ref() for ref in engines] == [None] * len(engines)  # every engine before this one is gone
        assert window.findChildren(EngineLoader) == [] and window.findChildren(QtWidgets.QProgressDialog) == []
        counts.append(len(window.findChildren(QtCore.QObject)))
    assert counts[3] == counts[1] and counts[2] <= counts[0]  # the same demo again: no more children than before
