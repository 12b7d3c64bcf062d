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
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from kvstream.kv_events.codec import (TIERS, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch,
                                      medium_tier)
from kvstream.prompt_check import TIER_OF_MEDIUM, Held, PromptCheck, Removal, classify_prompt


class Residency(NamedTuple):
    """One place a block's KV lives, as its BlockStored said: the medium as published and vLLM's qualifiers.

    A block can have several: the GPU pool and a CPU copy, or (hybrid models) the same hash in two KV-cache groups.
    A BlockRemoved takes away the residencies it matches (a field it leaves None matches any)."""

    medium: str | None  # as published: "GPU", "CPU", "STORAGE", SGLang's "CPU_PINNED", "DISK", ...; None: unsaid
    group_idx: int | None  # vLLM's KV-cache group; None if not sent
    locality: str | None  # vLLM: "LOCAL" / "REMOTE" relative to the publisher
    ownership: str | None  # vLLM: the secondary offloading tier that generated the event

    @property
    def tier(self) -> str | None:
        """The tier it counts as ("GPU", "CPU", "STORAGE", another name, or None)."""
        return _tier(self.medium)

    def matches(self, other: Residency) -> bool:
        """A removal ``other`` takes this residency: every field equal, or None on either side."""
        if self == other:
            return True
        a, b = _tier(self.medium), _tier(other.medium)
        return ((a is None or b is None or a == b)
                and (self.group_idx is None or other.group_idx is None or self.group_idx == other.group_idx)
                and (self.locality is None or other.locality is None or self.locality == other.locality)
                and (self.ownership is None or other.ownership is None or self.ownership == other.ownership))


_TIERS_SEEN: dict = {}  # medium as published -> tier (a handful of spellings; the index asks per block)


def _tier(medium: str | None) -> str | None:
    try:
        return _TIERS_SEEN[medium]
    except KeyError:
        tier = medium_tier(medium)
        if len(_TIERS_SEEN) < 1024:  # publishers spell a few media; a hostile one must not grow this
            _TIERS_SEEN[medium] = tier
        return tier


def _tiers_and_groups(residencies: frozenset) -> tuple:
    """The distinct tiers and groups of some residencies (one residency, the common case, without sets)."""
    if len(residencies) == 1:
        for r in residencies:
            return (_tier(r.medium),), (r.group_idx,)
    return {_tier(r.medium) for r in residencies}, {r.group_idx for r in residencies}


CONTENT_SENT = "sent"  # its tokens came with its BlockStored
CONTENT_NOT_SENT = "content not sent"  # known only by hash (an offloading placeholder nobody described)


@dataclass(frozen=True)
class StoredBlock:
    """One live hashed block of an instance, as its BlockStored event described it."""

    block_hash: BlockHash  # its prefix hash as published (int, or bytes)
    parent_hash: BlockHash | None  # the block before it in its sequence; None at a sequence's start
    token_ids: tuple[int, ...]  # its tokens (block_size of them for a full block); empty if content not sent
    block_size: int  # tokens per block on that instance (0: a hash-only placeholder's)
    media: frozenset  # tiers holding it now, as published ("GPU", "CPU", ...; None where the publisher did not say)
    lora_name: str | None  # adapter the hash is keyed by; None for the base model
    lora_id: int | None  # vLLM's older adapter id
    group_idx: int | None  # vLLM's KV-cache group of the first store; None if not sent (all: :attr:`groups`)
    stored_ts: float  # publisher time of the batch that first stored it
    stored_seq: int | None  # sequence number of that batch (None when applied without one)
    residencies: frozenset = frozenset()  # every Residency it has now (medium, group, locality, ownership)
    content_from: str | None = None  # tier whose BlockStored sent its tokens; None: content not sent
    hash_only: frozenset = frozenset()  # tiers that reported it by hash only (offloading placeholders)
    kv_cache_spec_kind: str | None = None  # vLLM 0.34: its group's cache-spec kind, when a store said
    kv_cache_spec_sliding_window: int | None = None  # vLLM 0.34: its group's sliding window, when a store said
    session_id: str | None = None  # session whose request first stored it (attribution only)
    extra_keys: tuple | None = None  # vLLM: the extra hash keys of this block (LoRA name, mm ids, cache salt)
    lookahead_token_ids: tuple[int, ...] | None = None  # vLLM 0.34: tokens past the block its hash covers

    @property
    def medium(self) -> str:
        """The tiers in words: "GPU", "CPU+GPU", or "unspecified"."""
        names = sorted(m for m in self.media if m is not None)
        return "+".join(names) if names else "unspecified"

    @property
    def tiers(self) -> frozenset:
        """The tiers holding it ("GPU", "CPU", "STORAGE", ...; SGLang's spellings folded in)."""
        return frozenset(r.tier for r in self.residencies)

    @property
    def groups(self) -> frozenset:
        """The KV-cache groups holding it (None where the publisher did not say)."""
        return frozenset(r.group_idx for r in self.residencies)

    @property
    def content(self) -> str:
        """Where its tokens come from, in words: "sent", "content known from its GPU store", "content not sent"."""
        if self.content_from is None:
            return CONTENT_NOT_SENT
        if self.hash_only:
            return f"content known from its {self.content_from or 'unspecified'} store"
        return CONTENT_SENT


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
        self.num_placeholders = 0  # hash-only BlockStored entries (offloading placeholders, Mamba checkpoints)
        self.num_placeholders_matched = 0  # ... whose hash matched a block whose tokens another store had sent
        self._tier_counts: Counter = Counter()  # tier -> live hashes with a residency there
        self._group_counts: Counter = Counter()  # group_idx -> live hashes with a residency in it
        self.group_specs: dict[int, tuple[str | None, int | None]] = {}  # group -> (spec kind, window), as sent
        # Content of blocks that left every tier, newest last: a placeholder arriving after its block's GPU copy
        # went (vLLM offloads on eviction) still gets its tokens back.
        self._departed: OrderedDict[BlockHash, StoredBlock] = OrderedDict()
        self._departed_when: dict[BlockHash, tuple[float, int | None, str]] = {}  # -> (batch ts, seq, "removed" or
        #                                                                          "cleared"), for a prompt check
        self._departed_kids: dict[BlockHash | None, set[BlockHash]] = {}  # parent -> departed children's hashes
        self._seen_block_size: int | None = None  # the block size of the last block stored with its tokens

    DEPARTED_LIMIT = 65_536  # departed blocks remembered for placeholders (bounded: a few MB)

    # ----- writing (the subscriber thread) -----
    def apply_batch(self, batch: KVEventBatch, seq: int | None = None) -> None:
        """Apply one batch's events in order."""
        with self._lock:
            stored = removed = 0
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored += self._store(event, batch.ts, seq)
                elif isinstance(event, BlockRemoved):
                    removed += self._remove(event, batch.ts, seq)
                elif isinstance(event, AllBlocksCleared):
                    removed += len(self._blocks)
                    for block in list(self._blocks.values()):
                        if block.content_from is not None:
                            self._depart(block, batch.ts, seq, "cleared")
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
            self._departed.clear()
            self._departed_when.clear()
            self._departed_kids.clear()
            self.group_specs.clear()
            self._timeline.clear()
            self.last_seq = self.last_ts = None
            self.num_resets += 1
            self.version += 1

    def _store(self, event: BlockStored, ts: float, seq: int | None) -> int:
        new = 0
        size = event.block_size
        where = Residency(event.medium, event.group_idx, event.locality, event.ownership)
        tier = where.tier
        placeholder = event.is_placeholder
        if event.group_idx is not None and (event.kv_cache_spec_kind is not None
                                            or event.kv_cache_spec_sliding_window is not None):
            self.group_specs[event.group_idx] = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
        if placeholder:
            self.num_placeholders += len(event.block_hashes)
        media, residencies = frozenset((event.medium,)), frozenset((where,))  # shared by the event's new blocks
        content_from = None if placeholder else tier
        for i, block_hash in enumerate(event.block_hashes):
            parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
            old = self._blocks.get(block_hash)
            if old is None and placeholder:
                old = self._undepart(block_hash)
                if old is not None:  # back from the departed: a new live block with the tokens we remembered
                    old = dataclasses.replace(old, media=frozenset(), residencies=frozenset(), hash_only=frozenset(),
                                              stored_ts=ts, stored_seq=seq)
                    self._link(old)
                    new += 1
            if old is not None:
                if old.residencies:  # (a block back from the departed has none yet)
                    self.num_reported_again += 1
                updated = old
                if placeholder:
                    if old.content_from is not None:
                        self.num_placeholders_matched += 1
                        if tier != old.content_from:
                            updated = dataclasses.replace(updated, hash_only=old.hash_only | {tier})
                elif old.content_from is None:  # a placeholder's tokens arrive: fill them in, chain it
                    self._unlink(old)
                    updated = dataclasses.replace(
                        updated, parent_hash=parent, token_ids=tuple(event.token_ids[i * size:(i + 1) * size]),
                        block_size=size, content_from=tier, lora_name=event.lora_name, lora_id=event.lora_id)
                    self._link(updated)
                self._set_residencies(updated, old.residencies | {where})
                continue
            if self._departed:
                self._undepart(block_hash)  # stored again: live, no longer a departed block
            extra = event.extra_keys[i] if event.extra_keys is not None and i < len(event.extra_keys) else None
            ahead = (event.lookahead_token_ids[i] if event.lookahead_token_ids is not None
                     and i < len(event.lookahead_token_ids) else None)
            # positional, in StoredBlock's field order: a keyword call of 19 fields costs twice as much per block
            block = StoredBlock(
                block_hash, parent, tuple(event.token_ids[i * size:(i + 1) * size]), size, media, event.lora_name,
                event.lora_id, event.group_idx, ts, seq, residencies, content_from, frozenset(),
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window, event.session_id,
                tuple(extra) if extra is not None else None, tuple(ahead) if ahead is not None else None)
            self._link(block)
            self._set_residencies(block, block.residencies)
            new += 1
        if not placeholder and size:
            self._seen_block_size = size
        return new

    def _link(self, block: StoredBlock) -> None:
        self._children.setdefault(block.parent_hash, set()).add(block.block_hash)
        self._block_sizes[block.block_size] += 1

    def _unlink(self, block: StoredBlock) -> None:
        siblings = self._children.get(block.parent_hash)
        if siblings is not None:
            siblings.discard(block.block_hash)
            if not siblings:
                del self._children[block.parent_hash]
        self._block_sizes[block.block_size] -= 1

    def _set_residencies(self, block: StoredBlock, residencies: frozenset) -> None:
        """Give ``block`` these residencies (empty: it leaves), keeping the per-tier and per-group counts."""
        old = self._blocks.get(block.block_hash)
        tier_counts, group_counts = self._tier_counts, self._group_counts
        if old is not None:
            tiers, groups = _tiers_and_groups(old.residencies)
            for tier in tiers:
                tier_counts[tier] -= 1
            for group in groups:
                group_counts[group] -= 1
        if not residencies:
            self._blocks.pop(block.block_hash, None)
            return
        tiers, groups = _tiers_and_groups(residencies)
        for tier in tiers:
            tier_counts[tier] = tier_counts.get(tier, 0) + 1
        for group in groups:
            group_counts[group] = group_counts.get(group, 0) + 1
        if residencies is not block.residencies:  # (a new block comes with its own: nothing to rebuild)
            block = dataclasses.replace(block, residencies=residencies, media=frozenset(r.medium for r in residencies),
                                        hash_only=block.hash_only & set(tiers))
        self._blocks[block.block_hash] = block

    def _remove(self, event: BlockRemoved, ts: float = 0.0, seq: int | None = None) -> int:
        removed = 0
        where = Residency(event.medium, event.group_idx, event.locality, event.ownership)
        for block_hash in event.block_hashes:
            old = self._blocks.get(block_hash)
            if old is None:
                self.num_unknown_removed += 1
                continue
            # A field left unset on either side matches any: the block leaves that tier (group...), or every one.
            left = frozenset(r for r in old.residencies if not r.matches(where))
            if left == old.residencies:
                self.num_unknown_removed += 1
                continue
            self._set_residencies(old, left)
            if left:
                continue
            self._unlink(old)
            if old.content_from is not None:
                self._depart(old, ts, seq, "removed")
            removed += 1
        return removed

    def _depart(self, block: StoredBlock, ts: float, seq: int | None, how: str) -> None:
        """Remember a block that left every tier: its tokens (a placeholder arriving later gets them back) and when
        it went (a prompt check says so)."""
        h = block.block_hash
        self._undepart(h)
        self._departed[h] = block
        self._departed_when[h] = (ts, seq, how)
        self._departed_kids.setdefault(block.parent_hash, set()).add(h)
        while len(self._departed) > self.DEPARTED_LIMIT:
            self._undepart(next(iter(self._departed)))

    def _undepart(self, block_hash: BlockHash) -> StoredBlock | None:
        """Forget a departed block (it is live again, or the oldest past the limit); returns it, or None."""
        block = self._departed.pop(block_hash, None)
        if block is not None:
            self._departed_when.pop(block_hash, None)
            kids = self._departed_kids.get(block.parent_hash)
            if kids is not None:
                kids.discard(block_hash)
                if not kids:
                    del self._departed_kids[block.parent_hash]
        return block

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self._block_sizes.clear()
        self._tier_counts.clear()
        self._group_counts.clear()

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
        return tuple(sorted(tops, key=lambda b: (not b.token_ids, b.parent_hash is not None, _age(b))))

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

    def match_prefix(self, token_ids: Sequence[int], lora_name: str | None = None, tier: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` this instance holds (what a KV-aware router scores); with
        ``tier`` ("GPU", "CPU", "STORAGE"; SGLang's spellings accepted), counting only blocks held in that tier."""
        token_ids = tuple(token_ids)
        tier = medium_tier(tier)
        with self._lock:
            parent, pos, matched = None, 0, 0
            while True:
                nxt = None
                for h in self._children.get(parent, ()):
                    b = self._blocks[h]
                    if b.lora_name == lora_name and b.token_ids and len(b.token_ids) == b.block_size \
                            and token_ids[pos:pos + b.block_size] == b.token_ids \
                            and (tier is None or any(r.tier == tier for r in b.residencies)):
                        nxt = b
                        break
                if nxt is None:
                    return matched
                parent, pos, matched = nxt.block_hash, pos + nxt.block_size, matched + 1

    def check_prompt(self, token_ids: Sequence[int], lora_name: str | None = None,
                     block_size: int | None = None) -> PromptCheck:
        """Would this prompt hit on this instance? Its blocks matched by the tokens each ``BlockStored`` carried,
        chained by parent hash from a sequence's start (no hash function or seed needed): held now (in which tier),
        stored then removed (when: the removing batch's time), or never stored as far as the stream tells; counted
        as the server counts a hit (:func:`kvstream.prompt_check.classify_prompt`). ``block_size``: where the
        stream has not said its own yet. Raises ValueError when no block size is known."""
        ids = tuple(int(t) for t in token_ids)
        with self._lock:
            size = self.block_size or self._seen_block_size or block_size
            if not size:
                raise ValueError(f"{self.name or 'this instance'} has not stored any block yet, so its block size is "
                                 "unknown")
            held: list[Held | None] = []
            gone: dict[int, Removal] = {}
            parent, known = None, True
            for i in range(len(ids) // size):
                tokens = ids[i * size:(i + 1) * size]
                live = self._child_with(self._children.get(parent, ()), self._blocks, tokens, lora_name) \
                    if known else None
                if live is not None:
                    held.append(Held(_held_tier(live), None, live.block_hash))
                    parent = live.block_hash
                    continue
                held.append(None)
                left = self._child_with(self._departed_kids.get(parent, ()), self._departed, tokens, lora_name) \
                    if known else None
                if left is None:
                    known = False  # its hash is unknown, so nothing after it can be found
                    continue
                ts, seq, how = self._departed_when[left.block_hash]
                gone[i] = Removal(None, ts, how, None, None)
                parent = left.block_hash
            note = ""
            if self.num_unknown_removed or self.num_resets:
                note = ("The stream began before this viewer joined it, or restarted: blocks stored before then "
                        "are known only if the server still holds them and they were replayed.")
            return classify_prompt(len(ids), size, held, gone.get, source=self.name or "kv-events",
                                   step=self.last_seq, note=note)

    @staticmethod
    def _child_with(hashes, blocks: dict, tokens: tuple, lora_name: str | None) -> StoredBlock | None:
        for h in hashes:
            b = blocks.get(h)
            if b is not None and b.token_ids == tokens and b.lora_name == lora_name:
                return b
        return None

    def match_prefix_by_tier(self, token_ids: Sequence[int], lora_name: str | None = None) -> dict[str, int]:
        """The longest match per tier ({"GPU": n, "CPU": n, "STORAGE": n}, plus any other tier the instance has):
        what Dynamo's KV router reports per tier. A tier's match is the leading blocks held in that tier."""
        with self._lock:
            tiers = list(TIERS) + sorted(t for t, n in self._tier_counts.items()
                                         if n > 0 and t not in TIERS and t is not None)
        return {t: self.match_prefix(token_ids, lora_name, t) for t in tiers}

    def stored_hashes_by_medium(self) -> dict[str, int]:
        """Live hashes per tier: {"GPU": n, "CPU": n, "STORAGE": n} always (DESIGN.md), then any other tier held
        (SGLang's "EXTERNAL"; "unspecified" for blocks whose publisher named no medium). A block on two tiers
        counts in both."""
        with self._lock:
            out = {t: int(self._tier_counts.get(t, 0)) for t in TIERS}
            for t, n in sorted(self._tier_counts.items(), key=lambda kv: str(kv[0])):
                if n > 0 and t not in TIERS:
                    out["unspecified" if t is None else t] = int(n)
        return out

    def stored_hashes_by_group(self) -> dict[str, int]:
        """Live hashes per KV-cache group ({"0": n, "1": n}; "none" for blocks stored without a group_idx)."""
        with self._lock:
            return {("none" if g is None else str(g)): int(n)
                    for g, n in sorted(self._group_counts.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
                    if n > 0}

    def timeline(self) -> Timeline:
        """Stored / removed / live per applied batch, oldest first (the last ``timeline_limit`` batches)."""
        with self._lock:
            rows = np.array(self._timeline, dtype=np.float64).reshape(-1, 5)  # [batches, (seq ts stored removed live)]
        return Timeline(seq=rows[:, 0].astype(np.int64), ts=rows[:, 1].copy(), stored=rows[:, 2].astype(np.int64),
                        removed=rows[:, 3].astype(np.int64), live=rows[:, 4].astype(np.int64))


def _held_tier(block: StoredBlock) -> str:
    """The highest tier a live block is in, named as the pool's tiers are ("device", "host", "disk"; another tier's
    own name; a block whose publisher named no medium is vLLM's GPU pool)."""
    tiers = block.tiers
    for medium, tier in TIER_OF_MEDIUM.items():
        if medium in tiers:
            return tier
    named = sorted(t for t in tiers if t is not None)
    return named[0] if named else "device"


def _age(block: StoredBlock) -> tuple:
    return (block.stored_seq if block.stored_seq is not None else -1, block.stored_ts)


def prefix_overlap(indexes: Iterable[KVCacheIndex], token_ids: Sequence[int],
                   lora_name: str | None = None) -> tuple[int, ...]:
    """For each instance, how many leading blocks of ``token_ids`` it holds (a router sends the request to the max)."""
    return tuple(index.match_prefix(token_ids, lora_name) for index in indexes)


def prefix_overlap_by_tier(indexes: Iterable[KVCacheIndex], token_ids: Sequence[int],
                           lora_name: str | None = None) -> tuple[dict[str, int], ...]:
    """For each instance, its longest match per tier (:meth:`KVCacheIndex.match_prefix_by_tier`)."""
    return tuple(index.match_prefix_by_tier(token_ids, lora_name) for index in indexes)


@dataclass(frozen=True)
class PrefixNode:
    """One block-sized step of a token prefix, merged across instances by content."""

    token_ids: tuple[int, ...]  # this block's tokens
    depth: int  # 0 for a sequence's first block
    holders: frozenset[int]  # positions (in the list given to where_cached) of the instances holding it
    children: tuple[PrefixNode, ...]  # next blocks, most widely held first
    num_descendants: int  # blocks below it (all instances merged)
    tiers: tuple[frozenset, ...] = ()  # per instance (same positions as holders): the tiers it holds this block in


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
            if not b.token_ids:
                continue  # content not sent: nothing to merge by
            node = level.setdefault((b.token_ids, b.lora_name), [set(), {}, {}])
            node[0].add(pos)
            node[2].setdefault(pos, set()).update(t for t in b.tiers if t is not None)
            stack.extend((c, node[1]) for c in kids.get(b.block_hash, ()))
    return _freeze(trie, 0, len(indexes))


def _freeze(level: dict, depth: int, n: int) -> tuple[PrefixNode, ...]:
    nodes = []
    for (tokens, _lora), (holders, kids, tiers) in level.items():
        children = _freeze(kids, depth + 1, n)
        nodes.append(PrefixNode(token_ids=tokens, depth=depth, holders=frozenset(holders), children=children,
                                num_descendants=sum(1 + c.num_descendants for c in children),
                                tiers=tuple(frozenset(tiers.get(i, ())) for i in range(n))))
    return tuple(sorted(nodes, key=lambda n: (-len(n.holders), -n.num_descendants, n.token_ids)))


def hash_text(block_hash: BlockHash | None) -> str:
    """A hash as people and JSON read it: decimal for integers, hex for digests, "-" for none."""
    if block_hash is None:
        return "-"
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


def json_summary(index: KVCacheIndex, status=None) -> dict:
    """The ``--json`` object of DESIGN.md for a KV-event source: what the stream cannot know is null.

    ``step`` is the last applied sequence number; ``stored_hashes`` the number of distinct live hashes (a count, as
    :func:`kvstream.summary.json_summary` gives it for every other source); ``stored_hashes_by_medium`` the live
    hashes per tier (DESIGN.md). Extras: the instance's name, its stored / removed totals, per-group counts and
    hash-only placeholders. With the endpoint's ``status`` (an ``EndpointStatus``): ``malformed``, ``lost``,
    ``odd_events`` and ``last_error`` (DESIGN.md's KV-event keys), else those are null."""
    with index._lock:  # one consistent moment
        out = {"source": "kv-events", "step": index.last_seq, "num_blocks": None, "block_size": index.block_size,
               "used": None, "cached": None, "free": None, "block_tables": None,
               "stored_hashes": len(index._blocks),
               "stored_hashes_by_medium": index.stored_hashes_by_medium(),
               # extras
               "name": index.name, "batches": index.num_batches, "stored_total": index.num_stored_total,
               "removed_total": index.num_removed_total,
               "stored_hashes_by_group": index.stored_hashes_by_group(),
               "placeholders": index.num_placeholders, "placeholders_matched": index.num_placeholders_matched}
    out.update({"malformed": getattr(status, "num_malformed", None), "lost": getattr(status, "num_lost", None),
                "odd_events": getattr(status, "num_odd_events", None),
                "last_error": getattr(status, "last_error", None)})
    return out
