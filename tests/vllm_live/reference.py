"""vLLM's own view of its block pool, read straight from its scheduler with a full scan: the reference that the
plugin's incremental views are checked against. Test code only (a full scan per step is what the plugin avoids)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstream.views import BlockState
from kvstream.vllm.hash import key_hash64

BLOCK_SIZE = 32  # the tests' vLLM engines: vLLM's CPU backend wants a multiple of 32
NUM_BLOCKS = 40  # small, so that a few requests fill it (evictions, preemptions)
MAX_MODEL_LEN = 512


def scheduler_of(engine):
    """vLLM's Scheduler inside an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return engine.engine_core.engine_core.scheduler


@dataclass(frozen=True)
class VllmState:
    """One moment of vLLM's pool, in the views' terms."""

    ref_count: np.ndarray  # KVCacheBlock.ref_cnt (0 for the null block, whose count vLLM does not keep)
    state: np.ndarray  # USED if held (or the null block), CACHED if free with a hash, else FREE
    block_hash: np.ndarray  # hash64 of each block's hash, 0 none
    tables: dict  # request id -> physical block ids, for every request holding blocks
    computed: dict  # request id -> num_computed_tokens, same requests
    num_free: int  # BlockPool.get_num_free_blocks()
    block_size: int

    @property
    def stored_hashes(self) -> set[int]:
        return set(self.block_hash[self.block_hash != 0].tolist())

    def filled(self, request_id: str) -> list[int]:
        """Slots holding K/V in each block of a request's table, from its num_computed_tokens."""
        bs, n = self.block_size, self.computed[request_id]
        return [min(bs, max(0, n - i * bs)) for i in range(len(self.tables[request_id]))]


def read_state(scheduler) -> VllmState:
    kvm = scheduler.kv_cache_manager
    pool, manager = kvm.block_pool, kvm.coordinator.single_type_managers[0]
    blocks = pool.blocks
    ref = np.array([0 if b.is_null else b.ref_cnt for b in blocks], np.int32)
    state = np.array([BlockState.USED if (b.is_null or b.ref_cnt > 0) else
                      BlockState.CACHED if b.block_hash is not None else BlockState.FREE for b in blocks], np.int8)
    hashes = np.array([key_hash64(b.block_hash) if b.block_hash is not None else 0 for b in blocks], np.uint64)
    tables = {rid: list(kvm.get_block_ids(rid)[0]) for rid in manager.req_to_blocks}
    computed = {rid: scheduler.requests[rid].num_computed_tokens for rid in tables}
    return VllmState(ref, state, hashes, tables, computed, pool.get_num_free_blocks(), manager.block_size)


def compare(snapshot, truth: VllmState) -> list[str]:
    """What differs between a view of the pool and vLLM's own state (empty when they agree)."""
    problems = []
    for name, mine, theirs in (("ref_count", snapshot.ref_count, truth.ref_count),
                               ("state", snapshot.state, truth.state),
                               ("block_hash", snapshot.hashes(), truth.block_hash)):
        bad = np.flatnonzero(np.asarray(mine) != theirs)
        if bad.size:
            problems.append(f"{name} differs at blocks {bad[:10].tolist()}: view {np.asarray(mine)[bad[:10]].tolist()}"
                            f" vLLM {theirs[bad[:10]].tolist()}")
    labels = {c.conversation_id: c.label for c in snapshot.conversations}
    tables = {labels.get(cid, f"?{cid}"): list(t) for cid, t in snapshot.block_tables.items()}
    if tables != truth.tables:
        problems.append(f"block tables differ: view {tables} vLLM {truth.tables}")
    else:
        for rid, table in truth.tables.items():
            filled = [int(snapshot.num_filled[b]) for b in table]
            if filled != truth.filled(rid):
                problems.append(f"{rid}: filled slots {filled}, vLLM computed {truth.filled(rid)}")
    free = int(np.count_nonzero(np.asarray(snapshot.state) != BlockState.USED))
    if free != truth.num_free:
        problems.append(f"{free} free or cached blocks in the view, vLLM has {truth.num_free} free")
    return problems
