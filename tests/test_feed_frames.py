"""One frame, one unit (issue 29): every feed's poll returns its newest frame with the events of every frame since
the previous poll, taken from the engine runner's updates (never read back out of the History). No Qt."""
import threading

import pytest

from engine import Engine, EngineConfig
from explorer.feeds.engine_feed import EngineFeed
from explorer.feeds.frames import FeedFrame, FrameBuffer
from explorer.feeds.stream_feed import RecordingFeed
from kvstream.events import BlockEvent, EventKind
from kvstream.recording import Recorder, open_recording
from kvstream.views import BlockState, PoolUpdate
from tests.helpers import wait_until


def small_engine(tokens=30):
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=4)
    engine = Engine(cfg)
    engine.add_conversation("Frames come with their events.", max_new_tokens=tokens, temperature=0.0,
                            ignore_eos=True)
    return engine, cfg


def event(step, kind=EventKind.ALLOCATED, blocks=(1,)):
    return BlockEvent(step_id=step, kind=kind, block_ids=tuple(blocks))


def test_the_buffer_coalesces_snapshots_keeps_every_event_and_bounds_them():
    snaps = [object() for _ in range(5)]
    buffer = FrameBuffer(max_events=4)
    assert buffer.take() is None
    buffer(PoolUpdate(snaps[0], (event(0),), seq=0))
    first = buffer.take()
    assert first == FeedFrame(snaps[0], 0, ((0, event(0)),), restarted=True, dropped=0)
    assert buffer.take() is None  # nothing new
    buffer(PoolUpdate(snaps[1], (event(1), event(1, EventKind.STORED)), seq=1))
    buffer(PoolUpdate(snaps[2], (), seq=2))
    frame = buffer.take()  # the newest snapshot, every event of the frames passed over
    assert frame.snapshot is snaps[2] and frame.seq == 2 and not frame.restarted and frame.dropped == 0
    assert [seq for seq, _ in frame.events] == [1, 1]
    for i in (3, 4):  # the window fell behind: 6 events over a cap of 4
        buffer(PoolUpdate(snaps[i], (event(i), event(i), event(i)), seq=i))
    frame = buffer.take()
    assert frame.snapshot is snaps[4] and frame.seq == 4 and frame.dropped == 2
    assert [seq for seq, _ in frame.events] == [3, 4, 4, 4]  # the newest kept


def test_a_joining_buffer_starts_from_the_runner_snapshot_once():
    buffer = FrameBuffer()
    snap = object()
    buffer.prime(snap)
    buffer.prime(object())  # only the first
    frame = buffer.take()
    assert frame.snapshot is snap and frame.seq is None and frame.events == () and frame.restarted
    buffer(PoolUpdate(object(), (event(1),), seq=7))  # the runner's number, whatever the buffer saw before
    assert buffer.take().seq == 7
    with pytest.raises(ValueError, match="numbered"):
        buffer(PoolUpdate(object(), (event(2),)))  # frames are numbered once, by the runner


def test_an_engine_feed_without_history_polls_frames_with_their_events():
    """``history_bytes=None`` (no History at all): the poll still carries every event, with the frame it led to."""
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True, history_bytes=None)
    try:
        assert feed.history is None
        seen = []
        for _ in range(5):
            feed.runner.step_once().result(timeout=10)
            frame = feed.poll()
            while frame is not None and frame.snapshot is not feed.runner.latest:  # the update follows the step
                more = feed.poll()
                frame = frame if more is None else FeedFrame(more.snapshot, more.seq, frame.events + more.events)
            seen.append(frame)
        assert all(f is not None for f in seen)
        kinds = {e.kind for f in seen for _, e in f.events}
        assert EventKind.ALLOCATED in kinds and EventKind.CONVERSATION_ADDED in kinds
        for f in seen:
            assert all(e.step_id <= f.snapshot.step_id for _, e in f.events)
            for _, e in f.events:
                if e.kind == EventKind.ALLOCATED and e.step_id == f.snapshot.step_id:
                    assert all(f.snapshot.state[b] == BlockState.USED for b in e.block_ids)
        assert feed.poll() is None  # taken once
    finally:
        feed.close()


def test_a_feed_nobody_polls_keeps_no_events():
    """The headless run reads ``latest()`` and never polls: a frame buffer there would hold every event of the run
    (up to its cap) for nobody. ``polled=False`` starts the runner without one; the headless command line does."""
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True, history_bytes=0, polled=False)
    try:
        for _ in range(5):
            feed.runner.step_once().result(timeout=10)
        assert feed.latest() is not None and feed.frames is None
        assert not any(isinstance(o, FrameBuffer) for o in feed.runner._observers)
    finally:
        feed.close()


def test_the_headless_run_builds_no_frame_buffer(monkeypatch, capsys):
    made = []

    class Counting(FrameBuffer):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    import main as app
    from explorer.feeds import engine_feed
    monkeypatch.setattr(engine_feed, "FrameBuffer", Counting)
    assert app.main(["--headless", "--demo", "busy", "--model", "builtin", "--num-blocks", "64",
                     "--quit-after", "1"]) == 0
    assert "step" in capsys.readouterr().out and made == []


def test_an_engine_feeds_frame_numbers_are_its_history_frames():
    """With a History, an event's seq is the History frame it is in (the timeline jumps there), though the window
    took it from the runner's update and not from the History."""
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True)
    try:
        target = feed.runner.latest.step_id + 6
        for _ in range(6):  # a step_once future resolves when the command is taken, before its step runs ...
            feed.runner.step_once().result(timeout=10)
        wait_until(lambda: feed.runner.latest.step_id >= target)
        feed.runner.pause().result(timeout=10)  # ... so wait for the steps, and for the engine thread to have
        feed.fanout.flush(10)  # handed the last one to the fanout (a command is taken after a step's publishing)
        frame = feed.poll()
        history = feed.history
        assert frame.seq == history.last_seq and frame.snapshot.step_id == history.step_of(frame.seq)
        assert list(frame.events) == history.events()
    finally:
        feed.close()


def test_a_frame_that_could_not_be_encoded_leaves_the_window_and_its_history_on_the_same_numbers(monkeypatch):
    """Frames are numbered once, by the runner: when the History's encoder fails on an update (said as an output
    problem), the frames after it keep the runner's numbers in the History too (a keyframe after the gap), so an
    event's seq still names its History frame. (Counted twice, the window ran one frame ahead of its History.)"""
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True)
    try:
        encode, calls = feed.fanout.encoder.encode, []

        def fail_the_third(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected: this frame could not be encoded")
            return encode(*args, **kwargs)
        monkeypatch.setattr(feed.fanout.encoder, "encode", fail_the_third)
        target = feed.runner.latest.step_id + 6
        for _ in range(6):
            feed.runner.step_once().result(timeout=10)
        wait_until(lambda: feed.runner.latest.step_id >= target)
        feed.runner.pause().result(timeout=10)
        feed.fanout.flush(10)
        frame = feed.poll()
        history = feed.history
        assert frame.seq == history.last_seq and frame.snapshot.step_id == history.step_of(frame.seq)
        (missing,) = set(range(frame.seq + 1)) - set(history.seqs())  # the one not encoded
        assert missing + 1 in history.seqs()  # the next one kept, under the runner's number
        assert [pair for pair in frame.events if pair[0] != missing] == history.events()
        assert any("could not be encoded" in p.text for p in feed.take_problems())
    finally:
        feed.close()


def test_the_buffer_stays_consistent_under_a_concurrent_engine():
    """Updates on another thread while the GUI thread takes: no event lost or repeated, seqs ascending."""
    buffer = FrameBuffer()
    n = 2000

    def produce():
        for i in range(n):
            buffer(PoolUpdate(i, (event(i),), seq=i))
    thread = threading.Thread(target=produce)
    thread.start()
    taken = []
    while thread.is_alive() or taken[-1:] != [n - 1]:
        frame = buffer.take()
        if frame is not None:
            taken.extend(seq for seq, _ in frame.events)
    thread.join()
    assert taken == list(range(n))


def test_a_recording_feed_hands_out_every_event_with_its_first_frame(tmp_path):
    engine, cfg = small_engine()
    recorder = Recorder(tmp_path / "frames.kvrec")
    feed = EngineFeed.start(engine, cfg, start_paused=True, extra_sinks=[recorder], history_bytes=None)
    for _ in range(4):
        feed.runner.step_once().result(timeout=10)
    feed.close()
    recording = RecordingFeed(open_recording(recorder.path), str(recorder.path))
    try:
        frame = recording.poll()
        history = recording.history
        assert frame.restarted and frame.seq == history.last_seq and frame.snapshot is recording.latest()
        assert list(frame.events) == history.events() and frame.events
        assert recording.poll() is None
    finally:
        recording.close()
