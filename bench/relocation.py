"""Relocation cost against what moves: ``relocate_blocks`` on a 65,536-block pool with a few thousand blocks in use.

Builtin model, block size 16 (64 KiB of K/V per block, 4 GiB of cache). Conversations with 241-token prompts are
prefilled (16 blocks each) until ``--used`` blocks are used; then each round times a random relocation (every used
block goes to a random other id) and a compacting one, and reads the peak RSS the relocation added (VmHWM, reset
through /proc/self/clear_refs before each call). Also relocates smaller and larger used sets, so the time is seen
to follow the blocks that move, not the pool. Outputs are checked unchanged: the same conversations decode the same
tokens after the moves as a twin engine that never relocated.

    python bench/relocation.py [--used 2304] [--rounds 5]

Target (issue 12): at most 0.5 s at 65,536 blocks with 2,304 used.
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

NUM_BLOCKS, BLOCK = 65536, 16
PROMPT = 241  # 16 blocks once prefilled; with up to 15 more tokens computed it never needs a 17th
NEW_TOKENS = 16  # 241 + 15 computed = 256 tokens: 16 blocks at most


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fill(eng: Engine, used: int, ids: list[int]) -> None:
    """Add conversations of 16 blocks each until ``used`` blocks are in use, and prefill them."""
    per = PROMPT // BLOCK + 1
    for i in range(len(ids), used // per):
        prompt = np.random.default_rng(i).integers(1, 251, PROMPT).tolist()  # distinct: no prefix sharing
        ids.append(eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    while any(not eng.conversation(c).output_token_ids for c in ids):
        eng.step()
    eng.take_events()


def num_used(eng: Engine) -> int:
    return int((eng.snapshot().state != 0).sum())


def timed(fn) -> tuple[float, float]:
    """Seconds, and MiB the peak RSS rose above the RSS at the start."""
    reset_peak()
    rss0 = status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, (status_kib("VmHWM") - rss0) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--used", type=int, default=2304, help="blocks in use when relocating")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not reset_peak():
        print("note: /proc/self/clear_refs is not writable here; peak RSS figures include earlier peaks")
    sizes = (args.used // 4, args.used, args.used * 4)
    fmt = lambda xs: f"median {statistics.median(xs):.3f} s (range {min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
    outputs = []
    for relocating in (True, False):  # the second engine never relocates: it gives the outputs to compare
        # a large step budget prefills thousands of prompts in a few steps (the first ones decode a few tokens
        # meanwhile, never past NEW_TOKENS), so every conversation holds exactly 16 blocks
        eng = Engine(EngineConfig(model="builtin", block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_seqs=4096,
                                  max_num_batched_tokens=16384, finished_window=4096))
        ids: list[int] = []
        for n in sizes:
            fill(eng, n, ids)
            if not relocating:
                continue
            if n != args.used:
                times = [timed(lambda: eng.relocate_blocks(seed=s))[0] for s in range(3)]
                print(f"  {num_used(eng):>6,} used: random relocation {fmt(times)}, 3 rounds")
                continue
            cache_gib = eng.kv.data.numel() * eng.kv.data.element_size() / 2**30
            print(f"pool {NUM_BLOCKS:,} blocks x {BLOCK} ({cache_gib:.1f} GiB of K/V), {num_used(eng):,} used "
                  f"({num_used(eng) * eng.kv.bytes_per_block / 2**20:.0f} MiB), RSS {status_kib('VmRSS') / 1024:.0f} MiB")
            rand, comp, rand_mem, comp_mem = [], [], [], []
            for r in range(args.rounds):  # alternate the two kinds, so machine noise hits both alike
                t, m = timed(lambda: eng.relocate_blocks(seed=r))
                rand.append(t), rand_mem.append(m)
                t, m = timed(lambda: eng.relocate_blocks(compact=True))
                comp.append(t), comp_mem.append(m)
            print(f"  random relocation, {args.rounds} rounds: {fmt(rand)}; peak RSS +{max(rand_mem):.0f} MiB "
                  f"(target <= 0.5 s)")
            print(f"  compacting relocation, {args.rounds} rounds: {fmt(comp)}; peak RSS +{max(comp_mem):.0f} MiB")
        eng.run_until_idle()
        outputs.append([eng.conversation(c).output_token_ids for c in ids])
        del eng  # one 4 GiB cache at a time
    print(f"outputs after {2 * args.rounds + 6} relocations equal those of an engine that never moved a block: "
          f"{outputs[0] == outputs[1]}")


if __name__ == "__main__":
    main()
