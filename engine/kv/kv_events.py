"""The engine's block events, published as vLLM-format KV events (what KV-aware routers read).

Only the changes a content index can use cross the wire, as vLLM sends them: a STORED event (full blocks got their
prefix hash) becomes ``BlockStored`` with the parent hash, the tokens and the block size; an EVICTED one (cached
blocks lost their KV) becomes ``BlockRemoved``; a reset of the prefix cache becomes ``AllBlocksCleared``. One batch
per engine step that produced any of them, as vLLM sends one per scheduler step: a committed operation that ran
several steps (``generate``) is split by step id, in order. Nothing is sent before the operation commits, so a
rolled-back one sends nothing. The medium is "GPU", vLLM's name for an engine's own block pool
(on any device). Hashes are the engine's uint64 prefix hashes, as vLLM sends integer hashes by default. The lower
tiers (engine/kv/tiers.py) publish as vLLM's offloading connector does in its self-describing mode: a block kept in the
host tier is a full ``BlockStored`` on medium "CPU", on the disk tier "STORAGE", and one let go a ``BlockRemoved``.
"""
from __future__ import annotations

from typing import Sequence

from kvstream.curve import CurveError
from kvstream.events import BlockEvent, EventKind
from kvstream.kv_events.codec import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstream.kv_events.publisher import KVEventError, KVEventPublisher

from ..config import EngineConfig
from ..errors import EngineError


def to_kv_events(events: Sequence[BlockEvent], block_size: int, groups: Sequence | None = None) -> list[KVEvent]:
    """``groups``: the engine's KV cache groups (kvstream.views.KVCacheGroupInfo); as vLLM 0.34 does, every
    BlockStored names its group (group_idx) with that group's spec kind and window, and every BlockRemoved its
    group. Hashes are the plain prefix hashes (the group rides beside them, not in them). None: no group fields."""
    out: list[KVEvent] = []
    for e in events:
        if e.kind == EventKind.STORED:
            spec = {} if groups is None else {
                "group_idx": e.group, "kv_cache_spec_kind": groups[e.group].kind,
                "kv_cache_spec_sliding_window": groups[e.group].sliding_window}
            out.append(BlockStored(block_hashes=tuple(e.block_hashes), parent_block_hash=e.parent_hash,
                                   token_ids=tuple(e.token_ids), block_size=block_size, lora_id=None,
                                   medium=MEDIUM_GPU, lora_name=None, **spec))
        elif e.kind == EventKind.EVICTED:
            out.append(BlockRemoved(block_hashes=tuple(e.block_hashes), medium=MEDIUM_GPU,
                                    group_idx=None if groups is None else e.group))
        elif e.kind == EventKind.CLEARED:
            out.append(AllBlocksCleared())
        elif e.kind in (EventKind.OFFLOADED, EventKind.DROPPED):
            out.append(_tier_kv_event(e, block_size, groups))
    return out


MEDIUM_STORAGE = "STORAGE"  # vLLM's medium for a disk tier (SGLang says "DISK")
TIER_MEDIUM = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}  # the lower tiers as vLLM's offloading connector names them


def _tier_kv_event(e: BlockEvent, block_size: int, groups: Sequence | None = None) -> KVEvent:
    """A block kept in (OFFLOADED) or let go by (DROPPED) a lower tier, as vLLM's offloading connector reports it
    in its self-describing mode: a full ``BlockStored`` (tokens, parent, block size) on medium "CPU" / "STORAGE",
    or a ``BlockRemoved`` there. A load back into the device needs no event of its own: the device block's STORED
    (medium "GPU") follows it."""
    medium = TIER_MEDIUM[e.tier]
    if e.kind == EventKind.OFFLOADED:
        spec = {} if groups is None else {
            "group_idx": e.group, "kv_cache_spec_kind": groups[e.group].kind,
            "kv_cache_spec_sliding_window": groups[e.group].sliding_window}
        return BlockStored(block_hashes=tuple(e.block_hashes), parent_block_hash=e.parent_hash,
                           token_ids=tuple(e.token_ids), block_size=block_size, lora_id=None, medium=medium,
                           lora_name=None, **spec)
    return BlockRemoved(block_hashes=tuple(e.block_hashes), medium=medium,
                        group_idx=None if groups is None else e.group)


def split_by_step(events: Sequence[BlockEvent]) -> list[list[BlockEvent]]:
    """``events`` in runs of equal step id, in order (one run per step: step ids only grow inside an operation)."""
    runs: list[list[BlockEvent]] = []
    for e in events:
        if runs and runs[-1][-1].step_id == e.step_id:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


class KVEventsOut:
    """Owns the ZMQ publisher of one engine (EngineConfig.kv_events_endpoint and friends)."""

    def __init__(self, cfg: EngineConfig, groups: Sequence | None = None):
        try:
            self.publisher = KVEventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                              cfg.kv_events_topic, curve=cfg.kv_events_curve)
        except (KVEventError, CurveError) as exc:
            raise EngineError(str(exc)) from None
        self.block_size = cfg.block_size
        self.groups = groups  # the engine's KV cache groups (each event names its own)
        self.endpoint = self.publisher.endpoint  # as bound (a port of 0 resolved)
        self.replay_endpoint = self.publisher.replay_endpoint

    def publish(self, events: Sequence[BlockEvent]) -> list[int]:
        """One batch per step among ``events`` (oldest first) that has KV events; returns their sequence numbers.

        Every batch is tried, in order, even after one fails: the publisher gives a refused batch its sequence
        number and keeps it for replay, so a watcher sees the gap and fetches it, in order, through the replay
        socket. Raises :class:`KVEventError` afterwards, saying how many of the step's batches were refused."""
        seqs: list[int] = []
        failures: list[str] = []
        batches = [b for b in (to_kv_events(step, self.block_size, self.groups) for step in split_by_step(events))
                   if b]
        for i, kv_events in enumerate(batches):
            try:
                seqs.append(self.publisher.publish(kv_events))
            except Exception as exc:
                failures.append(f"batch {i + 1} of {len(batches)}: {type(exc).__name__}: {exc}")
        if failures:
            raise KVEventError(f"{len(failures)} of {len(batches)} KV-event batches were not sent (a watcher "
                               f"recovers them through the replay socket): {failures[0]}")
        return seqs

    def close(self) -> None:
        self.publisher.close()
