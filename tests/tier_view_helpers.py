"""Hand-built snapshots with tiers and KV cache groups, for the VIEW tests (tests/test_tier_views.py,
tests/test_gui_tier_views.py).

They follow the view contract of DESIGN.md "Beyond one pool" (PoolSnapshot.tiers, kv_cache_groups,
group_block_tables; ConversationInfo.group_block_tables, prompt_token_sources; OFFLOADED / LOADED / DROPPED /
WINDOW_RELEASED events) and are built by hand because the engine sides of tiers and groups are written on other
branches: once they are merged, integration tests drive a real engine through the same views.

The pool (block size 4, 8 device blocks):
- conversation 1, running: group 0 (full attention) table (0, 1, 2); group 1 (sliding window 4) table (-1, 3, 4):
  its first group-1 block (7) was released by the window. Device block 0 holds content H0, loaded back from the
  host tier after block 7 had held it, been cached, evicted and offloaded.
- conversation 2, finished: its content H5 is cached in device block 5; its older content HA sits in host slot 0.
- host tier, 4 slots: slot 0 HA (conversation 2's, announced by a STORED event), slot 2 H0 (the same content as
  device block 0); slots 1 and 3 free.
- disk tier, 2 slots: slot 1 HB, whose owner nobody announced.
"""
from __future__ import annotations

import numpy as np

from kvstream.events import BlockEvent, EventKind
from kvstream.views import (NO_HASH, BlockState, ConversationInfo, KVCacheGroupInfo, PoolSnapshot, Status,
                            TierView)

H0, H5, HA, HB = 0x1111_2222_3333_4444, 0x5555_0000_0000_0005, 0xAB12_0000_0000_0001, 0xCD34_0000_0000_0002
BLOCK_SIZE = 4
GROUPS = (KVCacheGroupInfo("full_attention", None, (0, 2)), KVCacheGroupInfo("sliding_window", 4, (1, 3)))


def conversation(cid: int, status=Status.RUNNING, *, tables=(), sources=None, prompt=8, arrival=0,
                 block_table=()) -> ConversationInfo:
    return ConversationInfo(
        conversation_id=cid, status=status, prompt_token_ids=tuple(range(prompt)), output_token_ids=(),
        output_text="", prompt_text="", block_table=tuple(block_table), num_computed_tokens=prompt,
        num_cached_tokens=0, max_new_tokens=8, temperature=0.0, parent_id=None, num_preemptions=0,
        arrival_step=arrival, group_block_tables=tuple(tables), prompt_token_sources=dict(sources or {}))


def tier(num_blocks: int, held: dict[int, int], last=None) -> TierView:
    state = np.zeros(num_blocks, np.int8)
    hashes = np.zeros(num_blocks, np.uint64)
    for slot, h in held.items():
        state[slot], hashes[slot] = BlockState.CACHED, h
    access = np.zeros(num_blocks, np.int64) if last is None else np.asarray(last, np.int64)
    return TierView(num_blocks, state, hashes, access)


def tiered_snapshot(*, step_id=20, host=None, disk=None, groups=True, conversations=None, version=1) -> PoolSnapshot:
    n = 8
    state = np.zeros(n, np.int8)
    ref = np.zeros(n, np.int32)
    filled = np.zeros(n, np.int32)
    owner = np.full(n, -1, np.int32)
    hashes = np.full(n, NO_HASH, np.uint64)
    for b in (0, 1, 2, 3, 4):
        state[b], ref[b], owner[b], filled[b] = BlockState.USED, 1, 1, BLOCK_SIZE
    filled[2] = filled[4] = 2
    state[5], owner[5], filled[5] = BlockState.CACHED, 2, BLOCK_SIZE
    hashes[0], hashes[5] = H0, H5
    tables = {1: (0, 1, 2)}
    group_tables = ({1: (0, 1, 2)}, {1: (-1, 3, 4)}) if groups else ()
    if conversations is None:
        conversations = (
            conversation(1, tables=((0, 1, 2), (-1, 3, 4)) if groups else (), block_table=(0, 1, 2),
                         sources={"device": 4, "host": 4, "disk": 0, "computed": 0}),
            conversation(2, Status.FINISHED, sources={"device": 0, "host": 0, "disk": 0, "computed": 8}),
        )
    tiers = {"host": host if host is not None else tier(4, {0: HA, 2: H0}, last=[12, 0, 15, 0]),
             "disk": disk if disk is not None else tier(2, {1: HB}, last=[0, 9])}
    return PoolSnapshot(step_id=step_id, block_size=BLOCK_SIZE, num_blocks=n, ref_count=ref, num_filled=filled,
                        state=state, owner=owner, last_access=np.full(n, step_id, np.int64), block_tables=tables,
                        conversations=tuple(conversations), block_hash=hashes, version=version, tiers=tiers,
                        kv_cache_groups=GROUPS if groups else (), group_block_tables=group_tables)


def tier_events() -> list[BlockEvent]:
    """What brought the tiers to the state above, as the engine side is to report it."""
    K = EventKind
    return [
        BlockEvent(3, K.ALLOCATED, 2, (6,)),
        BlockEvent(4, K.STORED, 2, (6,), block_hashes=(HA,), token_ids=(7, 8, 9, 10)),
        BlockEvent(6, K.CACHED, 2, (6,)),
        BlockEvent(12, K.EVICTED, 1, (6,), block_hashes=(HA,)),
        BlockEvent(12, K.OFFLOADED, -1, (6,), block_hashes=(HA,), tier="host", tier_slots=(0,)),
        BlockEvent(13, K.ALLOCATED, 1, (7,)),
        BlockEvent(13, K.STORED, 1, (7,), block_hashes=(H0,), token_ids=(1, 2, 3, 4)),
        BlockEvent(14, K.CACHED, 1, (7,)),
        BlockEvent(15, K.EVICTED, 2, (7,), block_hashes=(H0,)),
        BlockEvent(15, K.OFFLOADED, -1, (7,), block_hashes=(H0,), tier="host", tier_slots=(2,)),
        BlockEvent(16, K.ALLOCATED, 1, (7,), group=1),
        BlockEvent(18, K.LOADED, 1, (0,), block_hashes=(H0,), tier="host", tier_slots=(2,)),
        BlockEvent(19, K.WINDOW_RELEASED, 1, (7,), group=1),
        BlockEvent(19, K.FREED, 1, (7,), group=1),
    ]
