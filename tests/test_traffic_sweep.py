"""Capacity sweeps of the shipped Mooncake trace: the reference figures of ../shared/traces/README.md exactly, the
fast path held to the engine's own pool eviction by eviction, and the command line's output."""
import json
import threading
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig
from engine.traffic import fastpath
from engine.traffic.replay import make_replay, trace_future
from engine.traffic.sweep import Sweep, SweepError, blocks_for_bytes, kv_bytes_per_token, parse_capacity
from engine.traffic.trace import read_trace
from kvstream.events import EventKind

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation.jsonl"
TESTER = TRACES / "kvcache_tester_trace_0010.json"
needs_traces = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the shipped traces are not at {TRACES}")

# ../shared/traces/README.md: instant replay, one id = one block
REFERENCE = {("lru", 5000): 32260, ("lru", 10000): 61046, ("lru", 20000): 83035, ("lru", 50000): 102290,
             ("fifo", 5000): 30505, ("fifo", 10000): 52338, ("fifo", 20000): 74115, ("fifo", 50000): 96231}


@pytest.fixture(scope="module")
def mooncake():
    return read_trace(str(MOONCAKE))


@pytest.fixture(scope="module")
def sweep(mooncake):
    return Sweep(mooncake)


@needs_traces
def test_lru_and_fifo_give_the_reference_figures_and_every_cold_miss(sweep):
    assert fastpath.library() is not None, fastpath.why_not()
    for (policy, blocks), hits in REFERENCE.items():
        point = sweep.point(policy, blocks)
        assert (point.hit_blocks, point.total_blocks) == (hits, 288500), (policy, blocks)
        assert point.misses["cold"] == 182790
        assert point.hit_blocks + sum(point.misses.values()) == 288500
    infinite = sweep.infinite()
    assert (infinite.hit_blocks, infinite.misses) == (105710, {"cold": 182790, "evicted": 0, "after_break": 0})


@needs_traces
def test_belady_is_the_bound_and_lru_is_far_below_it(sweep):
    """Belady (furthest next use, a request holding all its blocks while it runs) at 5,000 blocks: 97,995 hits,
    33.97%; no online policy may beat it, and the infinite pool caps it."""
    belady = sweep.point("belady", 5000)
    assert belady.hit_blocks == 97995
    assert round(belady.hit_rate, 3) == 0.340
    for policy in ("lru", "fifo"):
        assert sweep.point(policy, 5000).hit_blocks < belady.hit_blocks / 3
    assert sweep.point("belady", 10000).hit_blocks == sweep.infinite().hit_blocks


@needs_traces
def test_s3lru_closes_part_of_the_gap_online(sweep):
    """The online policy this project found best on the shipped trace (docs/traffic.md): more than 3 points above
    LRU at 5,000 blocks, and above it at 10,000 and 20,000; S3-FIFO gains at 5,000 but loses at 10,000."""
    s3lru = {n: sweep.point("s3lru", n).hit_blocks for n in (5000, 10000, 20000)}
    assert s3lru == {5000: 42092, 10000: 64166, 20000: 85359}
    assert s3lru[5000] - REFERENCE["lru", 5000] > 0.03 * 288500
    assert s3lru[10000] > REFERENCE["lru", 10000] and s3lru[20000] > REFERENCE["lru", 20000]
    s3fifo = {n: sweep.point("s3fifo", n).hit_blocks for n in (5000, 10000)}
    assert s3fifo[5000] > REFERENCE["lru", 5000] and s3fifo[10000] < REFERENCE["lru", 10000]


@needs_traces
def test_token_figures_weigh_the_partial_last_block(mooncake, sweep):
    point = sweep.point("lru", 5000)
    assert point.total_tokens == int(mooncake.input_length.sum()) == 144793823
    assert point.hit_tokens == 16505817  # hit blocks weighed in tokens: 512, less for a request's partial last
    assert point.prefill_speedup == pytest.approx(1 / (1 - point.hit_tokens / point.total_tokens))


@needs_traces
def test_warmup_counts_only_the_last_requests(mooncake):
    warm = Sweep(mooncake, warmup=0.5)
    counted = mooncake.num_requests - mooncake.num_requests // 2
    point = warm.point("lru", 5000)
    assert point.requests == counted
    assert point.total_blocks == int(mooncake.offsets[-1] - mooncake.offsets[mooncake.num_requests // 2])
    full = Sweep(mooncake).point("lru", 5000)
    assert 0 < point.hit_blocks < full.hit_blocks


def _engine_evictions(trace, policy, blocks):
    replay = make_replay(EngineConfig(model="none", num_blocks=blocks, block_size=4, eviction_policy=policy), trace)
    keys = trace_future(trace, replay.synth, replay._dense, replay.max_blocks)._keys
    log, hits = [], []
    while not replay.done:
        index = replay.next_index
        replay.advance(1)
        for event in replay.engine.take_events():
            if event.kind == EventKind.EVICTED:
                log += [(index, b, keys[h]) for b, h in zip(event.block_ids, event.block_hashes)]
    hits = [o.hit_blocks for o in sorted(replay.outcomes, key=lambda o: o.index)]
    return log, hits, replay.totals()


@needs_traces
@pytest.mark.parametrize("policy", sorted(fastpath.POLICIES))
def test_the_fast_path_makes_the_engines_evictions(mooncake, policy):
    """The same trace through the engine (model none) and through csrc/replay.c: every eviction equal, in order
    (request, physical block, content), and so every request's hits and every miss's cause."""
    trace = mooncake.slice(0, 1500)
    sweep = Sweep(trace)
    engine_log, engine_hits, totals = _engine_evictions(trace, policy, 600)
    hits, outcome, log, count = fastpath.replay(sweep.offsets, sweep.nodes, sweep.num_nodes, sweep.next_pos, 600,
                                                policy, log_evictions=10**6)
    assert count == len(engine_log) > 1000
    assert [tuple(row) for row in log.tolist()] == engine_log
    assert hits.tolist() == engine_hits
    point = sweep.point(policy, 600)
    assert totals["misses"] == point.misses and totals["hit_blocks"] == point.hit_blocks


@needs_traces
@pytest.mark.parametrize("policy", ["radix"])
def test_policies_without_a_fast_path_run_the_engine(mooncake, policy):
    trace = mooncake.slice(0, 600)
    point = Sweep(trace).point(policy, 400)
    lru = Sweep(trace).point("lru", 400)
    assert point.engine == "engine" and point.total_blocks == lru.total_blocks
    assert point.misses["cold"] == lru.misses["cold"]
    assert point.hit_blocks + sum(point.misses.values()) == point.total_blocks


def test_capacities_in_blocks_and_bytes(tmp_path):
    assert parse_capacity("5000") == (5000, None)
    assert parse_capacity("8GiB") == (None, 8 << 30)
    assert parse_capacity("1.5 GB") == (None, 1_500_000_000)
    for bad in ("", "0", "-3", "12.5", "5 parsecs", "GiB"):
        with pytest.raises(SweepError):
            parse_capacity(bad)
    config = tmp_path / "config.json"  # Llama-3.1-8B's shape: 128 KiB of K/V a token in bfloat16
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    per_token, _ = kv_bytes_per_token(str(config), "auto")
    assert per_token == 128 << 10
    assert kv_bytes_per_token(str(config), "fp8")[0] == 64 << 10  # fp8 halves it: twice the blocks
    assert blocks_for_bytes(64 << 30, per_token, 512) == 1024
    config.write_text(json.dumps({"num_hidden_layers": "many"}))
    with pytest.raises(SweepError, match="num_hidden_layers"):
        kv_bytes_per_token(str(config), "auto")


def _main(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@needs_traces
def test_the_command_line_prints_one_json_object_per_policy_and_capacity():
    done = _main("--trace", str(MOONCAKE), "--sweep", "5000,10000", "--policies", "lru,fifo", "--headless", "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(x["policy"], x["blocks"]) for x in lines] == [("lru", 5000), ("lru", 10000), ("fifo", 5000),
                                                          ("fifo", 10000), ("infinite", None)]
    first = lines[0]
    assert (first["hit_blocks"], first["total_blocks"], first["requests"]) == (32260, 288500, 12031)
    assert first["hit_rate"] == round(32260 / 288500, 6) and first["misses"]["cold"] == 182790
    for key in ("hit_tokens", "total_tokens", "misses", "hit_blocks_by_medium"):
        assert key in first


@needs_traces
def test_the_command_line_sweeps_bytes_for_a_model_shape(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    done = _main("--trace", str(MOONCAKE), "--sweep", "320GiB", "--policies", "lru", "--kv-shape", str(config),
                 "--headless", "--json")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout.splitlines()[0])
    assert first["blocks"] == 5120 and first["capacity"] == "320GiB"  # 320 GiB / (128 KiB x 512 tokens)


@pytest.mark.parametrize("args, message", [
    (["--sweep", "5000", "--headless"], "--sweep goes with --trace"),
    (["--trace", "TRACE", "--sweep", "5000"], "add --headless"),
    (["--trace", "TRACE", "--sweep", "8GiB", "--headless"], "needs --kv-shape"),
    (["--trace", "TRACE", "--sweep", "lots", "--headless"], "a capacity is"),
    (["--trace", "TRACE", "--sweep", "5000", "--policies", "lru,mru", "--headless"], "mru is not a policy"),
    (["--trace", "TRACE", "--sweep", "5000", "--warmup", "1", "--headless"], "--warmup"),
    (["--policies", "lru"], "--policies goes with --sweep"),
    (["--eviction-policy", "belady", "--headless"], "only a trace replay"),
])
def test_sweep_flags_that_cannot_work_are_one_line_and_exit_2(args, message, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    done = _main(*[str(trace) if a == "TRACE" else a for a in args], timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@needs_traces
def test_the_live_engine_replaying_instantly_ends_with_the_sweeps_hits(tmp_path):
    """--model none --replay instant on the engine thread (the runner feeding the replay between steps): its last
    --json line's trace figures are the sweep's for the same trace and pool size."""
    excerpt = tmp_path / "excerpt.jsonl"
    with open(MOONCAKE) as f:
        excerpt.write_text("".join(next(f) for _ in range(1200)))
    live = _main("--model", "none", "--trace", str(excerpt), "--replay", "instant", "--num-blocks", "500",
                 "--headless", "--json", timeout=600)
    assert live.returncode == 0, live.stderr
    lines = [json.loads(line) for line in live.stdout.splitlines()]
    last = lines[-1]["trace"]
    swept = Sweep(read_trace(str(excerpt))).point("lru", 500)
    assert last["requests_done"] == last["requests"] == 1200
    assert (last["hit_blocks"], last["total_blocks"], last["misses"]) == \
        (swept.hit_blocks, swept.total_blocks, swept.misses)
    assert lines[-1]["num_blocks"] == 500 and all("trace" in line for line in lines)


def test_a_timed_replay_cuts_prompts_to_leave_its_first_output_a_position(tmp_path):
    """A prompt longer than the model's context is cut to it; a timed request then still needs one position for
    its first output (cut to the whole context, the built-in model's 1,024 positions, it was refused mid-replay:
    'would reach 1025 tokens'). An instant one generates nothing and keeps the whole context."""
    path = tmp_path / "long.jsonl"
    lines = [{"timestamp": 0, "input_length": 512 * 80, "output_length": 4, "hash_ids": list(range(80))},
             {"timestamp": 0, "input_length": 512 * 3, "output_length": 4, "hash_ids": [0, 1, 2]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trace = read_trace(str(path))
    cfg = EngineConfig(model="builtin", num_blocks=256, block_size=16)  # 1,024 positions: 64 blocks
    timed = make_replay(cfg, trace, "timed", step_seconds=1.0)
    timed.run()
    assert timed.max_blocks == 63 and timed.num_cut == 1
    assert [timed.engine.conversation(o.conversation_id).finish_reason is not None for o in timed.outcomes] == \
        [True, True]
    # the second prompt is held whole, but a generating request recomputes its last token (and so its last block)
    assert timed.totals()["total_blocks"] == 63 + 3 and timed.totals()["hit_blocks"] == 2


def test_an_instant_replay_on_a_real_model_takes_a_prompt_held_whole_without_computing(tmp_path):
    """A prefill-only request whose prompt the pool holds whole computes no token: a step of only such requests
    runs no forward (on the built-in model it passed an empty batch to the native decode and failed), and its
    figures are the sweep's."""
    path = tmp_path / "again.jsonl"
    lines = [{"timestamp": 0, "input_length": 512 * 80, "output_length": 4, "hash_ids": list(range(80))},
             {"timestamp": 1, "input_length": 512 * 3, "output_length": 4, "hash_ids": [0, 1, 2]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trace = read_trace(str(path))
    instant = make_replay(EngineConfig(model="builtin", num_blocks=256, block_size=16), trace, "instant")
    instant.run()
    assert instant.max_blocks == 64 and instant.num_cut == 1
    assert (instant.totals()["hit_blocks"], instant.totals()["total_blocks"]) == (3, 64 + 3)
    assert [o.block_outcomes for o in instant.outcomes][1] == ("device",) * 3


def test_an_instant_replay_runs_to_its_end_beside_other_work(tmp_path):
    """run() on an engine that already has a conversation of its own: the replay lets it finish, then sends its
    requests one by one as always (it sent nothing while the engine was busy and spun forever)."""
    path = tmp_path / "two.jsonl"
    lines = [{"timestamp": 0, "input_length": 512 * 2, "output_length": 4, "hash_ids": [0, 1]},
             {"timestamp": 1, "input_length": 512 * 2, "output_length": 4, "hash_ids": [0, 1]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    replay = make_replay(EngineConfig(model="none", num_blocks=256, block_size=16), read_trace(str(path)), "instant")
    other = replay.engine.add_prefill(list(range(100, 180)))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (replay.run(), done.set()), daemon=True)
    worker.start()
    assert done.wait(60), "the replay never ended"
    assert replay.engine.is_finished(other) and len(replay.outcomes) == 2
    assert (replay.totals()["hit_blocks"], replay.totals()["total_blocks"]) == (2, 4)  # the second prompt held


@needs_traces
def test_a_timed_replay_decodes_outputs_and_requests_overlap():
    """Arrivals on the trace's clock (here the engine's steps, 0.5 trace seconds each, at speed 20): requests
    overlap and hold their blocks while they decode their outputs (scaled), as in a server."""
    trace = read_trace(str(TESTER)).slice(0, 60)
    cfg = EngineConfig(model="none", num_blocks=3000, block_size=16)
    timed = make_replay(cfg, trace, "timed", speed=20.0, scale=0.05, step_seconds=0.5)
    engine, peak = timed.engine, 0
    while not timed.done:
        timed.advance()
        peak = max(peak, len(engine.snapshot().block_tables))
    assert peak > 1  # several requests held blocks at once
    totals = timed.totals()
    assert totals["requests_done"] == 60
    for o in timed.outcomes:
        info = engine.conversation(o.conversation_id)
        assert len(info.output_token_ids) == max(1, round(int(trace.output_length[o.index]) * 0.05))
        assert info.arrival_step >= trace.arrival_s[o.index] / 20.0 / 0.5 - 1  # not before its time
    sweep = Sweep(trace)
    assert totals["total_blocks"] == sweep.point("lru", 3000).total_blocks
    assert 0 < totals["hit_blocks"] <= sweep.infinite().hit_blocks


@needs_traces
def test_a_sweep_with_a_host_tier_splits_the_hits_by_medium(mooncake):
    """With a host tier the engine replays the points itself: blocks the device evicted come back from the host
    tier, so the hits grow and some are the host's."""
    trace = mooncake.slice(0, 600)
    sweep = Sweep(trace)
    device = sweep.point("lru", 300)
    tiered = sweep.point("lru", 300, host_tier_blocks=600)
    by = tiered.hit_blocks_by_medium
    assert tiered.engine == "engine" and by["CPU"] > 0 and by["GPU"] + by["CPU"] + by["STORAGE"] == tiered.hit_blocks
    assert tiered.hit_blocks > device.hit_blocks
    assert tiered.misses["cold"] == device.misses["cold"]
