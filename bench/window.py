"""What a sliding window saves: blocks held, and decode time at a long context, against full attention.

Two checkpoints with the same random weights (a ~3M-parameter Llama shape, 4 layers): one whose every layer slides
(MistralForCausalLM, ``sliding_window`` 512: one sliding-window KV cache group) and one with full attention
(``sliding_window`` null). Printed, side by side in one run:

1. Blocks: one conversation grown to 4,096 tokens; the most blocks its table held at once in the sliding group, the
   bound ``ceil(window / block_size) + 1``, and the ``4096 / block_size`` full attention holds.
2. Decode at 4,096 tokens of context: ``--batch`` conversations prefilled to 4,096 - ``--steps`` tokens, then
   ``--steps`` decode steps timed, windowed and full alternately for ``--rounds`` rounds (median ms a step, and the
   ratio). The attention share of a step is measured the same way with attention replaced by a stub that returns
   zeros (same shapes): share = 1 - stub / real. The window's saving should be about the full model's attention share
   times (1 - window / context).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig  # noqa: E402
from engine import attention  # noqa: E402
from engine.kv.groups import ABSENT  # noqa: E402
from engine.model.causal_lm import CausalLM, ModelConfig  # noqa: E402

CONTEXT, WINDOW = 4096, 512


def write(path: Path, window: int | None) -> str:
    d = dict(architectures=["MistralForCausalLM"], vocab_size=258, hidden_size=256, intermediate_size=688,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=CONTEXT + 64, hidden_act="silu", sliding_window=window, rms_norm_eps=1e-5)
    model = CausalLM(ModelConfig.from_hf_dict(d))
    model.init_weights(0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return str(path)


def blocks_held(model: str, block_size: int) -> int:
    """Most live blocks one conversation's table held at once while growing to CONTEXT tokens."""
    eng = Engine(EngineConfig(model=model, block_size=block_size, num_blocks=CONTEXT // block_size + 8))
    cid = eng.add_conversation(prompt_token_ids=[(7 * i) % 250 for i in range(CONTEXT - 64)], max_new_tokens=64,
                               ignore_eos=True)
    most = 0
    while eng.has_work():
        eng.step()
        seq = eng.seqs[cid]
        most = max(most, sum(b != ABSENT for b in seq.block_table))
    return most


def decode_engine(model: str, batch: int, block_size: int, steps: int) -> Engine:
    eng = Engine(EngineConfig(model=model, block_size=block_size, num_blocks=batch * (CONTEXT // block_size + 2),
                              max_num_batched_tokens=1024))
    for b in range(batch):
        eng.add_conversation(prompt_token_ids=[(b + 3 * i) % 250 for i in range(CONTEXT - steps)],
                             max_new_tokens=steps + 1, ignore_eos=True)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()  # prefill everyone (each then decodes one token a step)
    return eng


def time_steps(eng: Engine, steps: int) -> float:
    """Median seconds of ``steps`` decode steps, rolled back afterwards so the next round decodes the same."""
    times = []
    with eng.transaction(rollback=True):
        for _ in range(steps):
            start = time.perf_counter()
            eng.step_unprotected()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def stub_attention(q, key_cache, value_cache, meta, scale, block_size, *rest):
    return torch.zeros_like(q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bs = args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        windowed = write(Path(tmp) / "window", WINDOW)
        full = write(Path(tmp) / "full", None)
        print(f"1. blocks held by one {CONTEXT}-token conversation, block size {bs}:")
        held_w, held_f = blocks_held(windowed, bs), blocks_held(full, bs)
        bound = math.ceil(WINDOW / bs) + 1
        print(f"   sliding window {WINDOW}: at most {held_w} blocks (bound ceil({WINDOW}/{bs}) + 1 = {bound}); "
              f"full attention: {held_f} ({CONTEXT}/{bs} = {CONTEXT // bs})")
        assert held_w <= bound
        print(f"2. decode at {CONTEXT} tokens of context, batch {args.batch}, {args.steps} steps, "
              f"{args.rounds} rounds (median ms a step):")
        engines = {"window": decode_engine(windowed, args.batch, bs, args.steps),
                   "full": decode_engine(full, args.batch, bs, args.steps)}
        stack = engines["full"].model.stack  # both layer by layer (a windowed model never takes the one-call step)
        engines["full"].model.stack = None
        real = {name: [] for name in engines}
        stub = {name: [] for name in engines}
        one_call = []
        for _ in range(args.rounds):
            engines["full"].model.stack = stack
            one_call.append(time_steps(engines["full"], args.steps))
            engines["full"].model.stack = None
            for name, eng in engines.items():
                real[name].append(time_steps(eng, args.steps))
                eng.runner.attend, kept = stub_attention, eng.runner.attend
                try:
                    stub[name].append(time_steps(eng, args.steps))
                finally:
                    eng.runner.attend = kept
        for name in engines:
            r, s = statistics.median(real[name]), statistics.median(stub[name])
            print(f"   {name:6s}: {1e3 * r:7.2f} ms a step; without attention {1e3 * s:7.2f} ms: attention "
                  f"{100 * (1 - s / r):4.1f}% of the step")
        print(f"   full attention through the one-call decode step: {1e3 * statistics.median(one_call):7.2f} ms")
        ratio = statistics.median(real["full"]) / statistics.median(real["window"])
        share = 1 - statistics.median(stub["full"]) / statistics.median(real["full"])
        print(f"   window / full: {ratio:.2f}x faster (attention share of the full step {100 * share:.1f}%; "
              f"reading {WINDOW}/{CONTEXT} of the keys predicts {1 / (1 - share * (1 - WINDOW / CONTEXT)):.2f}x)")
        print(f"   native kernel: {attention.decodes_natively(attention.attend_batch)}")


if __name__ == "__main__":
    main()
