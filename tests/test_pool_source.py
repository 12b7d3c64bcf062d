"""The window's model (explorer.model.pool_source.PoolSource) without Qt or a display: a recording's frames and
events handed out as one unit, the step cursor moved and followed, a run of moves decoded on a worker, the present
again. The window gives the same object Qt signals (explorer.window.qt_source); here they are plain ones."""
import subprocess
import sys

import pytest

from explorer.feeds.stream_feed import RecordingFeed
from explorer.model.pool_source import SCRUB_ON_GUI_THREAD, PoolSource
from kvstream.recording import Recorder
from tests.helpers import wait_until
from tests.poolstream_helpers import assert_same_snapshot, encode_all, workload

SIGNALS = ("sourceChanged", "frameArrived", "viewChanged", "viewingChanged", "eventsArrived", "eventsDropped",
           "historyChanged", "problem")


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=8 * SCRUB_ON_GUI_THREAD)  # far frames cost more than the GUI's
    path = tmp_path_factory.mktemp("rec") / "run.kvpool"
    with Recorder(path) as rec:
        for f in frames:
            rec.write(f)
    return snaps, path


@pytest.fixture
def watched(recording):
    """(source, the snapshots, every signal it emitted as (name, args), in order)."""
    snaps, path = recording
    source, heard = PoolSource(RecordingFeed.open(path)), []
    for name in SIGNALS:
        getattr(source, name).connect(lambda *args, name=name: heard.append((name, args)))
    yield source, snaps, heard
    source.close()


def test_the_model_runs_without_qt():
    code = ("import sys; import explorer.model.pool_source, explorer.model.pacer, explorer.model.cursor; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'pyqtgraph', 'shiboken6')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_poll_hands_out_the_events_then_the_frame_as_one_unit(watched):
    source, snaps, heard = watched
    assert source.poll() is True
    names = [name for name, _ in heard]
    assert names.index("eventsArrived") < names.index("frameArrived") < names.index("viewChanged")
    (pairs, restarted), = [args for name, args in heard if name == "eventsArrived"]
    assert restarted and pairs == source.history.events() and pairs  # every recorded event, once
    assert_same_snapshot(snaps[-1][0], source.view) and source.view is source.live and source.viewing is None
    heard.clear()
    assert source.poll() is False and heard == []  # nothing new: nothing said


def test_the_cursor_moves_the_view_and_the_present_comes_back(watched):
    source, snaps, heard = watched
    source.poll()
    heard.clear()
    source.cursor.move(10)  # whoever moved it (the timeline, the event log): the source follows
    assert source.viewing == source.cursor.shown == 10
    assert heard == [("viewingChanged", (10,)), ("viewChanged", (source.view,))]
    assert_same_snapshot(snaps[10][0], source.view)
    source.cursor.move(len(snaps) + 100)  # past what is kept: the newest frame kept
    assert source.cursor.seq == source.viewing == len(snaps) - 1
    heard.clear()
    source.go_live()
    assert source.cursor.live and source.viewing is None and source.view is source.live
    assert heard == [("viewingChanged", (None,)), ("viewChanged", (source.live,))]


def test_a_run_of_moves_decodes_far_frames_on_a_worker_and_shows_the_last(watched):
    source, snaps, heard = watched
    source.poll()
    before = source.view
    far = len(snaps) // 2 + SCRUB_ON_GUI_THREAD + 3  # far from a keyframe: more than the GUI thread decodes
    for seq in (far - 2, far - 1, far):  # a drag: only the last one matters
        source.seek_soon(seq)
    assert source.scrubbing and source.view is before  # the window keeps its frame meanwhile
    wait_until(lambda: source.poll() is not None and not source.scrubbing)  # lands through the frame loop
    assert source.viewing == source.cursor.seq == far
    assert_same_snapshot(snaps[far][0], source.view)
