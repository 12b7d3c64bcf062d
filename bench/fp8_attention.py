"""Decode attention over an fp8 pool against a bfloat16 one, side by side in one run (issue 47).

The native walk (engine.native.decode, csrc/paged_decode.c) as a decode step calls it for one layer: a bfloat16
query of the 135M shape's heads (9 query heads, 3 KV heads, head size 64), blocks of 16 scattered over the pool,
over a bfloat16 pool and over e4m3 and e5m2 pools holding the same values quantised. Cold: a 64 MiB buffer is read
before every call, so K/V come from memory as in a decode step (a layer's K/V were last touched a step ago). Kinds
alternate call by call within each round; the figure is each kind's median time over the rounds, and the ratio
bfloat16 time / fp8 time (above 1: the fp8 pool is faster).

    python bench/fp8_attention.py [--seqs 16] [--contexts 256,1600] [--rounds 5] [--repeat 10] [--threads 0]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import native  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
KINDS = {"bfloat16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def pools(seqs: int, context: int, generator: torch.Generator):
    per = (context + BLOCK - 1) // BLOCK
    blocks = seqs * per
    key = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
    value = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=generator).view(seqs, per)  # scattered, as a busy pool's
    return {name: (key.to(dtype), value.to(dtype)) for name, dtype in KINDS.items()}, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--contexts", default="256,1600")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=10, help="calls of each kind per round")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.kernel() is None:
        sys.exit(f"the native kernel is unavailable: {native.error()}")
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(16 * 2**20)
    print(f"native decode attention, {args.seqs} sequences, {HEADS}/{KV_HEADS} heads of {DIM}, blocks of {BLOCK}, "
          f"{torch.get_num_threads()} threads, cold (a 64 MiB read before each call), {args.rounds} rounds of "
          f"{args.repeat} calls; median ms a call, bfloat16 time / each kind's")
    for context in (int(c) for c in args.contexts.split(",")):
        kv, tables = pools(args.seqs, context, g)
        query = torch.randn(args.seqs, HEADS, DIM, generator=g).to(torch.bfloat16)
        lens = torch.full((args.seqs,), context)
        times: dict[str, list[float]] = {name: [] for name in KINDS}
        for name, (k, v) in kv.items():
            if native.decode(query, k, v, tables, lens, DIM ** -0.5) is None:
                sys.exit(f"the native walk does not take a {name} pool here")
        for _ in range(args.rounds):
            for _ in range(args.repeat):
                for name, (k, v) in kv.items():
                    flush.sum()
                    start = time.perf_counter()
                    native.decode(query, k, v, tables, lens, DIM ** -0.5)
                    times[name].append(time.perf_counter() - start)
        base = statistics.median(times["bfloat16"])
        cells = [f"{name} {statistics.median(t) * 1e3:.3f} ms ({base / statistics.median(t):.2f}x)"
                 for name, t in times.items()]
        print(f"  context {context}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
