"""vLLM-format KV events: codec against vLLM's and SGLang's own classes, publisher and subscriber over real ZMQ
sockets (ipc, in a temp dir), gap filling, loss, malformed input, several endpoints, and the content index.

Every socket test follows one real stream; a "wire peer" built from the protocol text alone (raw PUB + ROUTER
driven by the test) lets a test decide exactly what goes out live and what the replay buffer holds."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from kvstream.kv_events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheIndex,
                                KVEventDecodeError, KVEventEndpoint, KVEventError, KVEventPublisher,
                                KVEventSubscriber, decode_batch, decode_batch_counted, encode_batch,
                                json_summary, make_batch, parse_endpoint_spec, prefix_overlap, where_cached)

from tests.helpers import fail_forward_on_call, joined, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sockdir():
    """A short directory for ipc sockets (their paths are limited to about 100 characters)."""
    path = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settled_status(sub, serve=None):
    """The endpoint's status once it reflects every batch its index holds: status() is a copy made by the
    subscriber's loop, up to POLL_MS old, so read at once after the index changed it can predate the change."""
    index = sub.indexes[0]
    wait_until(lambda: (sub.status()[0].num_batches, sub.status()[0].last_seq) == (index.num_batches, index.last_seq),
               serve=serve)
    return sub.status()[0]


def live_joined(sub, pub):
    """Publish empty batches on ``pub`` until one reaches the KVEventSubscriber ``sub`` live (not by its replay):
    from then on what ``pub`` sends arrives live."""
    wait_until(lambda: (st := sub.status()[0]).num_batches > st.num_replayed, serve=lambda: pub.publish([]),
               what="a batch to come live")


def stored(hashes, parent=None, size=2, medium="GPU", tokens=None, lora_name=None):
    hashes = tuple(hashes)
    tokens = tuple(range(len(hashes) * size)) if tokens is None else tuple(tokens)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       lora_id=None, medium=medium, lora_name=lora_name)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=tuple(hashes), medium=medium)


def chain_hash(parent, tokens):
    """A block's prefix hash from its parent's and its tokens, as vLLM computes them (here: 64 bits of SHA-256)."""
    digest = hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def workload(seed=0, steps=120, block_size=4):
    """Batches a prefix-caching server would send: requests share prefixes, so only the blocks past the cached
    part of a prompt are stored (with the last cached block as parent); a full cache evicts least recently used
    leaves; a reset clears everything once. Returns (batches, live set)."""
    rng = random.Random(seed)
    live: dict[int, int | None] = {}  # hash -> parent
    order: list[int] = []  # LRU order of live hashes
    batches = []
    prefixes = [[rng.randrange(50) for _ in range(block_size * rng.randint(1, 3))] for _ in range(4)]
    for step in range(steps):
        events = []
        if step == steps // 2:
            events.append(AllBlocksCleared())
            live.clear()
            order.clear()
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(block_size * rng.randint(0, 3))]
        parent, new, new_parent, new_tokens = None, [], None, []
        for i in range(len(tokens) // block_size):
            block = tokens[i * block_size:(i + 1) * block_size]
            h = chain_hash(parent, block)
            if h in live:
                order.remove(h)  # a hit: most recently used now
            else:
                if not new:
                    new_parent = parent
                new.append(h)
                new_tokens += block
                live[h] = parent
            order.append(h)
            parent = h
        if new:
            events.append(BlockStored(block_hashes=tuple(new), parent_block_hash=new_parent,
                                      token_ids=tuple(new_tokens), block_size=block_size, lora_id=None,
                                      medium="GPU", lora_name=None))
        while len(live) > 25:  # evict the least recently used leaf
            leaf = next(h for h in order if h not in live.values())
            order.remove(leaf)
            del live[leaf]
            events.append(removed([leaf]))
        batches.append(events)
    return batches, set(live)


# ----------------------------------------------------------------------------------------------- codec
def _vllm_python():
    for candidate in (os.environ.get("KV_EVENTS_VLLM_PYTHON"), ROOT / ".venv-vllm/bin/python"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


# Batches both sides build from the same plain description: [ts, rank, [[type, fields], ...]].
SPEC = [
    [1.5, 0, [["BlockStored", dict(block_hashes=[1, 2, 2**64 - 1], parent_block_hash=None,
                                   token_ids=list(range(48)), block_size=16, lora_id=None, medium="GPU",
                                   lora_name=None, group_idx=0)],
              ["BlockRemoved", dict(block_hashes=[7], medium="GPU", group_idx=0)],
              ["AllBlocksCleared", {}]]],
    [2.25, None, [["BlockStored", dict(block_hashes=[b"\x01" * 32], parent_block_hash=b"\xfe" * 32,
                                       token_ids=[5, 6, 7, 8], block_size=4, lora_id=3, medium="CPU",
                                       lora_name="adapter", extra_keys=[("salt",)], group_idx=1,
                                       kv_cache_spec_kind="full_attention", session_id="s1")],
                  ["BlockRemoved", dict(block_hashes=[b"\x01" * 32], medium="CPU", locality="LOCAL")]]],
    [3.0, 2, []],
]

VLLM_SIDE = textwrap.dedent("""
    import os, sys, tempfile, time, traceback
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    spec, ours = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
    theirs = [msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[kinds[k](**f) for k, f in evs],
                                                  data_parallel_rank=rank)) for ts, rank, evs in spec]
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    # vLLM decodes our bytes; equal to what it built itself from the same description?
    equal = [dec.decode(o) == dec.decode(t) for o, t in zip(ours, theirs)]
    reencoded = [msgspec.msgpack.encode(dec.decode(o)) for o in ours]

    def follow_a_real_engine():
        # A real vLLM engine (in-process engine core, to read its block pool) publishing KV events; our subscriber,
        # started after the first requests, follows it. Returns vLLM's cached hashes, ours, and the status.
        sys.path.insert(0, sys.argv[3])
        from pathlib import Path
        from tests.vllm_live.checkpoint import make_checkpoint
        from kvstream.kv_events import KVEventEndpoint, KVEventSubscriber
        from vllm import LLM, SamplingParams
        from vllm.config import KVEventsConfig
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash
        d = tempfile.mkdtemp(prefix="vkv", dir="/tmp")
        ep, rp = f"ipc://{d}/ev", f"ipc://{d}/rp"
        llm = LLM(model=str(make_checkpoint(Path(d) / "llama")), block_size=32, num_gpu_blocks_override=40,
                  max_model_len=512, enforce_eager=True, enable_prefix_caching=True,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=ep,
                                                  replay_endpoint=rp))
        shared = "The quick brown fox jumps over the lazy dog. " * 3
        params = SamplingParams(max_tokens=40, temperature=0)
        llm.generate([shared + "One.", shared + "Two two."], params)  # before anyone listens
        with KVEventSubscriber([KVEventEndpoint(ep, rp)]) as sub:
            for i in range(6):  # more than 40 blocks: evictions
                llm.generate([f"{i} unique prompt number {i} " * 12, shared + f"tail {i}"], params)
            pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            vllm_hashes = sorted(maybe_convert_block_hash(get_block_hash(k))
                                 for k in pool.cached_block_hash_to_block._cache)
            index = sub.indexes[0]
            from tests.helpers import wait_until
            wait_until(lambda: sorted(index.live_hashes()) == vllm_hashes, what="our index to hold vLLM's hashes",
                       seen=lambda: sorted(index.live_hashes()))
            st = sub.status()[0]
        return [vllm_hashes, sorted(index.live_hashes()), st.num_lost, st.num_malformed, st.num_replayed,
                index.num_removed_total]

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        engine = follow_a_real_engine()
    except Exception:
        engine = traceback.format_exc()
    open(sys.argv[2], "wb").write(msgspec.msgpack.encode([theirs, equal, reencoded, engine]))
""")


def _ours(spec):
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    return [make_batch([msgspec.convert(f, kinds[k]) for k, f in evs], ts, rank) for ts, rank, evs in spec]


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    """One vLLM subprocess for both vLLM tests (importing vLLM is most of the cost: 10-20 s here)."""
    python = _vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (set KV_EVENTS_VLLM_PYTHON, or build .venv-vllm with tools/make_vllm_venv.sh)")
    tmp = tmp_path_factory.mktemp("vllm")
    (tmp / "in").write_bytes(msgspec.msgpack.encode([SPEC, [encode_batch(b) for b in _ours(SPEC)]]))
    subprocess.run([python, "-c", VLLM_SIDE, str(tmp / "in"), str(tmp / "out"), str(ROOT)], check=True,
                   cwd=tmp, timeout=300, capture_output=True)
    return msgspec.msgpack.decode((tmp / "out").read_bytes())


def msgpack_shape(payload):
    """A payload's msgpack value with every map as its (key, value) list in wire order: two payloads with the same
    shape differ at most in header widths (msgspec writes a BlockStored map with a map16 header once the struct has
    16 fields, as vLLM 0.34's has, and a fixmap header for 0.32's 15)."""
    def walk(v):
        if isinstance(v, dict):
            return [(k, walk(x)) for k, x in v.items()]
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(msgspec.msgpack.decode(payload))


def test_codec_matches_vllm_both_ways(vllm_side):
    """vLLM's own decoder reads our bytes as the objects it builds itself, and ours reads its bytes. Our structs
    are vLLM 0.34's (byte for byte: tests/test_kv_events_tiers.py); against 0.32 the maps hold the same keys in the
    same order with the same values, BlockRemoved byte for byte, BlockStored's map header one width wider."""
    theirs, equal, reencoded, _ = vllm_side
    assert equal == [True] * len(SPEC)
    for batch, their_bytes, again in zip(_ours(SPEC), theirs, reencoded):
        ours = encode_batch(batch)
        assert msgpack_shape(ours) == msgpack_shape(their_bytes) == msgpack_shape(again)
        if not any(isinstance(e, BlockStored) for e in batch.events):
            assert ours == their_bytes == again  # byte for byte
        assert decode_batch(their_bytes) == batch


def test_real_vllm_stream_rebuilds_vllms_cached_hashes(vllm_side):
    """A real vLLM engine's KV events, followed from after its first requests (catch-up by replay): our live set
    equals the hashes in vLLM's own block pool, after evictions, with nothing lost or malformed."""
    engine = vllm_side[3]
    assert not isinstance(engine, str), engine  # the traceback, if vLLM failed
    vllm_hashes, ours, lost, malformed, replayed, removed_total = engine
    assert ours == vllm_hashes and len(vllm_hashes) > 10
    assert lost == 0 and malformed == 0 and replayed >= 1 and removed_total > 0


def test_decode_roundtrip_and_hash_types():
    for batch in _ours(SPEC):
        assert decode_batch(encode_batch(batch)) == batch
    batch = decode_batch(encode_batch(_ours(SPEC)[1]))
    assert batch.events[0].block_hashes == (b"\x01" * 32,) and batch.data_parallel_rank is None
    # SGLang's namespaced hashes are signed int64
    neg = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-(2**63)]}], 0])
    assert decode_batch(neg).events[0].block_hashes == (-(2**63),)


# How vLLM before map encoding and SGLang <= 0.5.14 declared their events: tagged arrays.
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # SGLang 0.4: [ts, events], no rank
    ts: float
    events: list[OldStored | OldRemoved | OldCleared]


def test_decode_old_array_form_and_unknown_parts():
    payload = msgspec.msgpack.encode(OldBatch(ts=4.0, events=[
        OldStored([10, 11], None, [1, 2, 3, 4], 2, None), OldStored([12], 11, [5, 6], 2, None, "GPU"),
        OldRemoved([10]), OldCleared()]))
    batch = decode_batch(payload)
    assert batch.ts == 4.0 and batch.data_parallel_rank is None
    a, b, c, d = batch.events
    assert a.block_hashes == (10, 11) and a.token_ids == (1, 2, 3, 4) and a.medium is None
    assert b.parent_block_hash == 11 and b.medium == "GPU"
    assert isinstance(c, BlockRemoved) and c.block_hashes == (10,) and isinstance(d, AllBlocksCleared)
    # unknown fields are ignored, unknown event types skipped and counted, optional fields may be missing
    payload = msgspec.msgpack.encode([5.0, [
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [9, 9], "block_size": 2, "future": {"x": 1}},
        {"type": "BlockUpdated", "block_hashes": [1]}, ["SomethingNew", 1, 2]], 3, "extra"])
    batch, unknown = decode_batch_counted(payload)
    assert unknown == 2 and batch.data_parallel_rank == 3
    assert batch.events == (BlockStored((1,), None, (9, 9), 2, None, None, None),)


@pytest.mark.parametrize("payload, words", [
    (b"\xc1", "not msgpack"),
    (b"", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "a batch is the array"),
    (msgspec.msgpack.encode([1.0]), "a batch is the array"),
    (msgspec.msgpack.encode(["now", []]), "ts must be a number"),
    (msgspec.msgpack.encode([1.0, {}]), "events must be an array"),
    (msgspec.msgpack.encode([1.0, [], "rank"]), "rank must be an integer"),
    (msgspec.msgpack.encode([1.0, [7]]), "must be a map or a tagged array"),
    (msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "no string type tag"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "token_ids": [],
                                    "block_size": 1}]]), r"event 0 \(BlockStored\)"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [],
                                    "block_size": 1}]]), "event 0"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
                                    "block_size": 0}]]), "block_size must be positive"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "block_hashes"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]]), "empty byte string"),
])
def test_malformed_payloads_raise_a_clear_value_error(payload, words):
    with pytest.raises(KVEventDecodeError, match=words) as info:
        decode_batch(payload)
    assert isinstance(info.value, ValueError)


# ----------------------------------------------------------------------------------------------- SGLang
_SGLANG = []  # SGLang's kv_events module, once loaded


def _sglang_kv_events():
    """SGLang's own publisher module. Its package __init__ files pull in the GPU stack (triton, torch, FastAPI);
    the module itself needs only msgspec, pyzmq, pydantic and psutil, so load it without running those two files
    (tools/install_sglang_publisher.sh installs exactly that)."""
    if _SGLANG:
        return _SGLANG[0]
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed: run tools/install_sglang_publisher.sh (CI does)")
    root = Path(spec.origin).parent
    added = []
    try:
        for name, sub in (("sglang", root), ("sglang.srt.utils", root / "srt" / "utils")):
            if name not in sys.modules:
                pkg = types.ModuleType(name)
                pkg.__path__ = [str(sub)]
                sys.modules[name] = pkg
                added.append(name)
        module = importlib.import_module("sglang.srt.disaggregation.kv_events")
    except ImportError as exc:
        pytest.skip(f"SGLang's publisher module does not import here: {exc}")
    finally:
        for name in added:  # the bare packages stood in only for the import
            del sys.modules[name]
    _SGLANG.append(module)
    return module


def test_sglang_publisher_batches(sockdir):
    """SGLang's own ZmqEventPublisher: its batches ([ts, events, attn_dp_rank], optional fields left out) and its
    replay socket, followed by our subscriber."""
    sgl = _sglang_kv_events()
    pub = sgl.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{sockdir}/s", replay_endpoint=f"ipc://{sockdir}/r",
                                buffer_steps=100)
    try:
        events = [sgl.BlockStored(block_hashes=[101, -102], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                  block_size=2, lora_id=None),
                  sgl.BlockStored(block_hashes=[103], parent_block_hash=-102, token_ids=[5, 6], block_size=2,
                                  lora_id=None, medium="GPU")]
        pub.publish(sgl.KVEventBatch(ts=time.time(), events=events))
        pub.publish(sgl.KVEventBatch(ts=time.time(), events=[sgl.BlockRemoved(block_hashes=[103])]))
        wait_until(lambda: len(pub._buffer) == 2)
        payload = pub._buffer[0][1]
        first = msgspec.msgpack.decode(payload)[1][0]
        assert "medium" not in first and "lora_name" not in first and first["lora_id"] is None  # left out
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and batch.events[0].medium is None
        assert batch.events[0].block_hashes == (101, -102) and batch.events[1].medium == "GPU"
        with KVEventSubscriber([KVEventEndpoint(f"ipc://{sockdir}/s", f"ipc://{sockdir}/r")]) as sub:
            wait_until(lambda: sub.indexes[0].num_batches == 2)
            pub.publish(sgl.KVEventBatch(ts=time.time(), events=[sgl.AllBlocksCleared()]))
            index = sub.indexes[0]
            wait_until(lambda: index.num_batches == 3 or index.num_cleared == 1)
            st = settled_status(sub)
        assert index.num_stored_total == 3 and index.num_removed_total == 3 and len(index) == 0
        assert st.num_lost == 0 and st.num_malformed == 0 and st.num_replayed == 2
    finally:
        pub.shutdown()


def test_sglang_batch_decodes_to_live_set(sockdir):
    sgl = _sglang_kv_events()
    enc = msgspec.msgpack.Encoder()
    payload = enc.encode(sgl.KVEventBatch(ts=1.0, events=[
        sgl.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 1, 2, 2], block_size=2,
                        lora_id=None, cache_salt="s"),
        sgl.BlockRemoved(block_hashes=[1], medium="GPU")], attn_dp_rank=1))
    index = KVCacheIndex()
    index.apply_batch(decode_batch(payload), 0)
    assert index.live_hashes() == {2} and decode_batch(payload).data_parallel_rank == 1


# ----------------------------------------------------------------------------------------------- our publisher
def test_round_trip_rebuilds_live_hashes_and_late_join_catches_up(sockdir):
    batches, expected = workload(seed=1)
    with KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r") as pub:
        for events in batches[:40]:  # published before anyone listens: only the replay can give them back
            pub.publish(events)
        with KVEventSubscriber([KVEventEndpoint(pub.endpoint, pub.replay_endpoint)]) as sub:
            index = sub.indexes[0]
            wait_until(lambda: index.num_batches == 40)
            for events in batches[40:]:
                pub.publish(events)
            wait_until(lambda: index.num_batches == len(batches))
            st = settled_status(sub)
    assert index.live_hashes() == expected
    assert st.num_lost == 0 and st.num_malformed == 0 and st.num_replayed >= 40 and st.last_seq == len(batches) - 1
    assert index.last_seq == len(batches) - 1 and index.num_cleared == 1
    tl = index.timeline()
    assert list(tl.seq) == list(range(len(batches))) and tl.live[-1] == len(expected)
    assert tl.stored.sum() == index.num_stored_total and tl.removed.sum() == index.num_removed_total


def test_wire_only_subscriber_and_replay_from_zero(sockdir):
    """A reader written from the wire description alone rebuilds the live set; replay from 0 returns the same
    (seq, payload) pairs as the live stream, then the end marker [b"", -1, b""]."""
    batches, expected = workload(seed=2, steps=60)
    ctx = zmq.Context.instance()
    with KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r", topic="kv") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        first = joined(sub, lambda: pub.publish([]))  # empty batches until the subscription is in
        for events in batches:
            pub.publish(events)
        live, hashes = [], set()
        message = first
        while True:
            topic, seq, payload = message
            assert topic == b"kv" and len(seq) == 8
            live.append((int.from_bytes(seq, "big"), payload))
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert rank == 0 and isinstance(ts, float)
            for event in events:
                if event["type"] == "BlockStored":
                    hashes.update(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    hashes.difference_update(event["block_hashes"])
                else:
                    hashes.clear()
            if len(live) == pub.next_seq - live[0][0]:  # every batch from the first one received
                break
            assert sub.poll(5000)
            message = sub.recv_multipart()
        sub.close(linger=0)
        probes = live[0][0]  # probes sent before the subscription was in (the one received and any after it are
        # in ``live``: empty batches, which change nothing)
        assert [s for s, _ in live] == list(range(probes, pub.next_seq)) and hashes == expected
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(5000)
            frames = req.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1:] == [b"", END_SEQ, b""]
                break
            assert frames[1] == b"kv"
            replayed.append((int.from_bytes(frames[2], "big"), frames[3]))
        req.send_multipart([b"", (50).to_bytes(8, "big")])  # from the middle
        tail = []
        while True:
            assert req.poll(5000)
            frames = req.recv_multipart()
            if frames[2] == END_SEQ:
                break
            tail.append(int.from_bytes(frames[2], "big"))
        req.send_multipart([b"", b"bad"])  # not 8 bytes: ignored, counted
        wait_until(lambda: pub.num_bad_replay_requests == 1)
        req.close(linger=0)
    assert replayed[probes:] == live and len(replayed) == pub.next_seq
    assert tail == list(range(50, pub.next_seq))


def test_loss_beyond_replay_buffer_is_reported(sockdir):
    batches, _ = workload(seed=3, steps=30)
    with KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r", buffer_size=8) as pub:
        for events in batches:
            pub.publish(events)
        with KVEventSubscriber([KVEventEndpoint(pub.endpoint, pub.replay_endpoint)]) as sub:
            wait_until(lambda: sub.indexes[0].num_batches == 8)
            st = settled_status(sub)
    assert st.num_lost == 22 and "lost 22 batches" in st.text and st.last_seq == 29
    assert "older than the replay buffer" in st.last_error


def test_without_replay_socket_a_late_join_counts_the_batches_before(sockdir):
    with KVEventPublisher(f"ipc://{sockdir}/p") as pub:
        with KVEventSubscriber([f"ipc://{sockdir}/p"]) as sub:
            sent = []  # the first few go out before the subscription lands
            wait_until(lambda: sub.indexes[0].num_batches > 0, serve=lambda: sent.append(pub.publish([stored([9])])))
            first = sub.indexes[0].last_seq  # the batch is applied before its gap is counted: wait for the count
            wait_until(lambda: sub.status()[0].num_lost == first)
            assert sub.status()[0].num_lost == first


def test_publisher_restart_starts_the_index_over(sockdir):
    ep = KVEventEndpoint(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r")
    pub = KVEventPublisher(ep.endpoint, ep.replay_endpoint)
    for h in (1, 2, 3):
        pub.publish([stored([h])])
    with KVEventSubscriber([ep]) as sub:
        index = sub.indexes[0]
        wait_until(lambda: index.num_batches == 3)
        pub.close()
        wait_until(lambda: sub.status()[0].state == "reconnecting")
        pub = KVEventPublisher(ep.endpoint, ep.replay_endpoint)  # a new server: seq from 0, other hashes
        pub.publish([stored([9])])
        wait_until(lambda: index.live_hashes() == {9})
        st = settled_status(sub)
        pub.close()
    assert st.num_restarts == 1 and index.num_resets == 1 and st.num_disconnects >= 1 and st.num_lost == 0


def test_silent_endpoint_and_nobody_there(sockdir):
    with KVEventPublisher(f"ipc://{sockdir}/p") as pub:
        with KVEventSubscriber([pub.endpoint, f"ipc://{sockdir}/nobody", "tcp://127.0.0.1:notaport"],
                               silent_after_s=0.2) as sub:
            wait_until(lambda: sub.status()[0].state == "silent")
            silent, nobody, bad = sub.status()
    assert silent.text.startswith("silent for") and silent.connected
    assert nobody.state == "connecting" and not nobody.connected and nobody.text == "connecting"
    assert bad.state == "failed" and bad.text.startswith("failed: cannot connect to tcp://127.0.0.1:notaport")


def test_two_endpoints_each_its_own_pool(sockdir):
    """Two instances (as two data-parallel ranks would be): separate indexes; the router's view across them."""
    a_tokens, b_tokens = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]
    with KVEventPublisher(f"ipc://{sockdir}/a", f"ipc://{sockdir}/ar") as a, \
            KVEventPublisher(f"ipc://{sockdir}/b", f"ipc://{sockdir}/br", data_parallel_rank=1) as b:
        a.publish([stored([11, 12, 13], tokens=a_tokens)])
        b.publish([stored([21, 22, 23], tokens=b_tokens)])
        b.publish([removed([23])])
        eps = [KVEventEndpoint(a.endpoint, a.replay_endpoint, name="A"),
               KVEventEndpoint(b.endpoint, b.replay_endpoint, name="B")]
        with KVEventSubscriber(eps) as sub:
            ia, ib = sub.indexes
            wait_until(lambda: ia.num_batches == 1 and ib.num_batches == 2)
            statuses = sub.status()
    assert ia.live_hashes() == {11, 12, 13} and ib.live_hashes() == {21, 22}
    assert [s.label for s in statuses] == ["A", "B"] and ia.name == "A"
    assert prefix_overlap([ia, ib], [1, 2, 3, 4, 5, 6, 7]) == (3, 2)
    assert prefix_overlap([ia, ib], [1, 2, 3, 4, 9, 9]) == (2, 2)
    (root,) = where_cached([ia, ib])
    assert root.token_ids == (1, 2) and root.holders == {0, 1}
    (second,) = root.children
    assert second.holders == {0, 1} and [c.holders for c in second.children] == [frozenset({0})]


# ----------------------------------------------------------------------------------------------- wire peer
class WirePeer:
    """A publisher built from the protocol text alone and driven by the test: it chooses what goes out live and
    what its replay buffer holds, so gaps and losses happen exactly where the test says."""

    def __init__(self, sockdir, answer=True):
        ctx = zmq.Context.instance()
        # an XPUB socket sends as a PUB does and tells the test when a subscription has reached it
        self.pub, self.router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        self.endpoint, self.replay_endpoint = f"ipc://{sockdir}/w", f"ipc://{sockdir}/wr"
        self.subscriptions = 0  # subscriptions that reached the live socket
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay_endpoint)
        self.buffer: dict[int, bytes] = {}  # what a replay returns
        self.requests: list[int] = []  # start seqs asked for
        self.answer = answer

    def payload(self, seq):
        return encode_batch(make_batch([stored([1000 + seq])], 100.0 + seq, 0))

    def live(self, *seqs, payload=None):
        for seq in seqs:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload or self.payload(seq)])

    def serve(self):
        while self.pub.poll(0):
            if self.pub.recv()[:1] == b"\x01":
                self.subscriptions += 1
        while self.router.poll(0):
            ident, delim, start = self.router.recv_multipart()
            assert delim == b"" and len(start) == 8
            self.requests.append(int.from_bytes(start, "big"))
            if not self.answer:
                continue
            for seq in sorted(self.buffer):
                if seq >= self.requests[-1]:
                    self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self):
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def peer(sockdir):
    p = WirePeer(sockdir)
    yield p
    p.close()


def _follow(peer, **kw):
    sub = KVEventSubscriber([KVEventEndpoint(peer.endpoint, peer.replay_endpoint)], **kw).start()
    wait_until(lambda: sub.status()[0].connected and peer.requests == [0] and peer.subscriptions, serve=peer.serve)
    return sub


def test_gap_is_filled_by_replay(peer):
    sub = _follow(peer)
    try:
        peer.buffer = {s: peer.payload(s) for s in range(10)}
        peer.live(0, 1, 2, 3, 4)
        peer.live(8, 9)  # 5, 6, 7 never arrive live
        index = sub.indexes[0]
        # the request for 5 goes out when 8 arrives; the replay holds 5-9, so 8 and 9 come twice (live and replayed,
        # in either order): each is applied once
        wait_until(lambda: index.num_batches == 10, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    assert peer.requests == [0, 5]  # exactly the gap was asked for
    assert index.live_hashes() == {1000 + s for s in range(10)} and st.num_lost == 0 and st.num_restarts == 0
    assert 3 <= st.num_replayed <= 5  # 5-7, and 8 and 9 where the replayed copy came first


def test_gap_older_than_buffer_is_lost_and_said(peer):
    sub = _follow(peer)
    try:
        peer.live(0, 1)
        peer.buffer = {s: peer.payload(s) for s in range(4, 8)}  # 2 and 3 fell out of the buffer
        peer.live(6, 7)
        index = sub.indexes[0]
        wait_until(lambda: index.num_batches == 6, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    assert st.num_lost == 2 and "lost 2 batches" in st.text and index.last_seq == 7
    assert index.live_hashes() == {1000, 1001, 1004, 1005, 1006, 1007}


def test_restarted_peer_detected_from_a_changed_batch(peer):
    """A live batch under a number already applied, with other contents: a new publisher. Start over from 0."""
    sub = _follow(peer)
    try:
        peer.live(0, 1, 2)
        index = sub.indexes[0]
        wait_until(lambda: index.num_batches == 3, serve=peer.serve)
        fresh = encode_batch(make_batch([stored([77])], 500.0, 0))
        peer.buffer = {0: fresh}
        peer.live(0, payload=fresh)
        wait_until(lambda: index.live_hashes() == {77}, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    assert st.num_restarts == 1 and peer.requests == [0, 0] and "restarted" in st.text and index.last_seq == 0


def test_replay_socket_that_never_answers(sockdir):
    peer = WirePeer(sockdir, answer=False)
    try:
        sub = KVEventSubscriber([KVEventEndpoint(peer.endpoint, peer.replay_endpoint)], replay_timeout_s=0.3)
        sub.start()
        wait_until(lambda: sub.status()[0].replay_answering is False and peer.subscriptions, serve=peer.serve)
        peer.live(3, 4)
        wait_until(lambda: sub.indexes[0].num_batches == 2, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
        sub.stop()
    finally:
        peer.close()
    # the first replay is asked FIRST_REPLAY_TRIES times (a starting server), then the gap once more
    assert st.num_lost == 3 and "replay socket not answering" in st.text and peer.requests == [0] * 4


def test_malformed_messages_are_counted_and_skipped(peer):
    sub = _follow(peer)
    try:
        peer.live(0)
        peer.pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])  # counted, seq used up
        peer.pub.send_multipart([b"", b"\x01\x02", peer.payload(2)])  # short seq frame
        peer.pub.send_multipart([b"only one frame"])
        peer.pub.send_multipart([b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": 5}]])])
        peer.live(3)
        index = sub.indexes[0]
        wait_until(lambda: index.last_seq == 3, serve=peer.serve)
        st = settled_status(sub, serve=peer.serve)
    finally:
        sub.stop()
    # the batch with one odd event is kept (empty), its event counted apart
    assert st.num_malformed == 3 and "3 malformed messages skipped" in st.text and st.num_lost == 0
    assert st.num_odd_events == 1 and "1 odd event skipped" in st.text and index.num_batches == 3
    assert index.live_hashes() == {1000, 1003} and sub.failure is None and peer.requests == [0]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, words", [
    (dict(endpoint="nowhere"), "endpoint must be a ZMQ address"),
    (dict(endpoint="ipc:///tmp/x", replay_endpoint=5), "replay_endpoint must be"),
    (dict(endpoint="ipc:///tmp/x", buffer_size=0), "buffer_size must be a positive int"),
    (dict(endpoint="ipc:///tmp/x", buffer_size=True), "buffer_size"),
    (dict(endpoint="ipc:///tmp/x", topic=b"t"), "topic must be a string"),
    (dict(endpoint="ipc:///tmp/x", data_parallel_rank=-1), "data_parallel_rank"),
    (dict(endpoint="tcp://*:notaport"), "cannot open KV-event sockets"),
])
def test_publisher_bad_arguments(kwargs, words):
    with pytest.raises(KVEventError, match=words):
        KVEventPublisher(**kwargs)


def test_publish_bad_events_changes_nothing(sockdir):
    with KVEventPublisher(f"ipc://{sockdir}/p") as pub:
        for events, ts in (([{"type": "BlockStored"}], None), (["x"], None), ([stored([1])], "now")):
            with pytest.raises(KVEventError):
                pub.publish(events, ts)
        assert pub.next_seq == 0 and pub.publish([stored([1])]) == 0 and pub.next_seq == 1
    with pytest.raises(KVEventError, match="closed"):
        pub.publish([])


def test_two_publishers_on_one_address_is_a_clear_error(sockdir):
    with KVEventPublisher(f"ipc://{sockdir}/p", "tcp://127.0.0.1:*") as pub:
        port = pub.replay_endpoint
        with pytest.raises(KVEventError, match="cannot open"):
            KVEventPublisher(f"ipc://{sockdir}/q", port)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not Path("/proc/self/task").exists(),
                    reason="scheduling policies as Linux has them")
def test_publishers_io_thread_does_not_preempt_decode(sockdir):
    """A send wakes ZMQ's I/O thread; at normal policy that preempted the decoding thread (bench/kv_events.py), so
    the publishers' context runs it as SCHED_BATCH, and the stream still arrives."""
    with KVEventPublisher(f"ipc://{sockdir}/p") as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            joined(sub, lambda: pub.publish([]))  # the I/O thread is carrying the stream
            policies = {}
            for task in Path("/proc/self/task").iterdir():
                name = (task / "comm").read_text().strip()
                if name.startswith("ZMQbg/IO"):
                    policies.setdefault(name, set()).add(os.sched_getscheduler(int(task.name)))
            assert os.SCHED_BATCH in policies["ZMQbg/IO/0"]  # the publishers' context's I/O thread
            sent = pub.publish([BlockRemoved(block_hashes=(7,), medium="GPU")])
            batch = None
            while batch is None or not batch.events:  # probes sent after the one received come first
                assert sub.poll(5000)
                topic, seq, payload = sub.recv_multipart()
                batch = decode_batch(payload)
            assert int.from_bytes(seq, "big") == sent and batch.events[0].block_hashes == (7,)
        finally:
            sub.close(linger=0)


@pytest.mark.parametrize("spec, words", [
    ("", "non-empty"), ("host:5557", "ZMQ address"), ("tcp://h:1,bogus", "unknown option"),
    ("tcp://h:1,dp=0", "dp must be"), ("tcp://h:65535,dp=2", "past 65535"), ("tcp://h:1,replay=nope", "replay"),
])
def test_endpoint_spec_errors(spec, words):
    with pytest.raises(KVEventError, match=words):
        parse_endpoint_spec(spec)


def test_endpoint_spec_forms():
    (one,) = parse_endpoint_spec("tcp://*:5557,tcp://*:5558")
    assert one == KVEventEndpoint("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    ranks = parse_endpoint_spec("tcp://h:5557,replay=tcp://h:6000,topic=kv,dp=3,name=node")
    assert [(e.endpoint, e.replay_endpoint, e.topic, e.label) for e in ranks] == [
        (f"tcp://h:{5557 + r}", f"tcp://h:{6000 + r}", "kv", f"node dp{r}") for r in range(3)]
    for bad in (dict(silent_after_s=0), dict(replay_timeout_s="1")):
        with pytest.raises(KVEventError):
            KVEventSubscriber(["tcp://h:1"], **bad)
    with pytest.raises(KVEventError, match="at least one"):
        KVEventSubscriber([])


# ----------------------------------------------------------------------------------------------- index
def test_index_prefix_tree_media_and_summary():
    index = KVCacheIndex("x")
    index.apply_batch(make_batch([stored([1, 2, 3], tokens=[1, 2, 3, 4, 5, 6]),
                                  stored([4], parent=2, tokens=[7, 7]), stored([9], parent=77, tokens=[8, 8])],
                                 10.0), 0)
    assert [b.block_hash for b in index.roots()] == [1, 9]  # a sequence start, then an orphan
    assert [b.block_hash for b in index.children(2)] == [3, 4]
    assert [b.block_hash for b in index.chain(4)] == [1, 2, 4] and index.block(3).token_ids == (5, 6)
    assert index.match_prefix([1, 2, 3, 4, 7, 7, 0]) == 3 and index.match_prefix([1, 2, 3]) == 1
    # the same block on a second tier, then dropped tier by tier
    index.apply_batch(make_batch([stored([3], parent=2, tokens=[5, 6], medium="CPU"), removed([3], "GPU")], 11.0), 1)
    assert index.block(3).medium == "CPU" and index.num_reported_again == 1
    index.apply_batch(make_batch([removed([3], "CPU"), removed([404])], 12.0), 2)
    assert index.block(3) is None and index.num_unknown_removed == 1
    summary = json_summary(index)
    assert summary == {"source": "kv-events", "step": 2, "num_blocks": None, "block_size": 2, "used": None,
                       "cached": None, "free": None, "block_tables": None, "stored_hashes": 4,
                       "stored_hashes_by_medium": {"GPU": 4, "CPU": 0, "STORAGE": 0},
                       "name": "x", "batches": 3, "stored_total": 5, "removed_total": 1,
                       "stored_hashes_by_group": {"none": 4}, "placeholders": 0, "placeholders_matched": 0,
                       "malformed": None, "lost": None, "odd_events": None, "last_error": None}
    assert index.live_hashes() == {1, 2, 4, 9}
    index.apply_batch(make_batch([AllBlocksCleared(), stored([b"\xab" * 32])], 13.0), 3)
    assert json_summary(index)["stored_hashes"] == 1 and index.live_hashes() == {b"\xab" * 32}
    tl = index.timeline()
    assert list(tl.stored) == [5, 0, 0, 1] and list(tl.removed) == [0, 0, 1, 4] and list(tl.live) == [5, 5, 4, 1]
    assert tl.ts.dtype == np.float64


def test_index_is_safe_to_read_while_a_thread_writes():
    batches, expected = workload(seed=4, steps=200)
    index = KVCacheIndex()
    errors = []

    def write():
        for seq, events in enumerate(batches):
            index.apply_batch(make_batch(events, float(seq)), seq)

    def read():
        try:
            while writer.is_alive():
                for b in index.roots():
                    index.chain(b.block_hash)
                where_cached([index])
                json_summary(index)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    writer = threading.Thread(target=write)
    reader = threading.Thread(target=read)
    writer.start()
    reader.start()
    writer.join()
    reader.join()
    assert not errors and index.live_hashes() == expected


# ----------------------------------------------------------------------------------------------- the engine
def test_engine_stream_rebuilds_the_engines_hashes(tmp_path, sockdir):
    """Our engine publishing with EngineConfig(kv_events_endpoint=...): after a workload with prefix hits and
    evictions, the live set rebuilt from the stream equals the hashes the engine holds (used and cached blocks),
    and every parent hash was stored before its child."""
    if importlib.util.find_spec("engine.kv.kv_events") is None:
        pytest.skip("the engine does not publish KV events yet (engine/kv/kv_events.py has not landed)")
    from engine import Engine, EngineConfig
    from tests.helpers import write_tiny_checkpoint
    from kvstream.views import BlockState

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    endpoint, replay = f"ipc://{sockdir}/e", f"ipc://{sockdir}/er"
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=24, device="cpu", dtype="float32",
                              enable_prefix_caching=True, seed=0, kv_events_endpoint=endpoint,
                              kv_events_replay_endpoint=replay))
    rng = random.Random(0)
    try:
        with KVEventSubscriber([KVEventEndpoint(endpoint, replay)]) as sub:
            shared = [rng.randrange(1, 90) for _ in range(8)]
            for round_ in range(6):  # more distinct prefixes than the pool can cache: evictions
                for _ in range(2):
                    tail = [rng.randrange(1, 90) for _ in range(rng.randint(2, 9))]
                    eng.add_conversation(prompt_token_ids=shared + tail if round_ % 2 else tail + shared,
                                         max_new_tokens=4)
                eng.run_until_idle()
            snap = eng.snapshot()
            held = {int(h) for h, s in zip(snap.block_hash, snap.state)
                    if h != 0 and s in (BlockState.USED, BlockState.CACHED)}
            index = sub.indexes[0]
            wait_until(lambda: index.live_hashes() == held, timeout=10)
            st = settled_status(sub)
            assert st.num_lost == 0 and st.num_malformed == 0
            assert index.num_removed_total > 0, "the workload was meant to evict"
            # every parent stored before its child: walk the batches in sequence order, through the replay socket
            ctx = zmq.Context.instance()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seen: set = set()
            while True:
                assert dealer.poll(5000)
                frames = dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                for event in decode_batch(frames[3]).events:
                    if isinstance(event, BlockStored):  # block i's parent is block i - 1 of the same event
                        assert event.parent_block_hash is None or event.parent_block_hash in seen
                        seen.update(event.block_hashes)
            dealer.close(linger=0)
            assert held <= seen
    finally:
        eng.close()


WIRE_END = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, from the wire description


def replay_batches(replay_endpoint, start=0):
    """(Wire only: zmq and nothing of the project.) Every buffered batch from ``start`` on, as (seq, payload), read over the ROUTER replay socket with a DEALER."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == WIRE_END:
                assert frames[1:] == [b"", WIRE_END, b""]
                return out
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        dealer.close(linger=0)


def _publishing_engine(tmp_path, sockdir, **kw):
    from engine import Engine, EngineConfig
    from tests.helpers import write_tiny_checkpoint
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        write_tiny_checkpoint(ckpt)
    kw.setdefault("num_blocks", 24)
    name = kw.pop("name", "e")
    return Engine(EngineConfig(model=str(ckpt), block_size=4, device="cpu", dtype="float32",
                               enable_prefix_caching=True, seed=0, kv_events_endpoint=f"ipc://{sockdir}/{name}",
                               kv_events_replay_endpoint=f"ipc://{sockdir}/{name}r", **kw))


def _hash_changes_by_step(events):
    """step id -> (stored hashes, removed hashes, cleared) of the engine's block events, for steps that had any."""
    from kvstream.events import EventKind
    out: dict[int, tuple[list, list, bool]] = {}
    for e in events:
        if e.kind in (EventKind.STORED, EventKind.EVICTED, EventKind.CLEARED):
            stored_, removed_, cleared = out.setdefault(e.step_id, ([], [], False))
            if e.kind == EventKind.STORED:
                stored_.extend(e.block_hashes)
            elif e.kind == EventKind.EVICTED:
                removed_.extend(e.block_hashes)
            else:
                out[e.step_id] = (stored_, removed_, True)
    return out


def _batch_changes(payload):
    stored_, removed_, cleared = [], [], False
    for event in msgspec.msgpack.decode(payload)[1]:
        if event["type"] == "BlockStored":
            stored_.extend(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            removed_.extend(event["block_hashes"])
        else:
            cleared = True
    return stored_, removed_, cleared


def test_engine_publishes_one_batch_per_step_that_changed_a_hash(tmp_path, sockdir, monkeypatch):
    """generate() runs many steps in one transaction and step() one: either way each step that stored, evicted or
    cleared a hash gets its own batch, in step order, holding exactly that step's changes; a rolled-back generate()
    publishes nothing."""
    if importlib.util.find_spec("engine.kv.kv_events") is None:
        pytest.skip("the engine does not publish KV events yet")
    eng = _publishing_engine(tmp_path, sockdir, num_blocks=16)
    try:
        replay = eng.kv_events_endpoints[1]
        # generate: prompts of 5, 7 and 10 tokens at block size 4 fill blocks at different steps (and not every step)
        eng.generate([list(range(1, 6)), list(range(20, 27)), list(range(40, 50))], max_new_tokens=9)
        changes = _hash_changes_by_step(eng.take_events())
        batches = replay_batches(replay)
        assert len(changes) > 2 and max(changes) - min(changes) + 1 > len(changes)  # several steps, some without
        assert [s for s, _ in batches] == list(range(len(changes)))
        assert [_batch_changes(p) for _, p in batches] == [changes[s] for s in sorted(changes)]
        # step(): the same rule, one step per transaction, with evictions on a 16-block pool
        for i in range(4):
            eng.add_conversation(prompt_token_ids=[(13 * i + j) % 90 + 1 for j in range(9 + i)], max_new_tokens=6)
        while eng.has_work():
            eng.step()
        changes = _hash_changes_by_step(eng.take_events())
        more = replay_batches(replay, start=len(batches))
        assert any(removed_ for _, removed_, _ in changes.values()), "the workload was meant to evict"
        assert [_batch_changes(p) for _, p in more] == [changes[s] for s in sorted(changes)]
        # rolled back: the third step fails, nothing goes out
        sent = eng._kv_events.publisher.next_seq
        fail_forward_on_call(monkeypatch, eng, 3)
        with pytest.raises(RuntimeError, match="third"):
            eng.generate([list(range(60, 71))], max_new_tokens=6)
        assert eng._kv_events.publisher.next_seq == sent
    finally:
        eng.close()


def test_wire_only_subscriber_follows_the_engine(tmp_path, sockdir):
    """A subscriber that knows only the wire format (a raw zmq SUB socket and msgspec.msgpack.decode, no project
    code) reads the engine's stream through a workload with prefix hits, evictions and a prefix-cache reset: the
    live set it rebuilds equals the hashes the engine holds (used and cached), every parent was stored before its
    child, sequence numbers run from 0 without a gap, and replay from 0 over the ROUTER socket (with a DEALER) gives
    the very batches it received live."""
    if importlib.util.find_spec("engine.kv.kv_events") is None:
        pytest.skip("the engine does not publish KV events yet")
    from kvstream.views import BlockState
    eng = _publishing_engine(tmp_path, sockdir, num_blocks=24, kv_events_topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(eng.kv_events_endpoints[0])
        # the empty pool's prefix cache reset (AllBlocksCleared) until the subscription is in: the batches before it
        # come by replay, as a reader that joins late fetches them
        live = [joined(sub, eng.reset_prefix_cache)]
        rng = random.Random(1)
        shared = [rng.randrange(1, 90) for _ in range(8)]
        for round_ in range(8):  # more distinct prefixes than 24 blocks can cache: evictions
            for _ in range(2):
                tail = [rng.randrange(1, 90) for _ in range(rng.randint(2, 9))]
                eng.add_conversation(prompt_token_ids=shared + tail if round_ % 2 else tail + shared,
                                     max_new_tokens=4)
            eng.run_until_idle()
            if round_ == 3:
                eng.reset_prefix_cache()  # AllBlocksCleared
        eng.generate([shared + [5, 6, 7]], max_new_tokens=5)  # several steps in one transaction
        sent = eng._kv_events.publisher.next_seq

        first = int.from_bytes(live[0][1], "big")
        missed = replay_batches(eng.kv_events_endpoints[1])[:first]  # the probes the subscription missed
        live = [(int.from_bytes(seq, "big"), payload) for _topic, seq, payload in live]
        while first + len(live) < sent:
            assert sub.poll(5000), f"received {first + len(live)} of {sent} batches"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            live.append((int.from_bytes(seq, "big"), payload))
        hashes, ever, kinds = set(), set(), set()
        for _seq, payload in missed + live:
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and rank == 0 and events
            for event in events:
                kinds.add(event["type"])
                if event["type"] == "BlockStored":
                    parent = event["parent_block_hash"]
                    assert parent is None or parent in ever, "a block was stored before its parent"
                    assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
                    hashes.update(event["block_hashes"])
                    ever.update(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    assert set(event["block_hashes"]) <= hashes, "removed a hash that was not live"
                    hashes.difference_update(event["block_hashes"])
                else:
                    assert event["type"] == "AllBlocksCleared"
                    hashes.clear()
        assert not sub.poll(100), "more batches than the publisher counted"
        assert [s for s, _ in missed + live] == list(range(sent))
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        snap = eng.snapshot()
        held = {int(h) for h, st in zip(snap.block_hash, snap.state)
                if h != 0 and st in (BlockState.USED, BlockState.CACHED)}
        assert held and hashes == held
        assert replay_batches(eng.kv_events_endpoints[1]) == missed + live
    finally:
        sub.close(linger=0)
        eng.close()
