"""The Capacity dock's model without a display (explorer.model.capacity, explorer.model.trace_rows): which points a
sweep computes and in what order, that they are the engine's own figures, cancelling, the cache's key, the pool a
hit rate needs, the live marker, and what the conversations table says of a replay's requests."""
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig, Sweep, make_replay, read_trace
from explorer.model.capacity import (BOUND, DEFAULT_POLICIES, CapacityCache, CapacityJob, CapacityResult,
                                     CapacitySpec, CurvePoint, capacity_grid, cut_trace, live_marker, spec_for,
                                     trace_digest)
from explorer.model.trace_rows import TraceRequests, outcome_cell
from kvstream.views import BlockOutcome

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "resources" / "traces" / "mooncake_excerpt.jsonl"


@pytest.fixture(scope="module")
def excerpt():
    return read_trace(str(EXCERPT))


def write_trace(path, requests):
    """A Mooncake JSONL file of (input blocks, ids) requests, one second apart."""
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 8,
                         "hash_ids": list(ids)}) for i, ids in enumerate(requests)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_grid_runs_from_the_longest_prompt_to_the_pool_that_never_evicts(excerpt):
    grid = capacity_grid(64, 8000, 24)
    assert grid[0] == 64 and grid[-1] == 8000 and list(grid) == sorted(set(grid)) and len(grid) == 24
    assert capacity_grid(10, 10) == (10,)
    job = CapacityJob(excerpt, spec_for(max_blocks=64))
    plan = job.prepare()
    lengths = np.diff(job.trace.offsets)
    assert plan.capacities[0] == lengths.max() == 64
    assert plan.capacities[-1] == job.sweep.num_nodes + 64  # as Sweep.infinite() sizes the pool that never evicts
    assert plan.all_policies == (BOUND,) + DEFAULT_POLICIES  # the bound first, then the default curves


def test_the_live_policy_joins_the_curves_and_the_engine_replays_what_the_fast_path_lacks():
    spec = spec_for(live_policy="radix")
    assert spec.policies == DEFAULT_POLICIES + ("radix",)
    assert spec_for(live_policy="belady").policies == DEFAULT_POLICIES  # the bound is drawn anyway
    tiered = spec_for(host_tier_blocks=100)
    job = CapacityJob(read_trace(str(EXCERPT)), spec)
    plan = job.prepare()
    assert plan.engine_path("radix") and not plan.engine_path("lru")
    assert len(plan.capacities_for("radix")) == 8 < len(plan.capacities_for("lru"))  # a whole run each: fewer
    assert CapacityJob(job.source, tiered).prepare().engine_path("lru")  # tiers: every policy through the engine


def test_the_trace_is_cut_as_the_live_replay_cuts_it(tmp_path):
    """The dock sweeps what the live engine replays: prompts past the model's context cut to it. An instant replay
    on the built-in model (1,024 positions: 64 blocks of 16) gives the hits of the sweep of the cut trace."""
    path = write_trace(tmp_path / "long.jsonl", [range(0, 80), range(100, 110), range(0, 70), range(100, 105),
                                                 range(200, 230), range(0, 66)])
    trace = read_trace(path)
    cut = cut_trace(trace, 64)
    assert np.diff(cut.offsets).tolist() == [64, 10, 64, 5, 30, 64]
    assert cut.ids[:64].tolist() == list(range(64)) and cut.input_length[0] == 64 * 512
    assert cut_trace(trace, 100) is trace  # nothing longer: the same trace
    replay = make_replay(EngineConfig(model="builtin", num_blocks=200, block_size=16), trace, "instant")
    replay.run()
    swept = Sweep(cut).point("lru", 200)
    assert replay.max_blocks == 64
    assert (replay.totals()["hit_blocks"], replay.totals()["total_blocks"]) == (swept.hit_blocks, swept.total_blocks)


def test_a_sweep_hands_over_the_engines_own_figures_point_by_point(excerpt):
    spec = CapacitySpec(policies=("lru", "s3lru"), max_blocks=64, points=5)
    job = CapacityJob(excerpt, spec)
    points, plans = [], []
    assert job.run(points.append, lambda plan, text: plans.append((plan, text)))
    plan = plans[0][0]
    assert "mooncake_excerpt.jsonl: 400 requests" in plans[0][1] and "cut to the model's context" in plans[0][1]
    assert points[0].policy == "infinite" and points[0].blocks is None
    order = [(p.policy, p.blocks) for p in points[1:]]
    assert order == [(policy, b) for policy in ("belady", "lru", "s3lru") for b in plan.capacities]
    sweep = Sweep(cut_trace(excerpt, 64))
    for p in points[1:]:
        want = sweep.point(p.policy, p.blocks)
        assert (p.hit_blocks, p.total_blocks, p.misses) == (want.hit_blocks, want.total_blocks, want.misses)
    assert points[0].hit_blocks == sweep.infinite().hit_blocks
    result = CapacityResult(plan)
    for p in reversed(points):  # whatever order they arrive in, each curve reads by pool size
        result.add(p)
    xs, ys = result.curve("lru")
    assert xs.tolist() == list(plan.capacities) and (np.diff(ys) >= 0).all()  # LRU only gains with size
    assert result.infinite.hit_rate >= ys.max()
    assert result.num_points == plan.num_points == 1 + 3 * len(plan.capacities)


def test_cancelling_stops_the_sweep_at_the_next_point(excerpt):
    job = CapacityJob(excerpt, CapacitySpec(max_blocks=64, points=6))
    got = []

    def emit(point):
        got.append(point)
        if len(got) == 3:
            job.cancel()
    assert job.run(emit) is False
    assert len(got) == 3 and job.cancelled


def test_cancelling_from_another_thread_ends_an_engine_sweep(excerpt):
    """With a host tier every point is a whole engine run; the thread that runs the sweep ends soon after another
    thread cancels it (the flag is looked at between requests, not only between points)."""
    job = CapacityJob(excerpt, CapacitySpec(policies=("lru",), max_blocks=64, host_tier_blocks=200, points=4))
    first = threading.Event()
    got, outcome = [], []

    def emit(point):
        got.append(point)
        first.set()
    thread = threading.Thread(target=lambda: outcome.append(job.run(emit)))
    thread.start()
    assert first.wait(120)
    job.cancel()
    thread.join(120)
    assert not thread.is_alive() and outcome == [False]
    assert len(got) < job.plan.num_points


def test_with_a_host_tier_the_hits_split_by_medium_as_the_engines_sweep_says(excerpt):
    trace = excerpt.slice(0, 200)
    job = CapacityJob(trace, CapacitySpec(policies=("lru",), bound=None, max_blocks=64, host_tier_blocks=4000))
    point = job.point("lru", 100)
    want = Sweep(cut_trace(trace, 64)).point("lru", 100, host_tier_blocks=4000)
    assert point.engine == "engine"
    assert (point.hit_blocks, point.total_blocks) == (want.hit_blocks, want.total_blocks)
    assert point.by_medium == want.hit_blocks_by_medium and sum(point.by_medium.values()) == point.hit_blocks
    assert point.by_medium["CPU"] > 0  # the small device pool lost blocks the host tier kept
    result = CapacityResult(job.prepare())
    result.add(point)
    xs, stacks = result.stacked("lru")
    assert stacks["STORAGE"][0] == pytest.approx(point.hit_rate)
    assert stacks["GPU"][0] == pytest.approx(point.by_medium["GPU"] / point.total_blocks)


def test_the_pool_for_a_hit_rate_is_the_smallest_that_reaches_it(excerpt):
    job = CapacityJob(excerpt, spec_for(max_blocks=64))
    sweep = job.sweep
    for policy, rate in (("lru", 0.06), ("belady", 0.10)):
        blocks = job.blocks_for_rate(policy, rate)
        assert sweep.point(policy, blocks).hit_rate >= rate > sweep.point(policy, blocks - 1).hit_rate
    assert job.blocks_for_rate("lru", 0.99) is None  # beyond the infinite pool


def test_the_cache_keeps_the_newest_sweeps_and_knows_a_trace_by_its_content(tmp_path):
    cache = CapacityCache(size=2)
    result = CapacityResult(None)
    for key in ("a", "b", "c"):
        cache.put(key, result)
    assert cache.get("a") is None and cache.get("b") is result and len(cache) == 2
    cache.put("d", result)  # "b" was read after "c": "c" goes
    assert cache.get("c") is None and cache.get("b") is result
    path = write_trace(tmp_path / "t.jsonl", [range(3), range(3)])
    before = trace_digest(read_trace(path))
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes((tmp_path / "t.jsonl").read_bytes())
    assert trace_digest(read_trace(str(copy))) == before  # the same requests, whatever the file
    write_trace(tmp_path / "t.jsonl", [range(3), range(4)])
    assert trace_digest(read_trace(path)) != before  # an edited id
    lines = (tmp_path / "t.jsonl").read_text().replace('"output_length": 8', '"output_length": 9', 1)
    (tmp_path / "t.jsonl").write_text(lines)
    assert trace_digest(read_trace(path)) not in (before, trace_digest(read_trace(str(copy))))  # an edited length


def test_the_live_marker_reads_the_replays_totals(tmp_path):
    path = write_trace(tmp_path / "m.jsonl", [range(4), range(4), range(10, 12)])
    replay = make_replay(EngineConfig(model="none", num_blocks=50, block_size=16), read_trace(path), "instant")
    assert live_marker(replay, 50, "lru").hit_rate is None
    replay.run()
    marker = live_marker(replay, 50, "lru")
    assert (marker.hit_blocks, marker.total_blocks, marker.requests_done, marker.requests) == (4, 10, 3, 3)
    assert marker.text().startswith("Live: LRU at 50 blocks, 40.0% of prompt blocks hit (3 of 3 requests")
    assert live_marker(None, 50, "lru") is None


def test_the_table_counts_a_prompts_blocks_and_names_the_trace_request(tmp_path):
    kinds = ["device"] * 3 + ["host", "after_break", "evicted", "cold", "cold"]
    outcomes = [BlockOutcome(i, kind) for i, kind in enumerate(kinds)]
    assert outcome_cell(outcomes) == "3 device · 1 host | 2 cold · 1 evicted · 1 after a miss"
    assert outcome_cell([BlockOutcome(0, "cold")]) == "no hits | 1 cold" and outcome_cell(()) == ""
    path = write_trace(tmp_path / "r.jsonl", [range(4), range(4), range(10, 12)])
    replay = make_replay(EngineConfig(model="none", num_blocks=50, block_size=16), read_trace(path), "instant")
    replay.engine.add_prefill(list(range(1, 17)))  # a conversation that is no request of the trace
    replay.engine.run_until_idle()  # an instant replay sends its next request once the engine is idle
    requests = TraceRequests(replay)
    replay.run()
    ids = [o.conversation_id for o in replay.outcomes]
    assert [requests.index(c) for c in ids] == [0, 1, 2] and requests.index(0) is None
    assert requests.cell(ids[2]) == "#2 at 2.0 s: 1,024 in, 8 out" and requests.cell(0) == ""
    info = replay.engine.conversation(ids[1])
    assert outcome_cell(info.prompt_block_outcomes) == "4 device"
