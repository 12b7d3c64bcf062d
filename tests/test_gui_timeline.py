"""The history timeline (explorer.widgets.timeline.Timeline), offscreen: seeking by drag and keys, live vs viewing,
markers drawn in their kind's colour, play, the budget box, and bad input refused without change."""
import numpy as np
import pytest
from PySide6 import QtCore, QtGui

from kvstream.events import NOTABLE_KINDS, EventKind
from explorer.model.event_colours import KIND_COLOURS
from explorer.widgets.timeline import MIB, Timeline

K = EventKind
LEFT = QtCore.Qt.MouseButton.LeftButton


@pytest.fixture
def timeline(qtbot, shown):
    t = shown(Timeline(), 600, 84)
    t.set_range(100, 1100, lambda seq: seq // 2)  # two frames per step
    return t


def track_point(t, seq):
    return QtCore.QPoint(t.track.x_of(seq), t.track.height() // 2)


def test_live_follows_the_newest_frame(timeline):
    t = timeline
    assert t.is_live and t.position == 1100
    assert t.banner_text() == "● live · step 550" and not t.live_button.isEnabled()
    t.set_range(120, 1200, lambda seq: seq // 2)
    assert t.is_live and t.position == 1200 and t.banner_text() == "● live · step 600"


def test_drag_seeks_and_back_to_live(qtbot, timeline):
    t = timeline
    seen = []
    t.seekRequested.connect(seen.append)
    press = track_point(t, 300)
    with qtbot.waitSignal(t.seekRequested) as blocker:
        qtbot.mousePress(t.track, LEFT, pos=press)
    # 1,000 frames over about 590 pixels: the pixel pressed holds frame 300 or a neighbour.
    seq = t.track.seq_at(press.x())
    assert blocker.args == [seq] and abs(seq - 300) <= 1 and not t.is_live and t.viewed_seq == seq
    assert t.banner_text() == f"viewing step {seq // 2} of 550" and t.live_button.isEnabled()
    qtbot.mouseMove(t.track, track_point(t, 700))
    QtCore.QCoreApplication.processEvents()
    # Offscreen mouse moves carry no pressed buttons; drive a drag event directly as a real one would arrive.
    move = QtGui.QMouseEvent(QtCore.QEvent.Type.MouseMove, QtCore.QPointF(track_point(t, 700)),
                             QtCore.QPointF(t.track.mapToGlobal(track_point(t, 700))), QtCore.Qt.MouseButton.NoButton,
                             LEFT, QtCore.Qt.KeyboardModifier.NoModifier)
    QtCore.QCoreApplication.sendEvent(t.track, move)
    qtbot.mouseRelease(t.track, LEFT, pos=track_point(t, 700))
    dragged = t.track.seq_at(track_point(t, 700).x())
    assert seen[-1] == dragged and abs(dragged - 700) <= 1 and t.viewed_seq == dragged
    t.set_range(120, 1300, lambda seq: seq // 2)  # new frames keep arriving: the view stays put
    assert t.viewed_seq == dragged and t.banner_text() == f"viewing step {dragged // 2} of 650"
    with qtbot.waitSignal(t.liveRequested):
        qtbot.mouseClick(t.live_button, LEFT)
    assert t.is_live and t.position == 1300 and not t.live_button.isEnabled()


def test_keys_step_frames_and_markers(qtbot, timeline):
    t = timeline
    t.add_markers([(400, K.COPIED_ON_WRITE), (800, K.EVICTED), (900, K.ALLOCATED)])  # allocated: not marked
    seen = []
    t.seekRequested.connect(seen.append)
    t.track.setFocus()
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left)
    assert seen == [1099] and not t.is_live
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left, QtCore.Qt.KeyboardModifier.ShiftModifier)
    assert seen[-1] == 800
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left, QtCore.Qt.KeyboardModifier.ShiftModifier)
    assert seen[-1] == 400
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left, QtCore.Qt.KeyboardModifier.ShiftModifier)
    assert seen[-1] == 400  # no earlier mark: stays
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Right, QtCore.Qt.KeyboardModifier.ShiftModifier)
    assert seen[-1] == 800  # 900 is an allocation, not marked by default
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Right)
    assert seen[-1] == 802  # 801 is step 400 too: the next step on screen is 401
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Home)
    assert seen[-1] == 100 and t.banner_text() == "viewing step 50 of 550"
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left)
    assert t.viewed_seq == 100  # the oldest frame kept is the floor
    t.seek(1100)
    with qtbot.waitSignal(t.liveRequested):
        qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Right)  # past the newest frame: live
    t.seek(500)
    with qtbot.waitSignal(t.liveRequested):
        qtbot.keyClick(t.track, QtCore.Qt.Key.Key_End)
    assert t.is_live


def test_markers_are_drawn_in_their_kind_colour(qtbot, timeline):
    t = timeline
    marks = [(200, K.COPIED_ON_WRITE), (500, K.EVICTED), (800, K.RELOCATED), (650, K.ALLOCATED)]
    t.add_markers(marks[:2])
    t.add_markers(marks[2:])
    assert t.markers.n == 4 and t.visible_marker_count() == 3  # allocation is stored but not marked by default
    image = t.track.grab().toImage()
    top = t.track.strip().top() + 2

    def colour_at(seq):
        c = image.pixelColor(t.track.x_of(seq), top)
        return c.red(), c.green(), c.blue()

    assert colour_at(200) == KIND_COLOURS[K.COPIED_ON_WRITE]
    assert colour_at(500) == KIND_COLOURS[K.EVICTED]
    assert colour_at(800) == KIND_COLOURS[K.RELOCATED]
    assert colour_at(650) != KIND_COLOURS[K.ALLOCATED]
    t.markers_menu.kind_actions[K.ALLOCATED].setChecked(True)  # from the Marks menu
    assert t.visible_marker_count() == 4
    image = t.track.grab().toImage()
    assert colour_at(650) == KIND_COLOURS[K.ALLOCATED]
    t.set_marked_kinds([K.EVICTED])
    assert t.visible_marker_count() == 1 and not t.markers_menu.kind_actions[K.COPIED_ON_WRITE].isChecked()
    assert "evicted" in t.tooltip_at(t.track.x_of(500)) and "copy-on-write" not in t.tooltip_at(t.track.x_of(200))


def test_thousands_of_markers_and_the_winner_of_a_pixel(qtbot, timeline):
    t = timeline
    rng = np.random.default_rng(1)
    kinds = sorted(NOTABLE_KINDS, key=lambda k: k.value)
    seqs = np.sort(rng.integers(100, 1101, 5000))
    t.set_markers([(int(s), kinds[int(k)]) for s, k in zip(seqs, rng.integers(0, len(kinds), 5000))])
    for start in range(0, 2000, 100):  # incremental, as frames arrive
        t.add_markers([(1100, K.ALLOCATED)] * 100)
    assert t.markers.n == 7000 and t.visible_marker_count() == 5000
    t.set_markers([(600, K.CONVERSATION_ADDED), (600, K.RELOCATED), (600, K.EVICTED)])
    columns = t.track.marker_columns()
    assert np.count_nonzero(columns < len(K)) == 1  # one pixel column; relocation outranks the others
    image = t.track.grab().toImage()
    c = image.pixelColor(t.track.x_of(600), t.track.strip().top() + 2)
    assert (c.red(), c.green(), c.blue()) == KIND_COLOURS[K.RELOCATED]
    t.add_markers([(300, "preempted")])  # string values and out-of-order appends are fine
    assert t.visible_marker_count() == 4
    t.seek(100)
    t.next_marker(+1)
    assert t.viewed_seq == 300


def test_history_trimming_moves_a_dropped_view(qtbot, timeline):
    t = timeline
    t.seek(150)
    with qtbot.waitSignal(t.seekRequested) as blocker:
        t.set_range(400, 1400, np.arange(400, 1401) // 2)  # steps as an array
    assert blocker.args == [400] and t.viewed_seq == 400 and t.banner_text() == "viewing step 200 of 700"


def test_play_runs_forward_and_reaches_live(qtbot, timeline):
    t = timeline
    t.set_range(0, 60)
    seen = []
    t.seekRequested.connect(seen.append)
    t.set_speed(300)
    t.seek(10)
    with qtbot.waitSignal(t.liveRequested, timeout=5000):
        t.play()
        assert t.playing and t.play_button.isChecked()
    assert t.is_live and not t.playing and not t.play_button.isChecked()
    assert seen[0] == 10 and len(seen) > 2 and seen == sorted(seen) and seen[-1] <= 60
    t.play()  # from live: replay from the oldest frame kept
    assert seen[-1] == 0 and t.playing
    qtbot.mousePress(t.track, LEFT, pos=track_point(t, 30))  # grabbing the cursor pauses
    assert not t.playing and t.viewed_seq == 30


def test_budget_box_and_kept_display(qtbot, timeline):
    t = timeline
    t.set_kept(212 * MIB, 256 * MIB)
    assert t.kept_text() == "history: steps 50-550 kept, 212 MiB of 256 MiB"
    assert t.budget_box.value() == 256
    with qtbot.waitSignal(t.budgetChanged) as blocker:
        t.budget_box.setValue(4096)
    assert blocker.args == [4096 * MIB] and blocker.args[0] > 2 ** 31
    with qtbot.assertNotEmitted(t.budgetChanged):
        t.set_kept(100 * MIB, 512 * MIB)  # the window reporting back does not echo
    assert t.budget_box.value() == 512 and "100 MiB of 512 MiB" in t.kept_text()
    t.set_kept(300 * 1024, 256 * MIB)  # a young history: not "0 MiB"
    assert t.kept_text().endswith("kept, 300 KiB of 256 MiB")
    t.set_kept(3 * MIB + MIB // 4, 256 * MIB)
    assert "3.2 MiB of 256 MiB" in t.kept_text()


def test_recording_speaks_of_the_end(timeline):
    t = timeline
    t.set_kept(300 * MIB, 256 * MIB)
    t.set_live_source(False)
    assert t.banner_text() == "at the end · step 550"
    t.seek(200)
    assert t.banner_text() == "viewing step 100 of 550"
    # its frames stay in the file: no budget to speak of or to set (it would read "300 MiB of 256 MiB")
    assert t.kept_text() == "recording: steps 50-550, 300 MiB read from the file as needed"
    assert t.budget_box.isHidden() and "256" not in t.kept_label.text()
    t.set_live_source(True)
    assert not t.budget_box.isHidden() and t.kept_text().endswith("300 MiB of 256 MiB")


def test_bad_input_changes_nothing(timeline):
    t = timeline
    t.seek(300)
    before = (t.first_seq, t.last_seq, t.viewed_seq, t.markers.n, t.banner_text())
    for call, match in [
        (lambda: t.set_range(500, 400), "after last_seq"),
        (lambda: t.set_range(-1, 400), "non-negative"),
        (lambda: t.set_range(True, 400), "non-negative"),
        (lambda: t.set_range(0, 10, [1, 2, 3]), "need 11"),
        (lambda: t.seek(5000), "not in the history kept"),
        (lambda: t.add_markers([(5, "exploded")]), "not a block event kind"),
        (lambda: t.add_markers([(5, K.EVICTED), (-3, K.EVICTED)]), "non-negative"),
        (lambda: t.set_kept(-1, 5), "bytes"),
        (lambda: t.set_speed(7), "play speed"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert (t.first_seq, t.last_seq, t.viewed_seq, t.markers.n, t.banner_text()) == before


def test_event_markers_in_bulk_equal_markers_one_by_one(qtbot):
    """add_event_markers (a history's (seq, event) pairs, in C-level passes) marks exactly what add_markers marks,
    and refuses what it refuses."""
    from kvstream.events import BlockEvent
    kinds = list(EventKind)
    pairs = [(seq, BlockEvent(seq, kinds[(seq * 7) % len(kinds)], 1, (seq,))) for seq in range(100, 1100, 3)]
    bulk, single = Timeline(), Timeline()
    for t in (bulk, single):
        qtbot.addWidget(t)
        t.set_range(100, 1100)
    bulk.add_event_markers(pairs[:200])
    bulk.add_event_markers(pairs[200:])
    for seq, event in pairs:
        single.add_markers([(seq, event.kind)])
    got, want = bulk.markers.arrays(), single.markers.arrays()
    assert bulk.markers.n == len(pairs) and all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="non-negative"):
        bulk.add_event_markers([(-3, pairs[0][1])])
    with pytest.raises(AttributeError):
        bulk.add_event_markers([(5, "evicted")])
    assert bulk.markers.n == len(pairs)


def test_empty_and_narrow(qtbot, shown):
    t = shown(Timeline(), 300, 64)
    assert t.empty and t.banner_text() == "no history yet" and not t.play_button.isEnabled()
    with pytest.raises(ValueError, match="nothing yet"):
        t.seek(0)
    t.set_range(1204, 9880)
    t.seek(2000)
    assert t.live_button.text() == "Live"  # short words at 300 px
    assert t.banner.shown_text() in ("viewing step 2,000 of 9,880", "step 2,000 of 9,880", "2,000 / 9,880")
    assert t.minimumSizeHint().width() <= 300 and t.minimumSizeHint().height() <= 64
    t.clear()
    assert t.empty and t.is_live and t.markers.n == 0


def test_a_cursor_moved_elsewhere_is_drawn_without_asking_again(qtbot, timeline):
    """The step on view is the cursor's: a move made elsewhere (an event clicked in the log, a menu's Back to live)
    is drawn at once, and the timeline emits nothing (the source follows the cursor, not the timeline)."""
    from explorer.model.cursor import StepCursor
    t = timeline
    with qtbot.assertNotEmitted(t.seekRequested), qtbot.assertNotEmitted(t.liveRequested):
        t.cursor.move(400)
        assert not t.is_live and t.position == 400 and t.banner_text() == "viewing step 200 of 550"
        t.cursor.move(None)
        assert t.is_live and t.position == 1100
    shared = StepCursor()  # a source's cursor: the timeline's moves are its moves, and its moves the timeline's
    t.follow(shared)
    t.seek(500)
    assert shared.seq == 500 and not shared.running
    shared.move(600)
    assert t.position == 600 and t.banner_text() == "viewing step 300 of 550"
    t.go_live()
    assert shared.live and t.is_live


def test_left_and_right_always_move_to_a_step_the_user_can_see(qtbot, timeline):
    """Issue 49: two frames can share a step number (a command answered between engine steps publishes one);
    Left moved one frame and the banner still said the same step. Each press now changes the step on view."""
    t = timeline
    steps = [0, 1, 1, 1, 2, 3, 3, 4]  # frames 10-17
    t.set_range(10, 17, steps)
    shown = []
    t.seekRequested.connect(lambda seq: shown.append(t.step_of(seq)))
    t.track.setFocus()
    for _ in range(5):
        qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left)
    assert shown == [3, 2, 1, 0] and t.viewed_seq == 10  # from live (step 4) down to the oldest: the floor
    for _ in range(4):
        qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Right)
    assert shown[4:] == [1, 2, 3, 4] and t.viewed_seq == 17
    t.seek(14)
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left)
    assert t.viewed_seq == 13 and t.banner_text().startswith("viewing step 1 of")


def test_frames_in_a_gap_are_skipped(qtbot, timeline):
    """After a resync history keeps frames 100-500 and 800-1100 (History.step_of raises LookupError between)."""
    t = timeline

    def step_of(seq):
        if 500 < seq < 800:
            raise LookupError(f"frame {seq} is not in the history")
        return seq // 2

    t.set_range(100, 1100, step_of)
    seen = []
    t.seekRequested.connect(seen.append)
    t.seek(650)
    assert seen[-1] == 500 and t.banner_text() == "viewing step 250 of 550"
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Right)
    assert seen[-1] == 800  # forward over the gap
    qtbot.keyClick(t.track, QtCore.Qt.Key.Key_Left)
    assert seen[-1] == 500  # and back
    qtbot.mousePress(t.track, LEFT, pos=track_point(t, 700))
    assert seen[-1] == 500 and t.viewed_seq == 500
    assert "step 250" in t.tooltip_at(t.track.x_of(700))


def test_a_new_frame_updates_words_and_strip_only(qtbot, timeline, monkeypatch):
    """30 frames a second: set_range and set_kept change the range, the banner's words, the kept line and the
    strip; the banner's colours, fonts, buttons and the budget box are left alone until the state changes."""
    t = timeline
    refreshed, box_sets, label_sets = [], [], []
    monkeypatch.setattr(t, "_refresh", lambda real=t._refresh: (refreshed.append(1), real()))
    box_set = t.budget_box.setValue
    monkeypatch.setattr(t.budget_box, "setValue", lambda v: (box_sets.append(v), box_set(v)))
    text_set = t.kept_label.setText
    monkeypatch.setattr(t.kept_label, "setText", lambda v: (label_sets.append(v), text_set(v)))
    for last in range(1101, 1131):
        t.set_range(100, last, lambda seq: seq // 2)
        t.set_kept(3 * MIB, 256 * MIB)
    assert refreshed == [] and box_sets == []
    assert t.banner_text() == "● live · step 565" and "3.0 MiB of" in t.kept_label.text()
    assert len(label_sets) == 16  # the kept line names the steps: new words every other frame, never the same twice
    t.set_kept(3 * MIB, 512 * MIB)  # the budget changed elsewhere: the box follows
    assert box_sets == [512]
    t.seek(300)  # a state change: the banner turns amber
    assert refreshed == [1] and t.banner.autoFillBackground()
    t.set_range(100, 1200, lambda seq: seq // 2)
    assert refreshed == [1] and t.banner_text() == "viewing step 150 of 600"
