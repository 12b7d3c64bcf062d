"""KV cache groups as the window shows them: which group each device block serves, and what a sliding window saves.

A model whose layers differ (full attention and sliding window) pages each kind as its own KV cache group, all
drawing from the one device pool (vLLM v1's hybrid allocator). The snapshot lists the groups
(``PoolSnapshot.kv_cache_groups``) and one set of block tables per group (``group_block_tables``, -1 where a window
released a block). Which group a block belongs to is read off those tables in ONE place, :func:`block_groups`, so
that when a source sends a per-block group array the change is made here only. No Qt: the grid's group colour mode,
its group filter, the conversation detail and the memory readout all ask this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from kvstream.rules import raw_hash
from kvstream.views import BlockState, KVCacheGroupInfo, PoolSnapshot

HOLE = -1  # a table entry whose block the sliding window released (vLLM's null block)
UNKNOWN_GROUP = -1  # a block no table names now (free, or cached: its group is not said by the tables)
FULL_ATTENTION = KVCacheGroupInfo("full_attention", None, ())  # what a snapshot without groups has


def groups_of(snapshot: PoolSnapshot) -> tuple[KVCacheGroupInfo, ...]:
    """The snapshot's KV cache groups; one full-attention group when it names none."""
    return tuple(snapshot.kv_cache_groups) or (FULL_ATTENTION,)


def tables_of(snapshot: PoolSnapshot) -> tuple[Mapping[int, tuple[int, ...]], ...]:
    """One {conversation id: table} per group; group 0's is ``block_tables`` when the source sent no group tables."""
    return tuple(snapshot.group_block_tables) or (snapshot.block_tables,)


def block_groups(snapshot: PoolSnapshot) -> np.ndarray:
    """int8 per device block: the KV cache group whose tables name it, or -1 (free, or cached and named by no
    table). With one group every block that holds KV is group 0's. A source's own per-block array
    (``block_group``, when a source sends one) wins over the tables."""
    sent = getattr(snapshot, "block_group", None)
    if sent is not None:
        return np.asarray(sent, np.int8)
    out = np.full(snapshot.num_blocks, UNKNOWN_GROUP, np.int8)
    groups = tables_of(snapshot)
    if len(groups) == 1:
        out[np.asarray(snapshot.state) != BlockState.FREE] = 0
        return out
    for g, tables in enumerate(groups):
        ids = [b for table in tables.values() for b in table if b >= 0]
        if ids:
            out[np.asarray(ids, np.int64)] = g
    return out


def group_name(group: KVCacheGroupInfo, index: int) -> str:
    """'group 0: full attention (layers 0, 2)', 'group 1: sliding window 4 (layers 1, 3)'."""
    kind = (f"sliding window {group.sliding_window}" if group.kind == "sliding_window" and group.sliding_window
            else group.kind.replace("_", " "))
    layers = f" (layers {', '.join(map(str, group.layers))})" if group.layers else ""
    return f"group {index}: {kind}{layers}"


def conversation_group_tables(snapshot: PoolSnapshot, conversation_id: int) -> tuple[tuple[int, ...], ...]:
    """One table per group for one conversation: its own ``group_block_tables`` when it has them, else the
    snapshot's tables per group (empty tuples where it holds nothing)."""
    info = snapshot.conversation(conversation_id)
    own = tuple(info.group_block_tables or ()) if info is not None else ()
    if own:
        return own
    return tuple(tuple(t.get(conversation_id, ())) for t in tables_of(snapshot))


@dataclass(frozen=True)
class GroupCount:
    """What one KV cache group holds in the device pool now."""

    index: int
    group: KVCacheGroupInfo
    blocks: int  # distinct device blocks its tables name
    holes: int  # table entries a sliding window released (-1): blocks full attention would still hold

    @property
    def full_attention_blocks(self) -> int:
        """What the same tables would hold if every layer of the group read every position."""
        return self.blocks + self.holes


def group_counts(snapshot: PoolSnapshot) -> list[GroupCount]:
    """Blocks in use and released-by-window entries per group: a block shared by several tables counts once, a hole
    once per table entry (an upper bound when the released blocks were shared: tables do not say what a hole held)."""
    out = []
    for g, (group, tables) in enumerate(zip(groups_of(snapshot), tables_of(snapshot))):
        used: set[int] = set()
        holes = 0
        for table in tables.values():
            for b in table:
                if b < 0:
                    holes += 1
                else:
                    used.add(b)
        out.append(GroupCount(g, group, len(used), holes))
    return out


def window_saving_text(snapshot: PoolSnapshot) -> str:
    """The memory readout's group lines: blocks per group, and what the windows saved against full attention
    ("" for a one-group pool: nothing to tell apart)."""
    groups = groups_of(snapshot)
    if len(groups) < 2 and groups[0].kind != "sliding_window":
        return ""
    counts = group_counts(snapshot)
    lines = [f"{group_name(c.group, c.index)}: {c.blocks:,} block{'s' if c.blocks != 1 else ''} in use"
             + (f", {c.holes:,} released by the window" if c.holes else "") for c in counts]
    held = sum(c.blocks for c in counts)
    full = sum(c.full_attention_blocks for c in counts)
    saved = full - held
    if full:
        lines.append(f"the window saved {saved:,} block{'s' if saved != 1 else ''} against full attention "
                     f"({held:,} held, {full:,} with every layer reading everything: {100 * saved / full:.0f}% less)")
    return "\n".join(lines)


def hash_words(snapshot: PoolSnapshot | None, key: int, group: int | None) -> str:
    """A block's prefix hash as the event log and KV events name it: 16 hex digits, then its KV cache group when the
    pool has several ("…, group 1").

    The project's engine keys a group's blocks (in the pool and in its tiers) by the group's cache key
    (:func:`kvstream.rules.group_key`: the hash itself for group 0), while its events carry the plain hash and the
    group, as vLLM's do; vLLM's tap sends the plain hash already (``source`` "vllm"), and so does any other source:
    only a snapshot of the project's engine (``source`` "engine", live, attached or recorded) has its keys turned
    back. Shown as the key, a group-1 block's "hash" would match no line of the event log. ``group`` None: not known
    (then the key is shown as what it is)."""
    key = int(key) & 0xFFFF_FFFF_FFFF_FFFF
    if snapshot is None or len(groups_of(snapshot)) <= 1:
        return f"{key:016x}"
    if group is None or group < 0:
        return f"{key:016x} (cache key; its KV cache group is not known here)"
    plain = raw_hash(key, group) if snapshot.source == "engine" else key
    return f"{plain:016x}, group {group}"


def block_group_of(snapshot: PoolSnapshot | None, block_id: int) -> int | None:
    """The KV cache group of device block ``block_id`` (None where the snapshot cannot say)."""
    if snapshot is None or not 0 <= block_id < snapshot.num_blocks:
        return None
    g = int(block_groups(snapshot)[block_id])
    return g if g >= 0 else None
