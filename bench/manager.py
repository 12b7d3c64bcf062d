"""Decode steps a second of this tree's engine against another revision's, side by side: what a KV-cache manager
change costs.

Issue 50 folded the plain manager and its KV-cache-group subclass into one manager over N groups; a plain model must
stay as fast as it was. This runs two engines, each in its own process: one imports this working tree, the other a
clean export of ``--baseline`` (a git revision of this repository). Same weights, same prompts, same order of work.

Models: the built-in model (one full-attention group) and the window demo's checkpoint (the same weights and shape,
layers alternating full attention and a sliding window: two groups; ``--window`` tokens). Per round and model, each
side adds ``--batch`` conversations of 32-token prompts, prefills them, then times ``--steps`` decode steps (every
conversation one token a step, so the manager's per-step work is all there: a fit check, a block now and then, the
commit, and for the window model a release every block); then ends them. Rounds alternate which side goes first;
round 0 warms both up and is not counted. Time is each side's process CPU time (one torch thread by default), so
what else runs on a shared machine does not count. Printed per model: the median steps per CPU second of each
side, the ratio of the medians (this tree / baseline) and the spread of the per-round ratios. A second row per
model times the same decode steps of the bookkeeping alone (scheduler and manager as Engine.step drives them, no
model run, 8x the steps): the part a manager change can move, without the model's share diluting it.

    python bench/manager.py --baseline main --rounds 30
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PROMPT_LEN = 32


# ---- the worker: one engine per model, in a process that imports one tree ------------------------------------------
def worker(root: str, threads: int) -> None:
    """Answer one JSON line per request on stdin: {"model", "batch", "steps", "seed"} -> {"steps_per_s"}."""
    sys.path.insert(0, root)
    import torch
    from engine import Engine, EngineConfig
    if threads:
        torch.set_num_threads(threads)
    engines = {}
    for line in sys.stdin:
        req = json.loads(line)
        model, batch, steps = req["model"], req["batch"], req["steps"]
        if model not in engines:
            blocks = batch * -(-(PROMPT_LEN + steps + 2) // 16) * 2 + 64  # both groups' blocks, and room to cache
            engines[model] = Engine(EngineConfig(model=model, block_size=16, num_blocks=blocks, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(batch * PROMPT_LEN, 256)))
        eng = engines[model]
        ids = [eng.add_conversation(prompt_token_ids=[(req["seed"] * 131 + i * 7 + j) % 250 for j in range(PROMPT_LEN)],
                                    max_new_tokens=steps + 2, ignore_eos=True) for i in range(batch)]
        eng.step()  # the prefill of every prompt (one batch)
        start = time.process_time()
        if req["alone"]:
            manager_steps(eng, steps)
        else:
            for _ in range(steps):
                eng.step()
        elapsed = time.process_time() - start
        for cid in ids:
            eng.end_conversation(cid)
        print(json.dumps({"steps_per_s": steps / elapsed}), flush=True)


def manager_steps(eng, steps: int) -> None:
    """``steps`` decode steps of the engine's bookkeeping alone, as Engine.step drives it, with no model run: the
    manager's checkpoint, the scheduler's asks (fit, copy-on-write, a block now and then), the commits (hashes,
    window releases) and the read stamps; each conversation's "token" is made up."""
    manager, scheduler = eng.manager, eng.scheduler
    for i in range(steps):
        manager.start_step(eng.step_id + 1 + i)
        manager.begin()
        batch = scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            manager.commit(seq, seq.num_computed_tokens + n)
            seq.version += 1
        for seq in batch.seqs:
            seq.append_token(1 + (i + seq.seq_id) % 250)
        manager.touch_used(eng.step_id + 1 + i)
        manager.end()
    eng.step_id += steps


class Side:
    """A worker process importing the tree at ``root``."""

    def __init__(self, name: str, root: Path, threads: int):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(root),
                                      "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root)

    def run(self, **req) -> float:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (its error is above)")
        return json.loads(line)["steps_per_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def export(revision: str, into: Path) -> Path:
    """A clean copy of ``revision``'s tree (git archive), so the baseline imports exactly that code."""
    archive = into / "tree.tar"
    with open(archive, "wb") as out:
        subprocess.run(["git", "-C", str(HERE), "archive", revision], stdout=out, check=True)
    root = into / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return root


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision to compare against (default: main)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side (0: torch's default); one keeps "
                    "the figure steady on a shared machine")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads)
        return
    sys.path.insert(0, str(HERE))
    from engine.model.window_model import write_window_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        base = export(args.baseline, Path(tmp))
        models = {"built-in (1 group)": "builtin",
                  f"window demo (2 groups, window {args.window})":
                      str(write_window_checkpoint(Path(tmp) / "window", window=args.window))}
        sides = [Side("this tree", HERE, args.threads), Side(f"baseline {args.baseline}", base, args.threads)]
        try:
            runs = {label: (model, False, args.steps) for label, model in models.items()}
            runs.update({f"{label}, manager alone": (model, True, args.steps * 8) for label, model in models.items()})
            rates = {(label, s.name): [] for label in runs for s in sides}
            for r in range(args.rounds + 1):
                order = sides if r % 2 == 0 else sides[::-1]
                for label, (model, alone, steps) in runs.items():
                    for side in order:
                        rate = side.run(model=model, batch=args.batch, steps=steps, seed=r, alone=alone)
                        if r:
                            rates[label, side.name].append(rate)
        finally:
            for side in sides:
                side.close()
    print(f"decode steps per CPU second, batch {args.batch}, {PROMPT_LEN}-token prompts, {args.steps} steps a round, "
          f"{args.rounds} rounds, {args.threads or 'default'} torch thread(s) a side (medians; ratio = this tree / "
          f"baseline {args.baseline}; the median of the per-round ratios in brackets)")
    for label in runs:
        new, old = rates[label, sides[0].name], rates[label, sides[1].name]
        ratios = [a / b for a, b in zip(new, old)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"  {label:50s} this tree {statistics.median(new):8.1f}   baseline {statistics.median(old):8.1f}   "
              f"ratio {statistics.median(new) / statistics.median(old):.3f} [{statistics.median(ratios):.3f}; "
              f"middle half of rounds {q1:.3f}-{q3:.3f}, all {min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
