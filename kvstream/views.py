"""Immutable views of a block pool, shared by every source the explorer can watch.

The project's engine builds them after each step; the pool stream (:mod:`kvstream.poolstream`) carries them across
processes and into recordings and rebuilds them array for array; the vLLM plugin builds them from vLLM's own block
pool. Nothing here refers to a live engine object: arrays are copies marked read-only, tuples replace lists, so a
view can be handed to another thread (the GUI) or kept as history.

numpy only: no torch, no Qt, so a recorder, a network publisher and a plugin inside another server can use it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import msgspec
import numpy as np


class BlockState(enum.IntEnum):
    """What a physical block holds right now."""

    FREE = 0  # no owner and no reusable content
    USED = 1  # referenced by at least one conversation's block table
    CACHED = 2  # no owner, but still holds a full block of KV that a matching prefix can reuse


class HashReason(str, enum.Enum):
    """Why a block has or has not a prefix hash: a fact the source states, which the explorer puts in words."""

    FREE = "free"  # a free block holds no reusable K/V
    HASHED = "hashed"  # full and hashed with its prefix: a prompt with the same prefix reuses it
    PARTIAL = "partial"  # not full: only full blocks are hashed
    CACHING_OFF = "caching_off"  # full, but prefix caching is off
    DUPLICATE = "duplicate"  # full, but the same prefix is already cached in another block
    NOT_HASHED = "not_hashed"  # full and not hashed; the source does not say whether caching is on


def hash_reason(state: int, hashed: bool, num_filled: int, block_size: int,
                prefix_caching: bool | None = None) -> HashReason:
    """Why a block has or has not a prefix hash (every source states it the same way). ``state`` is a BlockState
    value; ``prefix_caching`` None: the source does not say whether it is on."""
    if state == BlockState.FREE:
        return HashReason.FREE
    if hashed:
        return HashReason.HASHED
    if num_filled < block_size:
        return HashReason.PARTIAL
    if prefix_caching is False:
        return HashReason.CACHING_OFF
    if prefix_caching:
        return HashReason.DUPLICATE
    return HashReason.NOT_HASHED


class Status(str, enum.Enum):
    """Life cycle of a conversation."""

    WAITING = "waiting"  # queued, holds no blocks yet
    RUNNING = "running"  # holds blocks and decodes one token per step
    PREEMPTED = "preempted"  # lost its blocks to make room; waits to be recomputed
    FINISHED = "finished"  # reached max_new_tokens, end-of-sequence or the context limit; blocks released
    ENDED = "ended"  # ended by the user; blocks released

    def __str__(self) -> str:  # "running", not "Status.RUNNING"
        return self.value


class FinishReason(str, enum.Enum):
    """Why a conversation stopped (None while it is live)."""

    EOS = "eos"  # the model sampled an end-of-sequence token
    LENGTH = "length"  # it generated max_new_tokens
    CONTEXT = "context"  # it reached the model's context limit (max_position_embeddings)
    ENDED = "ended"  # the user ended it
    NON_FINITE = "non_finite"  # the model's logits for it were NaN or infinite: nothing can be sampled from them

    def __str__(self) -> str:
        return self.value  # what the window says: explorer.model.event_text.finish_words


@dataclass(frozen=True)
class KVCacheGroupInfo:
    """One KV cache group of a pool, as vLLM v1's hybrid allocator forms them: the layers of one kind, paged through
    their own block tables out of the one shared pool."""

    kind: str  # "full_attention" | "sliding_window"
    sliding_window: int | None  # a query at position p reads keys at positions > p - window; None: every position
    layers: tuple[int, ...]  # the model's layer indices in this group


HIT_MEDIA = ("device", "host", "disk")  # where a prompt block's hit came from
MISS_CAUSES = ("cold", "evicted", "after_break", "partial", "window", "last_token", "salted")  # why one missed


class BlockOutcome(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """How one block of a prompt fared at its conversation's last admission: a hit (``outcome`` is where from) or a
    miss and its one cause:

    - "cold": this content was never in any pool before;
    - "evicted": it was, until an eviction (``evicted_step``, to make room for ``evicted_for``, by ``evicted_by``:
      the eviction policy, or the tier that dropped it, after ``idle_steps`` steps unused);
    - "after_break": the pool holds it, but an earlier block missed, so it is computed again;
    - "partial": the prompt's last block is not full (only full blocks are cached);
    - "window": the full-attention layers hold it, but a sliding window released it from its group;
    - "last_token": held whole, but it holds the prompt's last token, which is computed again for the logits of
      the first output (vLLM does the same, so a fully held prompt counts the blocks before it);
    - "salted": a cache salt or LoRA made equal tokens a different block (reported by sources that tell).

    A msgspec struct (an array on the wire): the pool stream carries it as it is."""

    index: int  # the block's logical index in the prompt
    outcome: str  # one of HIT_MEDIA, or one of MISS_CAUSES
    evicted_step: int | None = None  # evicted: the step it left the last pool that held it
    evicted_for: int | None = None  # evicted: the conversation that needed its block (-1: none, e.g. a reset)
    evicted_by: str = ""  # evicted: the policy ("lru", ...) or what dropped it ("host tier", "disk tier", "reset")
    idle_steps: int | None = None  # evicted: steps since it was last used, when it went

    @property
    def hit(self) -> bool:
        return self.outcome in HIT_MEDIA


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    """One conversation as seen from outside the engine."""

    conversation_id: int  # id handed out by add_conversation / fork_conversation
    status: Status  # waiting | running | preempted | finished | ended (compares equal to the plain string)
    prompt_token_ids: tuple[int, ...]  # the whole prompt, verbatim (history included after a reply)
    output_token_ids: tuple[int, ...]  # tokens generated since the last prompt (may end with EOS)
    output_text: str  # detokenized output; an incomplete trailing UTF-8 sequence is held back
    prompt_text: str  # detokenized prompt
    block_table: tuple[int, ...]  # physical block ids in logical order (empty when it holds no blocks)
    num_computed_tokens: int  # tokens whose K/V sit in the pool
    num_cached_tokens: int  # prompt tokens taken from the prefix cache at the last admission
    max_new_tokens: int  # generation budget of the current turn
    temperature: float  # 0 means greedy
    parent_id: int | None  # conversation this one was forked from
    num_preemptions: int  # times it lost its blocks and was recomputed
    arrival_step: int  # engine step at which it was added (or continued)
    finish_reason: FinishReason | None = None  # why it stopped; None while live
    turns: tuple[tuple[int, int], ...] = ()  # per turn: (position its user message starts, position its reply starts)
    label: str = ""  # the source's own name for it (a vLLM request id); "" for the project's engine
    group_block_tables: tuple[tuple[int, ...], ...] = ()  # one table per KV cache group (-1 where a sliding window
    #                    released a block); a one-group table is always (block_table,)
    prompt_token_sources: Mapping[str, int] = field(default_factory=dict, hash=False)  # last admission's prompt
    #                   tokens by where their K/V came from: "device", "host", "disk" (tiers) or "computed"; {}: unknown
    prompt_block_outcomes: tuple[BlockOutcome, ...] = ()  # last admission: how each prompt block fared; (): unknown

    def __post_init__(self) -> None:
        # A plain pool has one KV cache group, whose table is block_table: every reader may index the groups the
        # same way whatever the model (DESIGN.md), while producers and the pool stream carry no second copy.
        if len(self.group_block_tables) <= 1:  # one group: its table is block_table (also after a replace())
            object.__setattr__(self, "group_block_tables", (self.block_table,))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt then output: the token at every position."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_live(self) -> bool:
        return self.status in (Status.WAITING, Status.RUNNING, Status.PREEMPTED)

    @property
    def name(self) -> str:
        """'conversation 3', or the source's label when it has one."""
        return self.label or f"conversation {self.conversation_id}"


KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # PoolSnapshot.kv_cache_dtype names
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}  # bytes a value


@dataclass(frozen=True)
class BlockInfo:
    """Everything about one physical block, for the inspector."""

    block_id: int  # physical id
    state: BlockState
    ref_count: int  # number of block-table entries naming this block
    num_filled: int  # slots holding K/V (0..block_size)
    block_size: int
    token_ids: tuple[int, ...]  # token in each filled slot
    token_texts: tuple[str, ...]  # printable text of each token
    positions: tuple[int, ...]  # position in its conversation of each filled slot
    owners: tuple[tuple[int, int], ...]  # (conversation id, logical block index) for each reference
    block_hash: int | None  # prefix-cache hash; None unless the block is full and hashed
    hash_reason: HashReason | None  # why there is or is not a hash (None: not said; the explorer words it)
    last_owner: int  # conversation that last wrote or used it (-1 never)
    keys: np.ndarray | None = field(default=None, repr=False)  # [layers, filled, kv_heads, head_dim] float32; None
    values: np.ndarray | None = field(default=None, repr=False)  # where the source keeps K/V to itself (vLLM)
    kv_cache_dtype: str = ""  # what the pool stores (KV_CACHE_DTYPES); "" not said
    stored_keys: np.ndarray | None = field(default=None, repr=False)  # an fp8 pool's bytes as stored (uint8, keys'
    stored_values: np.ndarray | None = field(default=None, repr=False)  # shape); keys/values: the values attention
    #                                                                     reads, the codes' values times the scales
    kv_scales: tuple[tuple[float, float], ...] = ()  # (K's, V's) scale of each of keys' layers (an fp8 pool)


@dataclass(frozen=True)
class EngineMetrics:
    """Counters since the engine started, plus figures of the current step."""

    num_steps: int = 0  # step() calls that did work
    num_generated_tokens: int = 0  # tokens sampled, all conversations
    num_prefill_tokens: int = 0  # prompt tokens whose K/V were computed
    num_preemptions: int = 0  # conversations preempted (recompute)
    num_cow_copies: int = 0  # copy-on-write block copies
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not recomputed)
    last_step_seconds: float = 0.0  # wall time of the last step
    last_step_tokens: int = 0  # tokens sampled in the last step
    last_step_prefill_tokens: int = 0  # tokens prefilled in the last step
    num_evictions: int = 0  # cached blocks whose KV was dropped to make room
    # Prompt blocks over every admission so far by outcome (BlockOutcome.outcome): hits by where they came from,
    # misses by cause. All 0 with prefix_cache_queries > 0: the source does not count them (an older stream).
    prompt_blocks_device: int = 0  # hits in the device pool
    prompt_blocks_host: int = 0  # hits loaded from the host tier
    prompt_blocks_disk: int = 0  # hits loaded from the disk tier
    prompt_blocks_cold: int = 0  # misses: never in any pool before
    prompt_blocks_evicted: int = 0  # misses: evicted before they were asked for again
    prompt_blocks_after_break: int = 0  # misses: held, but after an earlier miss
    prompt_blocks_partial: int = 0  # misses: the prompt's last block was not full
    prompt_blocks_window: int = 0  # misses: a sliding window had let them go
    prompt_blocks_last_token: int = 0  # misses: held, but holding the prompt's last token (recomputed)
    prompt_blocks_salted: int = 0  # misses: a cache salt or LoRA made equal tokens differ

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prompt_block_totals(self) -> dict[str, int] | None:
        """{outcome: prompt blocks} over every admission (HIT_MEDIA and MISS_CAUSES), or None where the source does
        not count them."""
        totals = {name: int(getattr(self, f"prompt_blocks_{name}")) for name in HIT_MEDIA + MISS_CAUSES}
        if not any(totals.values()) and self.prefix_cache_queries > 0:
            return None
        return totals


@dataclass(frozen=True)
class MemoryStats:
    """Where the bytes of the pool go, for the conversations holding blocks now."""

    bytes_per_block: int  # K and V of one block across all layers
    bytes_per_token: int  # K and V of one token slot across all layers
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_filled_slots: int  # slots of used blocks holding K/V (shared blocks counted once)
    num_allocated_slots: int  # used blocks * block_size
    num_tail_empty_slots: int  # empty slots in used blocks: the internal waste of paging
    num_logical_slots: int  # filled slots summed over conversations (shared blocks counted per owner)
    num_slots_saved_by_sharing: int  # num_logical_slots - num_filled_slots
    num_contiguous_slots: int  # what reserving prompt + max_new_tokens contiguously per conversation would take
    block_table_bytes: int  # int32 entries of all block tables

    @property
    def kv_bytes_used(self) -> int:
        return self.num_filled_slots * self.bytes_per_token

    @property
    def tail_waste_bytes(self) -> int:
        return self.num_tail_empty_slots * self.bytes_per_token

    @property
    def contiguous_bytes(self) -> int:
        return self.num_contiguous_slots * self.bytes_per_token


NO_HASH = 0  # block_hash entry of a block without a prefix hash (a real hash of 0 is remapped by its maker)


@dataclass(frozen=True)
class TierView:
    """One lower tier of the KV cache (host memory, disk) as the window sees it: a slot per block it can hold.

    A tier only ever holds full hashed blocks that the device pool evicted (or that the tier above passed down), so
    a slot is FREE or CACHED; the hash names the content, and the device pool's hashes tell whose it was."""

    num_blocks: int  # slots in the tier
    state: np.ndarray  # int8 BlockState per slot: FREE or CACHED
    block_hash: np.ndarray  # uint64 prefix hash held in each slot, NO_HASH where empty
    last_access: np.ndarray  # int64: step at which each slot was last written or read (loaded back)


_OWNER_SCANS = 4  # owners_of questions a snapshot answers by scanning its tables before it builds the index
# (building the index costs far more than one scan of the tables: docs/performance.md, "Pool views")


@dataclass(frozen=True)
class PoolSnapshot:
    """The block pool and its conversations after one engine step. Arrays have length num_blocks."""

    step_id: int  # engine step this snapshot was taken after
    block_size: int
    num_blocks: int
    ref_count: np.ndarray  # int32: block-table entries naming each block
    num_filled: np.ndarray  # int32: slots holding K/V
    state: np.ndarray  # int8: BlockState values
    owner: np.ndarray  # int32: a conversation holding a used block (the earliest still holding it), the last
    #                    holder of a cached one, -1 if none
    last_access: np.ndarray  # int64: step at which each block was last allocated, written or read
    block_tables: Mapping[int, tuple[int, ...]]  # conversation id -> physical ids, only conversations holding blocks
    conversations: tuple[ConversationInfo, ...]  # live ones and the most recent finished ones, by id
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    memory: MemoryStats | None = None
    model_name: str = ""  # "builtin" or the checkpoint directory
    max_model_len: int = 0  # most tokens (prompt + output) in one conversation: the model's positions; 0: unknown
    device: str = "cpu"
    block_hash: np.ndarray | None = None  # uint64 prefix hash of each block, NO_HASH where it has none
    version: int = 0  # bumped by every change to the pool or a conversation; equal versions: same contents
    source: str = "engine"  # what produced it: "engine", "vllm", ... (the --json "source" field)
    tiers: Mapping[str, TierView] = field(default_factory=dict)  # "host", "disk": only the tiers that are on
    kv_cache_groups: tuple[KVCacheGroupInfo, ...] = ()  # () means one full-attention group
    group_block_tables: tuple[Mapping[int, tuple[int, ...]], ...] = ()  # one {conversation id: ids} per group, -1
    #                     where a window released a block; without block_group (one plain group) it is always
    #                     (block_tables,), the very same mapping
    block_group: np.ndarray | None = None  # int8: the group of each non-free block (its last one for a free block);
    #                                        None for one group
    tokenizer: str = ""  # what turns its token ids into text: "builtin", a model name ("smollm2"), a checkpoint
    #                      directory or a .gguf path; "" where the source has none or does not say
    kv_cache_dtype: str = ""  # what the pool stores K/V as: one of KV_CACHE_DTYPES; "" where the source does not say

    def __post_init__(self) -> None:
        # As ConversationInfo's: one plain group's tables are block_tables itself, so readers index the groups the
        # same way for every model and the pool stream carries the tables once.
        if self.block_group is None and len(self.group_block_tables) <= 1:  # also after a replace()
            object.__setattr__(self, "group_block_tables", (self.block_tables,))

    @property
    def carries_group_tables(self) -> bool:
        """Whether the per-group tables say more than block_tables (several groups, or a sliding window's holes):
        only then does the pool stream carry them."""
        return self.block_group is not None or len(self.group_block_tables) != 1

    def conversation(self, conversation_id: int) -> ConversationInfo | None:
        index = self._by_id.get(conversation_id)
        return None if index is None else self.conversations[index]

    @property
    def _by_id(self) -> Mapping[int, int]:
        cached = self.__dict__.get("_index")
        if cached is None:  # built once per snapshot (frozen dataclass: write through __dict__)
            cached = MappingProxyType({c.conversation_id: i for i, c in enumerate(self.conversations)})
            object.__setattr__(self, "_index", cached)
        return cached

    def owners_of(self, block_id: int) -> tuple[tuple[int, int], ...]:
        """(conversation id, logical index) of every table entry naming ``block_id``, by conversation id. The
        index behind it is built once per snapshot (hover, inspector and grid ask many times a frame)."""
        block_id = int(block_id)
        index = self.__dict__.get("_owners")
        if index is None:
            asked = self.__dict__.get("_owners_asked", 0) + 1
            object.__setattr__(self, "_owners_asked", asked)
            if asked <= _OWNER_SCANS:  # a few questions (a frame scrubbed past): scanning the tables is cheaper
                tables = self.block_tables
                return tuple((cid, list(tables[cid]).index(block_id)) for cid in sorted(tables)
                             if block_id in tables[cid])
            from .rules import owner_index
            index = owner_index(self.block_tables)
            object.__setattr__(self, "_owners", index)
        return index.get(block_id, ())

    def hashes(self) -> np.ndarray:
        """block_hash, or all NO_HASH when the source sent none."""
        if self.block_hash is None:
            return np.zeros(self.num_blocks, np.uint64)
        return self.block_hash


_NO_PREFIXES: Mapping[int, tuple[int, ...]] = MappingProxyType({})


@dataclass(frozen=True)
class ChangeRecord:
    """What the producer of a snapshot knows changed since the snapshot it built before, handed on beside the
    snapshot (never attached to it: a snapshot is frozen, and the record is about two snapshots, not one).

    The pool-stream encoder, holding ``base``, compares only the masked blocks instead of six arrays of 65,536 in
    full, and takes a grown conversation's old outputs by identity instead of comparing them token by token. A
    wrong record corrupts every frame encoded from it: a producer makes one only from a record of every change
    (the project's engine: its block pool notes each block it writes, its token lists are only appended to).
    Build the masks with :func:`block_masks`, which checks them."""

    base: "PoolSnapshot | None" = None  # the earlier snapshot the masks compare against (None: nothing known)
    block_masks: "Mapping[str, np.ndarray] | None" = None  # per array of BLOCK_ARRAYS: bool over the pool, True
    # where the block may differ from base's (None: any block may differ)
    output_prefixes: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: _NO_PREFIXES)  # conversation id
    # -> a tuple its output_token_ids starts with, the very tuple of an earlier snapshot's info (known by identity)


NO_CHANGE_RECORD = ChangeRecord()  # nothing known: compare everything


def chain_changes(first: ChangeRecord, later: ChangeRecord) -> ChangeRecord:
    """What changed from ``first.base`` to the snapshot ``later`` describes, where ``later.base`` is the snapshot
    ``first`` describes (the caller knows it; a record does not hold its own snapshot): the blocks either record
    names. Nothing known where either knows nothing. Outputs that only grew are known by identity against one
    snapshot's infos, so a chain keeps none of them (compare those)."""
    if first.base is None or first.block_masks is None or later.block_masks is None:
        return NO_CHANGE_RECORD
    masks = {name: np.logical_or(first.block_masks[name], later.block_masks[name]) for name in BLOCK_ARRAYS}
    for mask in masks.values():
        mask.setflags(write=False)
    return ChangeRecord(first.base, MappingProxyType(masks))


@dataclass(frozen=True)
class PoolUpdate:
    """One publication of a pool, as one unit: the snapshot, the block events that led to it (since the update
    before), and what its producer knows changed. The engine runner hands this to every observer, so a recorder,
    the window's history and a publisher all see the snapshot together with its own events and record."""

    snapshot: "PoolSnapshot"
    events: tuple = ()  # kvstream.events.BlockEvent, oldest first
    changes: ChangeRecord = NO_CHANGE_RECORD
    seq: int | None = None  # its number in its producer's publications, from 0 (the engine runner's: the one count
    # the window's frame buffer and the pool-stream encoder both read); None: not numbered

    @classmethod
    def of(cls, snapshot: "PoolSnapshot", events=()) -> "PoolUpdate":
        """The update of a snapshot handed on alone: nothing is known about what changed (compare everything)."""
        return cls(snapshot, tuple(events))


BLOCK_ARRAYS = ("state", "ref_count", "num_filled", "owner", "last_access", "block_hash")  # per-block, wire order


def block_masks(snapshot: PoolSnapshot, base: PoolSnapshot, mask: np.ndarray,
                **wider: np.ndarray) -> Mapping[str, np.ndarray]:
    """:attr:`ChangeRecord.block_masks` for ``snapshot`` against ``base``: its arrays equal ``base``'s wherever
    ``mask`` (bool, num_blocks entries, read-only) is False, or for an array named in ``wider`` (``last_access=``),
    wherever that array's own mask is. Refuses masks that do not fit the pool (ValueError)."""
    unknown = set(wider) - set(BLOCK_ARRAYS)
    if unknown:
        raise ValueError(f"no per-block array named {', '.join(sorted(unknown))}")
    masks = {name: wider.get(name, mask) for name in BLOCK_ARRAYS}
    for m in masks.values():
        if m.shape != (snapshot.num_blocks,) or m.dtype != np.bool_ or base.num_blocks != snapshot.num_blocks:
            raise ValueError("a change record needs bool masks over the pool, against a pool of the same size")
    return MappingProxyType(masks)


def frozen_array(array: np.ndarray, dtype=None) -> np.ndarray:
    """A read-only copy of ``array``."""
    out = np.array(array, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out
