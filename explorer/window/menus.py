"""The window's menus and toolbar actions: File, Engine, Conversation, Pool, View, Demos, Help.

Actions that change the pool are listed in ``window.command_actions`` so the window can disable them, with the
reason in their tooltip, when the source is read-only. Every action with a shortcut shows up in Help > Keyboard
shortcuts, which is built from these same actions and so cannot drift from them.
"""
from __future__ import annotations

from PySide6 import QtGui, QtWidgets

from . import files


def _action(window, menu: QtWidgets.QMenu, text: str, shortcut: str | None, slot, tip: str = "") -> QtGui.QAction:
    action = QtGui.QAction(text, window)
    if shortcut:
        action.setShortcut(QtGui.QKeySequence(shortcut))
    if tip:
        action.setToolTip(tip)
        action.setStatusTip(tip)
    action.triggered.connect(lambda _checked=False: slot())
    menu.addAction(action)
    return action


def build_menus(window) -> None:
    """Create the menu bar, fill the engine toolbar, and set the action attributes the window and tests use."""
    bar = window.menuBar()
    controls = window.controls

    file_menu = bar.addMenu("&File")
    window.record_action = _action(window, file_menu, "Record…", None,
                                   lambda: files.start_recording_dialog(window),
                                   "Save the local engine's pool stream to a file while it runs")
    window.stop_record_action = _action(window, file_menu, "Stop recording", None,
                                        lambda: files.stop_recording(window))
    window.stop_record_action.setEnabled(False)
    window.open_action = _action(window, file_menu, "Open recording…", "Ctrl+O", lambda: files.open_dialog(window),
                                 "Replay a recording with the timeline (read-only)")
    export = file_menu.addMenu("Export")
    window.export_window_action = _action(window, export, "Window as PNG…", None,
                                          lambda: files.export_dialog(window, "window"))
    window.export_grid_action = _action(window, export, "Grid as PNG…", None,
                                        lambda: files.export_dialog(window, "grid"))
    window.export_json_action = _action(window, export, "Current view as JSON…", None,
                                        lambda: files.export_dialog(window, "json"))
    file_menu.addSeparator()
    window.quit_action = _action(window, file_menu, "Quit", "Ctrl+Q", window.close)

    engine_menu = bar.addMenu("&Engine")
    engine_menu.addAction(controls.pause_action)
    engine_menu.addAction(controls.step_action)
    engine_menu.addSeparator()
    engine_menu.addAction(controls.restart_action)
    window.restart_action = controls.restart_action

    conv = bar.addMenu("&Conversation")
    window.add_action = _action(window, conv, "Add…", "Ctrl+N", window.open_add_dialog,
                                "Add a conversation (prompt, samples, system prompt)")
    window.fork_action = _action(window, conv, "Fork", "Ctrl+F", lambda: window.with_selected(window.fork_conversation),
                                 "Fork the selected conversation: the fork shares all its blocks")
    window.reply_action = _action(window, conv, "Reply…", "Ctrl+R",
                                  lambda: window.with_selected(window.open_reply_dialog),
                                  "Send a follow-up message to the selected finished conversation")
    window.end_action = _action(window, conv, "End", "Ctrl+E", lambda: window.with_selected(window.end_conversation),
                                "End the selected conversation: its blocks are released at once")

    pool = bar.addMenu("&Pool")
    relocate = pool.addMenu("Relocate blocks")
    window.scramble_action = _action(window, relocate, "Scramble", "Ctrl+Shift+S", lambda: window.relocate(False),
                                     "Move every block to a random other physical id while decoding")
    window.compact_action = _action(window, relocate, "Compact to low ids", "Ctrl+Shift+C",
                                    lambda: window.relocate(True), "Move blocks towards the lowest physical ids")

    view = window.view_menu = bar.addMenu("&View")
    window.back_to_live_action = _action(window, view, "Back to live", "End", lambda: window.source.go_live(),
                                         "Leave the history frame and show the newest one")
    window.back_to_live_action.setEnabled(False)
    window.contiguous_action = _action(window, view, "Contiguous allocator side by side", "Ctrl+Shift+K",
                                       lambda: window.set_contiguous(window.contiguous_action.isChecked()),
                                       "Beside the paged grid: the same conversations reserved prompt + max new "
                                       "tokens each, in one run of slots (what paging replaces)")
    window.contiguous_action.setCheckable(True)
    view.addSeparator()
    for key in window.docks:
        view.addAction(window.docks[key].toggleViewAction())
    window.view_menu_docks_end = view.addSeparator()
    window.reset_layout_action = _action(window, view, "Reset layout", None, window.reset_layout,
                                         "Arrange the panels as on first launch, for this window size")

    demos = bar.addMenu("&Demos")
    window.demo_actions = {}
    for name, text, tip in (("busy", "Busy: shared prefixes, a fork, tails", "A few conversations that share "
                             "system-prompt blocks, a fork and a short one that leaves cached blocks"),
                            ("crowd", "Crowd: many conversations", "Many conversations of mixed lengths, for "
                             "large pools")):
        window.demo_actions[name] = _action(window, demos, text, None, lambda n=name: files.start_demo(window, n), tip)
    demos.addSeparator()
    window.lesson_action = _action(window, demos, "Lesson…", "Ctrl+L", window.open_lesson,
                                   "The source text's experiment, one position at a time")
    window.demo_actions["lesson"] = window.lesson_action

    help_menu = bar.addMenu("&Help")
    window.help_action = _action(window, help_menu, "What the grid shows…", "F1", lambda: files.open_help(window))
    window.shortcuts_action = _action(window, help_menu, "Keyboard shortcuts…", None,
                                      lambda: files.show_shortcuts(window))
    help_menu.addAction(window.lesson_action)

    controls.addSeparator()
    controls.addAction(window.add_action)
    controls.addSeparator()
    controls.addWidget(QtWidgets.QLabel(" Relocate: "))
    controls.addAction(window.scramble_action)
    controls.addAction(window.compact_action)
    controls.addSeparator()
    controls.addAction(window.lesson_action)

    window.command_actions = [controls.pause_action, controls.step_action, window.add_action, window.fork_action,
                              window.reply_action, window.end_action, window.scramble_action, window.compact_action,
                              window.record_action]


def shortcut_rows(window) -> list[tuple[str, str]]:
    """(shortcut, what it does) for every action of the window that has one, in menu order."""
    rows, seen = [], set()
    for menu_action in window.menuBar().actions():
        menu = menu_action.menu()
        stack = [menu] if menu is not None else []
        while stack:
            for action in stack.pop(0).actions():
                if action.menu() is not None:
                    stack.append(action.menu())
                    continue
                key = action.shortcut().toString(QtGui.QKeySequence.SequenceFormat.NativeText)
                if key and id(action) not in seen:
                    seen.add(id(action))
                    rows.append((key, action.text().replace("&", "").rstrip("…").strip()))
    return rows
