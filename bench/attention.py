"""paged_attention vs torch SDPA on the same K/V stored contiguously, side by side in one run.

Decode shapes (one query token per sequence): 8 query heads, 2 KV heads, head dim 64, block size 16, float32.
Prints paged/contiguous time ratios; the PagedAttention paper reports 20-26% kernel overhead for paging.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import attention  # noqa: E402
from engine.attention import paged_attention  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16


def timeit(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def case(batch: int, ctx: int, repeat: int) -> tuple[float, float, float, float]:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, KV_HEADS, ctx, DIM, generator=g)  # contiguous layout for SDPA
    values = torch.randn(batch, KV_HEADS, ctx, DIM, generator=g)
    query = torch.randn(batch, HEADS, DIM, generator=g)
    blocks_per_seq = ctx // BLOCK
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=g)  # scattered physical layout
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    key_cache = torch.empty(num_blocks, BLOCK, KV_HEADS, DIM)
    value_cache = torch.empty(num_blocks, BLOCK, KV_HEADS, DIM)
    key_cache[tables.long()] = keys.permute(0, 2, 1, 3).reshape(batch, blocks_per_seq, BLOCK, KV_HEADS, DIM)
    value_cache[tables.long()] = values.permute(0, 2, 1, 3).reshape(batch, blocks_per_seq, BLOCK, KV_HEADS, DIM)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)

    def contiguous():
        return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, enable_gqa=True).squeeze(2)

    def paged():
        return paged_attention(query, key_cache, value_cache, tables, seq_lens)

    flush = torch.ones(64 * 2**20 // 4)  # larger than the 32 MiB L3 seen here; read, never written, between calls

    def rounds():
        """Variants timed in alternating blocks of `repeat` calls (so machine noise hits them alike), each call
        starting with K/V out of cache as in a real decode step. Not call-by-call round robin: the eager variant
        leaves 2 x 16 MiB of freshly written copies behind, whose write-back would be charged to the next call."""
        samples = {"contiguous": [], "eager": [], "compiled": []}
        for _ in range(3):
            for name in samples:
                attention.use_compiled_attention(name == "compiled")
                fn = contiguous if name == "contiguous" else paged
                fn()
                for _ in range(repeat):
                    flush.sum()
                    t = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t)
        return {k: statistics.median(v) for k, v in samples.items()}

    with torch.inference_mode():
        ref = contiguous()
        attention.use_compiled_attention(False)
        err = (paged() - ref).abs().max().item()
        attention.use_compiled_attention(True)
        err = max(err, (paged() - ref).abs().max().item())  # also compiles the fused kernel
        t = rounds()
    return t["contiguous"], t["eager"], t["compiled"], err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15, help="calls per variant per round (3 rounds)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("ratio = paged time / contiguous SDPA time (medians; K/V out of cache before every call)")
    print(f"{'batch':>5} {'ctx':>5} {'contiguous ms':>14} {'eager ms':>9} {'ratio':>6} {'compiled ms':>12} {'ratio':>6} {'max err':>8}")
    for batch in (1, 8, 32):
        for ctx in (128, 1024):
            tc, te, tf, err = case(batch, ctx, args.repeat)
            print(f"{batch:>5} {ctx:>5} {tc * 1e3:>14.3f} {te * 1e3:>9.3f} {te / tc:>6.2f} {tf * 1e3:>12.3f} "
                  f"{tf / tc:>6.2f} {err:>8.1e}")
    if attention._compiled.failed:
        print("note: torch.compile failed on this machine; the compiled column is the eager fallback")


if __name__ == "__main__":
    main()
