"""Figures per tier, without Qt: prompt-token hit rates over time, and how long blocks live, idle and wait to be
reused in each tier (what operators ask vLLM for: block lifetime, idle time before eviction, reuse gap).

Hit rates come from the conversations' ``prompt_token_sources`` (each admission counted once, when it first shows
its sources); the three durations come from block events alone, so a recording or a watched server's pool stream
gives them as far as its events tell. Every duration is in engine steps, unless a clock turns steps into time
(the local engine's Prometheus exporter measures the same durations in seconds, as vLLM's histograms do).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from kvstream.events import BlockEvent, EventKind
from kvstream.views import PoolSnapshot, Status

from .tiers import SOURCES, tier_slots_of

MEASURES = ("lifetime", "idle", "reuse_gap")
MEASURE_TITLES = {"lifetime": "Block lifetime (steps)", "idle": "Idle before eviction (steps)",
                  "reuse_gap": "Reuse gap (steps)"}
MAX_ADMISSIONS = 1 << 16  # admissions remembered as counted
MAX_SAMPLES = 1 << 14  # durations kept per tier and measure (the newest): a histogram of them stays cheap each frame
HISTORY = 1200  # hit-rate samples kept
_NOT_ADMITTED = (Status.WAITING, Status.PREEMPTED)  # still showing the sources of the admission before, if any


class HitRates:
    """Cumulative share of prompt tokens served by each source (device, host, disk) and computed, one sample per
    step seen. An admission is counted once: by (conversation id, arrival step, preemptions, turns), the first time
    its ``prompt_token_sources`` are non-empty and it was admitted (a continued or preempted conversation waits with
    the sources of its admission before, until it is admitted again)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.totals = dict.fromkeys(SOURCES, 0)
        self._counted: dict[tuple, None] = {}
        self.steps: list[int] = []
        self.rates: dict[str, list[float]] = {s: [] for s in SOURCES}  # percent of all prompt tokens so far

    def record(self, snapshot: PoolSnapshot) -> None:
        for info in snapshot.conversations:
            sources = info.prompt_token_sources
            if not sources or info.status in _NOT_ADMITTED:
                continue
            key = (info.conversation_id, info.arrival_step, info.num_preemptions, len(info.turns))
            if key in self._counted:
                continue
            self._counted[key] = None
            if len(self._counted) > MAX_ADMISSIONS:
                self._counted.pop(next(iter(self._counted)))
            for s in SOURCES:
                self.totals[s] += int(sources.get(s, 0))
        total = sum(self.totals.values())
        values = {s: 100.0 * self.totals[s] / total if total else float("nan") for s in SOURCES}
        if self.steps and self.steps[-1] == snapshot.step_id:
            for s in SOURCES:
                self.rates[s][-1] = values[s]
            return
        self.steps.append(int(snapshot.step_id))
        for s in SOURCES:
            self.rates[s].append(values[s])
        if len(self.steps) > HISTORY:
            del self.steps[0]
            for s in SOURCES:
                del self.rates[s][0]

    def series(self, source: str) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.steps, float), np.asarray(self.rates[source], float)


# A followed block or slot is a plain tuple (born, touched, cached): the step (or time) its content arrived, the one
# it was last written, read, shared or released, and whether it is a device block released to the prefix cache (no
# holder, KV kept). A tuple of numbers and a bool is something the cyclic collector stops tracking, where an object
# per slot was not: a 262,144-slot host tier held a quarter of a million objects that every full collection walked
# while the GUI thread waited (docs/performance.md, "The collector").


@dataclass
class Durations:
    """Samples of the three durations per tier ("device", "host", "disk"), newest last."""

    samples: dict[tuple[str, str], deque] = field(default_factory=dict)  # (tier, measure) -> steps, bounded
    on_sample: Callable[[str, str, float], None] | None = None  # told of each duration as it is added

    def add(self, tier: str, measure: str, steps: int | float) -> None:
        kept = self.samples.get((tier, measure))
        if kept is None:
            kept = self.samples[(tier, measure)] = deque(maxlen=MAX_SAMPLES)  # the oldest go, in O(1)
        value = max(steps, 0)
        kept.append(value)
        if self.on_sample is not None:
            self.on_sample(tier, measure, value)

    def of(self, tier: str, measure: str) -> np.ndarray:
        kept = np.asarray(tuple(self.samples.get((tier, measure), ())))
        return kept if kept.dtype.kind == "f" else kept.astype(np.int64)  # steps, or a clock's seconds

    def tiers(self) -> list[str]:
        return sorted({t for t, _ in self.samples}, key=lambda t: (("device", "host", "disk") + (t,)).index(t))


class BlockDurations:
    """Follows every block event and records, per tier:

    - lifetime: steps from when content arrived in a block or slot (allocated, copied, loaded into the device;
      offloaded into a tier) to when it left (freed, evicted, dropped, cleared);
    - idle: steps from its last use to its eviction (device EVICTED, tier DROPPED);
    - reuse gap: steps from its last use to a prefix hit on it (a device block shared by a prefix hit; a tier slot
      loaded back).
    Device blocks are followed through relocations (their ids change, their content does not).

    ``clock`` turns an event's step into the time durations are measured in (None: steps); ``on_sample`` is told
    of every duration as it is recorded (the Prometheus exporter observes them into its histograms)."""

    def __init__(self, clock: Callable[[int], float] | None = None,
                 on_sample: Callable[[str, str, float], None] | None = None):
        self._clock = clock
        self._on_sample = on_sample
        self.clear()

    def clear(self) -> None:
        self.durations = Durations(on_sample=self._on_sample)
        self._device: dict[int, tuple[int, int, bool]] = {}  # block id -> (born, touched, cached)
        self._tiers: dict[str, dict[int, tuple[int, int, bool]]] = {}  # tier -> slot -> the same

    def add_events(self, events: Iterable[BlockEvent]) -> None:
        handlers = self._handlers
        for e in events:
            handler = handlers.get(e.kind)
            if handler is not None:
                handler(self, e)

    def _when(self, e: BlockEvent) -> int | float:
        """The event's step, or its time by the clock."""
        return e.step_id if self._clock is None else self._clock(e.step_id)

    def _end(self, tier: str, slots: dict[int, tuple], key: int, step: int | float, idle: bool) -> None:
        slot = slots.pop(key, None)
        if slot is None:
            return
        self.durations.add(tier, "lifetime", step - slot[0])
        if idle:
            self.durations.add(tier, "idle", step - slot[1])

    # one handler per kind (a table, not a chain of comparisons: a busy pool sends thousands of events a frame)
    def _allocated(self, e: BlockEvent) -> None:
        step, dev = self._when(e), self._device
        for b in e.block_ids:
            dev[b] = (step, step, False)

    def _copied(self, e: BlockEvent) -> None:
        step, dev = self._when(e), self._device
        if e.new_block_ids:
            dev[e.new_block_ids[0]] = (step, step, False)
            old = dev.get(e.block_ids[0]) if e.block_ids else None
            if old is not None:
                dev[e.block_ids[0]] = (old[0], step, old[2])

    def _shared(self, e: BlockEvent) -> None:
        step, dev = self._when(e), self._device
        for b in e.block_ids:
            born, touched, _ = dev.get(b) or (step, step, False)
            if e.reason == "prefix_hit":
                self.durations.add("device", "reuse_gap", step - touched)
            dev[b] = (born, step, False)

    def _touched(self, e: BlockEvent) -> None:  # STORED, RELEASED, CACHED
        step, dev, k = self._when(e), self._device, e.kind
        for b in e.block_ids:
            slot = dev.get(b)
            if slot is not None:
                dev[b] = (slot[0], step, k is EventKind.CACHED or (slot[2] and k is EventKind.STORED))

    def _freed(self, e: BlockEvent) -> None:
        step = self._when(e)
        for b in e.block_ids:
            self._end("device", self._device, b, step, idle=False)

    def _evicted(self, e: BlockEvent) -> None:
        step = self._when(e)
        for b in e.block_ids:
            self._end("device", self._device, b, step, idle=True)

    def _relocated(self, e: BlockEvent) -> None:
        dev = self._device
        self._device = {new: dev[old] for old, new in zip(e.block_ids, e.new_block_ids) if old in dev}

    def _cleared(self, e: BlockEvent) -> None:  # every cached block freed: its content is gone
        dev, step = self._device, self._when(e)
        for b in [b for b, slot in dev.items() if slot[2]]:
            self._end("device", dev, b, step, idle=False)

    def _offloaded(self, e: BlockEvent) -> None:
        step, slots = self._when(e), self._tiers.setdefault(e.tier, {})
        for s in tier_slots_of(e):
            slots[s] = (step, step, False)

    def _loaded(self, e: BlockEvent) -> None:
        step, slots = self._when(e), self._tiers.setdefault(e.tier, {})
        for s in tier_slots_of(e):
            born, touched, cached = slots.get(s) or (step, step, False)
            self.durations.add(e.tier, "reuse_gap", step - touched)
            slots[s] = (born, step, cached)
        for b in e.block_ids:  # the content starts a life in the device pool
            self._device[b] = (step, step, False)

    def _dropped(self, e: BlockEvent) -> None:
        slots, step = self._tiers.setdefault(e.tier, {}), self._when(e)
        for s in tier_slots_of(e):
            self._end(e.tier, slots, s, step, idle=True)

    _handlers = {EventKind.ALLOCATED: _allocated, EventKind.COPIED_ON_WRITE: _copied, EventKind.SHARED: _shared,
                 EventKind.STORED: _touched, EventKind.RELEASED: _touched, EventKind.CACHED: _touched,
                 EventKind.FREED: _freed, EventKind.EVICTED: _evicted, EventKind.RELOCATED: _relocated,
                 EventKind.CLEARED: _cleared, EventKind.OFFLOADED: _offloaded, EventKind.LOADED: _loaded,
                 EventKind.DROPPED: _dropped}


def histogram(samples: np.ndarray, bins: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of durations in steps, integer-aligned bins from 0 to the largest sample (one bin of width 1
    when there are none)."""
    samples = np.asarray(samples, np.int64)
    top = int(samples.max()) + 1 if samples.size else 1
    width = max(1, -(-top // bins))
    edges = np.arange(0, top + width, width, dtype=float)
    if len(edges) < 2:
        edges = np.array([0.0, 1.0])
    counts, edges = np.histogram(samples, edges)
    return counts, edges
