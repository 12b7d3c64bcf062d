"""Host and disk tiers against recomputing, and what the tiers cost a decode, side by side in one run.

On random weights of SmolLM2-135M's shape (bench/peers.py builds the checkpoint), block size 16:

1. Time to first token of a returning conversation whose 2,048-token prefix was evicted from the device pool: with
   the prefix in the host tier (loaded back), on disk (a disk tier alone), and with the tiers off (recomputed).
   The device pool holds exactly one such conversation, so a second one of the same length evicts every block of
   the first before it returns.
2. Decode with the tiers on but nothing to offload (a pool large enough) against the tiers off.
3. Decode with a steady offload stream: the pool's free blocks are all cached blocks of finished conversations, and
   the decoding ones cross a block boundary every step or two, so nearly every step evicts (and, with the host tier
   on, offloads) a block; against the same workload with the tiers off (evicting just as often, keeping nothing).

Each measurement alternates its sides, ``--rounds`` times, and prints medians and the ratio of the medians. The
first-token times are also given in CPU seconds of this process (all its threads): on a shared machine the wall
clock counts other processes' time too, the CPU time only this engine's work.

    python bench/tiers.py [--rounds 2] [--model 135m|3m] [--prefix 2048] [--steps 96]
                          [--sections ttft decode stream] [--quick]

``--quick``: the 3M-shape model, a 512-token prefix, 32 decode steps, 1 round (a smoke run, not the figures).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.peers import MODELS, build_checkpoint  # noqa: E402
from engine import Engine, EngineConfig  # noqa: E402

BS = 16


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 2) + 1 for i in range(n)]


def returning_ttft(ckpt: str, tier: str, prefix: int, vocab: int, tmp: Path) -> tuple[float, float, dict]:
    """(Wall seconds, CPU seconds) from the reply to its first token, for a conversation whose prefix was pushed
    out of the device, and where its prompt tokens came from."""
    blocks = -(-(prefix + 1) // BS) + 1
    kw = {}
    if tier == "host":
        kw = dict(host_tier_blocks=blocks + 8)
    elif tier == "disk":
        kw = dict(disk_tier_blocks=blocks + 8, disk_tier_path=str(tmp / "disk-tier.bin"))
    eng = Engine(EngineConfig(model=ckpt, block_size=BS, num_blocks=blocks, max_num_batched_tokens=prefix + 64,
                              max_num_seqs=4, **kw))
    a = eng.add_conversation(prompt_token_ids=_prompt(1, prefix, vocab), max_new_tokens=1)
    eng.run_until_idle()
    eng.add_conversation(prompt_token_ids=_prompt(2, prefix, vocab), max_new_tokens=1)  # evicts all of a's
    eng.run_until_idle()
    eng.continue_conversation(a, prompt_token_ids=[5], max_new_tokens=1)
    start, cpu = time.perf_counter(), time.process_time()
    eng.step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(eng.conversation(a).output_token_ids) == 1
    sources = eng.prompt_token_sources(a)
    eng.close()
    return seconds, cpu, sources


def decode_rate(ckpt: str, tiers: bool, stream: bool, vocab: int, steps: int) -> tuple[float, float, int]:
    """Tokens/s of ``steps`` decode steps of 16 conversations: (per wall second, per CPU second of this process,
    blocks evicted while measuring)."""
    batch, prompt = 16, 96
    start_blocks = sum(-(-(prompt + i + 2) // BS) for i in range(batch))
    fillers = steps // 3 + 8 if stream else 0  # finished conversations, 3 cached blocks each: what new blocks evict
    num_blocks = start_blocks + 4 * fillers + 8 if stream else 4 * start_blocks
    kw = dict(host_tier_blocks=3 * fillers + 64) if tiers else {}
    eng = Engine(EngineConfig(model=ckpt, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=4096,
                              max_num_seqs=batch, **kw))
    for i in range(fillers):
        eng.add_conversation(prompt_token_ids=_prompt(100 + i, 4 * BS - 1, vocab), max_new_tokens=1)
    eng.run_until_idle()
    # staggered lengths: every step or two, some conversation's next token starts a new block
    for i in range(batch):
        eng.add_conversation(prompt_token_ids=_prompt(i, prompt + i, vocab),
                             max_new_tokens=min(10 * steps, eng.max_model_len - prompt - batch),
                             ignore_eos=True)
    while eng.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
        eng.step()
    while stream and eng.pool.free_queue:  # from here on every new block evicts a cached one
        eng.step()
    evictions = eng.manager.num_evictions
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        eng.step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    evicted = eng.manager.num_evictions - evictions
    assert eng.scheduler.num_preemptions == 0 and len(eng.scheduler.running) == batch
    eng.close()
    return batch * steps / seconds, batch * steps / cpu, evicted


def ttft_section(ckpt: str, prefix: int, vocab: int, tmp: Path, rounds: int) -> None:
    ttft = {"off": [], "host": [], "disk": []}
    cpu = {"off": [], "host": [], "disk": []}
    for r in range(rounds):
        for tier in ("off", "host", "disk") if r % 2 == 0 else ("disk", "host", "off"):
            seconds, cpu_seconds, sources = returning_ttft(ckpt, tier, prefix, vocab, tmp)
            ttft[tier].append(seconds)
            cpu[tier].append(cpu_seconds)
            print(f"  round {r + 1} {tier:>4}: first token {seconds * 1e3:8.1f} ms (CPU {cpu_seconds * 1e3:8.1f} ms)"
                  f"   prompt from {sources}", flush=True)
    for what, times in (("wall", ttft), ("CPU", cpu)):
        off = statistics.median(times["off"])
        for tier in ("host", "disk"):
            med = statistics.median(times[tier])
            ratios = [o / t for o, t in zip(times["off"], times[tier])]
            print(f"TTFT ({what}), returning {prefix}-token prefix from {tier}: {med * 1e3:.1f} ms vs recompute "
                  f"{off * 1e3:.1f} ms = {off / med:.1f}x faster (rounds {min(ratios):.1f}-{max(ratios):.1f}x)")


def decode_section(ckpt: str, vocab: int, steps: int, rounds: int, stream: bool) -> None:
    rates = {True: [], False: []}
    cpu_rates = {True: [], False: []}
    moved = {True: 0, False: 0}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            rate, cpu_rate, n = decode_rate(ckpt, on, stream, vocab, steps)
            rates[on].append(rate)
            cpu_rates[on].append(cpu_rate)
            moved[on] = n
            print(f"  round {r + 1} tiers {'on ' if on else 'off'}: {rate:.1f} tokens/s ({cpu_rate:.1f} per CPU "
                  f"second), {n} evicted", flush=True)
    what = (f"steady offload stream ({moved[True]} blocks evicted and offloaded in {steps} steps)"
            if stream else f"nothing to offload ({moved[True]} evicted)")
    for unit, got in (("tokens/s", rates), ("tokens per CPU second", cpu_rates)):
        on_med, off_med = statistics.median(got[True]), statistics.median(got[False])
        ratios = [a / b for a, b in zip(got[True], got[False])]
        print(f"decode, tiers on vs off, {what}: {on_med:.1f} vs {off_med:.1f} {unit} = {on_med / off_med:.3f}x "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="135m", choices=sorted(MODELS))
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=96, help="decode steps measured")
    ap.add_argument("--sections", nargs="+", default=["ttft", "decode", "stream"],
                    choices=["ttft", "decode", "stream"], help="ttft: first token from host/disk vs recompute; "
                    "decode: tiers on with nothing to offload; stream: a steady offload stream")
    ap.add_argument("--quick", action="store_true", help="3m model, 512-token prefix, 32 steps, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.model, args.prefix, args.steps, args.rounds = "3m", 512, 32, 1
    tmp = Path(tempfile.mkdtemp(prefix="tiers-bench-"))
    ckpt = str(build_checkpoint(args.model, Path(tempfile.gettempdir()) / "paged-kv-bench"))
    vocab = MODELS[args.model]["vocab_size"]
    prefix = min(args.prefix, MODELS[args.model]["max_position_embeddings"] - 8)
    print(f"model {args.model} (random weights), block size {BS}, prefix {prefix} tokens, {args.steps} decode steps, "
          f"{args.rounds} rounds, sections {' '.join(args.sections)}", flush=True)

    if "ttft" in args.sections:
        returning_ttft(ckpt, "off", prefix, vocab, tmp)  # warm-up (first engine of the process, caches, allocator)
        ttft_section(ckpt, prefix, vocab, tmp, args.rounds)
    if "decode" in args.sections or "stream" in args.sections:
        decode_rate(ckpt, False, False, vocab, 8)  # warm-up
    if "decode" in args.sections:
        decode_section(ckpt, vocab, args.steps, args.rounds, False)
    if "stream" in args.sections:
        decode_section(ckpt, vocab, args.steps, args.rounds, True)


if __name__ == "__main__":
    main()
