"""What ``--metrics-port`` costs the engine thread, and what a scrape costs, measured side by side in one run.

The runner already takes a snapshot and the events after every step; the exporter's observer is what
``--metrics-port`` adds there (gauges and counters from the snapshot, every block event through BlockDurations
into the histograms). The built-in engine decodes ``--conversations`` conversations on a pool small enough to
evict, a new one arriving as one finishes (prompts sharing a prefix, so prefix hits, evictions and frees all
happen); each round times ``--steps`` steps with the observer called after each, alternating rounds that call it
and rounds that do not, and prints the observer's share of a step and the step-time ratio with / without. Then
the time prometheus_client takes to write the answer of one scrape (on its HTTP thread, not the engine's).

Nothing here is asserted (tests never time).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating with and without (even)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--conversations", type=int, default=32)
    args = parser.parse_args()

    from prometheus_client import generate_latest

    from engine import Engine, EngineConfig
    from explorer.model.metrics_export import EngineMetricsExport
    from kvstream.views import PoolUpdate

    cfg = EngineConfig(model="builtin", block_size=16, num_blocks=160, seed=0)
    eng = Engine(cfg)
    export = EngineMetricsExport(None)  # no HTTP server: the engine thread's part only
    observe = export.observer(cfg)
    rng = random.Random(0)
    shared = [rng.randrange(2, 250) for _ in range(48)]

    def arrive() -> None:
        tail = [rng.randrange(2, 250) for _ in range(rng.randrange(8, 40))]
        eng.add_conversation(prompt_token_ids=shared + tail, max_new_tokens=rng.randrange(16, 64))

    for _ in range(args.conversations):
        arrive()

    def run(steps: int, with_observer: bool) -> tuple[float, float]:
        stepped = observed = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            update = PoolUpdate.of(eng.snapshot(), eng.take_events())  # the runner does this either way
            t1 = time.perf_counter()
            if with_observer:
                observe(update)
            t2 = time.perf_counter()
            stepped += t1 - t0
            observed += t2 - t1
            live = sum(c.is_live for c in update.snapshot.conversations)
            for _ in range(args.conversations - live):
                arrive()
        return stepped, observed

    run(30, True)  # warm-up
    shares, ratios = [], []
    pairs: list[dict] = []
    for r in range(args.rounds):
        on = r % 2 == 0
        stepped, observed = run(args.steps, on)
        total = (stepped + observed) / args.steps
        if on:
            pairs.append({"on": total, "share": observed / (stepped + observed)})
        else:
            pairs[-1]["off"] = total
    for p in pairs:
        if "off" in p:
            ratios.append(p["on"] / p["off"])
            shares.append(p["share"])
    scrape = []
    for _ in range(50):
        t = time.perf_counter()
        body = generate_latest(export.metrics.registry)
        scrape.append(time.perf_counter() - t)
    snap = eng.snapshot()
    print(f"{args.conversations} conversations, {cfg.num_blocks} blocks of {cfg.block_size}, {args.steps} steps a "
          f"round, {len(ratios)} pairs of rounds; {snap.metrics.num_evictions} evictions, "
          f"{snap.metrics.prefix_cache_hits} hit tokens by the end")
    print(f"observer's share of a step: median {100 * statistics.median(shares):.2f}% "
          f"(rounds {', '.join(f'{100 * s:.2f}%' for s in shares)})")
    print(f"step with / without the observer: median {statistics.median(ratios):.3f}x "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"one scrape's answer ({len(body):,} bytes): median {1e3 * statistics.median(scrape):.2f} ms")


if __name__ == "__main__":
    main()
