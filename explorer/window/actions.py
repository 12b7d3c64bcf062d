"""Every action of the main window, as one object: the menus, the engine toolbar and the keyboard all read their
QActions from :class:`WindowActions`, and Help's table of shortcuts is made from the same object, so none of them
can drift from another.

The window is handed the object instead of carrying an attribute per action; which actions change the pool (and
are disabled, with the reason, while the source is read-only) is said once, here (:attr:`WindowActions.commands`).
"""
from __future__ import annotations

from PySide6 import QtGui

from . import files, traces


def _action(parent, text: str, shortcut: str | None, slot, tip: str = "") -> QtGui.QAction:
    action = QtGui.QAction(text, parent)
    if shortcut:
        action.setShortcut(QtGui.QKeySequence(shortcut))
    if tip:
        action.setToolTip(tip)
        action.setStatusTip(tip)
    action.triggered.connect(lambda _checked=False: slot())
    return action


DEMOS = (("busy", "Busy: shared prefixes, a fork, tails", "A few conversations that share system-prompt blocks, a "
          "fork and a short one that leaves cached blocks"),
         ("crowd", "Crowd: many conversations", "Many conversations of mixed lengths, for large pools"),
         ("serve", "Serve: traffic that never runs dry", "Requests arrive as at a server (the toolbar's arrivals "
          "slider sets the rate): shared system prompts, follow-ups, parallel samples, long prompts, early stops"),
         ("tiers", "Tiers: prefixes back from host memory", "A small device pool and a host tier: returning "
          "conversations load their evicted prefix back from host memory instead of recomputing it"),
         ("window", "Window: a sliding-window model", "A checkpoint whose layers alternate sliding-window and full "
          "attention: the sliding group releases blocks the model will never read again"),
         ("traffic", "Traffic: a real trace through the pool", "The first requests of Mooncake's production chat "
          "trace replayed live, on a pool where LRU keeps losing blocks the trace needs again (the Capacity dock "
          "shows how far it is from the optimum)"))


class WindowActions:
    """The window's actions, built from the window (whose slots they call: its source and its commands) and its
    engine toolbar (which owns Pause, Step and Restart). Enabling by the source's capabilities stays with the
    window (``MainWindow._enable_commands``), over :attr:`commands`."""

    def __init__(self, window, controls):
        w = window
        # File
        self.record = _action(w, "Record…", None, lambda: files.start_recording_dialog(w),
                              "Save the local engine's pool stream to a file while it runs")
        self.stop_record = _action(w, "Stop recording", None, lambda: files.stop_recording(w))
        self.stop_record.setEnabled(False)
        self.open = _action(w, "Open recording…", "Ctrl+O", lambda: files.open_dialog(w),
                            "Replay a recording with the timeline (read-only)")
        self.open_trace = _action(w, "Open trace…", "Ctrl+Shift+O", lambda: traces.open_trace_dialog(w),
                                  "Replay a request trace (Mooncake JSONL or kv-cache-tester JSON) live through the "
                                  "local engine, and sweep its hit rate against pool size (the Capacity dock)")
        self.export_window = _action(w, "Window as PNG…", None, lambda: files.export_dialog(w, "window"))
        self.export_grid = _action(w, "Grid as PNG…", None, lambda: files.export_dialog(w, "grid"))
        self.export_json = _action(w, "Current view as JSON…", None, lambda: files.export_dialog(w, "json"))
        self.quit = _action(w, "Quit", "Ctrl+Q", w.close)
        # Engine (the toolbar's own)
        self.pause, self.step, self.restart = controls.pause_action, controls.step_action, controls.restart_action
        # Conversation
        self.add = _action(w, "Add…", "Ctrl+N", w.open_add_dialog, "Add a conversation (prompt, samples, system prompt)")
        self.fork = _action(w, "Fork", "Ctrl+F", lambda: w.with_selected(w.fork_conversation),
                            "Fork the selected conversation: the fork shares all its blocks")
        self.reply = _action(w, "Reply…", "Ctrl+R", lambda: w.with_selected(w.open_reply_dialog),
                             "Send a follow-up message to the selected finished conversation")
        self.end = _action(w, "End", "Ctrl+E", lambda: w.with_selected(w.end_conversation),
                           "End the selected conversation: its blocks are released at once")
        # Pool
        self.scramble = _action(w, "Scramble", "Ctrl+Shift+S", lambda: w.relocate(False),
                                "Move every block to a random other physical id while decoding")
        self.compact = _action(w, "Compact to low ids", "Ctrl+Shift+C", lambda: w.relocate(True),
                               "Move blocks towards the lowest physical ids")
        self.check_prompt = _action(w, "Check a prompt…", "Ctrl+Shift+P", w.open_check_prompt,
                                    "Would this prompt hit? Which of its blocks the pool holds now, where, and why "
                                    "the others would miss")
        # View
        self.back_to_live = _action(w, "Back to live", "End", lambda: w.source.go_live(),
                                    "Leave the history frame and show the newest one")
        self.back_to_live.setEnabled(False)
        self.contiguous = _action(w, "Contiguous allocator side by side", "Ctrl+Shift+K",
                                  lambda: w.set_contiguous(self.contiguous.isChecked()),
                                  "Beside the paged grid: the same conversations reserved prompt + max new tokens "
                                  "each, in one run of slots (what paging replaces)")
        self.contiguous.setCheckable(True)
        self.reset_layout = _action(w, "Reset layout", None, w.reset_layout,
                                    "Arrange the panels as on first launch, for this window size")
        # Demos and Help
        self.demos = {name: _action(w, text, None, lambda n=name: files.start_demo(w, n), tip)
                      for name, text, tip in DEMOS}
        self.lesson = _action(w, "Lesson…", "Ctrl+L", w.open_lesson,
                              "The source text's experiment, one position at a time")
        self.demos["lesson"] = self.lesson
        self.help = _action(w, "What the grid shows…", "F1", lambda: files.open_help(w))
        self.shortcuts = _action(w, "Keyboard shortcuts…", None, lambda: files.show_shortcuts(w))

    @property
    def commands(self) -> list[QtGui.QAction]:
        """The actions that change the pool: usable only where the source takes commands."""
        return [self.pause, self.step, self.add, self.fork, self.reply, self.end, self.scramble, self.compact,
                self.record]

    def in_menu_order(self) -> list[QtGui.QAction]:
        return [self.record, self.stop_record, self.open, self.open_trace, self.export_window, self.export_grid,
                self.export_json, self.quit, self.pause, self.step, self.restart, self.add, self.fork, self.reply,
                self.end, self.scramble, self.compact, self.check_prompt, self.back_to_live, self.contiguous,
                self.reset_layout, *self.demos.values(), self.help, self.shortcuts]

    def shortcut_rows(self) -> list[tuple[str, str]]:
        """(shortcut, what it does) for every action that has one, in menu order."""
        rows = []
        for action in dict.fromkeys(self.in_menu_order()):  # the lesson is in two menus: once
            key = action.shortcut().toString(QtGui.QKeySequence.SequenceFormat.NativeText)
            if key:
                # an action whose text changes or carries a glyph ("❚❚ Pause", read as "▌▌ Pause" in the help)
                # names what it does in its "help_text" property
                rows.append((key, action.property("help_text") or action.text().replace("&", "").rstrip("…").strip()))
        return rows
