"""FrameFanout on a thread of its own (as the app records): the same frames, in order, written off the caller's
thread; flush and close wait for what was handed over; a failing sink is dropped and said, the others go on."""
import threading

import pytest

from kvstream.fanout import QUEUE_FRAMES, FrameFanout
from kvstream.poolstream import StreamDecoder, read_head
from tests.poolstream_helpers import assert_same_snapshot, workload


class Sink:
    def __init__(self, fail_at=None, hold=None):
        self.frames, self.threads = [], set()
        self.fail_at, self.hold = fail_at, hold
        self.closed = False

    def write(self, frame):
        if self.hold is not None:
            self.hold.wait(10)
        if self.fail_at is not None and len(self.frames) == self.fail_at:
            raise OSError("disk full")
        self.threads.add(threading.current_thread().name)
        self.frames.append(frame)

    def close(self):
        self.closed = True


def test_threaded_fanout_writes_the_same_frames_in_order_off_the_callers_thread():
    snaps = workload()
    sync_sink, thread_sink, failing = Sink(), Sink(), Sink(fail_at=5)
    sync, threaded = FrameFanout([sync_sink]), FrameFanout([thread_sink, failing], threaded=True)
    for snap, events in snaps:
        sync(snap, events)
        threaded(snap, events)
    assert threaded.flush(10)
    assert len(thread_sink.frames) == len(sync_sink.frames) == len(snaps) == threaded.frames
    assert thread_sink.threads == {"pool-stream encoder"} and sync_sink.threads == {threading.current_thread().name}
    decoder = StreamDecoder()
    for (snap, events), a, b in zip(snaps, sync_sink.frames, thread_sink.frames):
        assert (a.seq, a.step_id, a.keyframe, a.events) == (b.seq, b.step_id, b.keyframe, b.events) == \
            (b.seq, snap.step_id, b.keyframe, tuple(events))
        decoder.apply(read_head(b.payload))
        assert_same_snapshot(snap, decoder.snapshot(), f"frame {b.seq}")
    assert len(failing.frames) == 5 and threaded.sinks == [thread_sink]  # dropped at its failure, said once
    assert threaded.take_failures() == ["Sink stopped: OSError: disk full"] and threaded.take_failures() == []
    threaded.close()
    assert thread_sink.closed and not failing.closed  # a dropped sink is no longer the fanout's
    with pytest.raises(RuntimeError, match="stopped"):
        threaded(snaps[0][0], ())


def test_close_waits_for_the_frames_handed_over_and_stop_can_give_up_and_wait_again():
    """A sink that holds the fanout's thread with its queue full (a stalled disk): flush and stop give up at their
    timeout instead of waiting to hand over their own marker, then close writes everything, in order."""
    snaps = workload()[:QUEUE_FRAMES + 1]  # one in the sink's write, the others fill the queue
    hold = threading.Event()
    sink = Sink(hold=hold)
    fanout = FrameFanout([sink], threaded=True)
    feeder = threading.Thread(target=lambda: [fanout(snap, events) for snap, events in snaps])
    feeder.start()
    feeder.join(5)
    assert not feeder.is_alive() and fanout._queue.full()
    answers = []
    asker = threading.Thread(target=lambda: answers.extend([fanout.flush(0.1), fanout.stop(0.1)]))
    asker.start()
    asker.join(5)
    assert not asker.is_alive() and answers == [False, False]  # gave up: the queue had no room for them
    assert sink.frames == [] and not sink.closed
    hold.set()
    fanout.close()
    assert sink.closed and [f.seq for f in sink.frames] == list(range(len(snaps)))
    assert fanout.stop(0) and fanout.flush(0)  # ended: nothing left to wait for
