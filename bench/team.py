"""How many threads the one-call decode step should take: all of torch's, one, or the engine's own choice as it runs
(engine.native.TeamSize), side by side in alternating rounds, each setting in a process of its own.

The engine (this tree, or ``--baseline``: another checkout) decodes a batch of 16 random 64-token prompts on the
135M shape of bench/peers.py (random weights, written once with ``save_pretrained``; ``--dir`` keeps them): a
one-token run and a run of ``--new`` tokens, and decode ms/step = (time of the long run - time of the short one) /
(new - 1). Each round runs every setting once, in a rotating order. Printed per round, then the medians; the
machine's load average is printed with each round, since the question is what a busy machine does to two threads.

    python bench/team.py [--rounds 3] [--dtype float32|bfloat16] [--new 33] [--settings auto all one]
                         [--baseline DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

SETTINGS = ("auto", "all", "one", "baseline")  # TeamSize's choice, all of torch's threads, one thread, the other tree


def worker(args) -> None:
    """One measurement in this process: prints ms/step as JSON."""
    import time

    import numpy as np
    import torch
    sys.path.insert(0, str(args.tree))
    from engine import Engine, EngineConfig, native
    if args.worker == "one":
        torch.set_num_threads(1)
    elif args.worker == "all" and hasattr(native, "team_size"):
        native.team_size.choose = lambda rows, most: most
    eng = Engine(EngineConfig(model=str(args.checkpoint), block_size=16, num_blocks=16 * 8 + 16, dtype=args.dtype,
                              max_num_batched_tokens=4096))
    rng = np.random.default_rng(args.seed)

    def run(n: int) -> float:
        prompts = rng.integers(3, 256, (16, 64)).tolist()
        start = time.perf_counter()
        eng.generate(prompts, max_new_tokens=n, ignore_eos=True)
        return time.perf_counter() - start

    run(2)
    one = min(run(1) for _ in range(2))
    print(json.dumps((run(args.new) - one) / (args.new - 1) * 1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--new", type=int, default=33, help="tokens of the long run")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS[:3], default=list(SETTINGS[:3]))
    parser.add_argument("--baseline", type=Path, help="another checkout, run as one more setting (its default)")
    parser.add_argument("--dir", type=Path, help="keep the checkpoint here (default: a temp dir)")
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from peers import build_checkpoint
    settings = list(args.settings) + (["baseline"] if args.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint = build_checkpoint("135m", directory)
        print(f"135M shape, batch 16, 64-token prompts, decode ms/step over {args.new - 1} steps, {args.dtype}, "
              f"{os.cpu_count()} CPUs")
        times: dict[str, list[float]] = {s: [] for s in settings}
        for r in range(args.rounds):
            line = []
            for setting in settings[r % len(settings):] + settings[: r % len(settings)]:
                tree = args.baseline if setting == "baseline" else ROOT
                done = subprocess.run([sys.executable, __file__, "--worker", setting, "--tree", str(tree),
                                       "--checkpoint", str(checkpoint), "--dtype", args.dtype, "--new", str(args.new),
                                       "--seed", str(r)], capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{setting} failed: {done.stderr.strip()[-500:]}")
                ms = json.loads(done.stdout.strip().splitlines()[-1])
                times[setting].append(ms)
                line.append(f"{setting} {ms:.1f}")
            print(f"round {r}: " + ", ".join(line) + f" ms/step (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
        for setting, values in times.items():
            print(f"{setting}: median {statistics.median(values):.1f} ms/step, rounds "
                  + ", ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
