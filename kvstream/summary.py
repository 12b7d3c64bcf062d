"""The ``--json`` object: one line of facts about a pool, the same whatever the source.

Why here: ``--headless --json`` prints it for the local engine, an attached stream and a replayed recording, and
``--open FILE --headless --json`` must end on exactly the line the recording run printed, so the object is computed
from the snapshot alone, in one place. Keys DESIGN.md fixes: source, step, num_blocks, block_size, used, cached,
free, block_tables, stored_hashes; ``null`` where a source cannot know (a snapshot without hashes has
stored_hashes null). The rest are extras scripts find useful, among them ``misses`` and ``hits_by_medium`` (prompt
blocks over every admission, by miss cause and by hit medium).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .views import HIT_MEDIA, MISS_CAUSES, NO_HASH, BlockState, PoolSnapshot

FIXED_KEYS = ("source", "step", "num_blocks", "block_size", "used", "cached", "free", "block_tables",
              "stored_hashes")  # what DESIGN.md's --json promises, in its order


def json_summary(snapshot: PoolSnapshot | None, *, source: str | None = None) -> dict[str, Any]:
    """The --json object of ``snapshot`` (None: a source with nothing to show yet, everything null).

    ``source`` overrides the snapshot's own source name (an attached pool can say which endpoint it is)."""
    if snapshot is None:
        out = {key: None for key in FIXED_KEYS}
        out["source"] = source
        return out
    counts = np.bincount(np.asarray(snapshot.state, np.int64), minlength=3) if snapshot.num_blocks else [0, 0, 0]
    hashes = snapshot.block_hash
    stored = None
    if hashes is not None:
        held = hashes[hashes != NO_HASH]
        stored = int(np.unique(held).size)
    metrics, memory = snapshot.metrics, snapshot.memory
    return {
        "source": source if source is not None else snapshot.source,
        "step": int(snapshot.step_id),
        "num_blocks": int(snapshot.num_blocks),
        "block_size": int(snapshot.block_size),
        "used": int(counts[BlockState.USED]),
        "cached": int(counts[BlockState.CACHED]),
        "free": int(counts[BlockState.FREE]),
        "block_tables": {str(cid): [int(b) for b in table] for cid, table in snapshot.block_tables.items()},
        "stored_hashes": stored,
        # extras
        "version": int(snapshot.version),
        "model": snapshot.model_name or None,
        "device": snapshot.device or None,
        "conversations": len(snapshot.conversations),
        "running": sum(1 for c in snapshot.conversations if c.status == "running"),
        "filled_slots": None if memory is None else int(memory.num_filled_slots),
        "shared_blocks": int(np.count_nonzero(np.asarray(snapshot.ref_count) > 1)),
        "generated_tokens": int(metrics.num_generated_tokens),
        "preemptions": int(metrics.num_preemptions),
        "evictions": int(metrics.num_evictions),
        **outcome_totals(metrics),
        "stored_hashes_by_medium": stored_by_medium(snapshot, stored),
        "tiers": {name: {"num_blocks": int(view.num_blocks),
                         "used": int(np.count_nonzero(view.state == BlockState.CACHED))}
                  for name, view in getattr(snapshot, "tiers", {}).items()},
    }


def outcome_totals(metrics) -> dict[str, Any]:
    """``misses`` (prompt blocks that missed, by cause) and ``hits_by_medium`` (prompt blocks that hit, by where
    they came from), over every admission the source saw; both null where the source does not count them."""
    totals = metrics.prompt_block_totals
    if totals is None:
        return {"misses": None, "hits_by_medium": None}
    return {"misses": {cause: totals[cause] for cause in MISS_CAUSES},
            "hits_by_medium": {medium: totals[medium] for medium in HIT_MEDIA}}


_TIER_MEDIA = {"host": "CPU", "disk": "STORAGE"}  # a pool's lower tiers by vLLM's medium names


def stored_by_medium(snapshot: PoolSnapshot, stored: int | None) -> dict[str, int | None]:
    """Distinct hashed blocks per medium: the pool itself is "GPU" (whatever its device), its host tier "CPU",
    its disk tier "STORAGE" (0 where the tier is off)."""
    out: dict[str, int | None] = {"GPU": stored, "CPU": 0, "STORAGE": 0}
    for name, view in getattr(snapshot, "tiers", {}).items():
        hashes = view.block_hash[view.block_hash != NO_HASH]
        out[_TIER_MEDIA.get(name, name)] = int(np.unique(hashes).size)
    return out


def fixed_part(summary: dict[str, Any]) -> dict[str, Any]:
    """Only DESIGN.md's keys of a --json object (what a recording run and its replay must agree on)."""
    return {key: summary.get(key) for key in FIXED_KEYS}
