"""Engine decode throughput vs transformers ``generate`` on the same weights, side by side in one run.

A ~3M-parameter Llama config with random weights, written once with ``save_pretrained`` and loaded by both.
64-token prompts, 128 new tokens, greedy, batch 1 / 16 / 64. Each batch runs both sides ``--rounds`` times,
alternating; prints median tokens/s, the ratio of the medians, the range of the per-round ratios, and checks
that both produced the same tokens. ``--dtype bfloat16`` runs both in bfloat16.

``--choices`` compares the engine's bfloat16 paths instead, each an engine in this process, in alternating rounds on
the same prompts (new ones each round): everything native (the default), decode attention through torch's SDPA
instead of csrc/paged_decode.c, the norms/SwiGLU/rotary through torch's operations instead of
csrc/norm_act_bf16.c, and the linears through F.linear instead of oneDNN's packed bfloat16 GEMM; plus the float32
engine for scale. Decode tok/s = batch * (new - 1) / (time of the run - time of a one-token run); each path's ratio
to the default's per round. ``--model 135m`` takes bench/peers.py's 135M shape instead of the 3M config.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 64, 128


def build_checkpoint(path: Path) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=True, bos_token_id=256, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, 256, (batch, PROMPT_LEN), generator=g).tolist()


DTYPE = "float32"  # --dtype


def run_hf(model, batch: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts(batch))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, PROMPT_LEN:].tolist()


def run_engine(path: Path, batch: int) -> tuple[float, list[list[int]]]:
    eng = Engine(EngineConfig(model=str(path), block_size=16, num_blocks=batch * 16 + 16, dtype=DTYPE))
    start = time.perf_counter()
    out = eng.generate(prompts(batch), max_new_tokens=NEW_TOKENS)
    return time.perf_counter() - start, out


def choices(args) -> None:
    """The engine's bfloat16 paths side by side (see the module docstring)."""
    import engine.model.causal_lm as engine_model
    from engine import native
    from engine.attention import use_native_kernel
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peers

    def plain(weight):
        return None

    variants = {  # name: (dtype, pack, native attention, native elementwise)
        "bf16 native (default)": ("bfloat16", True, True, True),
        "bf16, attention via SDPA": ("bfloat16", True, False, True),
        "bf16, norms/act via torch": ("bfloat16", True, True, False),
        "bf16, F.linear (no packing)": ("bfloat16", False, True, True),
        "float32 engine": ("float32", True, True, True),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = peers.build_checkpoint(args.model, Path(tmp))
        vocab = peers.MODELS[args.model]["vocab_size"]
        for batch in args.batches:
            engines = {}
            for name, (dtype, pack, _, _) in variants.items():
                saved = engine_model._pack_weight
                engine_model._pack_weight = saved if pack else plain
                try:
                    engines[name] = Engine(EngineConfig(model=str(path), block_size=16, dtype=dtype,
                                                        num_blocks=batch * (-(-(PROMPT_LEN + NEW_TOKENS) // 16)) + 16))
                finally:
                    engine_model._pack_weight = saved
            decode: dict[str, list[float]] = {name: [] for name in variants}
            order = list(variants)
            for r in range(args.rounds + 1):  # round 0 warms every path up, untimed
                batch_prompts = peers.prompts(100 + r, batch, vocab)
                one_prompts = peers.prompts(200 + r, batch, vocab)
                for name in order[r % len(order):] + order[: r % len(order)]:
                    _, _, attention_native, elementwise = variants[name]
                    before = (use_native_kernel(attention_native), native.use_bf16_elementwise(elementwise))
                    try:
                        start = time.perf_counter()
                        engines[name].generate(one_prompts, max_new_tokens=1)
                        one = time.perf_counter() - start
                        start = time.perf_counter()
                        engines[name].generate(batch_prompts, max_new_tokens=NEW_TOKENS)
                        full = time.perf_counter() - start
                    finally:
                        use_native_kernel(before[0])
                        native.use_bf16_elementwise(before[1])
                    if r:
                        decode[name].append(batch * (NEW_TOKENS - 1) / (full - one))
            default = decode[order[0]]
            print(f"{args.model} model, batch {batch}, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, "
                  f"{args.rounds} rounds")
            print(f"  {'path':<30} {'decode tok/s':>13} {'x default (range)':>22}")
            for name in variants:
                ratios = [a / b for a, b in zip(decode[name], default)]
                print(f"  {name:<30} {statistics.median(decode[name]):>13.0f} {statistics.median(ratios):>9.2f} "
                      f"({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    global NEW_TOKENS, DTYPE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per side per batch; medians reported")
    parser.add_argument("--compile", action="store_true", help="engine decode attention through torch.compile")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both sides' weights, activations and KV cache")
    parser.add_argument("--choices", action="store_true", help="the engine's bfloat16 paths side by side instead")
    parser.add_argument("--model", choices=("3m", "135m"), default="3m", help="with --choices: which shape")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens generated per prompt")
    args = parser.parse_args()
    NEW_TOKENS, DTYPE = args.new_tokens, args.dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.choices:
        return choices(args)
    if args.compile:
        from engine.attention import use_compiled_attention
        use_compiled_attention(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp))
        if DTYPE == "bfloat16":  # as a user loads it: from_pretrained keeps the rotary frequencies in float32
            model = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
        params = sum(p.numel() for p in model.parameters())
        print(f"model: {params / 1e6:.2f}M parameters; prompts {PROMPT_LEN} tokens, {NEW_TOKENS} new tokens, greedy")
        print(f"{'batch':>5} {'transformers tok/s':>19} {'engine tok/s':>13} {'ratio':>6} {'rounds':>11} {'same tokens':>12}")
        run_engine(Path(tmp), 1)  # warm-up both
        run_hf(model, 1)
        for batch in args.batches:
            if args.compile:  # compile the kernels for this batch's shapes outside the timed run
                run_engine(Path(tmp), batch)
            times_hf, times_en = [], []
            for _ in range(args.rounds):  # alternate the two, so that machine noise hits both alike
                t_hf, out_hf = run_hf(model, batch)
                t_en, out_en = run_engine(Path(tmp), batch)
                times_hf.append(t_hf)
                times_en.append(t_en)
            t_hf, t_en = statistics.median(times_hf), statistics.median(times_en)
            ratios = sorted(a / b for a, b in zip(times_hf, times_en))
            tokens = batch * NEW_TOKENS
            same = sum(a == b for a, b in zip(out_hf, out_en))
            print(f"{batch:>5} {tokens / t_hf:>19.0f} {tokens / t_en:>13.0f} {t_hf / t_en:>6.2f} "
                  f"{ratios[0]:>5.2f}-{ratios[-1]:<5.2f} {same:>6}/{batch}")

if __name__ == "__main__":
    main()
