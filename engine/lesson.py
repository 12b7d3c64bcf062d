"""The lesson's toy experiment: one scalar attention head stored in a paged pool, stepped one position at a time.

Why a toy: with every key 0 and the query 1, all attention weights are equal, so the output is simply the mean of
the values 1, 2, 3, ... stored so far. Any mistake in addressing (a wrong block, a wrong slot, a slot read twice)
would change that mean, so the number the user sees checks the paging machinery itself.

Nothing here is a separate animation: the K/V live in pool tensors of the engine's shape
``[num_blocks, block_size, kv_heads, head_dim]``, blocks come from the engine's :class:`BlockPool` free queue through
its :class:`KVCacheManager` (the pool's one writer, as in the engine), and the output comes from
:func:`paged_attention`. No Qt here; the window in ``explorer/window/lesson.py`` only draws this state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import paged_attention
from .kv.pool import BlockPool, random_cycle
from .kv import fp8
from .kv.manager import KVCacheManager
from .sequence import Sequence
from kvstream.views import BlockState

BLOCK_SIZE = 4
NUM_BLOCKS = 8
TOY_OWNER = 0  # owner id of the lesson's sequence in the BlockPool
KV_BYTES_PER_SLOT = 2 * 4  # one float32 key + one float32 value (one head of dimension 1; fp8: a byte each)
TABLE_BYTES_PER_ENTRY = 4  # a block table entry is an int32


@dataclass(frozen=True)
class Tenant:
    """Another conversation that used the pool before the lesson started; it explains the free queue's order."""

    name: str  # short label drawn in its blocks
    owner: int  # owner id in the BlockPool
    num_blocks: int  # blocks it took from the fresh pool, in order
    finished: bool  # finished before the lesson, so its blocks went back to the free queue
    value: float  # value stored in its slots: any wrong read would pull this into the lesson's mean


# Fresh pool hands out 0..7 in order: A takes 0-1, B 2-3, C 4, D 5-7. Then C finishes (block 4 is freed) and A
# finishes (blocks are freed tail first: 1, then 0). The free queue is now 4, 1, 0, so the lesson's first block is
# physical 4, its second physical 1, its third physical 0, while B and D keep 2-3 and 5-7 between them.
TENANTS = (
    Tenant("A", 1, 2, True, 100.0),
    Tenant("B", 2, 2, False, 200.0),
    Tenant("C", 3, 1, True, 300.0),
    Tenant("D", 4, 3, False, 400.0),
)
FINISH_ORDER = ("C", "A")
_TENANT_NAMES = {t.owner: t.name for t in TENANTS}  # BlockPool owner id -> tenant name


@dataclass(frozen=True)
class StepEvent:
    """Where one appended position went."""

    position: int  # 1-based position just appended (also its value)
    logical_block: int  # index in the block table
    physical_block: int  # id in the pool
    slot: int  # slot inside the block, 0..block_size-1
    allocated: bool  # a new block was taken from the free queue for this position


@dataclass(frozen=True)
class LayoutChange:
    """The same data before and after moving every used block to another physical id."""

    num_positions: int
    before_table: tuple[int, ...]  # physical ids in logical order, before the move
    after_table: tuple[int, ...]
    before_result: float  # paged_attention output before the move
    after_result: float
    mapping: dict[int, int]  # old physical id -> new physical id, for every moved block (tenants too)

    @property
    def bit_identical(self) -> bool:
        return np.float32(self.before_result).tobytes() == np.float32(self.after_result).tobytes()


@dataclass(frozen=True)
class LessonView:
    """An immutable picture of the pool, for drawing (the window keeps the one from before a layout change)."""

    num_positions: int
    block_size: int
    slot_values: np.ndarray  # float32 [num_blocks, block_size]: value in each filled slot, NaN in empty ones
    roles: tuple[str, ...]  # per physical block: "lesson", "free" or a tenant's name
    block_table: tuple[int, ...]  # physical ids in logical order
    result: float  # paged_attention output (NaN with no positions)
    newest: tuple[int, int] | None  # (physical block, slot) of the position appended last
    sliding_window: int | None = None  # positions attention reads back (None: all of them, plain paging)

    @property
    def num_blocks(self) -> int:
        return len(self.roles)


class ToyPagedSequence:
    """One sequence of the toy head, appended position by position into a paged pool shared with other tenants.

    ``sliding_window``: the lesson's second chapter. The head then reads only the last ``sliding_window`` positions
    (a sliding-window layer), and a block wholly behind the window is released at the step that puts it there,
    because the model will never read it again; the table keeps its place as -1 (vLLM's null block). Paging alone
    (None) never releases anything: it changes where KV lives, not how much of it is kept."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto"):
        """``kv_cache_dtype``: EngineConfig's values; fp8 stores the toy's keys and values as the engine's fp8 pool
        does (engine/kv/fp8.py), so a value the format cannot hold is read back as the value it was cut to (e4m3:
        the positions 1..16 stay exact; e5m2: 9 is read as 8), and a layout change still gives the same bits."""
        if num_blocks < sum(t.num_blocks for t in TENANTS) or block_size < 1:
            raise ValueError("the lesson's pool needs room for its tenants")
        if kv_cache_dtype not in fp8.KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(fp8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self.kv_dtype = fp8.storage_dtype(kv_cache_dtype, torch.float32)
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.reset()

    # ---- state ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to zero positions, with the tenants' history replayed so the free queue has its chosen order."""
        self.pool = BlockPool(self.num_blocks, self.block_size, enable_prefix_caching=False)
        self.manager = KVCacheManager(self.pool)
        shape = (self.num_blocks, self.block_size, 1, 1)  # [num_blocks, block_size, kv_heads, head_dim]
        self.key_cache = torch.zeros(shape, dtype=self.kv_dtype)
        self.value_cache = torch.zeros(shape, dtype=self.kv_dtype)
        self.tenants: dict[str, Sequence] = {}
        for tenant in TENANTS:
            seq = _toy_sequence(tenant.owner, tenant.num_blocks * self.block_size)
            self.manager.allocate_slots(seq, seq.num_tokens)
            self.manager.commit(seq, seq.num_tokens)
            for b in seq.block_table:
                self.value_cache[b] = self._stored(tenant.value)
            self.tenants[tenant.name] = seq
        for name in FINISH_ORDER:
            self.manager.free(self.tenants[name])
        self.seq = _toy_sequence(TOY_OWNER, 0)
        self.num_positions = 0
        self.last_event: StepEvent | None = None
        self.last_change: LayoutChange | None = None
        self.released: list[tuple[int, int, int]] = []  # (position that released it, logical, physical) per release
        self.last_action = "reset"  # "reset", "step" or "layout": what the explanation should talk about

    @property
    def block_table(self) -> list[int]:
        """The lesson sequence's physical block ids in logical order."""
        return self.seq.block_table

    @property
    def free_queue(self) -> tuple[int, ...]:
        """Free block ids in the order BlockPool will hand them out."""
        return self.pool.free_queue

    @property
    def live_blocks(self) -> list[int]:
        """The physical blocks the sequence holds (its table without the window's released entries)."""
        return [b for b in self.block_table if b >= 0]

    @property
    def max_positions(self) -> int:
        """Positions the sequence can reach before the pool runs out (the tenants keep their blocks); with a window,
        the blocks it releases come back, so this grows as it goes."""
        return (len(self.live_blocks) + self.pool.num_free_blocks) * self.block_size

    def can_step(self) -> bool:
        return self.num_positions % self.block_size != 0 or self.pool.can_allocate(1)

    # ---- the experiment -------------------------------------------------------------------------------------
    def step(self) -> StepEvent:
        """Append one position: key 0, value = position. A new block is allocated only when the last one is full."""
        if not self.can_step():
            raise RuntimeError("the pool has no free block for another position")
        index = self.num_positions  # 0-based index of the new position
        logical, slot = divmod(index, self.block_size)
        allocated = slot == 0
        self.seq.token_ids.append(index + 1)  # the toy's "token" at a position is its value
        self.manager.allocate_slots(self.seq, 1)
        block = self.block_table[logical]
        self.key_cache[block, slot, 0, 0] = self._stored(0.0)
        self.value_cache[block, slot, 0, 0] = self._stored(float(index + 1))
        self.manager.commit(self.seq, index + 1)
        self.num_positions = index + 1
        self.last_event = StepEvent(index + 1, logical, block, slot, allocated)
        self.last_action = "step"
        self._release_out_of_window()
        return self.last_event

    def _stored(self, value: float) -> torch.Tensor:
        """``value`` as the pool stores it: itself in float32, quantised as the engine's cache write does in fp8."""
        x = torch.tensor(value, dtype=torch.float32)
        return fp8.quantize(x, self.kv_dtype) if fp8.is_fp8(self.kv_dtype) else x

    def window_start(self) -> int:
        """0-based first position attention reads now (0 without a window)."""
        w = self.sliding_window
        return 0 if w is None else max(0, self.num_positions - w)

    def _release_out_of_window(self) -> None:
        """Give back every block wholly before the window: the model never reads those positions again. Its
        reference is dropped through the manager (the pool's one writer) and its table entry becomes -1."""
        if self.sliding_window is None:
            return
        table = self.seq.block_table
        for logical in range(self.window_start() // self.block_size):  # blocks ending before the window's start
            block = table[logical]
            if block < 0:
                continue
            self.manager._drop(block, self.seq.seq_id)  # the pool's only writer; the block goes to the free queue
            table[logical] = -1
            self.released.append((self.num_positions, logical, block))

    def result(self) -> float:
        """The head's output for the current positions, computed by paged_attention through the block table (with a
        window: read through the same table, the window's positions only)."""
        if self.num_positions == 0:
            return float("nan")
        if self.sliding_window is not None:
            return self._windowed_result()
        query = torch.ones(1, 1, 1)  # [seqs, heads, dim]
        table = torch.tensor([self.block_table], dtype=torch.int32)  # [seqs, blocks]
        lens = torch.tensor([self.num_positions], dtype=torch.int32)
        return float(paged_attention(query, self.key_cache, self.value_cache, table, lens)[0, 0, 0])

    def _windowed_result(self) -> float:
        """Attention over the window's positions, each found through the block table (logical block, slot): the
        same addressing as paged_attention, so a wrong table entry gives a wrong mean, and a released block
        (-1) inside the window would fail loudly instead of being read."""
        positions = range(self.window_start(), self.num_positions)
        table = self.block_table
        blocks = [table[p // self.block_size] for p in positions]
        if min(blocks) < 0:
            raise RuntimeError("the window reaches a released block")
        index = torch.tensor(blocks, dtype=torch.long)
        slots = torch.tensor([p % self.block_size for p in positions], dtype=torch.long)
        keys = self.key_cache[index, slots, 0, 0].float()  # [window]
        values = self.value_cache[index, slots, 0, 0].float()  # [window]
        weights = torch.softmax(keys * 1.0, dim=0)  # query 1, head dimension 1: scale 1
        return float((weights * values).sum())

    def expected(self) -> float:
        """The mean of the values the head reads (1..n, or the window's last positions), the answer the paged
        computation must give."""
        if not self.num_positions:
            return float("nan")
        first = self.window_start() + 1
        if fp8.is_fp8(self.kv_dtype):  # the values as stored: the mean of what the head reads
            return float(sum(float(self._stored(float(p)).float()) for p in range(first, self.num_positions + 1))
                         / (self.num_positions - first + 1))
        return (first + self.num_positions) / 2

    def change_layout(self, seed: int = 0) -> LayoutChange:
        """Move every used block (the lesson's and the tenants') to another physical id, data included.

        Like the engine's relocation: a permutation of the whole pool in which no used block keeps its id; the
        cache rows are moved with it, the BlockPool renames its bookkeeping and the block table is rewritten."""
        before_table, before = tuple(self.block_table), self.result()
        holes = [i for i, b in enumerate(self.seq.block_table) if b < 0]  # released by the window: nothing to move
        self.seq.block_table = [b for b in self.seq.block_table if b >= 0]
        used = np.nonzero(self.pool.state != BlockState.FREE)[0]
        new_id = random_cycle(self.num_blocks, seed)
        index = torch.as_tensor(new_id, dtype=torch.long)
        moved_k, moved_v = torch.empty_like(self.key_cache), torch.empty_like(self.value_cache)
        moved_k[index] = self.key_cache  # old block b now lives at new_id[b]
        moved_v[index] = self.value_cache
        self.key_cache, self.value_cache = moved_k, moved_v
        self.manager.relocate(new_id, [self.seq, *self.tenants.values()])
        for i in holes:
            self.seq.block_table.insert(i, -1)
        if self.last_event is not None:
            e = self.last_event
            self.last_event = StepEvent(e.position, e.logical_block, int(new_id[e.physical_block]), e.slot, e.allocated)
        self.last_change = LayoutChange(self.num_positions, before_table, tuple(self.block_table), before,
                                        self.result(), {int(b): int(new_id[b]) for b in used})
        self.last_action = "layout"
        return self.last_change

    # ---- views for drawing ----------------------------------------------------------------------------------
    def slot_values(self) -> np.ndarray:
        """float32 [num_blocks, block_size]: the value in every slot the pool counts as filled, NaN elsewhere."""
        values = self.value_cache[:, :, 0, 0].float().numpy().copy()
        filled = np.arange(self.block_size)[None, :] < self.pool.num_filled[:, None]
        values[~filled] = np.nan
        return values

    def view(self) -> LessonView:
        values = self.slot_values()
        values.setflags(write=False)
        newest = None if self.last_event is None else (self.last_event.physical_block, self.last_event.slot)
        return LessonView(self.num_positions, self.block_size, values, tuple(self.block_roles()),
                          tuple(self.block_table), self.result(), newest, self.sliding_window)

    def block_roles(self) -> list[str]:
        """Per physical block: 'lesson', 'free' or a tenant's name."""
        lesson = set(self.block_table)
        roles = []
        for b in range(self.num_blocks):
            if b in lesson:
                roles.append("lesson")
            elif self.pool.state[b] == BlockState.FREE:
                roles.append("free")
            else:  # the pool's owner id (renamed with the block by BlockPool.permute) names the tenant
                roles.append(_TENANT_NAMES.get(int(self.pool.owner[b]), "?"))
        return roles

    def memory(self) -> dict[str, int]:
        """Bytes of the lesson's sequence: KV held, empty tail slots, table, and a contiguous max-length reservation."""
        live = self.live_blocks
        allocated = len(live) * self.block_size
        held = int(sum(self.pool.num_filled[b] for b in live))  # positions whose K/V the pool still holds
        per_slot = 2 * self.key_cache.element_size()  # a key and a value
        return {
            "filled_slots": held,
            "allocated_slots": allocated,
            "empty_tail_slots": allocated - held,
            "kv_bytes": held * per_slot,
            "tail_bytes": (allocated - held) * per_slot,
            "table_bytes": len(self.block_table) * TABLE_BYTES_PER_ENTRY,
            "released_blocks": len(self.released),
            "contiguous_bytes": self.max_positions * per_slot,
        }


def _toy_sequence(owner: int, num_tokens: int) -> Sequence:
    """A sequence of the toy pool: only its block table and fill matter (its "tokens" are its values)."""
    return Sequence(owner, list(range(1, num_tokens + 1)), max_new_tokens=1, temperature=0.0, seed=0, arrival_step=0)
