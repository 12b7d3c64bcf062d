"""File and help actions of the window: export PNG/JSON, record and open pool streams, demos, help, shortcuts.

Each action is a plain function of the window so menus, tests and the command line share it. Anything that can
fail on the user's input (a path that cannot be written, a file that is not a recording) ends in a message that
says what happened, and leaves the window as it was.
"""
from __future__ import annotations

import json
import os

from PySide6 import QtCore, QtWidgets

from . import file_dialogs

EXPORT_KINDS = {  # kind -> (dialog title, file filter, default suffix)
    "window": ("Export window as PNG", "PNG images (*.png)", ".png"),
    "grid": ("Export grid as PNG", "PNG images (*.png)", ".png"),
    "json": ("Export current view as JSON", "JSON (*.json)", ".json"),
}


def _writable(path: str) -> str:
    """'' if ``path`` can be written, else why not."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return ""


# ---- export -------------------------------------------------------------------------------------------------------
def view_json(window) -> dict:
    """The current view as one JSON object: DESIGN.md's --json summary, plus what is being viewed and from where."""
    from kvstream.summary import json_summary
    source = window.source
    if source.view is None:
        raise ValueError("there is no view to export yet")
    data = dict(json_summary(source.view))
    data["viewing_history_seq"] = source.viewing
    data["title"] = source.feed.title
    data["conversations"] = [
        {"id": c.conversation_id, "status": str(c.status), "label": c.label, "prompt_tokens": len(c.prompt_token_ids),
         "output_tokens": len(c.output_token_ids), "output_text": c.output_text,
         "finish_reason": None if c.finish_reason is None else str(c.finish_reason)}
        for c in source.view.conversations]
    return data


def export(window, kind: str, path: str) -> str:
    """Write the window, the grid or the current view to ``path``; returns the path (raises ValueError/OSError)."""
    if kind not in EXPORT_KINDS:
        raise ValueError(f"unknown export {kind!r}; choose one of {', '.join(EXPORT_KINDS)}")
    problem = _writable(path)
    if problem:
        raise ValueError(f"cannot write {path}: {problem}")
    if kind == "json":
        text = json.dumps(view_json(window), indent=1)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        return path
    widget = window if kind == "window" else window.grid
    if not widget.grab().save(path, "PNG"):
        raise OSError(f"could not save a PNG to {path}")
    return path


def export_dialog(window, kind: str) -> None:
    title, pattern, suffix = EXPORT_KINDS[kind]
    path, _ = file_dialogs.save_file_name(window, title, f"explorer-{kind}{suffix}", pattern)
    if not path:
        return
    if not path.endswith(suffix):
        path += suffix
    try:
        export(window, kind, path)
    except (ValueError, OSError, ImportError) as exc:
        window.show_error("Export failed", str(exc))
        return
    window.statusBar().showMessage(f"Saved {path}", 5000)


# ---- recording and opening ------------------------------------------------------------------------------------------
RECORDING_SUFFIX = ".kvpool"  # what a new recording is called (the README's run.kvpool)
RECORDING_SUFFIXES = (".kvpool", ".kvrec")  # what recordings are called (.kvrec: files of earlier versions)
RECORDING_FILTER = ("Pool-stream recordings (" + " ".join(f"*{s}" for s in RECORDING_SUFFIXES) + ");;"
                    "All files (*)")  # the Record and Open dialogs' filter


def recording_path(path: str) -> str:
    """``path`` as a recording's name: a name without a suffix gets .kvpool; any other is taken as typed."""
    return path + RECORDING_SUFFIX if path and not os.path.splitext(os.path.basename(path))[1] else path


def start_recording_dialog(window) -> None:
    path, _ = file_dialogs.save_file_name(window, "Record the pool stream", "explorer" + RECORDING_SUFFIX,
                                          RECORDING_FILTER)
    if path:
        start_recording(window, recording_path(path))


def start_recording(window, path: str) -> bool:
    """Save the local engine's frames to ``path`` from now on; False (and a message) when it cannot."""
    feed = window.source.feed
    if not feed.capabilities.can_record:
        window.show_error("Cannot record", f"Only the local engine can be recorded; this source is a {feed.kind} "
                          "(it is already a stream: open or attach it again instead).")
        return False
    if feed.recorders:
        window.show_error("Cannot record", f"Already recording to {feed.recorders[-1][0].path}; stop that first.")
        return False
    problem = _writable(path)
    if problem:
        window.show_error("Cannot record", f"Cannot write {path}: {problem}.")
        return False
    from kvstream.recording import Recorder
    try:
        recorder = Recorder(path)
    except (ValueError, OSError) as exc:
        window.show_error("Cannot record", str(exc))
        return False
    feed.start_recording(recorder)
    window.window_actions.stop_record.setEnabled(True)
    window.statusBar().showMessage(f"Recording to {path}", 5000)
    return True


def stop_recording(window) -> str | None:
    """Stop the recording File > Record started; returns its path. "Recording saved" is said once the engine
    thread has let go of the file and it is closed (its frame count is then final)."""
    feed = window.source.feed
    stopped = feed.stop_recording() if hasattr(feed, "stop_recording") else None
    window.window_actions.stop_record.setEnabled(False)
    if stopped is None:
        return None
    recorder, closed = stopped
    window.statusBar().showMessage(f"Stopping the recording to {recorder.path}…", 3000)

    def saved(rec) -> None:
        window.statusBar().showMessage(f"Recording saved: {rec.path} ({rec.frames_written} frames)", 8000)

    def failed(exc: BaseException) -> None:
        window.show_error("Recording not saved", f"Closing {recorder.path} failed: {exc}")

    window.source.futures.watch(closed, saved, failed)
    return recorder.path


def open_dialog(window) -> None:
    path, _ = file_dialogs.open_file_name(window, "Open a recording", "", RECORDING_FILTER)
    if path:
        open_recording(window, path)


def open_recording(window, path: str) -> bool:
    """Replace the active source by the recording at ``path``; on a bad file say why and keep the current one."""
    from ..feeds.stream_feed import RecordingFeed
    try:
        feed = RecordingFeed.open(path)
    except (ValueError, OSError) as exc:
        window.show_error("Cannot open recording", str(exc))
        return False
    stopped = _outputs_of(window.source.feed)
    window.set_feed(feed)
    window.statusBar().showMessage(f"Opened {path}: read-only; Engine > Restart starts a local engine again."
                                   + (f" {stopped} stopped with the local engine." if stopped else ""), 8000)
    return True


def open_dropped(window, path: str) -> None:
    """A file dropped on the window: a recording opens as File > Open does, anything else as a trace (the reader
    says in one line what is wrong with a file that is neither)."""
    from kvstream.recording import MAGIC
    from .traces import open_trace
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(MAGIC))
    except OSError as exc:
        window.show_error("Cannot open file", f"{path}: {exc.strerror or exc}")
        return
    if head == MAGIC:
        open_recording(window, path)
    else:
        open_trace(window, path)


def _outputs_of(feed) -> str:
    """The recordings and publishers of a local engine feed, in words ("" for none or another kind of feed)."""
    sinks = list(getattr(feed, "outputs", ())) + [r for r, _ in getattr(feed, "recorders", ())]
    names = [f"recording {s.path}" if hasattr(s, "path") else f"publishing on {s.endpoint}" for s in sinks
             if hasattr(s, "path") or hasattr(s, "endpoint")]
    return ", ".join(names)[:1].upper() + ", ".join(names)[1:] if names else ""


# ---- demos and help ---------------------------------------------------------------------------------------------------
def start_demo(window, name: str, confirm: bool = True) -> None:
    """Restart with a demo workload (busy, crowd) or open the lesson; asks first if live conversations would go."""
    if name == "lesson":
        window.open_lesson()
        return
    from ..feeds.demo import DEMOS
    from ..feeds.traffic_demo import NAME as TRAFFIC
    if name not in DEMOS and name != TRAFFIC:
        window.show_error("Unknown demo", f"There is no demo {name!r}; the demos are {', '.join(DEMOS)}, {TRAFFIC} "
                          "and lesson.")
        return
    view = window.source.live
    live = [c for c in view.conversations if c.is_live] if view is not None else []
    if confirm and live and window.source.capabilities.can_command:
        box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Question, f"Start the {name} demo",
                                    f"Starting the {name} demo restarts the engine and ends {len(live)} live "
                                    "conversation(s). Continue?",
                                    QtWidgets.QMessageBox.StandardButton.Yes
                                    | QtWidgets.QMessageBox.StandardButton.Cancel, window)
        yes = QtWidgets.QMessageBox.StandardButton.Yes
        box.buttonClicked.connect(lambda button: box.standardButton(button) == yes
                                  and start_demo(window, name, confirm=False))
        window.demo_question = box
        box.open()
        return
    from ..feeds.demo import menu_demo_config
    cfg, before = menu_demo_config(window.config or window.engine_config, name, window.config_before_demo)
    if name == TRAFFIC:  # a trace replay, not seeded conversations
        from .traces import start_traffic_demo
        start_traffic_demo(window, cfg, before)
        return
    window.restart_engine(cfg, setup=DEMOS[name], demo=name, config_before_demo=before)


def open_help(window):
    """The help window (what each grid mark means, shortcuts, the lesson)."""
    from .help import HelpDialog
    if window.help_window is None:
        window.help_window = HelpDialog(window)
    window.help_window.show()
    window.help_window.raise_()
    return window.help_window


def show_shortcuts(window) -> QtWidgets.QDialog:
    """A table of every keyboard shortcut, read from the window's own actions."""
    dialog = QtWidgets.QDialog(window)
    dialog.setWindowTitle("Keyboard shortcuts")
    table = QtWidgets.QTableWidget(0, 2, dialog)
    table.setHorizontalHeaderLabels(["Keys", "Action"])
    table.verticalHeader().hide()
    table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
    for keys, text in window.window_actions.shortcut_rows():
        row = table.rowCount()
        table.insertRow(row)
        table.setItem(row, 0, QtWidgets.QTableWidgetItem(keys))
        table.setItem(row, 1, QtWidgets.QTableWidgetItem(text))
    table.resizeColumnsToContents()
    table.horizontalHeader().setStretchLastSection(True)
    buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.StandardButton.Close)
    buttons.rejected.connect(dialog.reject)
    layout = QtWidgets.QVBoxLayout(dialog)
    layout.addWidget(table)
    layout.addWidget(buttons)
    dialog.resize(440, 420)
    dialog.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
    window.shortcuts_dialog = dialog
    dialog.show()
    return dialog
