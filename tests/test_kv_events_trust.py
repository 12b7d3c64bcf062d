"""What a KV-event watcher does with input it must not believe or cannot handle (issue 32: findings 5, 8, 12).

- A sequence number from the future (2**64 - 1, or any implausible jump) is set aside and counted, never turned into
  billions of lost batches; a run of them is a new stream, followed from there.
- Any exception while handling a message is counted as malformed, with the last error; the thread goes on.
- A publish the socket refuses still takes its sequence number and its place in the replay buffer, so watchers see
  the gap and fetch the batch by replay.
- A watcher started before its server catches up through replay once the server appears (our publisher, our
  engine)."""
from __future__ import annotations

import random

import zmq

from kvstream.kv_events import KVEventEndpoint, KVEventError, KVEventPublisher, KVEventSubscriber, encode_batch, \
    make_batch
from tests.helpers import holds_for, wait_until
from tests.test_kv_events import (WirePeer, _follow, _publishing_engine, live_joined, peer, settled_status,  # noqa
                                  sockdir, stored)


def test_a_seq_from_the_future_is_set_aside_not_counted_lost(peer):
    sub = _follow(peer)
    try:
        index = sub.indexes[0]
        peer.live(0)
        wait_until(lambda: index.last_seq == 0, serve=peer.serve)
        peer.live(2**64 - 1, payload=encode_batch(make_batch([stored([666])], 1.0, 0)))  # forged or corrupt
        wait_until(lambda: sub.status()[0].num_future == 1, serve=peer.serve)  # set aside
        peer.live(1, 2)
        wait_until(lambda: index.last_seq == 2, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    assert st.num_lost == 0 and "lost" not in st.text and st.state != "catching up"
    assert st.num_future == 1 and "1 batch from the future ignored" in st.text
    assert index.live_hashes() == {1000, 1001, 1002} and 666 not in index.live_hashes()
    assert peer.requests == [0] and sub.failure is None


def test_a_stream_that_really_jumps_is_followed_from_there(peer):
    """Several consecutive batches far ahead are the stream (its numbering moved on): a new stream, not a freeze."""
    sub = _follow(peer)
    far = 10**12
    try:
        index = sub.indexes[0]
        peer.live(0, 1)
        wait_until(lambda: index.last_seq == 1, serve=peer.serve)
        peer.live(far, far + 1, far + 2)
        wait_until(lambda: index.last_seq == far + 2, serve=peer.serve)
        peer.live(far + 3)
        wait_until(lambda: index.last_seq == far + 3, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    assert st.num_lost == 0 and st.num_future == 0 and st.num_restarts == 1
    assert index.live_hashes() == {1000 + far + i for i in range(4)} and index.num_resets == 1


def test_without_replay_a_far_first_seq_is_not_counted_lost(sockdir):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # a PUB that says when the subscription has reached it
    pub.bind(f"ipc://{sockdir}/n")
    try:
        with KVEventSubscriber([f"ipc://{sockdir}/n"]) as sub:
            wait_until(lambda: pub.poll(0) and pub.recv()[:1] == b"\x01")
            for seq in (2**64 - 2, 2**64 - 1):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(make_batch([stored([seq])], 1.0))])
            wait_until(lambda: sub.indexes[0].num_batches == 2)
            st = settled_status(sub)
    finally:
        pub.close(linger=0)
    assert st.num_lost == 0 and "joined at seq" in st.last_error


def test_an_exception_while_handling_a_message_is_counted_and_the_watcher_goes_on(peer):
    sub = KVEventSubscriber([KVEventEndpoint(peer.endpoint, peer.replay_endpoint)])
    index = sub.indexes[0]
    real_apply, calls = index.apply_batch, []

    def apply_once_broken(batch, seq=None):
        calls.append(seq)
        if len(calls) == 1:
            raise RuntimeError("injected: the index could not take this batch")
        return real_apply(batch, seq)

    index.apply_batch = apply_once_broken
    sub.start()
    try:
        wait_until(lambda: sub.status()[0].connected and peer.requests == [0] and peer.subscriptions,
                   serve=peer.serve)
        peer.live(0, 1, 2)
        wait_until(lambda: index.last_seq == 2, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
        assert sub.running
    finally:
        sub.stop()
    assert sub.failure is None and st.num_malformed == 1 and "RuntimeError: injected" in st.last_error
    assert index.live_hashes() == {1001, 1002}


class _RefusingSocket:
    """Stands in for the PUB socket: refuses the next ``n`` sends (what a closed or broken socket does)."""

    def __init__(self, real, n=1):
        self.real, self.n = real, n

    def send_multipart(self, frames):
        if self.n:
            self.n -= 1
            raise zmq.ZMQError(zmq.EAGAIN, "injected: resource temporarily unavailable")
        return self.real.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_failed_publish_uses_its_seq_and_the_watcher_recovers_it_by_replay(sockdir):
    with KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r") as pub:
        with KVEventSubscriber([KVEventEndpoint(pub.endpoint, pub.replay_endpoint)]) as sub:
            index = sub.indexes[0]
            live_joined(sub, pub)
            first = pub.publish([stored([1])])
            wait_until(lambda: index.last_seq == first)
            real = pub._pub
            pub._pub = _RefusingSocket(real)
            try:
                pub.publish([stored([2], parent=1)])
                raise AssertionError("a refused send must raise")
            except KVEventError as exc:
                assert f"batch {first + 1} was not sent" in str(exc)
            assert pub.next_seq == first + 2 and pub.num_send_failures == 1
            assert pub.publish([stored([3], parent=2)]) == first + 2  # the gap shows: replay fills it
            wait_until(lambda: index.live_hashes() == {1, 2, 3})
            st = settled_status(sub)
    assert st.num_lost == 0 and st.num_replayed >= 1 and st.last_seq == first + 2


def test_a_watcher_started_before_its_publisher_catches_up(sockdir):
    """The common order: open the viewer, then start the server. The server publishes before our live socket has
    reconnected (ZMQ backs off up to 2 s) and then goes quiet: only a replay asked on connect can show it."""
    ep = KVEventEndpoint(f"ipc://{sockdir}/late", f"ipc://{sockdir}/later")
    with KVEventSubscriber([ep], replay_timeout_s=0.3) as sub:
        index = sub.indexes[0]
        # the viewer waits a while, long enough for ZMQ's reconnect back-off to grow past the server's first batches
        holds_for(lambda: sub.status()[0].state == "connecting", 1.0, what="connecting, with nothing to connect to")
        with KVEventPublisher(ep.endpoint, ep.replay_endpoint) as pub:
            for h in range(1, 6):
                pub.publish([stored([h], parent=h - 1 if h > 1 else None)])
            wait_until(lambda: index.num_batches == 5, timeout=10)
            st = settled_status(sub)
    assert index.live_hashes() == {1, 2, 3, 4, 5} and st.num_lost == 0 and st.num_replayed == 5


def test_a_watcher_started_before_our_engine_catches_up(tmp_path, sockdir):
    """Our own engine as the late server: the live set equals the engine's hashes though no batch came live."""
    from kvstream.views import BlockState
    ep = KVEventEndpoint(f"ipc://{sockdir}/e", f"ipc://{sockdir}/er")
    with KVEventSubscriber([ep], replay_timeout_s=0.3) as sub:
        index = sub.indexes[0]
        holds_for(lambda: sub.status()[0].state == "connecting", 0.8, what="connecting, with nothing to connect to")
        eng = _publishing_engine(tmp_path, sockdir)
        try:
            rng = random.Random(3)
            shared = [rng.randrange(1, 90) for _ in range(8)]
            for _ in range(3):
                eng.add_conversation(prompt_token_ids=shared + [rng.randrange(1, 90) for _ in range(5)],
                                     max_new_tokens=3)
            eng.run_until_idle()
            snap = eng.snapshot()
            held = {int(h) for h, s in zip(snap.block_hash, snap.state)
                    if h != 0 and s in (BlockState.USED, BlockState.CACHED)}
            assert held
            wait_until(lambda: index.live_hashes() == held, timeout=10)
            st = settled_status(sub)
        finally:
            eng.close()
    assert st.num_lost == 0 and st.num_malformed == 0 and st.num_replayed >= 1


def test_the_engine_tries_every_batch_of_a_call_after_one_is_refused(sockdir):
    """The engine publishes one batch per step; when the first of a call's batches is refused, the later ones still
    go out (each refused batch keeps its seq for replay), so no step's blocks are silently missing."""
    from engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="builtin", block_size=4, num_blocks=64, seed=0,
                              kv_events_endpoint=f"ipc://{sockdir}/e", kv_events_replay_endpoint=f"ipc://{sockdir}/er"))
    out = eng._kv_events
    pub = out.publisher
    eng.add_conversation(prompt_token_ids=list(range(1, 13)), max_new_tokens=6)
    eng.take_events()
    for _ in range(8):  # several steps' worth of events (the engine published them as it went), published again
        eng.step()      # below in one call, as after an operation that spans steps
    events = eng.take_events()
    before = pub.next_seq
    real = pub._pub
    pub._pub = _RefusingSocket(real, n=1)
    try:
        out.publish(events)
        raise AssertionError("a refused batch must be reported")
    except KVEventError as exc:
        assert "1 of" in str(exc) and "replay" in str(exc)
    finally:
        pub._pub = real
    sent = pub.next_seq - before
    assert sent >= 2 and pub.num_send_failures == 1  # the refused one took its seq; the later ones were sent
    assert len({e.step_id for e in events}) >= 3
