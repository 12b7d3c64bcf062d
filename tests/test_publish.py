"""The pool stream over ZMQ between two processes: subscribers from the start and late ones rebuild every frame they
get exactly; gaps resync; malformed messages are counted and skipped; a silent or restarted source is reported and
followed. Loopback TCP and ipc only."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstream.history import History
from kvstream.poolstream.publisher import PoolStreamPublisher
from kvstream.poolstream.subscriber import PoolStreamSubscriber
from kvstream.poolstream.transport import FRAME_TOPIC, PublishError
from kvstream.recording import Recorder
from tests.helpers import holds_for, wait_until
from tests.poolstream_helpers import assert_same_snapshot, encode_all, workload

ROOT = Path(__file__).resolve().parents[1]

# The publishing process: replays a recording's frames (made from the real engine) through PoolStreamPublisher,
# as many as each line on stdin says, publishing heartbeats in between, until stdin closes. With restart, it
# re-encodes the recording's snapshots as a new stream (what a restarted source sends).
PUBLISHER = """
import sys
sys.path.insert(0, {root!r})
from kvstream.poolstream import StreamEncoder
from kvstream.poolstream.publisher import PoolStreamPublisher
from kvstream.recording import read_frames, read_snapshots
frames = list(read_frames({path!r}))
if {restart!r}:
    enc = StreamEncoder(keyframe_interval=40)
    frames = [enc.encode(snap, events) for _, snap, events in read_snapshots({path!r})]
pub = PoolStreamPublisher({endpoint!r}, heartbeat_seconds=0.2)
print(pub.bound, flush=True)
for line in sys.stdin:
    n = int(line)
    for f in frames[:n]:
        pub.write(f)
    frames = frames[n:]
    print("sent", flush=True)
pub.close()
"""


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=40)
    path = tmp_path_factory.mktemp("pub") / "run.kvpool"
    with Recorder(path) as rec:
        for f in frames:
            rec.write(f)
    return snaps, frames, path


def _publisher(path, endpoint, restart=False):
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER.format(root=str(ROOT), path=str(path),
                                                                    endpoint=endpoint, restart=restart)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    bound = proc.stdout.readline().strip()
    assert bound, "the publisher did not start"
    return proc, bound


def _send(proc, n):
    proc.stdin.write(f"{n}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "sent"


def _check(history: History, snaps, first_key: bool = True):
    seqs = history.seqs()
    assert seqs == list(range(seqs[0], seqs[-1] + 1))
    assert history.keyframe_seqs()[0] == seqs[0]
    for seq in seqs:
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_two_processes_early_and_late_subscribers(recording, tmp_path, transport):
    snaps, frames, path = recording
    endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/pool.sock"
    proc, bound = _publisher(path, endpoint)
    early = PoolStreamSubscriber(bound, silent_seconds=5)
    try:
        wait_until(lambda: early.status.connected)
        assert early.status.state in ("waiting", "connecting")
        wait_until(lambda: early.status.silent_seconds is not None)  # a heartbeat came: the publisher has it
        _send(proc, 110)
        wait_until(lambda: early.status.last_seq == 109)
        late = PoolStreamSubscriber(bound, silent_seconds=5)
        side = PoolStreamSubscriber(bound, silent_seconds=5)  # a third one side by side
        # the late subscriber gets the last keyframe (80) and the deltas since, at once
        wait_until(lambda: late.status.last_seq == 109 and side.status.last_seq == 109)
        assert late.history.first_seq == 80 and late.history.keyframe_seqs()[0] == 80
        _send(proc, len(frames) - 110)
        last = len(frames) - 1
        wait_until(lambda: all(s.status.last_seq == last for s in (early, late, side)))
        for sub in (early, late, side):
            st = sub.status
            assert st.state == "live" and st.malformed == 0 and st.gaps == 0, st
        assert early.history.first_seq == 0 and len(early.history) == len(frames)
        _check(early.history, snaps)
        _check(late.history, snaps)
        assert_same_snapshot(snaps[-1][0], side.latest())
        assert_same_snapshot(snaps[-1][0], late.latest())
    finally:
        proc.stdin.close()
        proc.wait(10)
        for sub in (early, locals().get("late"), locals().get("side")):
            if sub is not None:
                sub.close()


def test_silent_then_restarted_source_is_followed(recording):
    snaps, frames, path = recording
    proc, bound = _publisher(path, "tcp://127.0.0.1:0")
    sub = PoolStreamSubscriber(bound, silent_seconds=0.8)
    try:
        wait_until(lambda: sub.status.silent_seconds is not None)  # subscribed (a heartbeat came)
        _send(proc, 50)
        wait_until(lambda: sub.status.last_seq == 49)
        holds_for(lambda: sub.status.state == "live", 1.0, what="live while idle (heartbeats say the source is there)")
        proc.stdin.close()
        proc.wait(10)
        wait_until(lambda: sub.status.state == "silent")
        assert "silent for" in sub.status.text
        # a new process publishes on the same endpoint: a new stream, followed by itself (ZMQ reconnects)
        proc, again = _publisher(path, bound, restart=True)
        assert again == bound
        wait_until(lambda: sub.status.connected and sub.status.state != "silent", 15)  # heartbeats again
        _send(proc, 20)
        wait_until(lambda: sub.status.restarts == 1 and sub.status.last_seq == 19, 15)
        assert sub.history.first_seq == 0 and sub.history.last_seq == 19
        _check(sub.history, snaps)
    finally:
        proc.stdin.close()
        proc.wait(10)
        sub.close()
    assert sub.status.state == "closed"


def test_malformed_messages_are_counted_and_skipped():
    snaps = workload()[:30]
    _, frames = encode_all(snaps, keyframe_interval=100)
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # sends as a plain PUB socket does, and says when the subscription reached it
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = PoolStreamSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: pub.poll(0) and pub.recv()[:1] == b"\x01")
        garbage = [
            [FRAME_TOPIC, b"\xc1\xc1"],
            [FRAME_TOPIC, msgspec.msgpack.encode([1.0, [], 0])],  # a vLLM KV-event batch
            [FRAME_TOPIC],
            [b"kvpool.other", b"x"],
            [b"kvpool.heartbeat", b"nonsense"],
            [FRAME_TOPIC, frames[0].payload[:-5]],
        ]
        for parts in garbage:
            pub.send_multipart(parts)
        for f in frames:
            pub.send_multipart([FRAME_TOPIC, f.payload])
        wait_until(lambda: sub.status.last_seq == len(frames) - 1)
        st = sub.status
        assert st.malformed == len(garbage) and "malformed" in st.text and st.last_error
        _check(sub.history, snaps)
    finally:
        sub.close()
        pub.close(0)


def test_a_gap_is_detected_and_resynced():
    snaps = workload()[:120]
    _, frames = encode_all(snaps, keyframe_interval=30)
    with PoolStreamPublisher("tcp://127.0.0.1:0", heartbeat_seconds=0.2) as pub:
        sub = PoolStreamSubscriber(pub.bound)
        try:
            wait_until(lambda: sub.status.silent_seconds is not None)  # subscribed (a heartbeat came)
            for f in frames[:50]:
                pub.write(f)
            wait_until(lambda: sub.status.last_seq == 49)
            for f in frames[51:60]:  # frame 50 is lost on the way; the next keyframe is 60
                pub.write(f)
            wait_until(lambda: sub.status.gaps == 1 and sub.status.resyncs >= 1)
            assert sub.status.last_seq == 49  # keeps the last good state meanwhile (no catch-up has frame 50)
            assert "missing" in sub.status.text
            for f in frames[60:]:
                pub.write(f)
            wait_until(lambda: sub.status.last_seq == len(frames) - 1)
            assert sub.history.seqs()[:50] == list(range(50)) and sub.history.seqs()[50] == 60  # resynced at 60
            for seq in sub.history.seqs():
                assert_same_snapshot(snaps[seq][0], sub.history.snapshot_at(seq), f"frame {seq}")
        finally:
            sub.close()


def test_bad_endpoints_get_a_clear_error():
    with PoolStreamPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(PublishError, match="in use"):
            PoolStreamPublisher(pub.bound)
        with pytest.raises(PublishError, match="closed"):
            pub.close()
            pub.write(encode_all(workload()[:1])[1][0])
    for bad in ("localhost:5560", 5560, None, "bogus://x", "tcp://127.0.0.1"):
        with pytest.raises(PublishError, match="ZMQ endpoint"):
            PoolStreamPublisher(bad)
        with pytest.raises(PublishError, match="ZMQ endpoint"):
            PoolStreamSubscriber(bad)
    with PoolStreamPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(TypeError):
            pub.write(b"bytes")
