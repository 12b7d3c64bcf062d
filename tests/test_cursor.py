"""The current-step cursor (explorer.model.cursor): one value that the timeline, the panes and the source read and
set, Qt-free."""
import pytest

from explorer.model.cursor import StepCursor


def test_a_move_tells_every_listener_once_and_a_repeat_tells_none():
    cursor, seen = StepCursor(), []
    cursor.subscribe(lambda c: seen.append(("a", c.seq, c.running)))
    cursor.subscribe(lambda c: seen.append(("b", c.seq, c.running)))
    assert cursor.live and cursor.seq is None
    assert cursor.move(12, running=True)
    assert not cursor.move(12, running=True)  # nothing changed
    assert cursor.move(12)  # the run ended on that frame
    assert cursor.move(None, running=True) and not cursor.running  # live is never a run
    assert seen == [("a", 12, True), ("b", 12, True), ("a", 12, False), ("b", 12, False),
                    ("a", None, False), ("b", None, False)]


def test_a_listener_can_be_removed_and_bad_frames_are_refused_unchanged():
    cursor, seen = StepCursor(), []
    listener = seen.append
    cursor.subscribe(listener)
    cursor.subscribe(listener)  # once only
    cursor.move(3)
    cursor.unsubscribe(listener)
    cursor.move(4)
    assert seen == [cursor] and cursor.seq == 4
    for bad in (-1, 2.5, True, "7"):
        with pytest.raises((ValueError, TypeError)):
            cursor.move(bad)
        assert cursor.seq == 4
