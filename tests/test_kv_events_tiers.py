"""KV events across tiers, as vLLM's offloading connector and SGLang's hierarchical cache send them (issue 30).

Batches are built by vLLM's own event classes and published by vLLM's own ``ZmqEventPublisher`` (in the vLLM venv,
a subprocess), and by SGLang's own publisher; the content index keeps every medium apart ("GPU", "CPU", "STORAGE";
SGLang's "CPU_PINNED" counts as CPU and "DISK" as STORAGE), matches hash-only placeholders to content it already
knows, keeps a batch whose single events are odd, and answers the per-tier longest match."""
from __future__ import annotations

import subprocess
import textwrap
import time

import msgspec
import pytest

from kvstream.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheIndex, KVEventDecodeError,
                                KVEventEndpoint, KVEventSubscriber, decode_batch, decode_batch_report,
                                encode_batch, json_summary, make_batch, medium_tier, prefix_overlap_by_tier,
                                where_cached)
from tests.test_kv_events import (ROOT, _sglang_kv_events, _vllm_python, msgpack_shape, settled_status,  # noqa: F401
                                  sockdir)
from tests.helpers import wait_until

# vLLM 0.34's fields, in its order (vllm/distributed/kv_events.py): what our structs must be, name for name.
VLLM_034_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                   "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                   "ownership", "session_id", "lookahead_token_ids")
VLLM_034_REMOVED = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def test_our_structs_have_vllm_034s_fields_in_its_order():
    assert BlockStored.__struct_fields__ == VLLM_034_STORED
    assert BlockRemoved.__struct_fields__ == VLLM_034_REMOVED
    # the ones vLLM added after the first seven default to None, so events that leave them out stay the old bytes
    assert BlockStored.__struct_defaults__ == (None,) * 8 and BlockRemoved.__struct_defaults__ == (None,) * 3
    event = BlockStored((1, 2), None, (1, 2, 3, 4), 2, None, "GPU", None, lookahead_token_ids=((5,), (6,)))
    assert decode_batch(encode_batch(make_batch([event], 1.0))).events == (event,)


VLLM_034_BYTES = textwrap.dedent("""
    import importlib.util, sys, msgspec
    spec = importlib.util.spec_from_file_location("vllm_kv_events_034", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)  # vLLM 0.34's module; its imports resolve in the installed vLLM
    events = [m.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                            block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                            session_id="s", lookahead_token_ids=[[5], [6]]),
              m.BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[], lora_id=None, block_size=0,
                            medium="CPU", lora_name=None, group_idx=1, kv_cache_spec_kind="mamba",
                            locality="LOCAL", ownership="fs"),
              m.BlockRemoved(block_hashes=[7], medium="CPU", group_idx=1, locality="LOCAL", ownership="fs"),
              m.AllBlocksCleared()]
    sys.stdout.buffer.write(msgspec.msgpack.encode(m.KVEventBatch(ts=2.5, events=events, data_parallel_rank=0)))
""")


def test_byte_for_byte_with_vllm_034(tmp_path):
    """Our encoder against vLLM 0.34's own classes, when its kv_events.py is at hand (KV_EVENTS_VLLM034_SOURCE:
    the file from the vllm 0.34.0 wheel; it runs on the installed vLLM's imports)."""
    import os
    source, python = os.environ.get("KV_EVENTS_VLLM034_SOURCE"), _vllm_python()
    if not source or python is None:
        pytest.skip("set KV_EVENTS_VLLM034_SOURCE to vLLM 0.34's vllm/distributed/kv_events.py (and a vLLM venv)")
    theirs = subprocess.run([python, "-c", VLLM_034_BYTES, source], capture_output=True, check=True,
                            timeout=300).stdout
    ours = make_batch([
        BlockStored((1, 2**64 - 1), None, (1, 2, 3, 4), 2, None, "GPU", None, group_idx=0, session_id="s",
                    lookahead_token_ids=((5,), (6,))),
        BlockStored((7,), None, (), 0, None, "CPU", None, group_idx=1, kv_cache_spec_kind="mamba",
                    locality="LOCAL", ownership="fs"),
        BlockRemoved((7,), "CPU", group_idx=1, locality="LOCAL", ownership="fs"), AllBlocksCleared()], 2.5, 0)
    assert encode_batch(ours) == theirs and decode_batch(theirs) == ours


def gpu(hashes, parent, tokens, size=4, group=0):
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, None, "GPU", None, group_idx=group)


def placeholder(h, medium, group=0, locality="LOCAL", ownership=None, kind=None):
    """The offloading connector's legacy placeholder, field for field as vLLM builds it."""
    return BlockStored((h,), None, (), 0, None, medium, None, group_idx=group, kv_cache_spec_kind=kind,
                       locality=locality, ownership=ownership)


def test_placeholders_match_known_content_and_tiers_stay_apart():
    tokens = tuple(range(100, 116))  # 4 blocks of 4
    index = KVCacheIndex("x")
    index.apply_batch(make_batch([gpu([11, 12, 13, 14], None, tokens)], 1.0), 0)
    index.apply_batch(make_batch([placeholder(11, "CPU"), placeholder(12, "CPU"), placeholder(999, "CPU"),
                                  BlockStored((14,), 13, (), 4, None, "CPU", None, group_idx=1,
                                              kv_cache_spec_kind="mamba")], 2.0), 1)
    b11, b999, b14 = index.block(11), index.block(999), index.block(14)
    assert b11.tiers == {"GPU", "CPU"} and b11.content == "content known from its GPU store"
    assert b11.token_ids == tokens[:4] and b999.content == "content not sent" and b999.token_ids == ()
    assert b14.groups == {0, 1} and index.group_specs == {1: ("mamba", None)}
    assert index.num_placeholders == 4 and index.num_placeholders_matched == 3
    assert index.stored_hashes_by_medium() == {"GPU": 4, "CPU": 4, "STORAGE": 0}
    assert index.match_prefix_by_tier(tokens) == {"GPU": 4, "CPU": 2, "STORAGE": 0}
    # GPU evicts 11 and 12 (their CPU copies stay, with their tokens); a described STORAGE store; a removal that
    # names a group and a locality takes only what it matches
    index.apply_batch(make_batch([
        BlockRemoved((11, 12), "GPU", group_idx=0),
        BlockStored((13,), 12, tokens[8:12], 4, None, "STORAGE", None, group_idx=0, locality="LOCAL",
                    ownership="fs", kv_cache_spec_kind="full_attention"),
        placeholder(11, "STORAGE", ownership="fs"),
        BlockRemoved((14,), "CPU", group_idx=0)], 3.0), 2)  # group 0 has no CPU copy of 14: nothing matches
    assert index.block(11).tiers == {"CPU", "STORAGE"} and index.block(11).token_ids == tokens[:4]
    assert index.block(13).tiers == {"GPU", "STORAGE"} and index.block(14).tiers == {"GPU", "CPU"}
    assert index.num_unknown_removed == 1
    assert index.match_prefix_by_tier(tokens) == {"GPU": 0, "CPU": 2, "STORAGE": 1}
    assert index.stored_hashes_by_medium() == {"GPU": 2, "CPU": 4, "STORAGE": 2}
    # the CPU copy of 12 goes: 12 has left every tier; a later STORAGE placeholder for it gets its tokens back
    index.apply_batch(make_batch([BlockRemoved((12,), "CPU", group_idx=0, locality="LOCAL")], 4.0), 3)
    assert index.block(12) is None and index.match_prefix_by_tier(tokens)["CPU"] == 1
    index.apply_batch(make_batch([placeholder(12, "STORAGE", ownership="fs")], 5.0), 4)
    assert index.block(12).token_ids == tokens[4:8] and index.block(12).tiers == {"STORAGE"}
    assert index.match_prefix_by_tier(tokens)["STORAGE"] == 3
    summary = json_summary(index)
    assert summary["stored_hashes_by_medium"] == {"GPU": 2, "CPU": 3, "STORAGE": 3}
    assert summary["stored_hashes_by_group"] == {"0": 5, "1": 1} and summary["placeholders"] == 6
    # the content-less block takes no part in prefix matching or in "Across instances"
    nodes = where_cached([index])
    assert all(n.token_ids for n in nodes) and nodes[0].tiers[0] == {"CPU", "STORAGE"}


def test_sglang_spellings_count_as_our_tiers():
    assert [medium_tier(m) for m in ("GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", "EXTERNAL", None)] == \
        ["GPU", "CPU", "CPU", "STORAGE", "STORAGE", "EXTERNAL", None]
    index = KVCacheIndex()
    stored = [BlockStored((h,), None, (h, h), 2, None, m, None) for h, m in
              ((1, "GPU"), (2, "CPU_PINNED"), (3, "DISK"), (4, "EXTERNAL"), (5, None))]
    index.apply_batch(make_batch(stored + [BlockStored((1,), None, (1, 1), 2, None, "CPU_PINNED", None)], 1.0), 0)
    assert index.block(1).media == {"GPU", "CPU_PINNED"} and index.block(1).tiers == {"GPU", "CPU"}
    assert index.stored_hashes_by_medium() == {"GPU": 1, "CPU": 2, "STORAGE": 1, "EXTERNAL": 1, "unspecified": 1}
    index.apply_batch(make_batch([BlockRemoved((1,), "CPU")], 2.0), 1)  # "CPU" removes the CPU_PINNED copy
    assert index.block(1).tiers == {"GPU"}


def test_one_odd_event_never_drops_its_batch():
    good = BlockStored((1,), None, (1, 2), 2, None, "GPU", None)
    payload = msgspec.msgpack.encode([7.0, [
        msgspec.to_builtins(good) | {"type": "BlockStored"},
        {"type": "BlockStored", "block_hashes": ["not a hash"], "parent_block_hash": None, "token_ids": [],
         "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [3], "block_size": 0,
         "lora_id": None, "medium": "GPU", "lora_name": None},
        7,
        {"type": "BlockRemoved", "block_hashes": [b""], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": [],
         "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None},  # a placeholder: fine
    ], 0])
    report = decode_batch_report(payload)
    assert [type(e).__name__ for e in report.batch.events] == ["BlockStored", "BlockStored"]
    assert report.batch.events[0] == good and report.batch.events[1].is_placeholder
    assert len(report.odd) == 4 and report.odd[0].startswith("event 1 (BlockStored)")
    assert any("block_size must be positive when tokens are sent" in o for o in report.odd)
    with pytest.raises(KVEventDecodeError, match="event 1"):
        decode_batch(payload)  # the strict form: all or nothing


# ----------------------------------------------------------------------------------------------- vLLM's classes
VLLM_TIERS = textwrap.dedent("""
    import sys, time, msgspec
    sys.path.insert(0, sys.argv[3])
    from vllm.distributed.kv_events import (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared,
                                            ZmqEventPublisher, MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
    from kvstream.kv_events import KVEventEndpoint, KVEventSubscriber, json_summary
    from tests.helpers import holds_for, wait_until

    tokens = list(range(100, 132))  # 4 blocks of 8
    def gpu(hashes, parent, toks, group=0):
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=8,
                           lora_id=None, medium=MEDIUM_GPU, lora_name=None, group_idx=group)
    def placeholder(h, medium, group=0, locality="LOCAL", ownership=None):
        # as vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py builds its placeholders
        return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], lora_id=None, block_size=0,
                           medium=medium, lora_name=None, group_idx=group, locality=locality, ownership=ownership)
    batches = [
        KVEventBatch(ts=1.0, events=[gpu([11, 12, 13, 14], None, tokens)]),
        KVEventBatch(ts=2.0, events=[placeholder(11, MEDIUM_CPU), placeholder(12, MEDIUM_CPU),
                                     placeholder(999, MEDIUM_CPU),
                                     BlockStored(block_hashes=[14], parent_block_hash=13, token_ids=[],
                                                 block_size=8, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
                                                 group_idx=1, kv_cache_spec_kind="mamba")]),
        KVEventBatch(ts=3.0, events=[  # one batch, three media
            BlockRemoved(block_hashes=[11, 12], medium=MEDIUM_GPU, group_idx=0),
            BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=tokens[16:24], block_size=8,
                        lora_id=None, medium=MEDIUM_STORAGE, lora_name=None, group_idx=0,
                        kv_cache_spec_kind="full_attention", locality="LOCAL", ownership="fs"),
            placeholder(11, MEDIUM_STORAGE, ownership="fs")]),
        KVEventBatch(ts=4.0, events=[BlockRemoved(block_hashes=[12], medium=MEDIUM_CPU, group_idx=0,
                                                  locality="LOCAL")]),
    ]
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(b) for b in batches]
    ep, rp = sys.argv[4], sys.argv[5]
    # our watcher first, then vLLM's own publisher (the late server), which publishes before we are connected
    with KVEventSubscriber([KVEventEndpoint(ep, rp)], replay_timeout_s=0.5) as sub:
        # the watcher waits a while, long enough for ZMQ's reconnect back-off to grow past the server's batches
        holds_for(lambda: sub.status()[0].state == "connecting", 1.0)
        pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=ep, replay_endpoint=rp)
        for b in batches:
            pub.publish(b)
        index = sub.indexes[0]
        wait_until(lambda: index.num_batches >= len(batches), 20)
        wait_until(lambda: (sub.status()[0].num_batches, sub.status()[0].last_seq) == (index.num_batches,
                                                                                       index.last_seq))
        summary = json_summary(index, sub.status()[0])
        pub.shutdown()
    open(sys.argv[2], "wb").write(msgspec.msgpack.encode([payloads, summary]))
""")


@pytest.fixture(scope="module")
def vllm_tiers(tmp_path_factory):
    python = _vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (set KV_EVENTS_VLLM_PYTHON, or build .venv-vllm with tools/make_vllm_venv.sh)")
    tmp = tmp_path_factory.mktemp("vtiers")
    import tempfile
    d = tempfile.mkdtemp(prefix="vt", dir="/tmp")
    proc = subprocess.run([python, "-c", VLLM_TIERS, "-", str(tmp / "out"), str(ROOT), f"ipc://{d}/ev",
                           f"ipc://{d}/rp"], cwd=tmp, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return msgspec.msgpack.decode((tmp / "out").read_bytes())


def test_vllm_tier_batches_decode_and_encode_as_vllm(vllm_tiers):
    """vLLM's bytes (placeholders included) read back and written again: the same maps, keys in the same order
    (byte for byte against 0.34, whose 16-field BlockStored takes a map16 header: see the 0.34 test below)."""
    payloads, _ = vllm_tiers
    for payload in payloads:
        batch = decode_batch(payload)
        assert msgpack_shape(encode_batch(batch)) == msgpack_shape(payload)
    placeholder_event = decode_batch(payloads[1]).events[0]
    assert placeholder_event.is_placeholder and placeholder_event.block_size == 0
    assert placeholder_event.medium == "CPU" and placeholder_event.locality == "LOCAL"


def test_vllm_tier_batches_rebuild_each_tier(vllm_tiers):
    payloads, _ = vllm_tiers
    index = KVCacheIndex()
    for seq, payload in enumerate(payloads):
        index.apply_batch(decode_batch(payload), seq)
    tokens = list(range(100, 132))
    assert index.live_hashes() == {11, 13, 14, 999}
    assert index.stored_hashes_by_medium() == {"GPU": 2, "CPU": 3, "STORAGE": 2}
    assert index.match_prefix_by_tier(tokens) == {"GPU": 0, "CPU": 1, "STORAGE": 1}
    assert index.block(11).content == "content known from its GPU store"
    assert index.block(999).content == "content not sent"
    assert index.block(13).residencies >= {("STORAGE", 0, "LOCAL", "fs")}
    assert prefix_overlap_by_tier([index], tokens) == ({"GPU": 0, "CPU": 1, "STORAGE": 1},)


def test_vllm_publisher_started_after_our_watcher(vllm_tiers):
    """vLLM's own ZmqEventPublisher, started a second after our watcher and done publishing before the watcher's
    live socket reconnected: the replay asked on connect brings all four batches."""
    _, summary = vllm_tiers
    assert summary["batches"] == 4 and summary["lost"] == 0 and summary["malformed"] == 0
    assert summary["stored_hashes"] == 4
    assert summary["stored_hashes_by_medium"] == {"GPU": 2, "CPU": 3, "STORAGE": 2}
    assert summary["stored_hashes_by_group"] == {"0": 4, "1": 1}


# ----------------------------------------------------------------------------------------------- SGLang's publisher
def test_sglang_publisher_tiers(sockdir):
    """SGLang's own ZmqEventPublisher with its StorageMedium spellings (GPU, CPU_PINNED, DISK)."""
    sgl = _sglang_kv_events()
    medium = sgl.StorageMedium
    pub = sgl.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{sockdir}/s", replay_endpoint=f"ipc://{sockdir}/r",
                                buffer_steps=100)
    try:
        with KVEventSubscriber([KVEventEndpoint(f"ipc://{sockdir}/s", f"ipc://{sockdir}/r")]) as sub:
            # slow joiner: both batches published before the subscription reached the publisher were lost with no
            # later batch to show the gap (the full suite timed out here once): empty batches until one comes live
            wait_until(lambda: (st := sub.status()[0]).num_batches > st.num_replayed,
                       serve=lambda: pub.publish(sgl.KVEventBatch(ts=time.time(), events=[])))
            index = sub.indexes[0]
            pub.publish(sgl.KVEventBatch(ts=time.time(), events=[
                sgl.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5, 6, 7, 8], block_size=2,
                                lora_id=None, medium=medium.GPU)]))
            pub.publish(sgl.KVEventBatch(ts=time.time(), events=[  # write-back to host, then to disk: one batch
                sgl.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5, 6, 7, 8], block_size=2,
                                lora_id=None, medium=medium.CPU),
                sgl.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5, 6], block_size=2,
                                lora_id=None, medium=medium.DISK),
                sgl.BlockRemoved(block_hashes=[2], medium=medium.GPU)]))
            # (probes still queued in SGLang's publishing thread may come between: wait for the last batch's state)
            wait_until(lambda: index.match_prefix_by_tier([5, 6, 7, 8]) == {"GPU": 1, "CPU": 2, "STORAGE": 1})
            st = settled_status(sub)
            payload = pub._buffer[-1][1]
        assert [e["medium"] for e in msgspec.msgpack.decode(payload)[1]] == ["CPU_PINNED", "DISK", "GPU"]
        summary = json_summary(index, st)
        assert summary["stored_hashes_by_medium"] == {"GPU": 1, "CPU": 2, "STORAGE": 1}
        assert summary["lost"] == 0 and summary["malformed"] == 0 and summary["odd_events"] == 0
        assert index.match_prefix_by_tier([5, 6, 7, 8]) == {"GPU": 1, "CPU": 2, "STORAGE": 1}
        assert index.block(2).media == {"CPU_PINNED"}
    finally:
        pub.shutdown()


def test_all_blocks_cleared_empties_every_tier():
    index = KVCacheIndex()
    index.apply_batch(make_batch([gpu([1], None, (1, 2, 3, 4)), placeholder(1, "CPU"), placeholder(2, "STORAGE")],
                                 1.0), 0)
    index.apply_batch(make_batch([AllBlocksCleared()], 2.0), 1)
    assert len(index) == 0 and index.stored_hashes_by_medium() == {"GPU": 0, "CPU": 0, "STORAGE": 0}
