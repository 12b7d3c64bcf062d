"""Capacity sweep of the shipped Mooncake trace against kvcache-simulator 0.1.3's C++ backend, side by side.

Both do the same 9 points (LRU, FIFO and the offline optimum at 5,000, 10,000 and 20,000 blocks of 512 tokens) from a
fresh process, in alternating rounds; the ratio is ours / theirs in wall time (below 1: ours is faster).
kvcache-simulator counts only the last half of the requests (its warmup is fixed at 0.5, and it takes capacities in
GiB for a model: ``cohere-command-a-03-2025``'s budgets below are exactly those block counts), so ours runs with
``--warmup 0.5`` too, and the hit tokens are printed beside each other: LRU must agree exactly; FIFO and the optimum
differ by their rules (docs/traffic.md says how).

    python bench/traffic_sweep.py [--rounds 5] [--trace ../shared/traces/mooncake_conversation.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
BLOCKS = (5000, 10000, 20000)
# kvcache-simulator's budgets in GiB that give exactly BLOCKS blocks of 512 tokens for this model's K/V
THEIR_MODEL = "cohere-command-a-03-2025"
THEIR_BUDGETS = "315.81626895513085,631.6009594412131,1263.1703404133777"


def ours(trace: str) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--trace", trace, "--sweep",
                           ",".join(map(str, BLOCKS)), "--policies", "lru,fifo,belady", "--warmup", "0.5",
                           "--headless", "--json"], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    hits = {(p["policy"], p["blocks"]): p["hit_tokens"] for p in map(json.loads, done.stdout.splitlines())}
    return wall, hits


def theirs(trace: str, tool: str) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([tool, "run", "--trace", trace, "--model", THEIR_MODEL, "--block-size", "512",
                           "--budgets-gib", THEIR_BUDGETS, "--policies", "fifo,lru,optimal", "--backend", "cpp",
                           "--format", "json", "--no-progress"], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    names = {"lru": "lru", "fifo": "fifo", "optimal": "belady"}
    return wall, {(names[policy], point["cacheBlocks"]): result["hitTokens"]
                  for point in json.loads(done.stdout)["points"] for policy, result in point["results"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trace", default=str(TRACE))
    args = parser.parse_args()
    tool = shutil.which("kvcache-simulator")
    if tool is None:
        sys.exit("kvcache-simulator is not installed: pip install kvcache-simulator==0.1.3")
    theirs(args.trace, tool)  # its first run compiles its C++ core; ours builds the fast path once too
    ours(args.trace)
    ratios, our_times, their_times = [], [], []
    for round_ in range(args.rounds):
        pair = [("ours", ours), ("theirs", lambda t: theirs(t, tool))]
        if round_ % 2:
            pair.reverse()
        times = {}
        for name, run in pair:
            times[name], result = run(args.trace)
            if name == "ours":
                our_hits = result
            else:
                their_result = result
        our_times.append(times["ours"])
        their_times.append(times["theirs"])
        ratios.append(times["ours"] / times["theirs"])
        print(f"round {round_ + 1}: ours {times['ours']:.3f} s, kvcache-simulator {times['theirs']:.3f} s, "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"median: ours {statistics.median(our_times):.3f} s, kvcache-simulator "
          f"{statistics.median(their_times):.3f} s, ratio {statistics.median(ratios):.2f} "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); load average {os.getloadavg()[0]:.1f}")
    print("hit tokens in the counted half, ours / kvcache-simulator's (its optimal beside our belady):")
    for policy in ("lru", "fifo", "belady"):
        print(f"  {policy:>6}: " + ", ".join(f"{b}: {our_hits[(policy, b)]:,} / {their_result.get((policy, b), 0):,}"
                                          for b in BLOCKS))


if __name__ == "__main__":
    main()
