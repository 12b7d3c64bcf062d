"""The lower tiers of the KV cache (host memory, disk) as the window shows them, without Qt.

A tier slot holds a full hashed block the device pool evicted; the slot itself knows only the hash. Who the content
belongs to, and its tokens, are known from elsewhere: the device pool's own hashed blocks (with their owners) and
the STORED events that announced each hash with its conversation and tokens. :class:`ContentBook` remembers both,
so a tier grid can be coloured by owner on the same rules as the device grid (owner of the content, cached, free),
and :func:`tier_snapshot` turns one tier into a :class:`PoolSnapshot` of CACHED/FREE slots that the grid renderer
draws as it draws the device pool. :class:`TierStories` keeps what happened to each piece of content across tiers
(offloaded, loaded back, dropped), which the tier inspector lists.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping

import numpy as np

from kvstream.events import TIER_KINDS, BlockEvent, EventKind
from kvstream.rules import group_key
from kvstream.views import NO_HASH, BlockState, PoolSnapshot, TierView

from .groups import hash_words

TIERS = ("host", "disk")  # the lower tiers, top to bottom (the device pool is above them)
SOURCES = ("device", "host", "disk", "computed")  # where an admission's prompt tokens came from
MAX_CONTENTS = 1 << 20  # hashes the content book remembers (least recently announced forgotten first)
MAX_LEARNT = 1 << 16  # owner changes the book lists for incremental recolouring (older: colour a tier afresh)
MAX_STORIES = 1 << 16  # hashes whose tier story is kept
STORY_LINES = 32  # newest lines kept per hash


def tier_slots_of(event: BlockEvent) -> tuple[int, ...]:
    """The slots in ``event.tier`` an OFFLOADED / LOADED / DROPPED event names (one place to read them)."""
    return tuple(event.tier_slots)


class ContentBook:
    """hash -> (the conversation whose chain it is, its tokens when announced), learnt from snapshots and events.

    Lookups for a whole tier go through a sorted array (:meth:`owners`), rebuilt only after the book changed: a
    262,144-slot host tier is coloured with one ``searchsorted``, not a Python loop."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._group: OrderedDict[int, int] = OrderedDict()  # key -> KV cache group, learnt from events (grouped pools)
        self._index: tuple[np.ndarray, np.ndarray] | None = None
        self._seen: tuple[object, int] | None = None
        self._device: tuple[np.ndarray, np.ndarray] | None = None  # (hashes, owners) of the pool observed last
        self._learnt: list[int] = []  # hashes whose owner was learnt or changed, in order (version = index + 1)
        self._learnt_base = 0  # version before the first entry still in _learnt
        self.version = 0  # bumped whenever an owner is learnt or changes (tier grids redraw then)

    def _learn(self, h: int, owner: int) -> None:
        if h == NO_HASH or owner < 0:
            return
        old = self._owner.get(h)
        if old == owner:
            return
        self._owner[h] = owner
        self._owner.move_to_end(h)
        if len(self._owner) > MAX_CONTENTS:
            gone, _ = self._owner.popitem(last=False)
            self._tokens.pop(gone, None)
        self._index = None
        self.version += 1
        self._learnt.append(h)
        if len(self._learnt) > MAX_LEARNT:
            drop = len(self._learnt) // 2
            del self._learnt[:drop]
            self._learnt_base += drop

    def learnt_since(self, version: int) -> list[int] | None:
        """Hashes whose owner was learnt or changed after ``version`` (None: too long ago to say; recolour all)."""
        if version < self._learnt_base:
            return None
        return self._learnt[version - self._learnt_base:]

    def observe(self, snapshot: PoolSnapshot) -> None:
        """Learn the owner of every hashed device block whose hash or owner changed since the snapshot observed
        last (all of them the first time): a step changes a few blocks, so this stays cheap on a 65,536-block
        pool. Only pools with a tier need it (nothing else is coloured through the book)."""
        key = (snapshot.source, snapshot.version, snapshot.step_id)
        if self._seen == key or not snapshot.tiers or snapshot.block_hash is None:
            return
        self._seen = key
        hashes, owner = np.asarray(snapshot.block_hash), np.asarray(snapshot.owner)
        before = self._device
        if before is not None and before[0].shape == hashes.shape:
            changed = (before[0] != hashes) | (before[1] != owner)
        else:
            changed = np.ones(hashes.shape, bool)
        self._device = (hashes, owner)
        at = np.nonzero(changed & (hashes != NO_HASH) & (owner >= 0))[0]
        for h, o in zip(hashes[at].tolist(), owner[at].tolist()):
            self._learn(h, o)

    def add_events(self, events: Iterable[BlockEvent], grouped: bool = False) -> None:
        """Learn owners and tokens from STORED events (the tokens of a block are known only from these), under
        the cache key the pool and its tiers show (the plain hash for group 0; kvstream.rules.group_key). In a
        pool of several KV cache groups (``grouped``) also each key's group, from STORED and tier events, so that
        a tier slot's hash can be named as the events name it (:meth:`group`)."""
        groups = self._group
        for e in events:
            kind, group = e.kind, e.group
            stored = kind is EventKind.STORED
            if not e.block_hashes or not (stored or (grouped and kind in TIER_KINDS)):
                continue
            keys = [group_key(int(h), group) if group else int(h) for h in e.block_hashes]  # each once
            if grouped:
                for key in keys:
                    groups[key] = group
                    groups.move_to_end(key)
                while len(groups) > MAX_CONTENTS:
                    groups.popitem(last=False)
            if not stored:
                continue
            per = len(e.token_ids) // len(e.block_hashes) if e.token_ids else 0
            for i, key in enumerate(keys):
                self._learn(key, int(e.conversation_id))
                if per:
                    self._tokens[key] = tuple(e.token_ids[i * per:(i + 1) * per])

    def group(self, h: int) -> int | None:
        """The KV cache group of the content under key ``h``, as its events said (None: not heard of)."""
        return self._group.get(int(h))

    def __len__(self) -> int:
        """Hashes whose owner is known."""
        return len(self._owner)

    def owner(self, h: int) -> int:
        return self._owner.get(int(h), -1)

    def tokens(self, h: int) -> tuple[int, ...] | None:
        return self._tokens.get(int(h))

    def owners(self, hashes: np.ndarray) -> np.ndarray:
        """int32 owner of each hash, -1 where unknown (NO_HASH included)."""
        hashes = np.asarray(hashes, np.uint64)
        if self._index is None:
            keys = np.fromiter(self._owner.keys(), np.uint64, len(self._owner))
            values = np.fromiter(self._owner.values(), np.int32, len(self._owner))
            order = np.argsort(keys)
            self._index = (keys[order], values[order])
        keys, values = self._index
        out = np.full(hashes.shape, -1, np.int32)
        if not len(keys):
            return out
        at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
        found = keys[at] == hashes
        out[found] = values[at[found]]
        out[hashes == NO_HASH] = -1
        return out


class TierOwners:
    """The owner of every slot of one tier, kept up to date from one frame to the next: only slots whose hash
    changed, or whose hash the content book has just learnt an owner for, are looked up again (a 262,144-slot host
    tier changes a few slots a step; looking all of them up each step cost tens of milliseconds). The slots of the
    newly learnt hashes are found through a hash -> slot map kept with the slots (a hash lives at most once in a
    tier), not by searching the whole tier: the book learns owners every step, and ``np.isin`` over 262,144 slots
    sorted them every frame."""

    def __init__(self):
        self.hashes: np.ndarray | None = None
        self.owner: np.ndarray | None = None
        self._book_version = 0
        self._slot_of: dict[int, int] = {}  # hash -> the slot holding it (NO_HASH never)
        self._unique = True  # no hash in two slots (a watched server's tier might): else the whole tier is searched

    def update(self, tier: TierView, book: ContentBook) -> bool:
        """Bring the owners up to date with ``tier`` and ``book``; returns whether any changed."""
        hashes = np.asarray(tier.block_hash, np.uint64)
        learnt = book.learnt_since(self._book_version)
        self._book_version = book.version
        if self.hashes is None or self.hashes.shape != hashes.shape or learnt is None:
            self.hashes, self.owner = hashes, book.owners(hashes)
            held = np.nonzero(hashes != NO_HASH)[0]
            self._slot_of = dict(zip(hashes[held].tolist(), held.tolist()))
            self._unique = len(self._slot_of) == len(held)
            return True
        slots = np.nonzero(hashes != self.hashes)[0]
        if len(slots):
            slot_of = self._slot_of
            for slot, old, new in zip(slots.tolist(), self.hashes[slots].tolist(), hashes[slots].tolist()):
                if old != NO_HASH and slot_of.get(old) == slot:
                    del slot_of[old]
                if new != NO_HASH:
                    prev = slot_of.get(new)
                    if prev is not None and prev != slot and hashes[prev] == new:
                        self._unique = False
                    slot_of[new] = slot
        if learnt and self._unique:
            found = [slot for slot in map(self._slot_of.get, learnt) if slot is not None]
            if found:
                slots = np.union1d(slots, np.asarray(found, np.int64))
        elif learnt:
            slots = np.union1d(slots, np.nonzero(np.isin(hashes, np.asarray(learnt, np.uint64)))[0])
        self.hashes = hashes
        if not len(slots):
            return False
        new = np.array([book.owner(h) for h in hashes[slots].tolist()], np.int32)
        changed = bool((new != self.owner[slots]).any())
        if changed:
            self.owner = self.owner.copy()  # the array a grid drew from stays as it was
            self.owner[slots] = new
        return changed


def tier_snapshot(snapshot: PoolSnapshot, name: str, tier: TierView, book: ContentBook,
                  version: int | None = None, owners: np.ndarray | None = None) -> PoolSnapshot:
    """One tier as a pool of CACHED / FREE slots, for the grid renderer: a cached slot is full (tier blocks are
    always full), held by no table (ref count 0), coloured by the owner the content book knows for its hash.
    ``version``: what the grid compares to tell a change (default: the device snapshot's); ``owners``: each slot's
    owner already looked up (:class:`TierOwners`), else the book is asked for all of them."""
    n = int(tier.num_blocks)
    state = np.asarray(tier.state, np.int8)
    cached = state == BlockState.CACHED
    filled = np.where(cached, snapshot.block_size, 0).astype(np.int32)
    owner = np.where(cached, book.owners(tier.block_hash) if owners is None else owners, -1).astype(np.int32)
    return PoolSnapshot(
        step_id=snapshot.step_id, block_size=snapshot.block_size, num_blocks=n, ref_count=np.zeros(n, np.int32),
        num_filled=filled, state=state, owner=owner, last_access=np.asarray(tier.last_access, np.int64),
        block_tables={}, conversations=snapshot.conversations, model_name=snapshot.model_name,
        device=name, block_hash=np.asarray(tier.block_hash, np.uint64),
        version=snapshot.version if version is None else version, source=f"{snapshot.source}:{name}")


def same_tier(a: TierView | None, b: TierView | None) -> bool:
    """Whether two views of a tier hold the same slots (the same object, or equal arrays): a tier grid redraws only
    when its arrays change."""
    if a is b:
        return True
    if a is None or b is None or a.num_blocks != b.num_blocks:
        return False
    return (np.array_equal(a.state, b.state) and np.array_equal(a.block_hash, b.block_hash))


def where_held(snapshot: PoolSnapshot, h: int) -> list[tuple[str, int]]:
    """Every place that holds content ``h`` now: ("device", block id) and (tier, slot), device first."""
    h = int(h)
    if h == NO_HASH:
        return []
    places = []
    if snapshot.block_hash is not None:
        places += [("device", int(b)) for b in np.nonzero(np.asarray(snapshot.block_hash) == np.uint64(h))[0]]
    for name in _tier_names(snapshot.tiers):
        tier = snapshot.tiers[name]
        hold = (np.asarray(tier.block_hash) == np.uint64(h)) & (np.asarray(tier.state) == BlockState.CACHED)
        places += [(name, int(s)) for s in np.nonzero(hold)[0]]
    return places


def _tier_names(tiers: Mapping[str, TierView]) -> list[str]:
    """Tier names top to bottom (known ones first, then any other a source sends)."""
    return [t for t in TIERS if t in tiers] + sorted(t for t in tiers if t not in TIERS)


def tier_names(snapshot: PoolSnapshot) -> list[str]:
    return _tier_names(snapshot.tiers)


def place_text(place: tuple[str, int]) -> str:
    tier, at = place
    return f"device block {at}" if tier == "device" else f"{tier} slot {at}"


class TierStories:
    """What happened to each piece of content (by hash) across tiers: stored, evicted from the device, offloaded,
    loaded back, dropped. Fed every block event once; keeps the newest moves of the most recent hashes, as facts
    (step, kind, tier, slot, device block, reason), worded only when asked for (:meth:`story`): a busy pool moves
    thousands of blocks a frame, and nobody reads most of their stories.

    A story is a tuple of facts and a fact a tuple of plain values (the kind by its value, not the enum member), so
    that the cyclic collector stops tracking them: 65,536 stories as lists of tuples holding enum members were a
    third of the objects each full collection walked while the GUI thread waited (docs/performance.md, "The
    collector")."""

    def __init__(self):
        self._moves: OrderedDict[int, tuple[tuple, ...]] = OrderedDict()

    def __len__(self) -> int:
        """Hashes whose story is kept."""
        return len(self._moves)

    def clear(self) -> None:
        self._moves.clear()

    def _add(self, h: int, move: tuple) -> None:
        moves = self._moves.get(h)
        if moves is None:
            self._moves[h] = (move,)
            if len(self._moves) > MAX_STORIES:
                self._moves.popitem(last=False)
        else:
            self._moves.move_to_end(h)
            self._moves[h] = (moves[1:] if len(moves) >= STORY_LINES else moves) + (move,)

    def add_events(self, events: Iterable[BlockEvent]) -> None:
        """Each move under the cache key the pool and its tiers show (events name the plain hash and the group)."""
        for e in events:
            kind, group = e.kind, e.group
            if kind in TIER_KINDS:
                slots, blocks = tier_slots_of(e), e.block_ids
                for i, h in enumerate(e.block_hashes):
                    self._add(group_key(int(h), group) if group else int(h),
                              (e.step_id, kind.value, e.tier, slots[i] if i < len(slots) else None,
                               blocks[i] if i < len(blocks) else None, e.reason))
            elif kind is EventKind.STORED or kind is EventKind.EVICTED:
                blocks = e.block_ids
                for i, h in enumerate(e.block_hashes):
                    self._add(group_key(int(h), group) if group else int(h),
                              (e.step_id, kind.value, "", None, blocks[i] if i < len(blocks) else "?", ""))

    def story(self, h: int) -> list[tuple[int, str]]:
        """(step, what happened) for content ``h``, oldest first."""
        return [(step, _move_text(EventKind(kind), tier, slot, block, reason))
                for step, kind, tier, slot, block, reason in self._moves.get(int(h), ())]


def _move_text(kind: EventKind, tier: str, slot, block, reason: str) -> str:
    if kind is EventKind.STORED:
        return f"stored in device block {block}"
    if kind is EventKind.EVICTED:
        return f"evicted from device block {block}"
    return _tier_move_text(kind, tier, slot, block, reason)


def _tier_move_text(kind: EventKind, tier: str, slot, block, reason: str) -> str:
    at = f"{tier} slot {slot}" if slot is not None else tier
    if kind == EventKind.OFFLOADED:
        return f"offloaded to {at}" + (f" from device block {block}" if block is not None else
                                       f" from {reason}" if reason else "")
    if kind == EventKind.LOADED:
        return f"loaded from {at}" + (f" into device block {block}" if block is not None else "")
    return f"dropped from {at}" + (f" (moved on to {reason})" if reason else "")


def tier_block_facts(snapshot: PoolSnapshot, tier: str, slot: int, book: ContentBook,
                     stories: TierStories | None = None, detokenize=None) -> list[str]:
    """What the window knows about one tier slot: state, hash, whose content, its tokens, every place holding the
    same content now, and its story across tiers (one fact per item; the tier inspector lists them)."""
    view = snapshot.tiers.get(tier)
    if view is None or not 0 <= slot < view.num_blocks:
        return [f"{tier} slot {slot}: not in this pool"]
    state = BlockState(int(view.state[slot]))
    h = int(view.block_hash[slot])
    if state != BlockState.CACHED or h == NO_HASH:
        return [f"{tier} slot {slot}: free", f"last used at step {int(view.last_access[slot]):,}"]
    facts = [f"{tier} slot {slot}: cached", f"hash {hash_words(snapshot, h, book.group(h))}",
             f"last written or read at step {int(view.last_access[slot]):,}"]
    owner = book.owner(h)
    if owner >= 0:
        info = snapshot.conversation(owner)
        facts.append(f"content of {info.name if info is not None else f'conversation {owner}'}")
    tokens = book.tokens(h)
    if tokens is not None:
        text = ""
        if detokenize is not None:
            try:
                text = f" “{detokenize(list(tokens))}”"
            except Exception:  # a detokenizer that cannot read these ids: the ids alone still say it
                text = ""
        facts.append(f"tokens {' '.join(map(str, tokens))}{text}")
    else:
        facts.append("tokens not known (their STORED event is not in this window's history)")
    places = where_held(snapshot, h)
    facts.append("held now by " + ", ".join(place_text(p) for p in places))
    if stories is not None:
        for step, text in stories.story(h):
            facts.append(f"step {step:,}: {text}")
    return facts
