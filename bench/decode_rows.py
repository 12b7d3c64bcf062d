"""Decode step CPU time by batch size on the 135M shape: the rows past the one-call step's 16 (issue 49's memory).

With each weight held once as panels, a step of more rows than the panel kernel serves unpacks every weight for the
call; this measures what a batch of 17 to 64 conversations pays, and what a prefill step pays. One thread and CPU
time (``time.thread_time``), so the figure holds on a shared machine; each configuration in its own process, the
trees given alternating (e.g. main against a worktree), rounds alternating too.

    python bench/decode_rows.py [--trees . ../other] [--batches 8,24,48] [--dtypes bfloat16,float32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(tree: str, checkpoint: str, dtype: str, batch: int, prompt: int, new: int) -> dict:
    sys.path.insert(0, tree)
    import torch
    torch.set_num_threads(1)
    from engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=checkpoint, dtype=dtype, block_size=16, max_num_batched_tokens=4096,
                              num_blocks=batch * ((prompt + new) // 16 + 2) + 16))
    rng = random.Random(0)
    for _ in range(batch):
        eng.add_conversation(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(prompt)],
                             max_new_tokens=new, ignore_eos=True)
    start = time.thread_time()
    eng.step()  # every prompt in one prefill step
    prefill = time.thread_time() - start
    start, steps = time.thread_time(), 0
    while eng.has_work():
        eng.step()
        steps += 1
    return {"prefill_ms": prefill * 1e3, "decode_ms": (time.thread_time() - start) / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="source trees to compare (default: this one)")
    parser.add_argument("--batches", default="8,24,48")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=17)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--checkpoint", default="/tmp/peers/ckpt", help="where bench/peers.py's checkpoints live")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    sys.path.insert(0, str(ROOT))
    from bench.peers import build_checkpoint
    checkpoint = str(build_checkpoint("135m", Path(args.checkpoint)))
    print(f"135M shape, one thread, CPU ms: the prefill step ({args.prompt}-token prompts) and a decode step "
          f"(mean of {args.new - 1}); min over {args.rounds} rounds")
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for tree in args.trees:
                    spec = json.dumps([str(Path(tree).resolve()), checkpoint, dtype, batch, args.prompt, args.new])
                    out = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True,
                                         text=True, check=True).stdout.strip().splitlines()[-1]
                    got = json.loads(out)
                    old = best.get(tree)
                    best[tree] = got if old is None else {k: min(v, old[k]) for k, v in got.items()}
            cells = [f"{Path(t).name or t}: prefill {r['prefill_ms']:.0f}, decode {r['decode_ms']:.1f}"
                     for t, r in best.items()]
            print(f"  {dtype} batch {batch}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
