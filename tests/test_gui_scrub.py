"""Scrubbing far: a drag's frames that are costly to decode are decoded on a worker thread while the window keeps
its pace, the latest one wanted wins, and any other move overrides them (pytest-qt, offscreen, a real recording of
the engine)."""
import threading

import pytest
from PySide6 import QtCore, QtGui

from explorer.window.main_window import MainWindow
from explorer.model.pool_source import SCRUB_ON_GUI_THREAD
from explorer.feeds.stream_feed import RecordingFeed
from kvstream.history import KEYFRAME_COST, Cancelled
from kvstream.poolstream import StreamEncoder
from kvstream.recording import Recorder
from tests.poolstream_helpers import assert_same_snapshot, workload

LEFT = QtCore.Qt.MouseButton.LeftButton
INTERVAL = 100  # frames from one keyframe to the next in the recording (long runs: far frames are costly)


@pytest.fixture
def scrub_window(qtbot, tmp_path):
    snaps = workload()
    path = tmp_path / "scrub.kvpool"
    encoder = StreamEncoder(keyframe_interval=INTERVAL, keyframe_after_bytes=10 ** 9)
    with Recorder(path) as recorder:
        for snap, events in snaps:
            recorder.write(encoder.encode(snap, events))
    window = MainWindow(feed=RecordingFeed.open(str(path)))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.source.view is not None, timeout=5000)
    history = window.source.history
    decoded = []  # (seq, thread name) of every snapshot_at
    real = history.snapshot_at

    def snapshot_at(seq, stop=None):
        decoded.append((seq, threading.current_thread().name))
        return real(seq, stop)

    history.snapshot_at = snapshot_at
    yield window, snaps, decoded
    window.close()


def mouse(track, kind, x):
    point = QtCore.QPointF(x, track.height() / 2)
    buttons = LEFT if kind != QtCore.QEvent.Type.MouseButtonRelease else QtCore.Qt.MouseButton.NoButton
    event = QtGui.QMouseEvent(kind, point, track.mapToGlobal(point),
                              QtCore.Qt.MouseButton.NoButton if kind == QtCore.QEvent.Type.MouseMove else LEFT,
                              buttons, QtCore.Qt.KeyboardModifier.NoModifier)
    QtCore.QCoreApplication.sendEvent(track, event)


def test_decode_cost_counts_the_frames_from_what_is_at_hand(scrub_window):
    window, snaps, _ = scrub_window
    history = window.source.history
    last = history.last_seq
    assert history.decode_cost(last) == 0  # on view: its snapshot is cached
    history.snapshot_at(INTERVAL + 10)
    assert history.decode_cost(INTERVAL + 10) == 0
    assert history.decode_cost(INTERVAL + 14) == 4  # on from the decoder left at INTERVAL + 10
    assert history.decode_cost(INTERVAL + 5) == KEYFRAME_COST + 5  # before it: from the keyframe at INTERVAL
    assert KEYFRAME_COST > SCRUB_ON_GUI_THREAD  # so a frame that starts at a keyframe goes to the worker


def test_a_far_frame_decodes_on_the_worker_and_the_latest_wanted_lands(qtbot, scrub_window):
    window, snaps, decoded = scrub_window
    source = window.source
    before = source.view
    source.seek_soon(INTERVAL + 60)  # nothing decoded in that run yet: costly
    assert source.scrubbing and source.view is before and source.viewing is None  # the window keeps its frame
    source.seek_soon(INTERVAL + 30)  # while the first decodes: wanted, then replaced
    source.seek_soon(INTERVAL + 40)
    qtbot.waitUntil(lambda: not source.scrubbing, timeout=5000)
    assert source.viewing == INTERVAL + 40 and window.grid.snapshot is source.view
    assert_same_snapshot(snaps[INTERVAL + 40][0], source.view, "landed")
    on_worker = [seq for seq, name in decoded if name.startswith("history-decode")]
    assert on_worker == [INTERVAL + 60, INTERVAL + 40]  # the replaced one was never decoded
    decoded.clear()
    source.seek_soon(INTERVAL + 41)  # one frame on: cheap, on the GUI thread at once
    assert not source.scrubbing and source.viewing == INTERVAL + 41
    assert decoded[0] == (INTERVAL + 41, threading.current_thread().name)
    assert not [name for _, name in decoded if name.startswith("history-decode")]


def test_any_other_move_overrides_a_scrub_under_way(qtbot, scrub_window):
    window, snaps, _ = scrub_window
    source = window.source
    source.seek_soon(INTERVAL + 50)
    assert source.scrubbing
    source.seek(10)  # a click on an event, a key: shown at once, the scrub's frame is dropped when it comes
    assert not source.scrubbing and source.viewing == 10
    qtbot.wait(300)
    assert source.viewing == 10 and window.pane.timeline.position == 10
    assert_same_snapshot(snaps[10][0], window.grid.snapshot, "after the override")
    window.source.history.drop_cache()  # nothing at hand: the next far frame goes to the worker
    source.seek_soon(INTERVAL + 50)
    assert source.scrubbing
    source.go_live()
    assert not source.scrubbing
    qtbot.wait(300)
    assert source.viewing is None and source.view is source.live and window.pane.timeline.is_live


def test_a_drag_keeps_the_cursor_where_the_mouse_is_while_its_frames_land(qtbot, scrub_window):
    window, snaps, decoded = scrub_window
    timeline, source = window.pane.timeline, window.source
    track = timeline.track
    r = track.strip()
    xs = [r.left() + r.width() * f for f in (0.9, 0.7, 0.5, 0.3, 0.45)]
    source.history.drop_cache()  # no checkpoint at hand (opening left some near the end): the press goes to the worker
    mouse(track, QtCore.QEvent.Type.MouseButtonPress, xs[0])
    assert timeline.scrubbing
    landed = []
    source.viewChanged.connect(lambda snap: landed.append(source.viewing))
    for x in xs[1:]:
        mouse(track, QtCore.QEvent.Type.MouseMove, x)
        wanted = track.seq_at(x)
        before = len(landed)
        qtbot.waitUntil(lambda: len(landed) > before or not source.scrubbing, timeout=5000)  # a frame lands
        assert timeline.position == wanted  # ... and the cursor stays where the mouse is
    assert any(seq != track.seq_at(x) for seq, x in zip(landed, xs[1:]))  # some landed behind the cursor
    mouse(track, QtCore.QEvent.Type.MouseButtonRelease, xs[-1])
    assert not timeline.scrubbing
    qtbot.waitUntil(lambda: not source.scrubbing, timeout=5000)
    wanted = track.seq_at(xs[-1])
    assert source.viewing == wanted == timeline.position and window.grid.snapshot is source.view
    assert_same_snapshot(snaps[wanted][0], source.view, "end of the drag")
    assert any(name.startswith("history-decode") for _, name in decoded)


def refuse_frame(monkeypatch, source, seq, error):
    """Make the source's history raise ``error`` for frame ``seq`` only; the problems the source then says."""
    problems = []
    source.problem.connect(problems.append)
    inner = source.history.snapshot_at

    def refused(wanted, stop=None):
        if wanted == seq:
            raise error
        return inner(wanted, stop)

    monkeypatch.setattr(source.history, "snapshot_at", refused)
    return problems


def test_a_frame_that_fails_to_decode_is_said_and_the_scrub_goes_on(qtbot, scrub_window, monkeypatch):
    window, snaps, _ = scrub_window
    source = window.source
    problems = refuse_frame(monkeypatch, source, INTERVAL + 70, ValueError("a broken frame"))
    source.seek_soon(INTERVAL + 70)
    assert source.scrubbing
    qtbot.waitUntil(lambda: not source.scrubbing, timeout=5000)
    assert [p.title for p in problems] == ["Frame not shown"] and "a broken frame" in problems[0].text
    assert source.viewing is None  # the view it had
    source.seek_soon(INTERVAL + 75)  # the next one decodes and lands
    qtbot.waitUntil(lambda: source.viewing == INTERVAL + 75, timeout=5000)
    assert_same_snapshot(snaps[INTERVAL + 75][0], source.view, "after the broken frame")


def test_a_refused_frame_on_a_plain_seek_is_said_and_the_view_stays(qtbot, scrub_window, monkeypatch):
    """seek() decodes on the GUI thread; a frame the reader refuses (StreamError: corrupt or impossible) is said as
    a problem and the window keeps the view it had, instead of an exception escaping into Qt."""
    from kvstream.poolstream import StreamError
    window, snaps, _ = scrub_window
    source = window.source
    problems = refuse_frame(monkeypatch, source, INTERVAL + 60, StreamError("impossible pool (ref counts): injected"))
    before = source.view
    source.seek(INTERVAL + 60)
    assert [p.title for p in problems] == ["Frame not shown"] and "injected" in problems[0].text
    assert source.view is before
    source.seek(INTERVAL + 61)
    assert source.viewing == INTERVAL + 61
    assert_same_snapshot(snaps[INTERVAL + 61][0], source.view, "after the refused frame")


def test_a_decode_dropped_by_another_move_stops_and_leaves_a_valid_cache(qtbot, scrub_window, monkeypatch):
    """History.snapshot_at(seq, stop): once stop says so the decode ends (Cancelled) at the next frame, its cache at
    the frame it reached, and the frames decoded from there are still exact. The source's worker decodes with a
    stop that turns true at any other move, so a click or a key after a drag does not wait for a stale decode."""
    window, snaps, _ = scrub_window
    source, history = window.source, window.source.history
    history.drop_cache()
    applied = []
    with pytest.raises(Cancelled, match="stopped"):
        history.snapshot_at(INTERVAL + 80, stop=lambda: applied.append(1) or len(applied) > 20)
    assert history._decoder is not None and history._decoder.seq == INTERVAL + 19  # keyframe + 19 deltas
    assert history.decode_cost(INTERVAL + 80) == 61  # goes on from there
    assert_same_snapshot(snaps[INTERVAL + 80][0], history.snapshot_at(INTERVAL + 80), "after a stopped decode")
    stops = []
    inner = history.snapshot_at
    monkeypatch.setattr(history, "snapshot_at", lambda seq, stop=None: stops.append(stop) or inner(seq, stop))
    history.drop_cache()
    source.seek_soon(INTERVAL + 30)
    qtbot.waitUntil(lambda: len(stops) > 0, timeout=5000)
    assert stops[0] is not None and not stops[0]()  # the frame is still wanted
    source.seek(10)
    assert stops[0]()  # another move: the worker's decode would stop at its next frame
    qtbot.wait(200)
    assert source.viewing == 10


def test_the_timeline_shows_the_step_wanted_while_it_decodes(qtbot, scrub_window):
    """One cursor: a move made anywhere (here the source's own API, as the event log and the menus use it) puts the
    timeline where the user wants to be at once, while the far frame still decodes and the grid keeps the frame it
    has; no flag on either side holds the timeline back until the frame lands."""
    window, snaps, _ = scrub_window
    source, timeline = window.source, window.pane.timeline
    before = source.view
    source.seek_soon(INTERVAL + 60)  # far: decodes on the worker
    assert source.scrubbing and source.view is before
    assert source.cursor.seq == INTERVAL + 60 and not timeline.is_live and timeline.position == INTERVAL + 60
    qtbot.waitUntil(lambda: not source.scrubbing, timeout=5000)
    assert source.viewing == timeline.position == INTERVAL + 60
    source.go_live()
    assert source.cursor.live and timeline.is_live and source.viewing is None
