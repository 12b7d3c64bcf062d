"""paged_attention vs torch SDPA on the same K/V stored contiguously, side by side in one run.

Decode shapes (one query token per sequence): 8 query heads, 2 KV heads, head dim 64, block size 16, float32, every
sequence's blocks scattered over the pool. Variants, timed in alternating blocks of calls:
- contiguous: SDPA on [batch, kv_heads, ctx, dim] K/V (the floor paging is measured against);
- default: ``paged_attention`` as the engine runs it: on the CPU in float32, the native kernel (engine.native: K/V
  read in place through the tables); where that cannot be built, for long contexts the fused kernel where the
  background compile measured it faster on that shape (engine.attention.compiled._AutoKernels: the bench waits
  for its decision and prints it), the eager path everywhere else;
- eager: the eager path alone (cache-sized groups: gather a few sequences, attend, repeat), the native kernel off;
- sdpa: the default's groups, each attended by SDPA (the default before short contexts on several threads took
  two batched matmuls instead, engine.attention.eager._cross_head_attention): today's default against it;
- previous: the earlier default (one gather of the whole batch's K/V, then one SDPA), kept here for comparison;
- compiled: the opt-in torch.compile'd fused kernel (``EngineConfig(compile_attention=True)``), compiled first.
Cold: a 64 MiB buffer is read before every call, so K/V come from memory as in a real decode step (each layer's
K/V were last touched a whole step ago). Hot: calls back to back. Ratios are time / contiguous time (medians).
Targets (issue 12): default <= 1.15x contiguous at batch 32, context 1024; never slower than the eager path (nor
than the previous one) at any shape.
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
VARIANTS = ("contiguous", "default", "eager", "sdpa", "previous", "compiled")


def previous_paged_attention(query, key_cache, value_cache, block_tables, seq_lens):
    """The earlier default path, as paged_attention ran it before cache-sized groups (the checks of its inputs in
    tensor operations, one gather of the whole batch's K/V, one masked SDPA), kept here for comparison."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    lens = seq_lens.long().cpu()  # the input checks, as they were
    assert int(lens.min()) >= 1 and int(lens.max()) <= block_tables.shape[1] * block_size
    live = torch.arange(block_tables.shape[1])[None, :] * block_size < lens[:, None]
    ids = block_tables.long().cpu()[live]
    assert not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks)
    seqs, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    max_len = int(seq_lens.max())  # the plan, as it was
    max_blocks = -(-max_len // block_size)
    tables = block_tables[:, :max_blocks].long()
    live = torch.arange(max_blocks)[None, :] * block_size < seq_lens[:, None]
    tables = torch.where(live, tables, 0)
    mask = None
    if bool((seq_lens != max_len).any()):
        mask = (torch.arange(max_len)[None, :] < seq_lens[:, None])[:, None, None, :]
    keys = key_cache.index_select(0, tables.view(-1)).view(seqs, max_blocks * block_size, kv_heads, dim)[:, :max_len]
    values = value_cache.index_select(0, tables.view(-1)).view(seqs, max_blocks * block_size, kv_heads, dim)[:, :max_len]
    out = F.scaled_dot_product_attention(query.view(seqs, kv_heads, heads // kv_heads, dim), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=mask, scale=dim ** -0.5)
    return out.reshape(seqs, heads, dim)


_CHOOSE_CROSS_HEAD = attention.eager._use_cross_head


def choose(variant: str) -> None:
    """Set engine.attention up for a variant: the native and compiled kernels on or off, and for "sdpa" SDPA in every
    group."""
    attention.use_compiled_attention(variant == "compiled")
    attention.use_auto_kernels(variant == "default")
    attention.use_native_kernel(variant == "default")
    attention.eager._use_cross_head = (lambda *args: False) if variant == "sdpa" else _CHOOSE_CROSS_HEAD


def case(batch: int, ctx: int, repeat: int, rounds: int) -> dict:
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

    fns = {
        "contiguous": lambda: F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, enable_gqa=True).squeeze(2),
        "default": lambda: paged_attention(query, key_cache, value_cache, tables, seq_lens),
        "eager": lambda: paged_attention(query, key_cache, value_cache, tables, seq_lens),
        "sdpa": lambda: paged_attention(query, key_cache, value_cache, tables, seq_lens),
        "previous": lambda: previous_paged_attention(query, key_cache, value_cache, tables, seq_lens.long()),
        "compiled": lambda: paged_attention(query, key_cache, value_cache, tables, seq_lens),
    }
    flush = torch.ones(64 * 2**20 // 4)  # larger than the 32 MiB L3 seen here; read, never written, between calls

    def timed(cold: bool) -> dict:
        """Variants in alternating blocks of `repeat` calls (so machine noise hits them alike). Not call-by-call
        round robin: a gathering variant leaves freshly written copies behind, whose write-back would be charged
        to the next call."""
        samples = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:
                choose(name)
                fns[name]()
                for _ in range(repeat):
                    if cold:
                        flush.sum()
                    start = time.perf_counter()
                    fns[name]()
                    samples[name].append(time.perf_counter() - start)
        choose("default")
        return {name: statistics.median(v) for name, v in samples.items()}

    with torch.inference_mode():
        ref = fns["contiguous"]()
        choose("default")  # the default path in steady use: its shape queued, compiled and decided in the background
        for _ in range(attention.AUTO_MIN_CALLS):
            fns["default"]()
        started = time.perf_counter()
        attention.wait_for_kernels()
        waited = time.perf_counter() - started
        for _ in range(2 * (attention.AUTO_WARMUP_CALLS + attention.AUTO_TIMING_CALLS)):  # its calls time both paths
            fns["default"]()
        err = 0.0
        for name in ("default", "eager", "sdpa", "previous", "compiled"):  # the last also compiles the fused kernel
            choose(name)
            err = max(err, (fns[name]() - ref).abs().max().item())
        choose("default")
        bucket = attention.plan._bucket
        decided = [v for k, v in attention.compiled._auto.decisions.items() if k[0] == bucket(batch)
                   and k[1] == bucket(blocks_per_seq)]
        return {"cold": timed(True), "hot": timed(False), "err": err, "waited": waited,
                "decision": decided[0] if decided else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--shapes", default="1x128,1x1024,8x128,8x1024,32x128,32x1024",
                        help="batch x context pairs, comma-separated")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.repeat} calls")
    print("ratio = time / contiguous SDPA time (medians); cold: K/V out of cache before every call; hot: back to back")
    print(f"{'batch':>5} {'ctx':>5} {'cache':>5} {'contig ms':>10} {'default':>8} {'ratio':>6} {'eager':>7} {'ratio':>6} "
          f"{'sdpa':>7} {'ratio':>6} {'previous':>9} {'ratio':>6} {'compiled':>9} {'ratio':>6} {'default/eager':>14} "
          f"{'default/previous':>17}")
    worst = worst_eager = 0.0
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        result = case(batch, ctx, args.repeat, args.rounds)
        for cache in ("cold", "hot"):
            t = result[cache]
            c = t["contiguous"]
            worst = max(worst, t["default"] / t["previous"])
            worst_eager = max(worst_eager, t["default"] / t["eager"])
            print(f"{batch:>5} {ctx:>5} {cache:>5} {c * 1e3:>10.3f} {t['default'] * 1e3:>8.3f} {t['default'] / c:>6.2f} "
                  f"{t['eager'] * 1e3:>7.3f} {t['eager'] / c:>6.2f} {t['sdpa'] * 1e3:>7.3f} {t['sdpa'] / c:>6.2f} "
                  f"{t['previous'] * 1e3:>9.3f} {t['previous'] / c:>6.2f} {t['compiled'] * 1e3:>9.3f} "
                  f"{t['compiled'] / c:>6.2f} {t['default'] / t['eager']:>14.2f} {t['default'] / t['previous']:>17.2f}")
        decision = result["decision"]
        chose = "the native kernel" if attention.native.available() else \
            "eager (context below attention.AUTO_MIN_POSITIONS)" if decision is None else \
            f"{'fused' if decision[1] <= attention.AUTO_MARGIN * decision[0] else 'eager'} (compiled in the background, then " \
            f"timed by its calls: eager {decision[0] * 1e3:.3f} ms, fused {decision[1] * 1e3:.3f} ms; waited " \
            f"{result['waited']:.1f} s for the compile)"
        print(f"{'':>17} max abs error against contiguous: {result['err']:.1e}; the default path chose {chose}")
    print(f"largest default/eager ratio over all shapes: {worst_eager:.2f} (target <= 1.00)")
    print(f"largest default/previous ratio over all shapes: {worst:.2f} (target <= 1.00)")
    if attention.compiled._compiled.failed:
        print("note: torch.compile failed on this machine; the compiled column is the eager fallback")


if __name__ == "__main__":
    main()
