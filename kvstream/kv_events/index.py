"""What one serving instance has cached, rebuilt from nothing but its KV-event stream.

A KV-event stream says which prefix hashes an instance stored and removed, with each block's parent hash and
tokens; it never says where a block lies in the pool, how full the pool is, or which request holds what. So this
is a content model, not a pool: hash -> stored block, the prefix tree the parent links make, the live set, and how
many blocks were stored and removed over time. Across instances it answers what a KV-aware router asks: for a
token prefix, how many of its leading blocks each instance holds (:func:`prefix_overlap`), and which prefixes are
cached where (:func:`where_cached`). Prefixes are compared by token content, so instances need not share a hash
function.

Thread-safe: the subscriber thread applies batches while the GUI reads; every query returns immutable values.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvstream.kv_events.codec import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch


@dataclass(frozen=True)
class StoredBlock:
    """One live hashed block of an instance, as its BlockStored event described it."""

    block_hash: BlockHash  # its prefix hash as published (int, or bytes)
    parent_hash: BlockHash | None  # the block before it in its sequence; None at a sequence's start
    token_ids: tuple[int, ...]  # its tokens (block_size of them for a full block)
    block_size: int  # tokens per block on that instance
    media: frozenset  # tiers holding it now ("GPU", "CPU", ...; None where the publisher did not say)
    lora_name: str | None  # adapter the hash is keyed by; None for the base model
    lora_id: int | None  # vLLM's older adapter id
    group_idx: int | None  # vLLM's KV-cache group; None if not sent
    stored_ts: float  # publisher time of the batch that first stored it
    stored_seq: int | None  # sequence number of that batch (None when applied without one)

    @property
    def medium(self) -> str:
        """The tiers in words: "GPU", "GPU+CPU", or "unspecified"."""
        names = sorted(m for m in self.media if m is not None)
        return "+".join(names) if names else "unspecified"


@dataclass(frozen=True)
class Timeline:
    """Per applied batch (oldest first, bounded): what it stored, removed, and how many blocks were live after."""

    seq: np.ndarray  # int64 sequence number of each batch (-1 when applied without one)
    ts: np.ndarray  # float64 publisher time of each batch
    stored: np.ndarray  # int64 new blocks stored by it (re-reports of live blocks not counted)
    removed: np.ndarray  # int64 blocks it removed (cleared ones included)
    live: np.ndarray  # int64 live blocks after it


class KVCacheIndex:
    """The content model of one instance's prefix cache, fed batch by batch from its KV-event stream.

    Why not a PoolSnapshot: the stream has no physical ids, no ref counts, no pool size; pretending otherwise would
    draw a made-up grid. This holds exactly what the events say and counts what they could not explain."""

    def __init__(self, name: str = "", timeline_limit: int = 10_000) -> None:
        self.name = name  # how the window labels this instance (endpoint, or "dp1")
        self._lock = threading.RLock()
        self._blocks: dict[BlockHash, StoredBlock] = {}  # live blocks by hash
        self._children: dict[BlockHash | None, set[BlockHash]] = {}  # parent hash -> live children's hashes
        self._timeline: deque[tuple[int, float, int, int, int]] = deque(maxlen=timeline_limit)
        self._block_sizes: Counter[int] = Counter()  # block_size -> live blocks with it
        self.version = 0  # bumped by every applied batch and every reset
        self.num_batches = 0  # batches applied
        self.last_seq: int | None = None  # sequence number of the last applied batch
        self.last_ts: float | None = None  # publisher time of the last applied batch
        self.num_stored_total = 0  # new blocks ever stored
        self.num_reported_again = 0  # BlockStored for blocks already live (vLLM re-reports prefix-cache hits)
        self.num_removed_total = 0  # blocks ever removed (cleared included)
        self.num_unknown_removed = 0  # removals of hashes never seen stored: history before we joined, or lost
        self.num_cleared = 0  # AllBlocksCleared events
        self.num_resets = 0  # times the index was emptied because its publisher restarted

    # ----- writing (the subscriber thread) -----
    def apply_batch(self, batch: KVEventBatch, seq: int | None = None) -> None:
        """Apply one batch's events in order."""
        with self._lock:
            stored = removed = 0
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored += self._store(event, batch.ts, seq)
                elif isinstance(event, BlockRemoved):
                    removed += self._remove(event)
                elif isinstance(event, AllBlocksCleared):
                    removed += len(self._blocks)
                    self._drop_all()
                    self.num_cleared += 1
            self.num_stored_total += stored
            self.num_removed_total += removed
            self.num_batches += 1
            self.last_seq, self.last_ts = seq, batch.ts
            self._timeline.append((-1 if seq is None else seq, batch.ts, stored, removed, len(self._blocks)))
            self.version += 1

    def reset(self) -> None:
        """Forget everything (the publisher restarted: its old hashes mean nothing now); counters carry on."""
        with self._lock:
            self._drop_all()
            self._timeline.clear()
            self.last_seq = self.last_ts = None
            self.num_resets += 1
            self.version += 1

    def _store(self, event: BlockStored, ts: float, seq: int | None) -> int:
        new = 0
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
            old = self._blocks.get(block_hash)
            if old is not None:
                self.num_reported_again += 1
                if event.medium not in old.media:
                    self._blocks[block_hash] = dataclasses.replace(old, media=old.media | {event.medium})
                continue
            self._blocks[block_hash] = StoredBlock(
                block_hash=block_hash, parent_hash=parent, token_ids=tuple(event.token_ids[i * size:(i + 1) * size]),
                block_size=size, media=frozenset((event.medium,)), lora_name=event.lora_name,
                lora_id=event.lora_id, group_idx=event.group_idx, stored_ts=ts, stored_seq=seq)
            self._children.setdefault(parent, set()).add(block_hash)
            self._block_sizes[size] += 1
            new += 1
        return new

    def _remove(self, event: BlockRemoved) -> int:
        removed = 0
        for block_hash in event.block_hashes:
            old = self._blocks.get(block_hash)
            if old is None:
                self.num_unknown_removed += 1
                continue
            # A medium left unset on either side matches any: the block leaves that tier, or every tier.
            if event.medium is None:
                media = frozenset()
            elif event.medium in old.media:
                media = old.media - {event.medium}
            elif None in old.media:
                media = old.media - {None}
            else:
                self.num_unknown_removed += 1
                continue
            if media:
                self._blocks[block_hash] = dataclasses.replace(old, media=media)
                continue
            del self._blocks[block_hash]
            siblings = self._children.get(old.parent_hash)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self._children[old.parent_hash]
            self._block_sizes[old.block_size] -= 1
            removed += 1
        return removed

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self._block_sizes.clear()

    # ----- reading (any thread) -----
    def __len__(self) -> int:
        return len(self._blocks)

    def live_hashes(self) -> frozenset:
        """Hashes of every block the instance holds now, as published."""
        with self._lock:
            return frozenset(self._blocks)

    def blocks(self) -> tuple[StoredBlock, ...]:
        """Every live block, in the order they were stored."""
        with self._lock:
            return tuple(self._blocks.values())

    def block(self, block_hash: BlockHash) -> StoredBlock | None:
        """The live block with that hash, or None."""
        with self._lock:
            return self._blocks.get(block_hash)

    def children(self, block_hash: BlockHash | None) -> tuple[StoredBlock, ...]:
        """Live blocks whose parent is ``block_hash`` (None: blocks that start a sequence), oldest first."""
        with self._lock:
            kids = [self._blocks[h] for h in self._children.get(block_hash, ())]
        return tuple(sorted(kids, key=_age))

    def roots(self) -> tuple[StoredBlock, ...]:
        """Live blocks whose parent is not live: sequence starts first, then orphans (parent evicted or never seen)."""
        with self._lock:
            tops = [b for b in self._blocks.values() if b.parent_hash is None or b.parent_hash not in self._blocks]
        return tuple(sorted(tops, key=lambda b: (b.parent_hash is not None, _age(b))))

    def chain(self, block_hash: BlockHash) -> tuple[StoredBlock, ...]:
        """The live ancestors of a block and the block, from the oldest live one down (empty if not live)."""
        with self._lock:
            out, seen = [], set()
            block = self._blocks.get(block_hash)
            while block is not None and block.block_hash not in seen:
                seen.add(block.block_hash)
                out.append(block)
                block = self._blocks.get(block.parent_hash) if block.parent_hash is not None else None
        return tuple(reversed(out))

    @property
    def block_size(self) -> int | None:
        """The block size most live blocks have (None while empty)."""
        with self._lock:
            sizes = [(n, s) for s, n in self._block_sizes.items() if n > 0]
        return max(sizes)[1] if sizes else None

    def match_prefix(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` this instance holds (what a KV-aware router scores)."""
        token_ids = tuple(token_ids)
        with self._lock:
            parent, pos, matched = None, 0, 0
            while True:
                nxt = None
                for h in self._children.get(parent, ()):
                    b = self._blocks[h]
                    if b.lora_name == lora_name and len(b.token_ids) == b.block_size \
                            and token_ids[pos:pos + b.block_size] == b.token_ids:
                        nxt = b
                        break
                if nxt is None:
                    return matched
                parent, pos, matched = nxt.block_hash, pos + nxt.block_size, matched + 1

    def timeline(self) -> Timeline:
        """Stored / removed / live per applied batch, oldest first (the last ``timeline_limit`` batches)."""
        with self._lock:
            rows = np.array(self._timeline, dtype=np.float64).reshape(-1, 5)  # [batches, (seq ts stored removed live)]
        return Timeline(seq=rows[:, 0].astype(np.int64), ts=rows[:, 1].copy(), stored=rows[:, 2].astype(np.int64),
                        removed=rows[:, 3].astype(np.int64), live=rows[:, 4].astype(np.int64))


def _age(block: StoredBlock) -> tuple:
    return (block.stored_seq if block.stored_seq is not None else -1, block.stored_ts)


def prefix_overlap(indexes: Iterable[KVCacheIndex], token_ids: Sequence[int],
                   lora_name: str | None = None) -> tuple[int, ...]:
    """For each instance, how many leading blocks of ``token_ids`` it holds (a router sends the request to the max)."""
    return tuple(index.match_prefix(token_ids, lora_name) for index in indexes)


@dataclass(frozen=True)
class PrefixNode:
    """One block-sized step of a token prefix, merged across instances by content."""

    token_ids: tuple[int, ...]  # this block's tokens
    depth: int  # 0 for a sequence's first block
    holders: frozenset[int]  # positions (in the list given to where_cached) of the instances holding it
    children: tuple[PrefixNode, ...]  # next blocks, most widely held first
    num_descendants: int  # blocks below it (all instances merged)


def where_cached(indexes: Sequence[KVCacheIndex]) -> tuple[PrefixNode, ...]:
    """The prefixes cached on any of ``indexes``, as one tree of token blocks with the instances holding each.

    Only blocks whose whole chain back to a sequence start is live take part (an orphan's prefix is unknown)."""
    # Merge every instance's sequence-start trees into one trie keyed by (tokens, lora): node -> holders, kids.
    trie: dict = {}
    for pos, index in enumerate(indexes):
        blocks = {b.block_hash: b for b in index.blocks()}
        kids: dict = {}
        for b in blocks.values():
            kids.setdefault(b.parent_hash, []).append(b)
        stack = [(b, trie) for b in kids.get(None, ())]
        while stack:
            b, level = stack.pop()
            node = level.setdefault((b.token_ids, b.lora_name), [set(), {}])
            node[0].add(pos)
            stack.extend((c, node[1]) for c in kids.get(b.block_hash, ()))
    return _freeze(trie, 0)


def _freeze(level: dict, depth: int) -> tuple[PrefixNode, ...]:
    nodes = []
    for (tokens, _lora), (holders, kids) in level.items():
        children = _freeze(kids, depth + 1)
        nodes.append(PrefixNode(token_ids=tokens, depth=depth, holders=frozenset(holders), children=children,
                                num_descendants=sum(1 + c.num_descendants for c in children)))
    return tuple(sorted(nodes, key=lambda n: (-len(n.holders), -n.num_descendants, n.token_ids)))


def hash_text(block_hash: BlockHash | None) -> str:
    """A hash as people and JSON read it: decimal for integers, hex for digests, "-" for none."""
    if block_hash is None:
        return "-"
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


def json_summary(index: KVCacheIndex) -> dict:
    """The ``--json`` object of DESIGN.md for a KV-event source: what the stream cannot know is null.

    ``step`` is the last applied sequence number; ``stored_hashes`` the number of distinct live hashes (a count, as
    :func:`kvstream.summary.json_summary` gives it for every other source). Extras: the instance's name and its
    stored / removed totals."""
    with index._lock:  # one consistent moment
        return {"source": "kv-events", "step": index.last_seq, "num_blocks": None, "block_size": index.block_size,
                "used": None, "cached": None, "free": None, "block_tables": None,
                "stored_hashes": len(index._blocks),
                # extras
                "name": index.name, "batches": index.num_batches, "stored_total": index.num_stored_total,
                "removed_total": index.num_removed_total}
