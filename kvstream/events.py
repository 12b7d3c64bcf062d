"""Block events: every change the engine's KV-cache manager makes to the pool, as one typed, immutable record.

They are what the event log shows, what history markers point at, and what the pool stream carries between
keyframes. Replaying them in order onto an empty pool (:func:`apply_event`) gives back every block's state and
ref count, which is how the tests hold the manager to them.

A msgspec Struct so that the pool stream and recordings encode them as they are (never pickled).
"""
from __future__ import annotations

import enum

import msgspec
import numpy as np

from .rules import group_key


class EventKind(str, enum.Enum):
    """What happened. The comment says which fields the kind fills in and what it does to the pool."""

    CONVERSATION_ADDED = "conversation_added"  # conversation_id; other_id = parent of a fork (reason "fork"),
    #                                            reason "sample" for the extra samples of one request
    CONVERSATION_CONTINUED = "conversation_continued"  # conversation_id got a reply and waits again
    CONVERSATION_FINISHED = "conversation_finished"  # conversation_id; reason = FinishReason value
    CONVERSATION_ENDED = "conversation_ended"  # conversation_id ended by the user
    ALLOCATED = "allocated"  # block_ids taken for conversation_id: each now USED with ref count 1, nothing filled
    SHARED = "shared"  # conversation_id took one more reference to block_ids, which already hold its KV;
    #                    reason "prefix_hit" (other_id -1) or "fork" (other_id = the parent); CACHED ones become USED
    COPIED_ON_WRITE = "copied_on_write"  # conversation_id wrote into shared block_ids[0]: it got a private copy,
    #                                      new_block_ids[0] (USED, ref 1), and dropped its reference to the original
    STORED = "stored"  # block_ids became full and hashed (block_hashes aligned, parent_hash of the one before the
    #                    first, token_ids block_size per block): a later prompt with that prefix can reuse them
    RELEASED = "released"  # conversation_id dropped its reference to block_ids; others still hold them
    CACHED = "cached"  # conversation_id dropped the last reference to block_ids: free, but keep their hashed KV
    FREED = "freed"  # conversation_id dropped the last reference to block_ids: free, nothing reusable
    EVICTED = "evicted"  # cached block_ids (block_hashes aligned) lost their KV so conversation_id can have them
    PREEMPTED = "preempted"  # conversation_id lost block_ids to make room (their RELEASED/CACHED/FREED follow)
    RELOCATED = "relocated"  # every non-free block moved: block_ids[i] is now new_block_ids[i]
    CLEARED = "cleared"  # the prefix cache was reset: every hash dropped, cached blocks freed
    OFFLOADED = "offloaded"  # block_hashes copied into tier ``tier`` at slots tier_slots; block_ids: the device
    #                          blocks they came from (empty when they came from the tier above: host -> disk, whose
    #                          name is the reason); parent_hash and token_ids of the block (one block per event)
    LOADED = "loaded"  # block_hashes copied from tier ``tier`` slots tier_slots into device block_ids, for
    #                    conversation_id (a prefix hit in a lower tier instead of recomputing)
    DROPPED = "dropped"  # tier ``tier`` let go of slots tier_slots (block_hashes aligned): to make room, or passed on
    #                      to the tier below (reason names it: "disk")
    WINDOW_RELEASED = "window_released"  # conversation_id's KV cache group ``group`` (a sliding window) let go of
    #                                      block_ids: wholly out of the window, the model never reads them again;
    #                                      its table keeps their places as -1 (their RELEASED/CACHED/FREED follow)


TIER_KINDS = frozenset({EventKind.OFFLOADED, EventKind.LOADED, EventKind.DROPPED})  # kinds that name a tier


WINDOW_REASON = "sliding_window"  # reason of the release events a sliding window causes (the model never reads
#                                   those blocks again; paging alone never releases anything)

# Kinds the timeline marks and the event log shows by default (allocation and release happen every few steps).
NOTABLE_KINDS = frozenset({
    EventKind.CONVERSATION_ADDED, EventKind.CONVERSATION_CONTINUED, EventKind.CONVERSATION_FINISHED,
    EventKind.CONVERSATION_ENDED, EventKind.COPIED_ON_WRITE, EventKind.EVICTED, EventKind.PREEMPTED,
    EventKind.RELOCATED, EventKind.CLEARED, EventKind.OFFLOADED, EventKind.LOADED, EventKind.DROPPED,
    EventKind.WINDOW_RELEASED,
})


class BlockEvent(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """One change to the pool, stamped with the step it happened in. Only ints, tuples, strings and None: it can
    never be part of a reference cycle, so the garbage collector skips it (a history holds hundreds of thousands)."""

    step_id: int  # engine step during (or before, for commands between steps: the step it follows) which it happened
    kind: EventKind
    conversation_id: int = -1  # the conversation it happened for; -1 for pool-wide events (relocation, reset)
    block_ids: tuple[int, ...] = ()  # physical blocks it touched, in the order the kind describes
    new_block_ids: tuple[int, ...] = ()  # copy-on-write: the copy; relocation: the new id of each block_ids entry
    block_hashes: tuple[int, ...] = ()  # stored / evicted: uint64 prefix hash of each block_ids entry
    parent_hash: int | None = None  # stored: hash of the block before block_ids[0] (None at the start)
    token_ids: tuple[int, ...] = ()  # stored: the tokens of the stored blocks, back to back
    other_id: int = -1  # shared by a fork / conversation added as a fork: the parent conversation
    reason: str = ""  # shared: "prefix_hit" | "fork"; finished: a FinishReason value
    tier: str = ""  # offloaded / loaded / dropped: the tier, "host" or "disk"
    group: int = 0  # the KV cache group the blocks belong to (window_released: the sliding-window group)
    tier_slots: tuple[int, ...] = ()  # offloaded / loaded / dropped: the slots in ``tier``, aligned with block_hashes


class PoolModel:
    """State and ref count of every block, rebuilt from events alone (the engine's pool must agree with it)."""

    def __init__(self, num_blocks: int, tier_blocks: dict[str, int] | None = None):
        self.state = np.zeros(num_blocks, np.int8)  # BlockState values: 0 free, 1 used, 2 cached
        self.ref_count = np.zeros(num_blocks, np.int32)
        self.hashed = np.zeros(num_blocks, bool)
        # each lower tier's cache key per slot (0: free; kvstream.rules.group_key of the hash and group the events
        # name), rebuilt from OFFLOADED / DROPPED (and checked by LOADED)
        self.tier_hash = {name: np.zeros(n, np.uint64) for name, n in (tier_blocks or {}).items()}

    def apply(self, event: BlockEvent) -> None:
        apply_event(self, event)


def apply_event(model: PoolModel, event: BlockEvent) -> None:
    """Apply one event's effect on state and ref count (raises AssertionError on an impossible event)."""
    kind, ids = event.kind, list(event.block_ids)
    st, ref = model.state, model.ref_count
    if kind == EventKind.ALLOCATED:
        assert all(st[b] == 0 for b in ids), f"allocated a block that is not free: {event}"
        st[ids], ref[ids], model.hashed[ids] = 1, 1, False
    elif kind == EventKind.SHARED:
        for b in ids:  # a block may appear twice (a table naming it twice) only through forks; count each
            assert st[b] != 0, f"shared a free block: {event}"
            st[b] = 1
            ref[b] += 1
    elif kind == EventKind.COPIED_ON_WRITE:
        src, dst = ids[0], event.new_block_ids[0]
        assert ref[src] > 1 and st[dst] == 0, f"impossible copy-on-write: {event}"
        ref[src] -= 1
        st[dst], ref[dst], model.hashed[dst] = 1, 1, False
    elif kind == EventKind.STORED:
        model.hashed[ids] = True
    elif kind in (EventKind.RELEASED, EventKind.CACHED, EventKind.FREED):
        for b in ids:
            assert ref[b] > 0, f"released a block nobody held: {event}"
            ref[b] -= 1
            if kind == EventKind.RELEASED:
                assert ref[b] > 0, f"released the last reference without caching or freeing: {event}"
            else:
                assert ref[b] == 0, f"{kind.value} a block still held: {event}"
                st[b] = 2 if kind == EventKind.CACHED else 0
                if kind == EventKind.FREED:
                    model.hashed[b] = False
    elif kind == EventKind.EVICTED:
        assert all(st[b] == 2 for b in ids), f"evicted a block that was not cached: {event}"
        st[ids], model.hashed[ids] = 0, False
    elif kind == EventKind.RELOCATED:
        new = list(event.new_block_ids)
        state, refs, hashed = st[ids].copy(), ref[ids].copy(), model.hashed[ids].copy()
        st[:], ref[:], model.hashed[:] = 0, 0, False
        st[new], ref[new], model.hashed[new] = state, refs, hashed
    elif kind == EventKind.CLEARED:
        model.hashed[:] = False
        st[st == 2] = 0
    elif kind in TIER_KINDS:
        _apply_tier_event(model, event)


def _apply_tier_event(model: PoolModel, event: BlockEvent) -> None:
    """A lower tier's slots after OFFLOADED (filled), DROPPED (emptied) or LOADED (read: must hold the hash)."""
    slots = model.tier_hash.get(event.tier)
    assert slots is not None, f"an event names tier {event.tier!r}, which is not on: {event}"
    assert len(event.tier_slots) == len(event.block_hashes), f"tier slots and hashes do not align: {event}"
    for slot, h in zip(event.tier_slots, event.block_hashes):
        h = group_key(h, event.group)  # a tier holds cache keys, as the pool does (one per group of a hash)
        if event.kind == EventKind.OFFLOADED:
            assert int(slots[slot]) == 0 and not (slots == np.uint64(h)).any(), f"offloaded into a taken slot, or a hash held twice: {event}"
            slots[slot] = h
        else:
            assert int(slots[slot]) == h, f"{event.kind.value} a slot that does not hold that hash: {event}"
            if event.kind == EventKind.DROPPED:
                slots[slot] = 0
