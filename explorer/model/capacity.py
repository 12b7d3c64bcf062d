"""The Capacity dock's model: hit rate against pool size for a trace, for each eviction policy, beside the optimum
(Belady) and the infinite pool; computed off the GUI thread, cancellable, cached per trace (by a digest of its content).

What a point is: an instant replay of the trace (engine.traffic.sweep), requests in trace order one at a time, so a
point depends only on the policy, the capacity and the lower tiers. The live replay in the window is a timed one
(requests decode and hold their blocks meanwhile), so its hit rate, drawn as a marker at the live pool's size, is
what that concurrency leaves of the curve's figure: the marker below the curve is the cost of running requests.

The trace is swept as the live engine replays it: prompts longer than the live model's context are cut to it, as
the replay cuts them (engine.traffic.replay), so the marker and the curves speak of the same requests.

Qt-free: the widget (explorer.widgets.capacity) runs :meth:`CapacityJob.run` on a worker thread and hands each
point back to the GUI thread; the cache and the results are only touched there.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .words import number

DEFAULT_POLICIES = ("lru", "fifo", "s3fifo", "s3lru")  # the online policies drawn unless asked otherwise
BOUND = "belady"  # the offline optimum: the bound an online policy can approach
FAST_PATH = ("lru", "fifo", "belady", "s3fifo", "s3lru")  # policies the sweep's C path replays (without tiers)
POINTS = 24  # capacities per curve on the fast path: log-spaced, so each is about 1.6x the last on a full trace
ENGINE_POINTS = 8  # capacities per curve where the engine itself replays (tiers, radix): each point is a whole run
ENGINE_CHUNK = 64  # requests an engine point replays between two looks at the cancel flag
CACHE_SIZE = 8  # sweeps kept (a trace and a spec each)
MEDIA = ("GPU", "CPU", "STORAGE")  # where hits came from, bottom of the stack first
POLICY_NAMES = {"lru": "LRU", "fifo": "FIFO", "s3fifo": "S3-FIFO", "s3lru": "S3-LRU", "radix": "radix",
                "belady": "Belady", "infinite": "infinite pool"}


class Cancelled(Exception):
    """A sweep stopped because another one replaced it (a new trace was opened)."""


def policy_name(policy: str) -> str:
    return POLICY_NAMES.get(policy, policy)


# ---- what to compute --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CapacitySpec:
    """What the window asks a sweep to cover; with the trace file, the cache's key (the sizes follow from the
    trace, and are worked out on the worker thread with the rest)."""

    policies: tuple[str, ...] = DEFAULT_POLICIES  # online policies, each a curve
    bound: str | None = BOUND  # the offline optimum's curve (None: not drawn)
    max_blocks: int | None = None  # prompts cut to this many blocks (the live model's context); None: not cut
    host_tier_blocks: int = 0  # lower tiers of every point (the live engine's): hits then split by medium
    disk_tier_blocks: int = 0
    points: int = POINTS  # pool sizes per fast-path curve


def spec_for(*, max_blocks: int | None = None, live_policy: str = "lru", host_tier_blocks: int = 0,
             disk_tier_blocks: int = 0, policies=DEFAULT_POLICIES) -> CapacitySpec:
    """The sweep for a live replay: the default policies and the live one (radix, say), the live engine's context
    and tiers."""
    wanted = tuple(dict.fromkeys(tuple(policies) + ((live_policy,) if live_policy != BOUND else ())))
    return CapacitySpec(wanted, BOUND, max_blocks, host_tier_blocks, disk_tier_blocks)


@dataclass(frozen=True)
class CapacityPlan:
    """A spec made concrete for one trace: the pool sizes of every curve."""

    spec: CapacitySpec
    capacities: tuple[int, ...]  # pool sizes in blocks, ascending

    @property
    def policies(self) -> tuple[str, ...]:
        return self.spec.policies

    @property
    def tiers(self) -> bool:
        return bool(self.spec.host_tier_blocks or self.spec.disk_tier_blocks)

    @property
    def all_policies(self) -> tuple[str, ...]:
        """Every curve, the bound first (it frames the others as they arrive)."""
        bound = self.spec.bound
        return ((bound,) if bound else ()) + tuple(p for p in self.policies if p != bound)

    def engine_path(self, policy: str) -> bool:
        """Whether the engine itself replays this policy's points (slower: fewer of them)."""
        return self.tiers or policy not in FAST_PATH

    def capacities_for(self, policy: str) -> tuple[int, ...]:
        if not self.engine_path(policy) or len(self.capacities) <= ENGINE_POINTS:
            return self.capacities
        picks = np.unique(np.round(np.linspace(0, len(self.capacities) - 1, ENGINE_POINTS)).astype(int))
        return tuple(self.capacities[i] for i in picks)

    @property
    def num_points(self) -> int:
        return sum(len(self.capacities_for(p)) for p in self.all_policies) + 1  # + the infinite pool


def capacity_grid(smallest: int, ceiling: int, points: int = POINTS) -> tuple[int, ...]:
    """``points`` pool sizes from ``smallest`` (the least pool that holds the longest prompt) to ``ceiling`` (a pool
    that never evicts), evenly spaced on a log scale, as whole blocks."""
    smallest = max(1, int(smallest))
    ceiling = max(smallest, int(ceiling))
    if ceiling == smallest:
        return (smallest,)
    grid = np.unique(np.round(np.geomspace(smallest, ceiling, points)).astype(np.int64))
    return tuple(int(b) for b in grid)


def plan_for(trace, spec: CapacitySpec) -> CapacityPlan:
    """``spec`` for ``trace`` (already cut to the spec's ``max_blocks``): sizes from the longest prompt to the pool
    that never evicts (every distinct block and one more prompt)."""
    longest = int(np.diff(trace.offsets).max(initial=1))
    distinct = int(trace.nodes[1])
    return CapacityPlan(spec, capacity_grid(longest, distinct + longest, spec.points))


def cut_trace(trace, max_blocks: int | None):
    """``trace`` with every prompt cut to ``max_blocks`` blocks, as a replay on a model of that context cuts it (the
    same trace when nothing is longer)."""
    from engine import Trace
    lengths = np.diff(trace.offsets)
    if max_blocks is None or int(lengths.max(initial=0)) <= max_blocks:
        return trace
    keep = np.minimum(lengths, max_blocks)
    position = np.arange(len(trace.ids)) - np.repeat(trace.offsets[:-1], lengths)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(keep, out=offsets[1:])
    return Trace(trace.path, trace.format, trace.block_size, trace.arrival_s,
                 np.minimum(trace.input_length, keep * trace.block_size), trace.output_length,
                 trace.ids[position < np.repeat(keep, lengths)], offsets, trace.agents, trace.name, trace.notes)


def trace_digest(trace) -> str:
    """What tells one trace from another for the cache: a digest of its content as replayed (block size, arrivals,
    lengths, ids), so the same requests opened from another file or after a copy come from the cache, and an edited
    file is swept again whatever its name and time stamps say."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{trace.format}:{trace.block_size}:{trace.num_requests}".encode())
    for column in (trace.arrival_s, trace.input_length, trace.output_length, trace.offsets, trace.ids):
        h.update(np.ascontiguousarray(column).tobytes())
    return h.hexdigest()


# ---- results ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurvePoint:
    """One policy at one pool size: what the trace's requests hit."""

    policy: str  # an eviction policy, or "infinite"
    blocks: int | None  # the pool's size (None: infinite)
    hit_blocks: int
    total_blocks: int
    by_medium: dict = field(default_factory=dict, hash=False)  # {"GPU": n, "CPU": n, "STORAGE": n}
    misses: dict = field(default_factory=dict, hash=False)  # {"cold": n, "evicted": n, "after_break": n}
    engine: str = "fast path"  # which replayed it: "fast path" or "engine"

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @classmethod
    def from_sweep(cls, point) -> "CurvePoint":
        """From an engine SweepPoint."""
        return cls(point.policy, point.blocks, point.hit_blocks, point.total_blocks,
                   dict(point.hit_blocks_by_medium), dict(point.misses), point.engine)


@dataclass
class CapacityResult:
    """The points a sweep computed so far (filled in point by point on the GUI thread)."""

    plan: CapacityPlan
    points: dict = field(default_factory=dict)  # policy -> [CurvePoint], ascending pool size
    infinite: CurvePoint | None = None
    complete: bool = False

    def add(self, point: CurvePoint) -> None:
        if point.policy == "infinite":
            self.infinite = point
            return
        curve = self.points.setdefault(point.policy, [])
        curve.append(point)
        curve.sort(key=lambda p: p.blocks)

    @property
    def num_points(self) -> int:
        return sum(len(c) for c in self.points.values()) + (self.infinite is not None)

    def curve(self, policy: str) -> tuple[np.ndarray, np.ndarray]:
        """(pool sizes, hit rates) of one policy's points so far."""
        pts = self.points.get(policy, [])
        return (np.array([p.blocks for p in pts], np.float64), np.array([p.hit_rate for p in pts], np.float64))

    def stacked(self, policy: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(pool sizes, {medium: hit rate of that medium and every one below it}): GPU, GPU + CPU, all."""
        pts = self.points.get(policy, [])
        xs = np.array([p.blocks for p in pts], np.float64)
        running = np.zeros(len(pts))
        out = {}
        for medium in MEDIA:
            running = running + np.array([p.by_medium.get(medium, 0) / p.total_blocks if p.total_blocks else 0.0
                                          for p in pts])
            out[medium] = running
        return xs, out

    def point_at(self, policy: str, blocks: int) -> CurvePoint | None:
        return next((p for p in self.points.get(policy, []) if p.blocks == blocks), None)

    def blocks_for(self, policy: str, rate: float) -> int | None:
        """The smallest computed pool size where ``policy`` reaches ``rate`` (None: none of them does)."""
        return next((p.blocks for p in self.points.get(policy, []) if p.hit_rate >= rate), None)


# ---- computing ----------------------------------------------------------------------------------------------------
class CapacityJob:
    """One sweep of ``trace`` under ``spec``, run on a worker thread. :meth:`run` first cuts the trace to the spec's
    context and plans the sizes (``started(plan, description)``), then hands every point to ``emit`` as it is done
    (the infinite pool first, then the bound, then each policy's curve from the smallest pool up), and stops at the
    next point once :meth:`cancel` was called (any thread)."""

    def __init__(self, trace, spec: CapacitySpec):
        self.source, self.spec = trace, spec
        self.trace = None  # the trace as swept (cut to the live model's context), once run() made it
        self.plan: CapacityPlan | None = None
        self._cancel = threading.Event()
        self._sweep = None

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled()

    def prepare(self) -> CapacityPlan:
        """Cut the trace and plan the sizes (once)."""
        if self.plan is None:
            self.trace = cut_trace(self.source, self.spec.max_blocks)
            self.plan = plan_for(self.trace, self.spec)
        return self.plan

    @property
    def sweep(self):
        """The engine's Sweep of the trace, prepared once (its prefix nodes and each lookup's next use)."""
        if self._sweep is None:
            from engine import Sweep
            self.prepare()
            self._sweep = Sweep(self.trace)
        return self._sweep

    def run(self, emit, started=None) -> bool:
        """Compute every point, calling ``emit(CurvePoint)`` for each; False when cancelled on the way."""
        try:
            self._check()
            plan = self.prepare()
            if started is not None:
                started(plan, describe_trace(self.trace, self.source))
            self._check()
            emit(CurvePoint.from_sweep(self.sweep.infinite()))
            for policy in plan.all_policies:
                for blocks in plan.capacities_for(policy):
                    self._check()
                    emit(self.point(policy, blocks))
        except Cancelled:
            return False
        return True

    def point(self, policy: str, blocks: int) -> CurvePoint:
        if not self.prepare().engine_path(policy):
            return CurvePoint.from_sweep(self.sweep.point(policy, blocks))
        return self._engine_point(policy, blocks)

    def _engine_point(self, policy: str, blocks: int) -> CurvePoint:
        """The engine itself (model none) replays the trace instantly: lower tiers and policies the fast path lacks.
        A whole run per point, so the cancel flag is looked at every few requests, not only between points."""
        from engine import EngineConfig, make_replay
        spec = self.spec
        disk_path = None
        if spec.disk_tier_blocks:
            fd, disk_path = tempfile.mkstemp(prefix="capacity-disk-", suffix=".tier")
            os.close(fd)
        try:
            cfg = EngineConfig(model="none", num_blocks=blocks, block_size=16, eviction_policy=policy,
                               host_tier_blocks=spec.host_tier_blocks, disk_tier_blocks=spec.disk_tier_blocks,
                               disk_tier_path=disk_path)
            replay = make_replay(cfg, self.trace, "instant")
            try:
                while not replay.done:
                    self._check()
                    replay.advance(ENGINE_CHUNK)
                totals = replay.totals()
            finally:
                replay.engine.close()
        finally:
            if disk_path is not None and os.path.exists(disk_path):
                os.unlink(disk_path)
        return CurvePoint(policy, blocks, totals["hit_blocks"], totals["total_blocks"],
                          dict(totals["hit_blocks_by_medium"]), dict(totals["misses"]), "engine")

    def blocks_for_rate(self, policy: str, rate: float) -> int | None:
        """The smallest pool (in blocks) at which ``policy`` reaches ``rate``, found by bisection on the fast path
        (None when even the infinite pool falls short). A stack policy such as LRU only gains with size, so this is
        exact for it; FIFO and the S3 queues may dip with size (Belady's anomaly), so for them it is a size that
        reaches the rate, between two that do not."""
        sweep = self.sweep
        if sweep.infinite().hit_rate < rate:
            return None
        lo, hi = sweep.longest, sweep.num_nodes + sweep.longest
        if sweep.point(policy, lo).hit_rate >= rate:
            return lo
        while hi - lo > 1:  # lo misses the rate, hi reaches it
            self._check()
            mid = (lo + hi) // 2
            if sweep.point(policy, mid).hit_rate >= rate:
                hi = mid
            else:
                lo = mid
        return hi


class CapacityCache:
    """Finished sweeps by (trace digest, spec), the most recent kept: opening the same trace again, or restarting the
    live replay at another size, draws its curves at once."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._results: OrderedDict = OrderedDict()

    def get(self, key) -> CapacityResult | None:
        result = self._results.get(key)
        if result is not None:
            self._results.move_to_end(key)
        return result

    def put(self, key, result: CapacityResult) -> None:
        self._results[key] = result
        self._results.move_to_end(key)
        while len(self._results) > self.size:
            self._results.popitem(last=False)

    def __len__(self) -> int:
        return len(self._results)


# ---- the live replay ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveMarker:
    """The live replay at its pool's size: what it hit so far."""

    blocks: int
    policy: str
    hit_blocks: int
    total_blocks: int
    requests_done: int
    requests: int
    mode: str  # "timed" or "instant"

    @property
    def hit_rate(self) -> float | None:
        return self.hit_blocks / self.total_blocks if self.total_blocks else None

    def text(self) -> str:
        rate = self.hit_rate
        what = f"{rate:.1%} of prompt blocks hit" if rate is not None else "no request finished yet"
        how = ("timed replay: requests hold their blocks while they decode" if self.mode == "timed"
               else "instant replay")
        return (f"Live: {policy_name(self.policy)} at {number(self.blocks)} blocks, {what} "
                f"({number(self.requests_done)} of {number(self.requests)} requests; {how})")


def live_marker(replay, num_blocks: int, policy: str) -> LiveMarker | None:
    """The marker of the live replay ``replay`` (a TraceReplay; its ``latest`` totals are replaced whole on the
    engine thread, so reading them here is safe), or None without one."""
    if replay is None:
        return None
    t = replay.latest
    return LiveMarker(num_blocks, policy, int(t["hit_blocks"]), int(t["total_blocks"]), int(t["requests_done"]),
                      int(t["requests"]), replay.mode)


def describe_trace(trace, cut_from=None) -> str:
    """One line about the trace swept: its name, requests, blocks, and prompts cut to the live model's context."""
    text = (f"{trace.name}: {number(trace.num_requests)} requests, {number(trace.num_blocks)} prompt blocks "
            f"({number(int(trace.nodes[1]))} distinct)")
    if cut_from is not None and cut_from is not trace:
        cut = int((np.diff(cut_from.offsets) > np.diff(trace.offsets)).sum())
        longest = int(np.diff(trace.offsets).max(initial=0))
        text += f"; {number(cut)} prompts cut to the model's context ({number(longest)} blocks)"
    return text


def rate_text(rate: float) -> str:
    return "-" if rate is None or math.isnan(rate) else f"{rate:.1%}"
