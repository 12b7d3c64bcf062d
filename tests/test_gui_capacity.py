"""Traces in the window (pytest-qt, offscreen, real engine): the Capacity dock sweeps on a worker thread and draws
the engine's figures, a new trace cancels the sweep in flight, a trace swept before is drawn from the cache, a click
on a point restarts the live replay there, File > Open trace and a dropped file replay a trace live (the table says
which request each conversation is and how its prompt blocks fared), a broken trace is one line and changes
nothing, and Demos > Traffic replays the shipped excerpt."""
import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets
from PySide6.QtTest import QTest

from engine import read_trace
from explorer.model.capacity import CapacitySpec, LiveMarker
from explorer.widgets.capacity import CapacityPanel
from explorer.widgets.conversations import COLUMNS, TRACE_COLUMN
from explorer.window import files, traces
from explorer.window.traces import ReplaySettings

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "resources" / "traces" / "mooncake_excerpt.jsonl"
FAST = ReplaySettings("timed", speed=50.0, scale=0.02)  # the excerpt's 141 s in 3, a few tokens a request


def small_trace(tmp_path, name="small.jsonl", count=40):
    """The excerpt's first ``count`` requests, as a file of their own."""
    path = tmp_path / name
    path.write_text("".join(EXCERPT.read_text().splitlines(keepends=True)[:count]))
    return str(path)


def wait_swept(qtbot, panel, timeout=120_000):
    qtbot.waitUntil(lambda: panel.result is not None and panel.result.complete, timeout=timeout)
    return panel.result


def test_the_dock_sweeps_on_a_worker_and_draws_the_engines_figures(qtbot):
    panel = CapacityPanel()
    qtbot.addWidget(panel)
    panel.show()
    trace = read_trace(str(EXCERPT))
    spec = CapacitySpec(policies=("lru", "fifo"), max_blocks=64, points=8)
    names = []
    real_run = panel._run
    panel._run = lambda token, job: (names.append(threading.current_thread().name), real_run(token, job))
    panel.set_trace(trace, spec)
    assert panel.busy and panel.progress.isVisibleTo(panel)
    result = wait_swept(qtbot, panel)
    assert names == ["capacity sweep"]  # not the GUI thread: the window keeps its pace meanwhile
    assert not panel.progress.isVisibleTo(panel) and not panel.busy
    job = panel.job
    for policy in ("belady", "lru", "fifo"):
        xs, ys = panel.curves[policy].getOriginalDataset()
        assert xs.tolist() == list(job.plan.capacities)
        want = [job.sweep.point(policy, int(b)).hit_rate * 100 for b in xs]
        assert ys == pytest.approx(want)
    assert panel.ceiling.value() == pytest.approx(100 * job.sweep.infinite().hit_rate)
    assert "mooncake_excerpt.jsonl: 400 requests" in panel.header.text()
    qtbot.waitUntil(lambda: panel.answer.text() not in ("", "finding…"), timeout=60_000)
    lru = job.blocks_for_rate("lru", 0.25)
    assert lru is None and "LRU: never" in panel.answer.text()  # the excerpt's ceiling is below 25%
    panel.target.setValue(10.0)
    qtbot.waitUntil(lambda: 0.1 in panel.answers, timeout=60_000)
    assert f"Belady: {job.blocks_for_rate('belady', 0.10):,} blocks" in panel.answer.text()


def test_a_new_trace_cancels_the_sweep_in_flight_and_a_swept_one_comes_from_the_cache(qtbot, tmp_path):
    panel = CapacityPanel()
    qtbot.addWidget(panel)
    big, small = read_trace(str(EXCERPT)), read_trace(small_trace(tmp_path))
    spec = CapacitySpec(max_blocks=64)
    panel.set_trace(big, spec)
    first = panel.job
    panel.set_trace(small, spec)  # at once: the first sweep is cancelled
    assert first.cancelled and panel.job is not first
    result = wait_swept(qtbot, panel)
    assert result.infinite.total_blocks == int(np.diff(small.offsets).clip(max=64).sum())
    for thread in panel.threads:
        thread.join(60)
    assert not any(t.is_alive() for t in panel.threads)  # the cancelled sweep's thread ended too
    panel.set_trace(big, spec)
    wait_swept(qtbot, panel)
    started = len(panel.threads)
    panel.set_trace(small, spec)  # swept before: drawn at once, no new sweep
    assert panel.result is result and panel.result.complete and not panel.busy
    assert all(t.name != "capacity sweep" for t in panel.threads[started:])


def test_the_live_marker_sits_at_the_pools_size(qtbot):
    panel = CapacityPanel()
    qtbot.addWidget(panel)
    panel.set_live(LiveMarker(1024, "lru", 40, 1000, 50, 400, "timed"), bytes_per_block=4096, model="builtin")
    xs, ys = panel.marker_item.getOriginalDataset()
    assert (xs.tolist(), ys.tolist()) == ([1024.0], [4.0])
    assert panel.live.text().startswith("Live: LRU at 1,024 blocks, 4.0% of prompt blocks hit (50 of 400")
    assert panel.top_axis.tickStrings([3.0], 1.0, 1.0) == ["3.91 MiB"]  # 1,000 blocks of 4 KiB
    panel.set_live(None)
    assert panel.marker_item.getOriginalDataset()[0] is None and panel.live.text() == ""


def click_point(qtbot, panel, policy, blocks):
    """A real mouse click on ``policy``'s point at ``blocks`` in the plot."""
    curve = panel.curves[policy]
    xs, ys = curve.getOriginalDataset()
    y = ys[xs.tolist().index(blocks)]
    view = panel.plot.getViewBox()
    scene = view.mapViewToScene(QtCore.QPointF(math.log10(blocks), y))
    pos = panel.plot_widget.mapFromScene(scene)
    QTest.mouseClick(panel.plot_widget.viewport(), QtCore.Qt.MouseButton.LeftButton,
                     QtCore.Qt.KeyboardModifier.NoModifier, pos)


def test_opening_a_trace_replays_it_live_and_a_click_restarts_it_at_that_size(qtbot, make_window, tmp_path):
    window = make_window(num_blocks=256, block_size=16)
    window.resize(1600, 1000)
    path = small_trace(tmp_path)
    traces.open_trace(window, path, FAST)
    qtbot.waitUntil(lambda: window.trace_replay is not None, timeout=60_000)
    replay = window.trace_replay
    assert window.source.feed.trace is replay and replay.trace.path == path
    assert window.config.num_blocks == 256 and window.config.model == "builtin"  # the window's engine, not none
    panel = window.capacity
    assert window.docks["capacity"].isVisible()
    result = wait_swept(qtbot, panel)
    assert panel.job.spec.max_blocks == replay.max_blocks == 63  # swept as replayed: cut to the context
    # the table: which trace request each conversation is, and its prompt blocks by outcome
    view = window.conversations.view
    assert not view.isColumnHidden(TRACE_COLUMN)
    qtbot.waitUntil(lambda: replay.latest["requests_done"] >= 10, timeout=60_000)
    model = window.conversations.model
    qtbot.waitUntil(lambda: model.rowCount() >= 10 and bool(model.rows()[0][COLUMNS.index("prompt blocks")]),
                    timeout=20_000)
    rows = model.rows()
    first = next(r for r in rows if r[0] == replay.outcomes[0].conversation_id)
    assert first[TRACE_COLUMN].startswith("#0 at 0.0 s: 6,758 in, 500 out")
    info = window.snapshot.conversation(first[0])
    assert first[COLUMNS.index("prompt blocks")] == \
        f"no hits | {sum(o.outcome == 'cold' for o in info.prompt_block_outcomes)} cold"
    qtbot.waitUntil(lambda: panel.marker is not None and panel.marker.requests_done > 0, timeout=20_000)
    assert panel.marker.blocks == 256 and panel.marker.policy == "lru"
    # a click on S3-LRU's third point: the replay starts again on that pool, under that policy
    window.docks["capacity"].raise_()
    qtbot.waitUntil(lambda: panel.plot_widget.isVisible(), timeout=5000)
    blocks = result.plan.capacities[2]
    with qtbot.waitSignal(panel.restartRequested, timeout=5000) as asked:
        click_point(qtbot, panel, "s3lru", blocks)
    assert asked.args == ["s3lru", blocks]
    qtbot.waitUntil(lambda: window.config.num_blocks == blocks, timeout=60_000)
    assert window.config.eviction_policy == "s3lru" and window.trace_replay is not replay
    assert window.trace_replay.trace is replay.trace and window.trace_settings == FAST
    assert panel.result is result  # the same trace: its curves from the cache, with the new marker


@pytest.mark.parametrize("content, words", [
    (b"", "is empty"),
    (b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1, "inp',
     "line 2 is not a JSON request (the line is cut short)"),
    (b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": ["a", "b"]}\n', "line 1"),
    (b'{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}\n', "0 or more, got -5"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary file"),
    (None, "is a folder"),
])
def test_a_broken_trace_is_one_line_and_the_engine_goes_on(qtbot, make_window, tmp_path, content, words):
    window = make_window()
    feed = window.source.feed
    path = tmp_path / "broken.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    traces.open_trace(window, str(path))
    qtbot.waitUntil(lambda: bool(window.errors), timeout=60_000)
    title, text = window.errors[-1]
    assert title == "Cannot open trace" and words in text
    assert "\n" not in text.split("\n\n")[0]  # one line (then what goes on)
    assert window.source.feed is feed and feed.runner.alive and window.trace_replay is None
    assert window.capacity.key is None  # nothing to sweep


def drop(window, path):
    mime = QtCore.QMimeData()
    mime.setUrls([QtCore.QUrl.fromLocalFile(str(path))])
    pos = QtCore.QPointF(window.width() / 2, window.height() / 2)
    args = (pos, QtCore.Qt.DropAction.CopyAction, mime, QtCore.Qt.MouseButton.LeftButton,
            QtCore.Qt.KeyboardModifier.NoModifier)
    enter = QtGui.QDragEnterEvent(pos.toPoint(), *args[1:])
    QtWidgets.QApplication.sendEvent(window, enter)
    assert enter.isAccepted()
    QtWidgets.QApplication.sendEvent(window, QtGui.QDropEvent(*args))


def test_a_dropped_trace_is_replayed_and_a_dropped_recording_opened(qtbot, make_window, tmp_path):
    window = make_window(num_blocks=256, block_size=16)
    drop(window, small_trace(tmp_path, count=10))
    qtbot.waitUntil(lambda: window.trace_replay is not None, timeout=60_000)
    assert window.trace_replay.trace.num_requests == 10
    recording = tmp_path / "run.kvpool"
    assert files.start_recording(window, str(recording))
    qtbot.waitUntil(lambda: window.snapshot.step_id > 2, timeout=30_000)
    files.stop_recording(window)
    qtbot.waitUntil(lambda: recording.exists() and recording.stat().st_size > 100, timeout=30_000)
    drop(window, recording)
    qtbot.waitUntil(lambda: window.source.feed.kind == "recording", timeout=30_000)
    assert window.capacity.key is None  # no live replay: the dock says how to open a trace
    text = QtCore.QMimeData()
    text.setText("not a file")
    enter = QtGui.QDragEnterEvent(QtCore.QPoint(5, 5), QtCore.Qt.DropAction.CopyAction, text,
                                  QtCore.Qt.MouseButton.LeftButton, QtCore.Qt.KeyboardModifier.NoModifier)
    QtWidgets.QApplication.sendEvent(window, enter)
    assert not enter.isAccepted()


def test_demos_traffic_replays_the_shipped_excerpt_on_its_pool(qtbot, make_window):
    window = make_window(num_blocks=64, block_size=16, host_tier_blocks=32)
    window.window_actions.demos["traffic"].trigger()
    qtbot.waitUntil(lambda: window.trace_replay is not None, timeout=60_000)
    cfg = window.config
    assert (cfg.model, cfg.num_blocks, cfg.eviction_policy, cfg.host_tier_blocks) == ("builtin", 1024, "lru", 0)
    assert Path(window.trace_replay.trace.path) == EXCERPT and window.trace_replay.mode == "timed"
    assert window.source.feed.speed == window.trace_settings.steps_per_second  # paced for a person
    wait_swept(qtbot, window.capacity)
    assert window.capacity.result.plan.spec.policies == ("lru", "fifo", "s3fifo", "s3lru")


def test_demo_traffic_on_the_command_line_is_a_timed_replay_of_the_excerpt(tmp_path):
    """--demo traffic becomes --trace of the shipped excerpt on the demo's pool and model, paced for a person; what
    the user gave wins, and a trace of their own is refused beside it (one line)."""
    from explorer.cli import UsageError, parse_args
    opts = parse_args(["--demo", "traffic"])
    assert Path(opts.trace) == EXCERPT and opts.traffic_demo and opts.demo == "none"
    assert (opts.model, opts.num_blocks, opts.replay) == ("builtin", 1024, "timed")
    assert parse_args(["--demo", "traffic", "--num-blocks", "2048"]).num_blocks == 2048
    with pytest.raises(UsageError) as refused:
        parse_args(["--demo", "traffic", "--trace", small_trace(tmp_path)])
    assert "--demo traffic replays its own trace" in str(refused.value)


def test_a_screenshot_waits_for_the_sweep_and_its_answer(qtbot, tmp_path):
    """--screenshot of a trace is taken once the dock has its curves and its answer for the target rate (not the
    half-drawn sweep); with nothing to sweep it is taken at once."""
    panel = CapacityPanel()
    qtbot.addWidget(panel)
    seen = []
    assert traces.when_swept(panel, lambda: seen.append("at once")) is None and seen == ["at once"]
    panel.set_trace(read_trace(small_trace(tmp_path)), CapacitySpec(policies=("lru",), max_blocks=64, points=6))
    traces.when_swept(panel, lambda: seen.append((panel.result.complete, bool(panel.answers), panel.settled)))
    assert len(seen) == 1  # not yet: the sweep has just started
    qtbot.waitUntil(lambda: len(seen) == 2, timeout=60_000)
    assert seen[1] == (True, True, True)


def test_with_a_host_tier_the_live_policys_hits_stack_by_medium(qtbot, tmp_path):
    panel = CapacityPanel()
    qtbot.addWidget(panel)
    trace = read_trace(small_trace(tmp_path, count=200))
    panel.set_trace(trace, CapacitySpec(policies=("lru",), bound=None, max_blocks=64, host_tier_blocks=4000,
                                        points=4))
    result = wait_swept(qtbot, panel)
    fills = [item for item in panel.bands if isinstance(item, pg.FillBetweenItem)]
    assert [f.toolTip() for f in fills] == [f"LRU: hits from {m}" for m in ("GPU", "CPU", "STORAGE")]
    xs, stacks = result.stacked("lru")
    assert all(p.engine == "engine" for p in result.points["lru"])  # tiers: the engine itself replays each point
    top = [item for item in panel.bands if isinstance(item, pg.PlotDataItem)][-1].getOriginalDataset()[1]
    assert top == pytest.approx(100 * stacks["STORAGE"])
    assert (stacks["CPU"] > stacks["GPU"]).any()  # at some size the host tier kept what the device pool lost
