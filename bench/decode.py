"""Engine decode throughput vs transformers ``generate`` on the same weights, side by side in one run.

A ~3M-parameter Llama config with random weights, written once with ``save_pretrained`` and loaded by both.
64-token prompts, 128 new tokens, greedy, batch 1 / 16 / 64. Each batch runs both sides ``--rounds`` times,
alternating; prints median tokens/s, the ratio of the medians, the range of the per-round ratios, and checks
that both produced the same tokens.
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


def run_hf(model, batch: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts(batch))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, PROMPT_LEN:].tolist()


def run_engine(path: Path, batch: int) -> tuple[float, list[list[int]]]:
    eng = Engine(EngineConfig(model=str(path), block_size=16, num_blocks=batch * 16 + 16))
    start = time.perf_counter()
    out = eng.generate(prompts(batch), max_new_tokens=NEW_TOKENS)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per side per batch; medians reported")
    parser.add_argument("--compile", action="store_true", help="engine decode attention through torch.compile")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        from engine.attention import use_compiled_attention
        use_compiled_attention(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp))
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
