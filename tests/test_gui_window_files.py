"""File menu and read-only sources in the window: export PNG/JSON, record at runtime and open the recording
(commands disabled, with the reason), a bad file changes nothing, attached pools side by side (pytest-qt, offscreen,
real engine, real pool stream over ipc)."""
import fnmatch
import json
import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from PySide6 import QtGui, QtWidgets

from explorer.window import files
from explorer.feeds.engine_feed import EngineFeed
from explorer.window.main_window import MainWindow
from explorer.feeds.stream_feed import ATTACH_READ_ONLY, RECORDING_READ_ONLY, AttachFeed
from kvstream.poolstream.publisher import PoolStreamPublisher
from kvstream.recording import read_frames
from kvstream.summary import fixed_part, json_summary
from engine import Engine
from test_gui_support import make_config, wait_for_snapshot


def two_conversations(engine):
    engine.add_conversation("Files and frames.", max_new_tokens=100, temperature=0.0, ignore_eos=True)
    engine.add_conversation("Another, for the record.", max_new_tokens=100, temperature=0.0, ignore_eos=True)
    engine.step()


def test_export_window_grid_and_view_json(qtbot, make_window, tmp_path):
    window = make_window(setup=two_conversations, paused=True)
    for kind, name in (("window", "w.png"), ("grid", "g.png")):
        path = files.export(window, kind, str(tmp_path / name))
        image = QtGui.QImage(path)
        assert not image.isNull() and image.width() > 100
    assert QtGui.QImage(str(tmp_path / "w.png")).width() == window.width()
    path = files.export(window, "json", str(tmp_path / "view.json"))
    data = json.loads(open(path).read())
    assert fixed_part(data) == fixed_part(json_summary(window.snapshot))
    assert data["viewing_history_seq"] is None and len(data["conversations"]) == 2
    for bad, words in ((str(tmp_path / "no-such-dir" / "x.png"), "does not exist"), (str(tmp_path), "is a folder")):
        try:
            files.export(window, "window", bad)
        except ValueError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(f"exporting to {bad} must be refused")


def _join_late(runner, seconds):
    """Make ``runner.add_observer`` take effect ``seconds`` later (a loaded machine's queued command): steps land
    between File > Record and the recorder's first frame, as they did when this test failed under load."""
    real = runner.add_observer

    def add_observer(observer):
        joined = Future()
        threading.Timer(seconds, lambda: real(observer).add_done_callback(
            lambda done: joined.set_result(done.result()))).start()  # resolved on the engine thread, as the real one
        return joined

    runner.add_observer = add_observer


@pytest.mark.parametrize("late", [False, True], ids=["prompt-join", "late-join"])
def test_record_at_runtime_then_open_it_read_only(qtbot, make_window, tmp_path, late):
    window = make_window(setup=two_conversations, speed=40, history=True)
    if late:
        _join_late(window.runner, 0.25)
    path = str(tmp_path / "run.kvpool")
    assert files.start_recording(window, path)
    assert window.window_actions.stop_record.isEnabled()
    # The recorder joins on the engine thread once its queued command runs, so steps may land between the request
    # and its first frame: the recording starts where the file says, not at the step the GUI saw at the request.
    recorder, joining = window.source.feed.recorders[-1]
    qtbot.waitUntil(lambda: joining.primed and recorder.frames_written >= 1, timeout=3000)
    start = next(read_frames(path)).step_id  # the first step it actually recorded, read from the file
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= start + 6)
    assert files.stop_recording(window) == path
    engine_feed = window.source.feed
    assert engine_feed.recorders == []
    qtbot.wait(200)  # the engine thread lets go of the recorder (removing the observer is a runner command)
    recorded_to = engine_feed.runner.latest.step_id
    assert files.open_recording(window, path)
    qtbot.waitUntil(lambda: window.source.feed.kind == "recording", timeout=2000)
    assert not engine_feed.runner.alive  # the engine it replaced was stopped
    source = window.source
    assert source.command_blocked_reason == RECORDING_READ_ONLY
    for action in (window.window_actions.add, window.window_actions.fork, window.window_actions.scramble, window.controls.pause_action):
        assert not action.isEnabled() and RECORDING_READ_ONLY in action.toolTip()
    assert not window.conversations.buttons["add"].isEnabled()
    assert RECORDING_READ_ONLY in window.pane.header.text()
    wait_for_snapshot(qtbot, window, lambda s: s is source.live)
    history = source.history
    assert len(history) >= 6 and history.step_of(history.first_seq) == start
    assert start + 6 <= source.live.step_id <= recorded_to
    assert window.pane.timeline.isVisible() and not window.pane.timeline.live_source
    # its size is the file's (the timeline had said the memory estimate of its frames: 513 MiB for 403 MiB)
    assert window.pane.timeline.kept_bytes == history.recording.num_bytes == os.path.getsize(path)
    window.pane.timeline.seek(history.first_seq)  # scrub back to where the recording started
    assert window.snapshot.step_id == history.step_of(history.first_seq)
    window.window_actions.add.trigger()  # disabled: nothing happens, no dialog
    assert window.add_dialog is None and window.errors == []
    window.commands.fork(0)  # a direct call is refused with the reason, nothing sent
    assert RECORDING_READ_ONLY in window.statusBar().currentMessage()
    # the metrics come from the recording itself (found in the X window: a recording's plots stayed empty)
    steps = [history.step_of(s) for s in history.seqs()]
    qtbot.waitUntil(lambda: not window.metrics_backfill.active, timeout=5000)
    sampled = window.metrics.history.series("step")
    assert sorted(set(sampled)) == sorted(set(steps))  # one sample per recorded step
    assert np.isnan(window.metrics.history.series("tokens_per_s")).all()  # no wall clock in a recording
    assert (window.metrics.history.series("used") > 0).all()
    window.metrics.redraw()
    x, _ = window.metrics.curves[0][1].getData()
    assert x.max() == window.snapshot.step_id  # scrubbed to the first frame: metrics up to that step


def test_record_and_open_dialogs_offer_kvpool_and_kvrec(qtbot, make_window, tmp_path, monkeypatch):
    """The README's recordings are run.kvpool: File > Record proposes explorer.kvpool (a name typed without a
    suffix gets .kvpool), and both dialogs list *.kvpool and the earlier *.kvrec files."""
    window = make_window(setup=two_conversations, speed=40, history=True)
    asked = []

    def save(parent, title, name, pattern):
        asked.append(("save", name, pattern))
        return str(tmp_path / "run"), pattern.split(";;")[0]

    def open_(parent, title, folder, pattern):
        asked.append(("open", folder, pattern))
        return str(tmp_path / "run.kvpool"), pattern.split(";;")[0]

    monkeypatch.setattr(files.file_dialogs, "save_file_name", save)
    monkeypatch.setattr(files.file_dialogs, "open_file_name", open_)
    files.start_recording_dialog(window)
    recorder, joining = window.source.feed.recorders[-1]
    assert recorder.path == str(tmp_path / "run.kvpool")
    qtbot.waitUntil(lambda: joining.primed and recorder.frames_written >= 2, timeout=3000)
    assert files.stop_recording(window) == str(tmp_path / "run.kvpool")
    qtbot.waitUntil(lambda: recorder.closed, timeout=3000)
    files.open_dialog(window)
    qtbot.waitUntil(lambda: window.source.feed.kind == "recording", timeout=3000)
    assert window.errors == []
    assert [a[0] for a in asked] == ["save", "open"] and asked[0][1] == "explorer.kvpool"
    for _, _, pattern in asked:
        globs = pattern.split(";;")[0].split("(")[1].rstrip(")").split()
        for name in ("run.kvpool", "old.kvrec"):
            assert any(fnmatch.fnmatch(name, g) for g in globs), (name, pattern)
    assert files.recording_path(str(tmp_path / "a.kvrec")) == str(tmp_path / "a.kvrec")  # taken as typed
    assert files.recording_path(str(tmp_path / "b.bin")) == str(tmp_path / "b.bin")


def test_a_bad_recording_is_refused_and_the_engine_keeps_running(qtbot, make_window, tmp_path):
    window = make_window(setup=two_conversations, speed=40)
    feed = window.source.feed
    bad = tmp_path / "bad.kvrec"
    bad.write_bytes(b"\x89KVPOOL\n" + b"\xff" * 40)
    assert not files.open_recording(window, str(bad))
    assert window.errors[-1][0] == "Cannot open recording" and "bad.kvrec" in window.errors[-1][1]
    assert window.source.feed is feed and feed.runner.alive
    before = window.snapshot.step_id
    wait_for_snapshot(qtbot, window, lambda s: s.step_id > before)


def test_two_attached_pools_side_by_side_each_with_its_header(qtbot, tmp_path):
    feeds, publishers = [], []
    for i, prompt in enumerate(("First pool decodes.", "Second pool decodes too.")):
        cfg = make_config(num_blocks=32 * (i + 1), block_size=4)
        engine = Engine(cfg)
        engine.add_conversation(prompt, max_new_tokens=40, temperature=0.0)
        publisher = PoolStreamPublisher(f"ipc://{tmp_path}/pool{i}")
        publishers.append(publisher)
        feeds.append(EngineFeed.start(engine, cfg, max_steps_per_second=20, extra_sinks=[publisher],
                                      history_bytes=None))
    attached = [AttachFeed.connect(f"ipc://{tmp_path}/pool{i}") for i in range(2)]
    window = MainWindow(feed=attached[0], extra_feeds=attached[1:])
    qtbot.addWidget(window)
    window.show()
    try:
        assert len(window.panes) == 2
        for i, pane in enumerate(window.panes):
            qtbot.waitUntil(lambda p=pane: p.source.view is not None, timeout=8000)
            assert f"ipc://{tmp_path}/pool{i}" in pane.header.text() and ATTACH_READ_ONLY in pane.header.text()
            qtbot.waitUntil(lambda p=pane: p.grid.frames_drawn > 0, timeout=3000)
        assert [p.source.view.num_blocks for p in window.panes] == [32, 64]
        assert window.source is window.panes[0].source and not window.window_actions.add.isEnabled()
        second = window.panes[1]
        window.activate_pane(second)  # the side panels follow the second pool now
        assert window.source is second.source and window.snapshot.num_blocks == 64
        table = next(iter(window.snapshot.block_tables.values()))
        window.select_block(table[0])
        qtbot.waitUntil(lambda: window.inspector.info is not None and window.inspector.info.block_id == table[0],
                        timeout=3000)
        assert window.inspector.info.keys is None and window.inspector.info.owners
        kv = window.inspector.kv_note  # an attached pool's K/V stay with the process that owns it, and it says so
        assert kv.isVisible() and "K/V values stay in the process that owns the pool" in kv.text(), kv.text()
        step = second.source.live.step_id
        qtbot.waitUntil(lambda: second.source.live.step_id > step, timeout=5000)  # live, frame by frame
    finally:
        window.close()
        for feed in feeds:
            feed.close()


def test_restarting_after_opening_a_recording_keeps_the_speed_box(qtbot, make_window, tmp_path):
    """Found in the X window: the speed box silently became "unlimited" when the engine restarted after a
    recording had been opened."""
    window = make_window(setup=lambda e: e.add_conversation("Keep my speed.", max_new_tokens=40), speed=30)
    qtbot.waitUntil(lambda: window.controls.speed.currentData() == 30.0, timeout=3000)
    path = str(tmp_path / "speed.kvpool")
    assert files.start_recording(window, path)
    recorder, joining = window.source.feed.recorders[-1]
    qtbot.waitUntil(lambda: joining.primed and recorder.frames_written >= 2, timeout=5000)
    assert files.stop_recording(window) == path
    qtbot.wait(200)
    config = window.config
    assert files.open_recording(window, path)
    qtbot.waitUntil(lambda: window.source.feed.kind == "recording", timeout=3000)
    window.restart_engine(config)
    qtbot.waitUntil(lambda: window.source.feed.kind == "engine", timeout=15000)
    qtbot.wait(300)
    assert window.source.feed.speed == 30.0 and window.controls.speed.currentData() == 30.0


def test_while_recording_the_status_bar_names_the_file_and_its_size(qtbot, make_window, tmp_path):
    window = make_window(setup=lambda e: e.add_conversation("Record me.", max_new_tokens=60), speed=30)
    path = str(tmp_path / "shown.kvpool")
    assert files.start_recording(window, path)
    recorder, joining = window.source.feed.recorders[-1]
    qtbot.waitUntil(lambda: recorder.frames_written >= 2, timeout=5000)
    qtbot.waitUntil(lambda: "● REC shown.kvpool" in window.status_labels["live"].text(), timeout=3000)
    assert "KiB" in window.status_labels["live"].text() or "MiB" in window.status_labels["live"].text()
    assert files.stop_recording(window) == path
    qtbot.waitUntil(lambda: "REC" not in window.status_labels["live"].text(), timeout=3000)


@pytest.mark.parametrize("kind", ["save", "open"])
def test_file_dialogs_name_icons_and_types_without_reading_a_file(qtbot, tmp_path, kind):
    """Qt's stock icon provider sniffs a file's first bytes for its MIME type (as root it blocked for good on
    /proc/kmsg): the window's dialogs say the same of a text file and a PNG whose names say nothing, and list a
    folder holding a FIFO without opening it."""
    from explorer.window import file_dialogs
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "notes").write_text("plain words, as a sniffer would find them\n" * 20)
    (tmp_path / "picture").write_bytes(bytes.fromhex("89504e470d0a1a0a0000000d49484452") + b"\0" * 64)
    (tmp_path / "sub").mkdir()
    dialog = file_dialogs.file_dialog(None, "t", str(tmp_path), "All files (*)", save=kind == "save")
    dialog.setOption(QtWidgets.QFileDialog.Option.DontUseNativeDialog, True)  # the Qt-drawn one, as on a bare X
    qtbot.addWidget(dialog)
    dialog.show()
    model = dialog.findChild(QtWidgets.QFileSystemModel)
    root = model.index(str(tmp_path))

    def types():
        rows = {model.index(r, 0, root).data(): model.type(model.index(r, 0, root))
                for r in range(model.rowCount(root))}
        return rows if all(rows.values()) else {}
    qtbot.waitUntil(lambda: set(types()) == {"notes", "picture", "sub"}, timeout=5000)
    seen = types()
    assert seen["sub"] == "Folder"
    assert seen["notes"] == seen["picture"] == "File"  # named from the entry, not from its bytes
    folders = file_dialogs.file_dialog(None, "t", str(tmp_path), folder=True)  # the checkpoint browser's
    assert isinstance(folders.iconProvider(), file_dialogs.PlainIcons)
    folders.deleteLater()
