"""Reading a live vLLM v1 scheduler's block pool as the project's views: a PoolSnapshot plus the BlockEvents between two.

vLLM keeps its pool as Python objects: ``BlockPool.blocks`` (one ``KVCacheBlock`` per physical block: ``block_id``,
``ref_cnt``, ``block_hash``), and per request the list of blocks it holds (``req_to_blocks`` of the single-type
manager). A pool can have hundreds of thousands of blocks, so the tap never scans them per step. It wraps, on the
one scheduler instance it serves, the few methods through which every change passes (the block pool's
``get_new_blocks`` / ``touch`` / ``free_blocks`` / ``cache_full_blocks`` / eviction / reset, the manager's
per-request calls that say for whom, the scheduler's step, admission, preemption and finish), records a typed
BlockEvent for each in order, and marks the blocks they touched. :meth:`VllmPoolTap.frame` then reads back only
those blocks and the tables of the requests holding blocks (O(changed blocks + requests)), updates numpy arrays it
keeps, and hands out a snapshot.

What vLLM knows is what the views show: physical ids, ref counts, states (free; cached: no holder but a prefix
hash; used), 64-bit digests of vLLM's hashes (:mod:`kvstream.vllm.hash`), block tables, how many slots of each block
hold K/V (from ``num_computed_tokens``), and request ids (``ConversationInfo.label``; the views' integer ids are
handed out in order of arrival). Block 0 is vLLM's null block, a placeholder it never hands out; it is shown USED
with no holder, as vLLM counts it. K/V values and text stay on the server: the engine core has no detokenizer.

Never imports vLLM at module level and never imports torch itself: the tap is given the scheduler.
Everything here runs on vLLM's engine-core thread, the only one that touches the scheduler.
"""
from __future__ import annotations

import re
import time
from collections import deque
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Callable, Generator

import numpy as np

from kvstream.events import BlockEvent, EventKind
from kvstream.prompt_check import Held, Removal, classify_prompt
from kvstream.views import (BlockOutcome, BlockState, ConversationInfo, EngineMetrics, FinishReason, KVCacheGroupInfo,
                            MemoryStats, PoolSnapshot, Status, frozen_array)
from kvstream.vllm.hash import hash64, key_hash64

SUPPORTED_VERSIONS = ("0.32.",)  # vLLM releases whose v1 internals this tap was tested against (prefixes)

MAX_EVICTED = 1 << 17  # evicted hashes remembered to explain later misses (the oldest are forgotten first)
_SAMPLE_ID = re.compile(r"^(\d+)_(.+)$")  # vLLM names the n samples of one request "<index>_<parent request id>"

# Attributes the tap relies on, checked before it touches anything (name on the object, what it is for).
_SCHEDULER_METHODS = ("schedule", "update_from_output", "add_request", "_free_request", "_preempt_request",
                      "finish_requests")
_POOL_METHODS = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "_maybe_evict_cached_block",
                 "reset_prefix_cache", "get_num_free_blocks")
_MANAGER_METHODS = ("add_local_computed_blocks", "allocate_new_blocks", "allocate_external_computed_blocks", "free")


class UnsupportedVllm(RuntimeError):
    """This vLLM (version or internals) is not one the tap knows how to read; the message says what is missing."""


def check_supported(scheduler: Any, version: str, any_version: bool = False) -> None:
    """Raise UnsupportedVllm unless ``scheduler`` is a vLLM v1 scheduler of a version and shape the tap can read."""
    if not any_version and not version.startswith(SUPPORTED_VERSIONS):
        raise UnsupportedVllm(f"vLLM {version} is not a supported version (supported: "
                              f"{', '.join(v + 'x' for v in SUPPORTED_VERSIONS)}; set PAGED_KV_EXPLORER_ANY_VLLM=1 "
                              f"to try anyway)")
    missing = [f"Scheduler.{m}" for m in _SCHEDULER_METHODS if not callable(getattr(scheduler, m, None))]
    kvm = getattr(scheduler, "kv_cache_manager", None)
    coordinator = getattr(kvm, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    pool = getattr(kvm, "block_pool", None)
    if kvm is None or managers is None or pool is None:
        raise UnsupportedVllm(f"vLLM {version}: the scheduler has no kv_cache_manager.coordinator.single_type_managers "
                              f"/ block_pool")
    odd = [type(m).__name__ for m in managers if type(m).__name__ not in _MANAGER_KINDS]
    if not managers or odd:
        raise UnsupportedVllm(f"vLLM {version}: KV cache groups of kinds {', '.join(odd) or 'none'}; the tap reads "
                              f"full-attention and sliding-window groups")
    manager = managers[0]
    missing += [f"BlockPool.{m}" for m in _POOL_METHODS if not callable(getattr(pool, m, None))]
    for m in managers:
        missing += [f"{type(m).__name__}.{n}" for n in _MANAGER_METHODS if not callable(getattr(m, n, None))]
        if _MANAGER_KINDS[type(m).__name__] and not callable(getattr(m, "remove_skipped_blocks", None)):
            missing.append(f"{type(m).__name__}.remove_skipped_blocks")
    for obj, attr in ((pool, "blocks"), (pool, "num_gpu_blocks"), (pool, "null_block"), (pool, "enable_caching"),
                      (pool, "hash_block_size"), (manager, "req_to_blocks"), (manager, "block_size"),
                      (scheduler, "requests")):
        if not hasattr(obj, attr):
            missing.append(f"{type(obj).__name__}.{attr}")
    if missing:
        raise UnsupportedVllm(f"vLLM {version}: missing {', '.join(missing)}")
    sizes = {int(m.block_size) for m in managers}
    if sizes != {int(pool.hash_block_size)}:
        raise UnsupportedVllm(f"vLLM {version}: hash block size {pool.hash_block_size} differs from the groups' block "
                              f"sizes {sorted(sizes)} (partial-block prefix hits are not read)")


_MANAGER_KINDS = {"FullAttentionManager": False, "SlidingWindowManager": True}  # the managers read: sliding or not
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")  # "model.layers.3.self_attn.attn" -> 3


def _group_infos(scheduler: Any, managers: list) -> tuple[KVCacheGroupInfo, ...]:
    """The KV cache groups as the views name them, from vLLM's kv_cache_config (window and layers per group)."""
    try:
        specs = list(scheduler.kv_cache_config.kv_cache_groups)
    except Exception:
        specs = []
    out = []
    for g, m in enumerate(managers):
        sliding = _MANAGER_KINDS[type(m).__name__]
        window = int(getattr(m, "sliding_window", 0) or 0) if sliding else None
        names = list(getattr(specs[g], "layer_names", ())) if g < len(specs) else []
        layers = []
        for name in names:
            match = _LAYER_INDEX.search(str(name))
            if match is not None:
                layers.append(int(match.group(1)))
        out.append(KVCacheGroupInfo("sliding_window" if sliding else "full_attention", window, tuple(sorted(layers))))
    return tuple(out)


def _status(status: Any) -> tuple[Status, FinishReason | None]:
    """The views' status and finish reason for a vLLM RequestStatus (compared by name: the enum is vLLM's)."""
    name = getattr(status, "name", str(status))
    if name == "RUNNING":
        return Status.RUNNING, None
    if name == "PREEMPTED":
        return Status.PREEMPTED, None
    if name.startswith("WAITING"):
        return Status.WAITING, None
    if name == "FINISHED_STOPPED":
        return Status.FINISHED, FinishReason.EOS
    if name == "FINISHED_LENGTH_CAPPED":
        return Status.FINISHED, FinishReason.LENGTH
    if name == "FINISHED_IGNORED":
        return Status.FINISHED, FinishReason.CONTEXT
    return Status.ENDED, FinishReason.ENDED  # aborted by the client, or an error / repetition stop


@dataclass
class _Tracked:
    """What the tap last read of one request that holds blocks."""

    cid: int  # the views' conversation id
    blocks: list  # vLLM's own list object (req_to_blocks[rid]); a new object means the table was rebuilt
    ids: list[int]  # physical ids of ``blocks`` as last read
    computed: int  # num_computed_tokens as last read (prefix-hit tokens at admission: those were not computed)
    table: tuple[int, ...] = ()  # ids as a tuple, for the snapshot (rebuilt when ids change)
    now: int = 0  # num_computed_tokens read by the sync in progress
    group: int = 0  # the KV cache group of this table


@dataclass
class _Conv:
    """Per-request facts that never change, kept so that infos are cheap to rebuild."""

    cid: int  # conversation id
    label: str  # vLLM's request id
    prompt: tuple[int, ...]  # prompt token ids
    arrival_step: int  # step at which vLLM admitted it
    parent_id: int | None  # first sample of the same request, for samples 1..n-1
    max_new_tokens: int  # SamplingParams.max_tokens
    temperature: float  # SamplingParams.temperature
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    outcomes: tuple = ()  # BlockOutcome per prompt block at its last admission (what its lookup found)
    counted_outputs: int = 0  # output tokens already added to the generated-token counter
    key: tuple = ()  # what the last info was built from
    info: ConversationInfo | None = None  # the last info built


@dataclass
class _Counters:
    """Running totals for EngineMetrics."""

    steps: int = 0  # update_from_output calls
    generated: int = 0  # output tokens, all requests
    prefill: int = 0  # prompt tokens whose K/V vLLM computed (prefix hits excluded)
    preemptions: int = 0  # requests preempted
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached blocks evicted
    outcomes: dict = field(default_factory=dict)  # BlockOutcome.outcome -> prompt blocks over every admission
    step_started: float = 0.0  # clock at the start of the step in progress
    last_step_seconds: float = 0.0  # wall time of the last step
    last_step_tokens: int = 0  # tokens sampled since the last frame (one step unless frames were rate-limited)
    last_step_prefill: int = 0  # prompt tokens computed since the last frame (same)
    generated_at_frame: int = 0  # ``generated`` at the last frame


@dataclass
class _Wrapped:
    """One method the tap replaced on an instance, to put back on detach."""

    obj: Any  # the instance
    name: str  # attribute name
    had_own: bool  # the instance already had its own attribute (someone else's wrapper): restore it
    original: Any  # what getattr returned before


class VllmPoolTap:
    """The project's pool views of one live vLLM v1 scheduler, kept up to date from what changed.

    ``VllmPoolTap(scheduler)`` checks the scheduler (raising UnsupportedVllm), wraps its methods and starts
    recording. ``frame()`` returns ``(snapshot, events since the last frame)``; ``detach()`` restores every method.
    If the tap's own bookkeeping ever raises, it calls ``on_error`` once and detaches: vLLM's calls always run
    exactly as they would without it, and their results and exceptions pass through untouched.
    """

    def __init__(self, scheduler: Any, *, version: str = "", any_version: bool = False,
                 finished_window: int = 64, on_error: Callable[[BaseException], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if not version:
            import vllm  # the running server's version; imported only here (it imports torch)
            version = vllm.__version__
        check_supported(scheduler, version, any_version)
        self.version_string = version  # vLLM version read at attach
        self.scheduler = scheduler
        self.managers = list(scheduler.kv_cache_manager.coordinator.single_type_managers)  # one per KV cache group
        self.manager = self.managers[0]
        self.groups = _group_infos(scheduler, self.managers)  # what each group is (kind, window, layers)
        # a pool with more than one group, or a sliding window, carries per-group tables (with -1 for vLLM's null
        # block) and each block's group; a plain full-attention model stays as the one-group pool it always was
        self.grouped = len(self.managers) > 1 or any(g.kind == "sliding_window" for g in self.groups)
        self.pool = scheduler.kv_cache_manager.block_pool
        self.block_size = int(self.manager.block_size)
        self.num_blocks = int(self.pool.num_gpu_blocks)
        self._clock = clock
        self._on_error = on_error
        self.failed: BaseException | None = None  # what made the tap detach itself
        n = self.num_blocks
        self._ref = np.zeros(n, np.int32)  # ref count per block
        self._filled = np.zeros(n, np.int32)  # slots holding K/V
        self._state = np.zeros(n, np.int8)  # BlockState values
        self._owner = np.full(n, -1, np.int32)  # first holder (used), last holder (cached), -1
        self._last = np.zeros(n, np.int64)  # step of the last change
        self._hash = np.zeros(n, np.uint64)  # hash64 of vLLM's hash, NO_HASH none
        self._bgroup = np.zeros(n, np.int8)  # the KV cache group of each block (the last that held it)
        self._group = 0  # group whose manager is working right now (attribution of pool calls)
        self._reason = ""  # why blocks are freed right now: "sliding_window" inside remove_skipped_blocks
        self._stale: set[tuple[int, str]] = set()  # (group, request) whose table vLLM changed in place
        self._counts = [0, 0, 0]  # blocks per BlockState
        self._filled_used = 0  # filled slots of USED blocks
        self._holders: dict[int, list[int]] = {}  # block id -> conversation ids holding it, in order of taking it
        self._dirty: set[int] = set()  # blocks whose state / ref / hash may have changed since the last frame
        self._events: list[BlockEvent] = []  # since the last frame
        self._rid: str | None = None  # request the manager is working for right now (attribution of pool calls)
        self._cids: dict[str, int] = {}  # vLLM request id -> conversation id (live requests)
        self._next_cid = 0  # conversation ids are handed out in order of arrival, never reused
        self._convs: dict[int, _Conv] = {}  # live (and not yet dropped) conversations
        self._first_sample: dict[str, int] = {}  # parent request id of n samples -> first sample's cid
        self._tracked_groups: list[dict[str, _Tracked]] = [{} for _ in self.managers]  # per group, as below
        self._tracked = self._tracked_groups[0]  # requests holding blocks at the last frame (group 0)
        self._finished: deque[ConversationInfo] = deque(maxlen=finished_window)  # most recent finished / ended
        self._hit_tokens: dict[str, int] = {}  # request id -> prefix-hit tokens of its current admission
        self._lookups: dict[str, tuple] = {}  # request id -> outcomes its newest prefix lookup found (admission)
        self._evicted: OrderedDict[int, tuple] = OrderedDict()  # hash64 -> (step, for conversation, idle steps)
        self._unsalted = None  # (hash function, hash_block_tokens) for salted requests' "salted" misses, once read
        self._c = _Counters()
        self.step_id = 0  # schedule() calls so far: events are stamped with it
        self.version = 0  # bumped by every frame that carries a change
        self._changed = True  # something happened since the last frame
        self._wrapped: list[_Wrapped] = []
        self.after_step: Callable[[], None] | None = None  # called after each step and each finish from outside
        config = getattr(scheduler, "vllm_config", None)
        self.model_name = str(getattr(getattr(config, "model_config", None), "model", "") or "")
        self.max_model_len = int(getattr(scheduler, "max_model_len", 0) or 0)
        self.device = str(getattr(getattr(config, "device_config", None), "device_type", "") or "")
        self.bytes_per_block = self._bytes_per_block(scheduler)
        self._read_all()
        self._install()

    # ---- wrappers ---------------------------------------------------------------------------------------------
    def _wrap(self, obj: Any, name: str, advice: Callable[..., Generator]) -> None:
        """Replace ``obj.name`` (on that instance only) by the one wrapper the tap uses, running ``advice`` around
        vLLM's call. ``advice`` is a generator function given the call's arguments: its code up to its one
        ``yield`` runs before the call and yields the arguments to call with (None: as given); the call's result
        is sent back in, and its code after the ``yield`` runs after the call. When the call raises, the advice is
        closed (its ``finally`` runs, the rest does not) and the exception passes through. A failure inside the
        advice detaches the tap (:meth:`_fail`); vLLM's call always runs, its result and exceptions untouched."""
        original = getattr(obj, name)
        self._wrapped.append(_Wrapped(obj, name, name in vars(obj), original))
        tap = self

        def wrapper(*args, **kwargs):
            if tap.failed is not None:
                return original(*args, **kwargs)
            try:
                around = advice(*args, **kwargs)
                given = next(around)
            except Exception as exc:  # the tap's bookkeeping failed: vLLM's call runs as given
                around = given = None
                tap._fail(exc)
            if given is not None:
                args, kwargs = given
            try:
                result = original(*args, **kwargs)
            except BaseException:
                if around is not None:
                    around.close()
                raise
            if around is not None:
                tap._finish(around, result)
            return result

        setattr(obj, name, wrapper)

    def _finish(self, around: Generator, result: Any) -> None:
        """Run the rest of an advice with the call's ``result`` (only its ``finally`` once the tap has failed)."""
        if self.failed is not None:
            around.close()
            return
        try:
            around.send(result)
        except StopIteration:
            return
        except Exception as exc:
            self._fail(exc)
            return
        around.close()  # an advice yields once: a second yield is cut short here
        self._fail(RuntimeError("a tap advice yielded twice"))

    def detach(self) -> None:
        """Put every wrapped method back (the instance then behaves as if the tap had never been there)."""
        while self._wrapped:
            w = self._wrapped.pop()
            if w.had_own:
                setattr(w.obj, w.name, w.original)
            else:
                try:
                    delattr(w.obj, w.name)
                except AttributeError:
                    pass

    @property
    def attached(self) -> bool:
        return bool(self._wrapped)

    def _fail(self, exc: BaseException) -> None:
        """The tap's own bookkeeping raised: detach (vLLM goes on as if the tap had never been there) and report
        once."""
        if self.failed is not None:
            return
        self.failed = exc
        self.detach()
        if self._on_error is not None:
            self._on_error(exc)

    def _install(self) -> None:
        """Wrap, on these instances only, every method through which the pool changes (see the module)."""
        for g, m in enumerate(self.managers):
            for name in _MANAGER_METHODS:
                self._wrap(m, name, partial(self._for_request, g, ""))
            if _MANAGER_KINDS[type(m).__name__]:  # a full-attention group's remove_skipped_blocks frees nothing
                self._wrap(m, "remove_skipped_blocks", partial(self._for_request, g, "sliding_window"))
        # Not wrapped: cache_blocks (STORED events read the request from cache_full_blocks' own arguments) and
        # pop_blocks_for_free (no pool call inside).
        pool, scheduler = self.pool, self.scheduler
        for obj, name, advice in (
                (pool, "get_new_blocks", self._new_blocks), (pool, "_maybe_evict_cached_block", self._evict),
                (pool, "touch", self._touch), (pool, "free_blocks", self._free_blocks),
                (pool, "cache_full_blocks", self._cache_full_blocks), (pool, "reset_prefix_cache", self._reset),
                (scheduler, "schedule", self._schedule), (scheduler, "update_from_output", self._step_done),
                (scheduler, "add_request", self._add_request), (scheduler, "_preempt_request", self._preempt),
                (scheduler, "_free_request", self._free_request), (scheduler, "finish_requests", self._aborted)):
            self._wrap(obj, name, advice)
        kvm = scheduler.kv_cache_manager  # the prefix lookup and the admission: why each prompt block missed
        if callable(getattr(kvm, "get_computed_blocks", None)) and callable(getattr(kvm, "allocate_slots", None)):
            self._wrap(kvm, "get_computed_blocks", self._lookup)
            self._wrap(kvm, "allocate_slots", self._slots)

    # ---- advice: what the tap does around each wrapped call (see _wrap) ------------------------------------------
    def _for_request(self, group: int, reason: str, request_id, *args, **kwargs) -> Generator:
        """A manager's per-request call: the pool calls inside it are for that request and group (and, for a
        sliding window's releases, for that reason). allocate_new_blocks runs for every scheduled request every
        step: this is kept to a few assignments."""
        previous = self._rid, self._group, self._reason
        self._rid, self._group, self._reason = request_id, group, reason
        try:
            yield None
        finally:
            self._rid, self._group, self._reason = previous
            if reason:  # the table keeps the released places as the null block, replaced in place
                self._stale.add((group, request_id))

    def _new_blocks(self, *args, **kwargs) -> Generator:
        self._on_allocated((yield None))

    def _evict(self, block, *args, **kwargs) -> Generator:
        key = block.block_hash  # read before vLLM drops it
        if (yield None):
            self._on_evicted(block, key)

    def _touch(self, blocks, *args, **kwargs) -> Generator:
        blocks = list(blocks)
        yield (blocks, *args), kwargs
        self._on_shared(blocks)

    def _free_blocks(self, ordered_blocks, *args, **kwargs) -> Generator:
        blocks = list(ordered_blocks)  # vLLM passes a reversed() iterator: read it once, hand on the list
        yield (blocks, *args), kwargs
        self._on_freed(blocks)

    def _cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs) -> Generator:
        before = [b.block_hash for b in blocks[num_cached_blocks:num_full_blocks]]
        yield None
        self._on_stored(request, blocks, num_cached_blocks, num_full_blocks, before)

    def _reset(self, *args, **kwargs) -> Generator:
        if (yield None):
            self._on_reset()

    def _lookup(self, request, *args, **kwargs) -> Generator:
        """The scheduler's prefix lookup: the pool as the request found it."""
        self._on_lookup(request, (yield None))

    def _slots(self, request, *args, **kwargs) -> Generator:
        """A waiting request's first slots: its admission."""
        blocks = yield None
        if self._lookups:
            self._on_slots(request, blocks)

    def _schedule(self, *args, **kwargs) -> Generator:
        self.step_id += 1
        self._c.step_started = self._clock()
        yield None

    def _step_done(self, *args, **kwargs) -> Generator:
        yield None
        self._on_step_done()
        if self.after_step is not None:
            self.after_step()

    def _aborted(self, *args, **kwargs) -> Generator:
        yield None
        if self.after_step is not None:  # an abort between steps: an idle server publishes it now
            self.after_step()

    def _add_request(self, request, *args, **kwargs) -> Generator:
        known = request.request_id in self._cids
        yield None
        if not known:
            self._on_added(request)

    def _preempt(self, request, *args, **kwargs) -> Generator:
        self._on_preempted(request)
        yield None

    def _free_request(self, request, *args, **kwargs) -> Generator:
        self._on_finished(request)
        yield None
        self._after_finished(request)

    # ---- events -----------------------------------------------------------------------------------------------
    def _cid(self) -> int:
        return self._cids.get(self._rid, -1) if self._rid is not None else -1

    def _emit(self, kind: EventKind, **fields) -> None:
        if self._group and "group" not in fields:
            fields["group"] = self._group
        self._events.append(BlockEvent(step_id=self.step_id, kind=kind, **fields))
        self._changed = True

    def _on_allocated(self, blocks) -> None:
        ids = tuple(b.block_id for b in blocks)
        if ids:
            self._dirty.update(ids)
            self._bgroup[list(ids)] = self._group
            self._emit(EventKind.ALLOCATED, conversation_id=self._cid(), block_ids=ids)

    def _on_evicted(self, block, key) -> None:
        self._c.evictions += 1
        self._dirty.add(block.block_id)
        h = key_hash64(key) if key is not None else 0
        if h:  # remembered to say why a later prompt missed it (bounded: the oldest are forgotten)
            self._evicted.pop(h, None)
            self._evicted[h] = (self.step_id, self._cid(), max(0, self.step_id - int(self._last[block.block_id])))
            if len(self._evicted) > MAX_EVICTED:
                self._evicted.popitem(last=False)
        last = self._events[-1] if self._events else None
        if last is not None and last.kind == EventKind.EVICTED and last.step_id == self.step_id \
                and last.conversation_id == self._cid():  # one event for the evictions of one allocation
            self._events[-1] = BlockEvent(step_id=self.step_id, kind=EventKind.EVICTED, conversation_id=self._cid(),
                                          block_ids=last.block_ids + (block.block_id,),
                                          block_hashes=last.block_hashes + (h,))
        else:
            self._emit(EventKind.EVICTED, conversation_id=self._cid(), block_ids=(block.block_id,), block_hashes=(h,))

    def _on_shared(self, blocks) -> None:
        ids = tuple(b.block_id for b in blocks if not b.is_null)
        if ids:
            self._dirty.update(ids)
            if self._rid is not None and self._group == 0:  # every group shares the hit: count it once
                self._hit_tokens[self._rid] = self._hit_tokens.get(self._rid, 0) + len(ids) * self.block_size
            self._emit(EventKind.SHARED, conversation_id=self._cid(), block_ids=ids, reason="prefix_hit")

    def _on_freed(self, blocks) -> None:
        cid, runs = self._cid(), []  # runs: [kind, ids] of consecutive blocks with the same outcome
        caching = self.pool.enable_caching
        for b in blocks:
            if b.is_null or (b.pool is not None and b.pool is not self.pool):
                continue
            self._dirty.add(b.block_id)
            if b.ref_cnt > 0:
                kind = EventKind.RELEASED
            elif caching and b.block_hash is not None:
                kind = EventKind.CACHED
            else:
                kind = EventKind.FREED
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(b.block_id)
            else:
                runs.append([kind, [b.block_id]])
        for kind, ids in runs:
            if self._reason:
                self._emit(kind, conversation_id=cid, block_ids=tuple(ids), reason=self._reason)
            else:
                self._emit(kind, conversation_id=cid, block_ids=tuple(ids))

    def _on_stored(self, request, blocks, start: int, end: int, before: list) -> None:
        run = []  # logical indices of newly hashed blocks, consecutive
        for i in range(start, end):
            b = blocks[i]
            if not b.is_null and b.block_hash is not None and before[i - start] is None:
                if run and run[-1] != i - 1:
                    self._stored_run(request, blocks, run)
                    run = []
                run.append(i)
        if run:
            self._stored_run(request, blocks, run)

    def _stored_run(self, request, blocks, run: list[int]) -> None:
        bs = self.block_size
        first, last = run[0], run[-1]
        ids = tuple(blocks[i].block_id for i in run)
        self._dirty.update(ids)
        parent = blocks[first - 1].block_hash if first > 0 else None
        if parent is None and first > 0 and len(request.block_hashes) >= first:
            parent_hash: int | None = hash64(request.block_hashes[first - 1])
        else:
            parent_hash = key_hash64(parent) if parent is not None else None
        self._emit(EventKind.STORED, conversation_id=self._cids.get(request.request_id, -1), block_ids=ids,
                   block_hashes=tuple(key_hash64(blocks[i].block_hash) for i in run), parent_hash=parent_hash,
                   token_ids=tuple(request.all_token_ids[first * bs:(last + 1) * bs]))

    def _on_reset(self) -> None:
        self._emit(EventKind.CLEARED)
        self._dirty.update(range(self.num_blocks))

    def _on_added(self, request) -> None:
        rid = request.request_id
        cid = self._next_cid
        self._next_cid += 1
        self._cids[rid] = cid
        parent_id, fields = None, {}
        sample = _SAMPLE_ID.match(rid)
        if sample is not None:
            first = self._first_sample.setdefault(sample.group(2), cid)
            if first != cid:
                parent_id, fields = first, {"other_id": first, "reason": "sample"}
        params = getattr(request, "sampling_params", None)
        self._convs[cid] = _Conv(
            cid=cid, label=rid, prompt=tuple(request.prompt_token_ids or ()), arrival_step=self.step_id,
            parent_id=parent_id, max_new_tokens=int(getattr(request, "max_tokens", 0) or 0),
            temperature=float(getattr(params, "temperature", 0.0) or 0.0))
        self._emit(EventKind.CONVERSATION_ADDED, conversation_id=cid, **fields)

    def _on_preempted(self, request) -> None:
        self._c.preemptions += 1
        ids = tuple(b.block_id for m in self.managers for b in m.req_to_blocks.get(request.request_id, ())
                    if not b.is_null)
        self._emit(EventKind.PREEMPTED, conversation_id=self._cids.get(request.request_id, -1), block_ids=ids)

    def _on_finished(self, request) -> None:
        cid = self._cids.get(request.request_id, -1)
        status, reason = _status(request.status)
        if status == Status.ENDED:
            self._emit(EventKind.CONVERSATION_ENDED, conversation_id=cid)
        else:
            self._emit(EventKind.CONVERSATION_FINISHED, conversation_id=cid, reason=reason.value)

    def _after_finished(self, request) -> None:
        rid = request.request_id
        cid = self._cids.pop(rid, None)
        self._hit_tokens.pop(rid, None)
        self._lookups.pop(rid, None)
        conv = self._convs.pop(cid, None) if cid is not None else None
        if conv is not None:
            sample = _SAMPLE_ID.match(rid)
            if sample is not None and self._first_sample.get(sample.group(2)) == cid:
                del self._first_sample[sample.group(2)]  # its siblings were all added with it
            self._finished.append(self._info(conv, request, (), ((),) * len(self.managers) if self.grouped else ()))

    def _on_step_done(self) -> None:
        c = self._c
        c.steps += 1
        c.last_step_seconds = self._clock() - c.step_started if c.step_started else 0.0
        self._changed = True

    # ---- reading the pool back --------------------------------------------------------------------------------
    @staticmethod
    def _bytes_per_block(scheduler) -> int:
        try:
            group = scheduler.kv_cache_config.kv_cache_groups[0]
            return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        except Exception:
            return 0

    def _read_all(self) -> None:
        """Every block, once at attach (vectorized when vLLM's pool is fresh: all free but the null block)."""
        pool = self.pool
        null = pool.null_block.block_id
        if pool.get_num_free_blocks() == self.num_blocks - 1:
            self._state[:] = BlockState.FREE
            self._state[null] = BlockState.USED
            self._counts = [self.num_blocks - 1, 1, 0]
        else:
            self._dirty.update(range(self.num_blocks))
            self._sync_tables()
            self._read_dirty()

    def _set_state(self, b: int, state: int, filled: int) -> None:
        old = int(self._state[b])
        self._counts[old] -= 1
        self._counts[state] += 1
        if old == BlockState.USED:
            self._filled_used -= int(self._filled[b])
        if state == BlockState.USED:
            self._filled_used += filled
        self._state[b] = state
        self._filled[b] = filled

    def _read_dirty(self) -> None:
        blocks, step, caching = self.pool.blocks, self.step_id, self.pool.enable_caching
        for b in self._dirty:
            blk = blocks[b]
            key = blk.block_hash
            if blk.is_null:
                state, ref = BlockState.USED, 0
            elif blk.ref_cnt > 0:
                state, ref = BlockState.USED, blk.ref_cnt
            else:
                state, ref = (BlockState.CACHED if caching and key is not None else BlockState.FREE), 0
            holders = self._holders.get(b)
            if holders:
                owner = holders[0]
            elif state == BlockState.FREE:
                owner = -1
            else:
                owner = int(self._owner[b])  # cached (or held only by a deferred free): the last holder
            filled = 0 if state == BlockState.FREE else (self.block_size if state == BlockState.CACHED
                                                         else int(self._filled[b]))
            self._set_state(b, state, filled)
            self._ref[b] = ref
            self._owner[b] = owner
            self._hash[b] = key_hash64(key) if key is not None else 0
            self._last[b] = step
        self._dirty.clear()

    def _sync_tables(self) -> list[_Tracked]:
        """Bring the tracked block tables of every group in line with vLLM's; returns the tables whose fill must be
        reread."""
        refill = []
        stale, self._stale = self._stale, set()
        for g, m in enumerate(self.managers):
            refill += self._sync_group(g, m.req_to_blocks, self._tracked_groups[g],
                                       {rid for sg, rid in stale if sg == g})
        return refill

    def _sync_group(self, g: int, current, tracked: dict, stale: set) -> list[_Tracked]:
        """One group's tables (vLLM's null block read as -1: a place a sliding window released)."""
        holders, dirty = self._holders, self._dirty
        for rid in [r for r, t in tracked.items() if current.get(r) is not t.blocks]:
            t = tracked.pop(rid)
            for b in t.ids:
                if b == -1:
                    continue
                h = holders.get(b)
                if h is not None:
                    try:
                        h.remove(t.cid)
                    except ValueError:
                        pass
                    if not h:
                        del holders[b]
                dirty.add(b)
        refill = []
        requests = self.scheduler.requests
        for rid, blocks in current.items():
            t = tracked.get(rid)
            request = requests.get(rid)
            computed = int(getattr(request, "num_computed_tokens", 0)) if request is not None else 0
            if t is None:
                cid = self._cids.get(rid, -1)
                ids = [-1 if blk.is_null else blk.block_id for blk in blocks]
                t = tracked[rid] = _Tracked(cid, blocks, ids, self._hit_tokens.get(rid, 0), tuple(ids), group=g)
                live = [b for b in ids if b != -1]
                for b in live:
                    holders.setdefault(b, []).append(cid)
                dirty.update(live)
                if live:
                    self._bgroup[live] = g
                if request is not None and g == 0:
                    self._admitted(rid, request, cid)
                refill.append(t)
            else:
                n = len(t.ids)
                if len(blocks) != n or (n and blocks[-1].block_id != t.ids[-1]) or rid in stale:
                    new = [-1 if blk.is_null else blk.block_id for blk in blocks]
                    old = set(t.ids)
                    for b in set(new) - old:
                        if b != -1:
                            holders.setdefault(b, []).append(t.cid)
                    for b in old - set(new):
                        h = holders.get(b)
                        if h is not None and t.cid in h:
                            h.remove(t.cid)
                            if not h:
                                del holders[b]
                    changed = old.symmetric_difference(new)
                    changed.discard(-1)
                    dirty.update(changed)
                    added = [b for b in set(new) - old if b != -1]
                    if added:
                        self._bgroup[added] = g
                    t.ids, t.table = new, tuple(new)
                    refill.append(t)
                elif computed != t.computed:
                    refill.append(t)
            t.now = computed
        return refill

    def _admitted(self, rid: str, request, cid: int) -> None:
        """Prefix-cache counters for a request that just got its blocks (again, after a preemption)."""
        conv = self._convs.get(cid)
        hits = self._hit_tokens.get(rid, 0)
        prompt = int(getattr(request, "num_prompt_tokens", 0) or 0)
        self._c.queries += prompt
        self._c.hits += min(hits, prompt)
        if conv is not None:
            conv.num_cached_tokens = min(hits, prompt)

    def _on_slots(self, request, blocks) -> None:
        """A waiting request got its slots: admitted (again, after a preemption) with what its lookup found (a
        request may be admitted, computed and finished between two frames: this is the one sure moment)."""
        outcomes = self._lookups.pop(request.request_id, None) if blocks is not None else None
        if not outcomes:
            return
        totals = self._c.outcomes
        for o in outcomes:
            totals[o.outcome] = totals.get(o.outcome, 0) + 1
        conv = self._convs.get(self._cids.get(request.request_id, -1))
        if conv is not None:
            conv.outcomes = outcomes
        self._changed = True

    def _on_lookup(self, request, result) -> None:
        """What the scheduler's prefix lookup found for ``request``, block by block, while the pool is still as
        the lookup saw it (the admission that follows evicts, allocates and stores): hits up to the lookup's
        answer; past it, each full block the pool holds (recomputed after the first miss, or holding the last
        token), evicted (when, for whom, after how long unused: the tap saw it go) or never seen (cold). Kept
        until the request is admitted (a request that waits is looked up again each step: the newest wins)."""
        bs = self.block_size
        n = int(request.num_tokens)
        hashes = list(request.block_hashes)[:n // bs]
        if len(hashes) < n // bs or not self.pool.enable_caching:
            return
        get = self.pool.get_cached_block
        held = []
        for h in hashes:
            blocks = get(h, [0])
            held.append(Held("device", blocks[0].block_id, hash64(h)) if blocks else None)

        def removal(i: int):
            record = self._evicted.get(hash64(hashes[i]))
            return None if record is None else Removal(record[0], None, "lru", record[1], record[2])

        check = classify_prompt(n, bs, held, removal, hits=int(result[1]) // bs)
        outcomes = [BlockOutcome(b.index, b.outcome) if b.removal is None else
                    BlockOutcome(b.index, b.outcome, b.removal.step, b.removal.for_conversation, b.removal.by,
                                 b.removal.idle_steps) for b in check.blocks]
        if getattr(request, "cache_salt", None) or getattr(request, "lora_request", None) is not None:
            self._mark_salted(request, outcomes, hashes)
        self._lookups[request.request_id] = tuple(outcomes)

    def _mark_salted(self, request, outcomes: list, hashes: list) -> None:
        """A salted (cache salt, LoRA) request's cold blocks whose plain tokens the pool holds under the unsalted
        hash missed because of the salt: "salted". The unsalted chain is hashed as vLLM hashes it (its own
        functions, the server's hash algorithm)."""
        if self._unsalted is None:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import hash_block_tokens
            algo = self.scheduler.vllm_config.cache_config.prefix_caching_hash_algo
            self._unsalted = (get_hash_fn_by_name(algo), hash_block_tokens)
        fn, hash_tokens = self._unsalted
        bs, tokens, parent = self.block_size, request.all_token_ids, None
        for i in range(len(hashes)):
            parent = hash_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], None)
            if outcomes[i].outcome == "cold" and self.pool.get_cached_block(parent, [0]):
                outcomes[i] = BlockOutcome(i, "salted")

    def _refill(self, refill: list[_Tracked]) -> None:
        """Slots filled in the blocks of requests whose computed tokens or tables changed; prompt tokens computed."""
        bs, state, filled, null = self.block_size, self._state, self._filled, self.pool.null_block.block_id
        prefill = 0
        for t in refill:
            now = t.now
            lo = min(t.computed, now) // bs
            conv = self._convs.get(t.cid)
            if conv is not None and now > t.computed and t.group == 0:
                prefill += max(0, min(now, len(conv.prompt)) - t.computed)
            for i in range(lo, len(t.ids)):
                b = t.ids[i]
                if b != -1 and state[b] == BlockState.USED and b != null:
                    f = min(bs, max(0, now - i * bs))
                    old = int(filled[b])
                    if f != old:
                        self._filled_used += f - old
                        filled[b] = f
                        self._last[b] = self.step_id
            t.computed = now
        self._c.prefill += prefill
        self._c.last_step_prefill = prefill  # since the last frame: one step unless frames were rate-limited

    # ---- conversations ----------------------------------------------------------------------------------------
    def _info(self, conv: _Conv, request, table: tuple[int, ...],
              group_tables: tuple[tuple[int, ...], ...] = ()) -> ConversationInfo:
        status, reason = _status(request.status)
        outputs = request.num_output_tokens
        key = (status, int(request.num_computed_tokens), outputs, table, int(getattr(request, "num_preemptions", 0)),
               group_tables, conv.outcomes)
        if conv.info is not None and conv.key == key:
            return conv.info
        self._c.generated += max(0, outputs - conv.counted_outputs)
        conv.counted_outputs = max(outputs, conv.counted_outputs)
        conv.key = key
        conv.info = ConversationInfo(
            conversation_id=conv.cid, status=status, prompt_token_ids=conv.prompt,
            output_token_ids=tuple(request.output_token_ids), output_text="", prompt_text="", block_table=table,
            num_computed_tokens=key[1], num_cached_tokens=conv.num_cached_tokens, max_new_tokens=conv.max_new_tokens,
            temperature=conv.temperature, parent_id=conv.parent_id, num_preemptions=key[4],
            arrival_step=conv.arrival_step, finish_reason=reason, turns=((0, len(conv.prompt)),), label=conv.label,
            group_block_tables=group_tables, prompt_block_outcomes=conv.outcomes)
        return conv.info

    # ---- frames -----------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """vLLM holds no request at all (no further step will come until one arrives)."""
        return not self.scheduler.requests

    @property
    def pending(self) -> bool:
        """Whether something changed since the last frame."""
        return self._changed or bool(self._events) or bool(self._dirty)

    def frame(self) -> tuple[PoolSnapshot, list[BlockEvent]]:
        """The pool now and the events since the last frame (which this call takes)."""
        changed = self.pending
        refill = self._sync_tables()
        self._read_dirty()
        self._refill(refill)
        tables, infos, logical, contiguous, entries = {}, [], 0, 0, 0
        tracked = self._tracked
        grouped = self.grouped
        group_tables: list[dict[int, tuple[int, ...]]] = [{} for _ in self.managers] if grouped else []
        for rid, request in self.scheduler.requests.items():
            cid = self._cids.get(rid)
            conv = self._convs.get(cid) if cid is not None else None
            if conv is None:
                continue
            t = tracked.get(rid)
            table = t.table if t is not None else ()
            if table:
                tables[cid] = table
                entries += len(table)
                logical += min(int(request.num_computed_tokens), len(table) * self.block_size)
                total = len(conv.prompt) + conv.max_new_tokens
                contiguous += min(total, self.max_model_len) if self.max_model_len else total
            mine: tuple = ()
            if grouped:
                mine = []
                for g, tg in enumerate(self._tracked_groups):
                    tt = tg.get(rid)
                    gt = tt.table if tt is not None else ()
                    if gt:
                        group_tables[g][cid] = gt
                        if g:
                            entries += len(gt)
                    mine.append(gt)
                mine = tuple(mine)
            infos.append(self._info(conv, request, table, mine))
        live = {i.conversation_id for i in infos}
        infos.extend(i for i in self._finished if i.conversation_id not in live)
        infos.sort(key=lambda i: i.conversation_id)
        if changed or refill:
            self.version += 1
        self._changed = False
        events, self._events = self._events, []
        c, bs = self._c, self.block_size
        c.last_step_tokens, c.generated_at_frame = c.generated - c.generated_at_frame, c.generated
        used, cached, free = self._counts[BlockState.USED], self._counts[BlockState.CACHED], \
            self._counts[BlockState.FREE]
        memory = MemoryStats(
            bytes_per_block=self.bytes_per_block, bytes_per_token=self.bytes_per_block // bs if bs else 0,
            num_used_blocks=used, num_cached_blocks=cached, num_free_blocks=free,
            num_filled_slots=self._filled_used, num_allocated_slots=used * bs,
            num_tail_empty_slots=used * bs - self._filled_used, num_logical_slots=logical,
            num_slots_saved_by_sharing=logical - self._filled_used, num_contiguous_slots=contiguous,
            block_table_bytes=4 * entries)
        metrics = EngineMetrics(
            num_steps=c.steps, num_generated_tokens=c.generated, num_prefill_tokens=c.prefill,
            num_preemptions=c.preemptions, prefix_cache_queries=c.queries, prefix_cache_hits=c.hits,
            last_step_seconds=c.last_step_seconds, last_step_tokens=c.last_step_tokens,
            last_step_prefill_tokens=c.last_step_prefill, num_evictions=c.evictions,
            **{f"prompt_blocks_{k}": v for k, v in c.outcomes.items()})
        snap = PoolSnapshot(
            step_id=self.step_id, block_size=bs, num_blocks=self.num_blocks,
            ref_count=frozen_array(self._ref), num_filled=frozen_array(self._filled),
            state=frozen_array(self._state), owner=frozen_array(self._owner), last_access=frozen_array(self._last),
            block_tables=MappingProxyType(tables), conversations=tuple(infos), metrics=metrics, memory=memory,
            model_name=self.model_name, max_model_len=self.max_model_len, device=self.device,
            block_hash=frozen_array(self._hash), version=self.version, source="vllm", kv_cache_groups=self.groups,
            group_block_tables=tuple(MappingProxyType(g) for g in group_tables),
            block_group=frozen_array(self._bgroup) if grouped else None)
        return snap, events
