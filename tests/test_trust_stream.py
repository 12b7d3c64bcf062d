"""Issue 32: no pool-stream message can kill, freeze or fool a watcher (findings 1, 3, 4, 5 and 9).

Each test forges what an attacker or a damaged link could send, starting from real frames of the engine workload,
and checks the watcher refuses it with the rule named, counts it, and goes on with the genuine frames after it."""
from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from kvstream.endpoints import EndpointError, check_endpoint, endpoint_for_rank
from kvstream.poolstream import Frame, StreamDecoder, StreamEncoder, StreamError, read_head
from kvstream.poolstream.schema import _ENCODER, FORMAT_VERSION, MAGIC, ArrayPatch, Body, Delta, Packed, _Envelope
from kvstream.poolstream.validate import check_snapshot, set_max_blocks
from kvstream.views import BlockState, frozen_array
from tests.helpers import wait_until
from tests.poolstream_helpers import assert_same_snapshot, encode_all, install_fake_tap, workload


def _forge(frame: Frame, *, seq: int | None = None, body=None, header: dict | None = None, **delta) -> bytes:
    """``frame``'s message with its seq, body, keyframe header fields or delta fields replaced."""
    head = read_head(frame.payload)
    if body is None:
        body = msgspec.msgpack.decode(head.body, type=Body)
    if header:
        body = msgspec.structs.replace(body, header=msgspec.structs.replace(body.header, **header))
    if delta:
        body = msgspec.structs.replace(body, **delta)
    env = _Envelope(MAGIC, FORMAT_VERSION, head.stream_id, head.seq if seq is None else seq, head.step_id,
                    head.keyframe, head.events, body)
    return _ENCODER.encode(env)


def _frame(payload: bytes) -> Frame:
    head = read_head(payload)
    return Frame(head.seq, head.step_id, head.keyframe, payload, head.events, head.stream_id)


def _rich() -> tuple:
    """A workload snapshot with USED, CACHED and FREE blocks, a shared block and a table, and its events."""
    for snap, events in workload():
        states = set(snap.state.tolist())
        if states == {0, 1, 2} and (snap.ref_count > 1).any() and snap.block_tables:
            return snap, events
    raise AssertionError("the workload has no such snapshot")


# ---- finding 1: a header claiming 10**12 blocks ------------------------------------------------------------------
def test_a_keyframe_claiming_a_huge_pool_is_refused_before_anything_is_allocated():
    _, frames = encode_all(workload()[:3])
    huge = _forge(frames[0], header={"num_blocks": 10 ** 12})
    dec = StreamDecoder()
    with pytest.raises(StreamError, match="more than what fits in a quarter of the memory"):
        dec.feed(huge)
    assert dec.seq is None
    set_max_blocks(1000)
    try:
        with pytest.raises(StreamError, match="configured maximum"):
            dec.feed(_forge(frames[0], header={"num_blocks": 1001}))
    finally:
        set_max_blocks(None)
    snap, _, _ = dec.feed(frames[0].payload)  # the genuine keyframe after them decodes
    assert_same_snapshot(workload()[0][0], snap)


# ---- finding 3: unsigned index gaps that wrap ----------------------------------------------------------------------
def test_an_unsigned_index_gap_that_would_wrap_is_refused():
    _, frames = encode_all(workload()[:3])
    dec = StreamDecoder()
    dec.feed(frames[0].payload)
    before = dec.snapshot()
    wrap = Packed("<u8", np.array([2 ** 64 - 1], "<u8").tobytes())  # int64: -1, the last block
    for gaps in (wrap, Packed("<u8", np.array([0, 2 ** 64 - 1], "<u8").tobytes())):
        forged = _forge(frames[1], body=Delta(version=1, arrays={"last_access": ArrayPatch(gaps, 12345)}))
        with pytest.raises(StreamError, match="gap in the indices of last_access"):
            dec.feed(forged)
        assert dec.snapshot() is before and int(before.last_access[-1]) != 12345


# ---- finding 4: pools that cannot exist ----------------------------------------------------------------------------
def _kinds(snap):
    """(what it forges, the rule the refusal names, the forged snapshot) for each kind of impossible pool."""
    n = snap.num_blocks
    used = int(np.flatnonzero(snap.state == BlockState.USED)[0])
    free = int(np.flatnonzero(snap.state == BlockState.FREE)[0])
    cached = int(np.flatnonzero(snap.state == BlockState.CACHED)[0])
    cid, table = next(iter(snap.block_tables.items()))
    conv = snap.conversation(cid)
    other = next(c for c in snap.conversations if c.conversation_id != cid)

    def arrays(**change):
        out = {}
        for name, (block, value) in change.items():
            a = getattr(snap, name).copy()
            a[block] = value
            out[name] = frozen_array(a)
        return dataclasses.replace(snap, **out)

    def conv_change(c=conv, **kw):
        new = dataclasses.replace(c, **kw)
        return dataclasses.replace(snap, conversations=tuple(new if x is c else x for x in snap.conversations))

    def with_table(new_table):
        tables = dict(snap.block_tables)
        tables[cid] = new_table
        s = conv_change(block_table=new_table)
        return dataclasses.replace(s, block_tables=tables)

    return [
        ("a table naming a FREE block", "block tables", with_table(table + (free,))),
        ("a negative ref count", "ref counts", arrays(ref_count=(free, -1))),
        ("more tokens than slots", "fill", arrays(num_filled=(used, snap.block_size + 1))),
        ("an unknown state", "block states", arrays(state=(free, 7))),
        ("an owner out of range", "owners", arrays(owner=(used, -5))),
        ("a negative computed count", "num_computed_tokens", conv_change(num_computed_tokens=-3)),
        ("a NaN temperature", "temperature", conv_change(temperature=float("nan"))),
        ("an infinite temperature", "temperature", conv_change(temperature=float("inf"))),
        ("token id -1", "token ids", conv_change(output_token_ids=conv.output_token_ids + (-1,))),
        ("a token id past int32", "token ids", conv_change(prompt_token_ids=(2 ** 40,) + conv.prompt_token_ids)),
        ("ref counts unlike the tables", "ref counts", arrays(ref_count=(used, int(snap.ref_count[used]) + 1))),
        ("a FREE block with a hash", "hashes", arrays(block_hash=(free, 99))),
        ("a CACHED block without one", "hashes", arrays(block_hash=(cached, 0))),
        ("a CACHED block not full", "cached blocks", arrays(num_filled=(cached, 1))),
        ("a FREE block holding tokens", "free blocks", arrays(num_filled=(free, 1))),
        ("a table naming a block twice", "block tables", with_table(table + (table[0],))),
        ("a USED block without an owner", "used blocks", arrays(owner=(used, -1))),
        ("a table of a conversation not in the frame", "block tables",
         dataclasses.replace(snap, conversations=tuple(c for c in snap.conversations if c.conversation_id != cid))),
        ("a table unlike its conversation's", "block tables", conv_change(block_table=table[:-1])),
        ("memory figures unlike the states", "memory",
         dataclasses.replace(snap, memory=dataclasses.replace(snap.memory,
                                                              num_used_blocks=snap.memory.num_used_blocks + 1))),
        ("negative metrics", "metrics",
         dataclasses.replace(snap, metrics=dataclasses.replace(snap.metrics, num_steps=-1))),
        ("a negative budget", "max_new_tokens", conv_change(c=other, max_new_tokens=-1)),
        ("a negative conversation id", "conversation ids", conv_change(c=other, conversation_id=-4)),
        ("a block owned by a conversation that does not hold it", "owners",
         arrays(owner=(table[-1], int(snap.owner[table[-1]]) + 1000))
         if snap.ref_count[table[-1]] == 1 else None),
    ]


@pytest.mark.parametrize("as_delta", [False, True])
def test_impossible_pools_are_refused_naming_the_rule(as_delta):
    snap, events = _rich()
    kinds = [k for k in _kinds(snap) if k[2] is not None]
    assert len(kinds) >= 23
    check_snapshot(snap)  # the genuine one passes
    for what, rule, forged in kinds:
        enc, dec = StreamEncoder(), StreamDecoder()
        if as_delta:
            dec.feed(enc.encode(snap).payload)
        with pytest.raises(StreamError, match=rf"\({rule}\)") as info:
            dec.feed(enc.encode(forged).payload)
        assert "impossible pool" in str(info.value), what
        # refused: the decoder is still at the frame before (a field checked as it arrives), or waits for a
        # keyframe (a rule of the whole pool); either way nothing of the forged frame is shown
        assert dec.seq is None or (as_delta and dec.seq == 0 and dec.snapshot() is not None), what
        if dec.seq is not None:
            assert_same_snapshot(snap, dec.snapshot(), what)
        good, _, _ = dec.feed(StreamEncoder().encode(snap).payload)  # the next genuine keyframe
        assert_same_snapshot(snap, good, what)


def test_every_workload_frame_passes_the_rules():
    """The rules are the engine's: every snapshot of the workload (forks, copy-on-write, preemption, eviction,
    relocation, replies) satisfies them, and so does what the decoder rebuilds."""
    counts = None
    for snap, _ in workload():
        counts = check_snapshot(snap, counts)


# ---- finding 5 and 1 over the network: the subscriber never dies and never freezes ---------------------------------
def test_the_subscriber_survives_refuses_and_goes_on():
    """A huge header (finding 1), an impossible pool (finding 4), a wrapping gap (finding 3), garbage, and a
    keyframe of the publisher's own stream with seq 2**62 (finding 5) are each counted as malformed; the thread
    lives, the genuine frames after them are shown, and --json reports malformed, lost and the last error."""
    from explorer.feeds.stream_feed import AttachFeed
    from kvstream.poolstream.publisher import PoolStreamPublisher
    from kvstream.poolstream.subscriber import PoolStreamSubscriber
    snaps = workload()[:40]
    enc, frames = encode_all(snaps, keyframe_interval=10)
    snap, _ = _rich()
    with PoolStreamPublisher("tcp://127.0.0.1:0", heartbeat_seconds=0.2) as pub:
        sub = PoolStreamSubscriber(pub.bound)
        feed = AttachFeed(sub)
        try:
            wait_until(lambda: sub.status.connected and pub.subscriptions >= 1)
            for f in frames[:5]:
                pub.write(f)
            wait_until(lambda: sub.status.last_seq == 4)
            bad = [_forge(frames[10], header={"num_blocks": 10 ** 12}),
                   _forge(frames[10], body=Delta(version=1, arrays={"owner": ArrayPatch(
                       Packed("<u8", np.array([2 ** 64 - 1], "<u8").tobytes()), 3)}), seq=5),
                   _forge(frames[10], seq=2 ** 62)]
            forged_pool = StreamEncoder(stream_id=enc.stream_id).encode(
                dataclasses.replace(snap, ref_count=frozen_array(np.full(snap.num_blocks, -1, np.int32))))
            for payload in bad:
                pub._push.send_multipart([b"\0" * 9, payload])  # straight to the socket: no Frame checks
            pub._push.send_multipart([b"\0" * 9, b"\x93\x01\x02"])
            pub._push.send_multipart([b"\0" * 9, forged_pool.payload])
            wait_until(lambda: sub.status.malformed >= 5, seen=lambda: sub.status)
            assert sub._thread.is_alive()
            for f in frames[5:]:
                pub.write(f)
            wait_until(lambda: sub.status.last_seq == len(frames) - 1, seen=lambda: sub.status)
            assert_same_snapshot(snaps[-1][0], sub.latest())
            data = feed.summary(final=True)
            assert data["malformed"] >= 5 and data["lost"] >= 0 and data["last_error"]
            assert "malformed" in feed.status_text()
            assert any("refused" in p.title for p in feed.take_problems())
        finally:
            sub.close()


def test_a_state_from_the_future_is_dropped_at_the_next_heartbeat():
    """Finding 5 when the forged frame comes first: the view jumps to frame 2**62 of the real stream id; the
    source's heartbeat says it is at frame 4, so the subscriber drops that state and resyncs to the real frames
    instead of reading 'live at frame 4611686018427387904' forever."""
    from kvstream.poolstream.publisher import PoolStreamPublisher
    from kvstream.poolstream.subscriber import PoolStreamSubscriber
    snaps = workload()[:10]
    _, frames = encode_all(snaps, keyframe_interval=4)
    with PoolStreamPublisher("tcp://127.0.0.1:0", heartbeat_seconds=0.2) as pub:
        sub = PoolStreamSubscriber(pub.bound)
        try:
            wait_until(lambda: sub.status.connected and pub.subscriptions >= 1)
            pub._push.send_multipart([b"\0" * 9, _forge(frames[0], seq=2 ** 62)])
            wait_until(lambda: sub.status.last_seq == 2 ** 62)
            for f in frames[:5]:
                pub.write(f)
            wait_until(lambda: sub.status.last_seq == 4, seen=lambda: sub.status)
            assert sub.status.malformed >= 1 and sub.history.last_seq == 4  # the forged state is gone
            assert_same_snapshot(snaps[4][0], sub.latest())
        finally:
            sub.close()


# ---- finding 9: endpoints --------------------------------------------------------------------------------------
def test_endpoints_are_checked_in_one_place():
    from kvstream.poolstream.publisher import PoolStreamPublisher
    from kvstream.poolstream.transport import PublishError
    from kvstream.vllm.plugin import rank_endpoint
    for bad in ("tcp://*:99999", "tcp://127.0.0.1:65536", "tcp://h:-1", "tcp://h:port"):
        with pytest.raises(EndpointError):
            check_endpoint(bad, bind=True)
        with pytest.raises(PublishError, match="out of range|ZMQ endpoint"):
            PoolStreamPublisher(bad)
    with pytest.raises(EndpointError, match="give the port"):
        check_endpoint("tcp://h:0", bind=False)
    with pytest.raises(EndpointError, match="give its host"):
        check_endpoint("tcp://*:5560", bind=False)
    assert check_endpoint("tcp://*:0", bind=True) == "tcp://*:0"
    # one rule for data-parallel ranks, the plugin's and everyone's
    assert rank_endpoint("ipc:///tmp/p.sock", 2) == endpoint_for_rank("ipc:///tmp/p.sock", 2) == "ipc:///tmp/p.sock_dp2"
    assert endpoint_for_rank("tcp://h:5560", 3) == "tcp://h:5563"
    with pytest.raises(EndpointError, match="past 65535"):
        rank_endpoint("tcp://*:65535", 1)
    with pytest.raises(EndpointError, match="out of range"):
        rank_endpoint("tcp://*:99999", 0)


def test_every_endpoint_spec_is_split_by_one_function():
    """``ENDPOINT[,KEY=VALUE]...`` (--publish, --attach, --kv-events, --attach-kv-events, the plugin's variable) has one
    splitter, kvstream.endpoints.split_spec; each front door keeps its own words when an option is wrong."""
    import ast
    from pathlib import Path
    from kvstream.endpoints import split_spec, stream_spec
    from kvstream.kv_events.codec import KVEventError
    from kvstream.kv_events.endpoint import parse_endpoint_spec
    root = Path(__file__).resolve().parents[1]
    defined = [f"{path.relative_to(root)}" for top in ("engine", "kvstream", "explorer")
               for path in sorted((root / top).rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "split_spec"]
    assert defined == ["kvstream/endpoints.py"]
    assert split_spec("tcp://h:1,tcp://h:2,topic=", {"replay": None, "topic": "x"}, "use ...", bare="replay") == \
        ("tcp://h:1", {"replay": "tcp://h:2", "topic": ""})
    with pytest.raises(EndpointError, match=r"^unknown option 'tcp://h:2' in 'tcp://h:1,tcp://h:2': use R$"):
        split_spec("tcp://h:1,tcp://h:2", {"replay": None}, "use R")  # a bare address only where one is asked for
    assert stream_spec("tcp://*:5560,curve=/k", bind=True, what="--publish") == ("tcp://*:5560", "/k")
    assert stream_spec("tcp://127.0.0.1:5560", bind=False) == ("tcp://127.0.0.1:5560", None)
    for spec in ("tcp://*:5560,curve=", "tcp://*:5560,curve", "tcp://*:5560,key=/k"):
        part = spec.split(",")[1]
        with pytest.raises(EndpointError) as raised:
            stream_spec(spec, bind=True, what="--publish")
        assert str(raised.value) == (f"unknown option {part!r} in --publish {spec!r}: the only option is curve=DIR "
                                     "(a key directory made by python main.py --make-keys DIR)")
    with pytest.raises(KVEventError) as raised:
        parse_endpoint_spec("tcp://h:5557,dp=2,colour=red")
    assert str(raised.value) == ("unknown option 'colour=red' in 'tcp://h:5557,dp=2,colour=red': use replay=ADDR, "
                                 "topic=T, dp=N, name=X or curve=DIR")
    two = parse_endpoint_spec("tcp://h:5557,tcp://h:6000,dp=2")
    assert [(e.endpoint, e.replay_endpoint) for e in two] == [("tcp://h:5557", "tcp://h:6000"),
                                                               ("tcp://h:5558", "tcp://h:6001")]


def test_the_plugin_logs_the_endpoint_it_bound(monkeypatch, caplog):
    """The plugin's log line names what was bound (port 0: the port chosen), not what it was given."""
    import types

    from kvstream.vllm import plugin
    install_fake_tap(monkeypatch)
    monkeypatch.setenv(plugin.ENV_ENDPOINT, "tcp://127.0.0.1:0")
    scheduler = types.SimpleNamespace()
    with caplog.at_level("INFO", logger="vllm.paged_kv_explorer"):
        publisher = plugin.attach(scheduler)
    try:
        assert publisher is not None, caplog.text
        bound = publisher.sink.bound
        assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith(":0")
        assert f"on {bound}" in caplog.text
    finally:
        publisher.close()
    monkeypatch.setenv(plugin.ENV_ENDPOINT, "tcp://*:99999")
    with caplog.at_level("INFO", logger="vllm.paged_kv_explorer"):
        assert plugin.attach(types.SimpleNamespace()) is None
    assert "out of range" in caplog.text
