"""RSS growth of the engine over many distinct prompt lengths and over a long soak of conversations.

Two figures, each measured after a warm-up in the same process (RSS from /proc/self/status, after gc):
- 1,000 distinct prefill lengths (one conversation at a time, prompts of 17..1,016 tokens, 1 new token): memory that
  grows per new shape (oneDNN keeps per-shape state for pre-packed weights, in caches capped at 64 shapes, which
  the warm-up fills);
- a 1,000-conversation soak (16 at a time, mixed lengths, some forked, all finished or ended): memory that grows
  with finished conversations (snapshots and the engine must keep a bounded window of them).
Target: at most +100 MiB each. Also times snapshot() at the end of the soak.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig  # noqa: E402


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def distinct_lengths(eng: Engine, count: int) -> float:
    # warm-up: prompts of 1-16 tokens, and 96 lengths that oneDNN serves (a prefill of more rows than the panel
    # kernel takes): more shapes than its per-shape caches hold (64 each, engine/__init__.py), so that they are full
    # before the measured window, whichever kernel serves the small rows. Each prompt differs from the one before
    # from its first token: a prefix hit would leave only the last block's rows to compute
    oneDNN = eng.model.panel_rows + 1
    for n in [*range(1, 17), *range(oneDNN, oneDNN + 96)]:
        eng.generate([[(i * 11 + n) % 250 + 1 for i in range(n)]], max_new_tokens=1)
    before = rss_mib()
    for n in range(17, 17 + count):
        eng.generate([[(i * 7 + n) % 250 + 1 for i in range(n)]], max_new_tokens=1)
    return rss_mib() - before


def soak(eng: Engine, count: int) -> tuple[float, float]:
    def batch(first: int) -> None:
        ids = []
        for i in range(first, first + 16):
            ids.append(eng.add_conversation(prompt_token_ids=[(i * 13 + j) % 250 + 1 for j in range(8 + i % 40)],
                                            max_new_tokens=4 + i % 12, temperature=0.8, seed=i))
        eng.step()
        ids.append(eng.fork_conversation(ids[0]))
        eng.end_conversation(ids[1])
        eng.run_until_idle()
        eng.take_events()

    batch(0)
    before = rss_mib()
    for first in range(16, count, 16):
        batch(first)
        eng.snapshot()
    growth = rss_mib() - before
    start = time.perf_counter()
    for _ in range(100):  # a new snapshot after a change (conversation infos are cached by their own version)
        eng.views._snapshot = None
        eng.snapshot()
    return growth, (time.perf_counter() - start) / 100 * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=1000)
    args = parser.parse_args()
    eng = Engine(EngineConfig(model="builtin", num_blocks=2048, block_size=16))
    print(f"distinct prefill lengths ({args.lengths}): RSS +{distinct_lengths(eng, args.lengths):.0f} MiB "
          f"(target <= 100)")
    eng = Engine(EngineConfig(model="builtin", num_blocks=2048, block_size=16))
    growth, ms = soak(eng, args.conversations)
    print(f"soak of {args.conversations} conversations: RSS +{growth:.0f} MiB (target <= 100); snapshot() "
          f"{ms:.2f} ms with {len(eng.snapshot().conversations)} conversations in view")


if __name__ == "__main__":
    main()
