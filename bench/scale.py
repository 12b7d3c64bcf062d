"""Chunked prefill at scale: 256 conversations arrive at once on a 65,536-block pool; how long is the longest step?

Builtin model, block size 16. Two workloads: prompts of 64-256 tokens, and prompts of 64-1,000 tokens (the model's
context is 1,024, so those decode fewer tokens). Every step of the arrival is timed; its longest step is what the
window waits for at worst. The reference is the median decode step once all 256 decode: the same prompts, prefilled
untimed in a few large steps, then 16 timed steps in which every conversation decodes (while they arrive under a
budget, the first ones finish before the last are admitted, so the arrival itself never has all 256 decoding).
Target (issue 12): longest <= 1.5x median decode. ``--budgets`` runs the same workload under other per-step token
budgets (``max_num_batched_tokens``), in alternating rounds, so the choice of the default can be argued from numbers.
``--check`` also runs whole-prompt prefill (``enable_chunked_prefill=False``) and checks the tokens are the same.

    python bench/scale.py [--rounds 2] [--budgets 256 512 1024] [--check]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig  # noqa: E402

NUM_BLOCKS, BLOCK, CONVERSATIONS = 65536, 16, 256
WORKLOADS = {  # name: (shortest prompt, longest prompt, new tokens)
    "prompts 64-256": (64, 256, 64),
    "prompts 64-1000": (64, 1000, 24),
}


def prompts(lo: int, hi: int) -> list[list[int]]:
    rng = np.random.default_rng(hi)
    return [rng.integers(1, 251, int(n)).tolist() for n in rng.integers(lo, hi + 1, CONVERSATIONS)]


def engine(budget: int, chunked: bool = True) -> Engine:
    return Engine(EngineConfig(model="builtin", block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=budget,
                               enable_chunked_prefill=chunked))


def arrival(budget: int, workload: str, chunked: bool = True) -> dict:
    """All conversations added at once, stepped to the end: every step's seconds, and the tokens."""
    lo, hi, new = WORKLOADS[workload]
    eng = engine(budget, chunked)
    ids = [eng.add_conversation(prompt_token_ids=p, max_new_tokens=new, ignore_eos=True) for p in prompts(lo, hi)]
    steps = []
    while eng.has_work():
        start = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - start)
    return {"steps": steps, "outputs": [list(eng.conversation(c).output_token_ids) for c in ids]}


def decode_reference(workload: str, steps: int = 16) -> list[float]:
    """Seconds of decode steps with all conversations decoding, at the workload's context lengths."""
    lo, hi, new = WORKLOADS[workload]
    eng = engine(65536)
    for p in prompts(lo, hi):
        eng.add_conversation(prompt_token_ids=p, max_new_tokens=new, ignore_eos=True)
    while eng.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
        eng.step()  # prefill, untimed
    times = []
    for _ in range(min(steps, new - 2)):
        assert len(eng.scheduler.running) == CONVERSATIONS
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs per budget and workload, alternating")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512], help="max_num_batched_tokens values")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--check", action="store_true", help="compare tokens with whole-prompt prefill")
    args = parser.parse_args()
    decode_reference("prompts 64-256", 2)  # warm-up (oneDNN shapes, allocator)
    for workload in args.workloads:
        results: dict[int, list[dict]] = {b: [] for b in args.budgets}
        reference: list[float] = []
        for _ in range(args.rounds):  # alternate budgets and the reference, so machine noise hits all alike
            reference.append(statistics.median(decode_reference(workload)) * 1e3)
            for budget in args.budgets:
                results[budget].append(arrival(budget, workload))
        ref = statistics.median(reference)
        print(f"{workload}, {CONVERSATIONS} conversations at once, {NUM_BLOCKS:,} blocks x {BLOCK}, {args.rounds} rounds:"
              f" median decode step with all {CONVERSATIONS} decoding {ref:.1f} ms ({min(reference):.1f}-"
              f"{max(reference):.1f})")
        for budget, rounds in results.items():
            longest = [max(r["steps"]) * 1e3 for r in rounds]
            ratios = [a / b for a, b in zip(longest, reference)]
            typical = statistics.median(statistics.median(r["steps"]) for r in rounds) * 1e3
            print(f"  budget {budget:>5}: longest step {statistics.median(longest):7.1f} ms "
                  f"({min(longest):.1f}-{max(longest):.1f}), ratio to decode {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}; target <= 1.5); median step {typical:.1f} ms, "
                  f"{len(rounds[0]['steps'])} steps, {sum(rounds[0]['steps']):.1f} s in all")
        if args.check:
            whole = arrival(max(args.budgets), workload, chunked=False)
            same = all(r["outputs"] == whole["outputs"] for rounds in results.values() for r in rounds)
            print(f"  tokens equal whole-prompt prefill: {same}; whole prompts: longest step "
                  f"{max(whole['steps']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
