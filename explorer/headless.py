"""Run the engine without Qt: print a short summary every few steps and stop when there is nothing left to do.

Useful on machines without a display and as the baseline the GUI benchmark compares against.
"""
from __future__ import annotations

import time
from collections import Counter


def summary_line(engine) -> str:
    snap = engine.snapshot()
    statuses = Counter(str(c.status) for c in snap.conversations)
    mem = snap.memory
    pool = (f"pool {mem.num_used_blocks} used / {mem.num_cached_blocks} cached / {mem.num_free_blocks} free, "
            f"{mem.num_filled_slots}/{mem.num_allocated_slots} slots filled" if mem else "")
    convs = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no conversations"
    return f"step {snap.step_id:5d}: {convs}; {pool}"


def run_headless(engine, every: int = 10, max_steps: int | None = None, out=print) -> int:
    """Step until idle (or ``max_steps``); returns the number of steps taken."""
    steps = 0
    start = time.perf_counter()
    out(summary_line(engine))
    while engine.has_work() and (max_steps is None or steps < max_steps):
        engine.step()
        steps += 1
        if steps % every == 0:
            out(summary_line(engine))
    elapsed = time.perf_counter() - start
    metrics = engine.snapshot().metrics
    out(summary_line(engine))
    out(f"idle after {steps} steps in {elapsed:.1f} s; {metrics.num_generated_tokens} tokens generated "
        f"({metrics.num_generated_tokens / max(elapsed, 1e-9):.1f} tokens/s)")
    return steps
