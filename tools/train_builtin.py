"""Train the built-in byte-level Llama model and write it to resources/builtin/ as an HF-style checkpoint.

Why a trained model at all: the explorer must start with no download and still show conversations whose text
reads like language, so the repo ships a tiny model trained here, on text every Python installation carries
(see tools/corpus.py). The output is the same format as any Hugging Face Llama checkpoint (config.json +
model.safetensors with HF parameter names), so one loader serves both.

Usage:

    .venv/bin/python tools/train_builtin.py                 # trains and writes resources/builtin/
    .venv/bin/python tools/train_builtin.py --steps 50 --minutes 2 --out /tmp/b   # a quick smoke run

The training loop stops after --minutes (default 35) of wall clock; corpus building, the final evaluation
and the save add about a minute, so a run ends well inside 40 minutes on 2 CPU cores. The shipped weights
came from the defaults on CPython 3.11.7 and torch 2.13 CPU, on a 2-core machine shared with
other work (see resources/builtin/model.safetensors metadata for the step and figures).

Choices, measured on this machine:
- 258 tokens (256 bytes + BOS 256 + EOS 257); hidden 256, 4 layers, 8 query heads sharing 4 KV heads (GQA, so
  the engine's grouped path is exercised), SwiGLU 688, tied embeddings: about 3.0M parameters, 6 MB in fp16.
- 4096 tokens per step: windows of 256 bytes for the first 60% of training (cheaper per token, and more
  updates while the model learns spelling), then windows of 1024 bytes, so every position up to
  max_position_embeddings (1024) was trained. Windows start anywhere in the stream and may cross document
  boundaries (BOS/EOS mark them).
- AdamW with linear warmup then cosine decay to a tenth of the peak rate. The schedule follows the step count;
  if the wall-clock budget (--minutes) would run out first, it follows elapsed time instead, so the decay
  still completes in time on a busy machine (such a run is no longer bit-reproducible, and says so).
- Held-out bits per byte is evaluated periodically on a fixed slice of held-out windows; the checkpoint with
  the best value is kept (a 2 MB corpus overfits after a few passes), then measured on every held-out window.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import corpus  # noqa: E402

DEFAULT_OUT = ROOT / "resources" / "builtin"
LN2 = math.log(2.0)


def model_classes():
    """(ModelConfig, CausalLM) from engine.model.causal_lm, imported late so --help works without torch models."""
    from engine.model.causal_lm import CausalLM, ModelConfig

    return ModelConfig, CausalLM


def make_config(args: argparse.Namespace):
    """The built-in architecture, as an engine ModelConfig built from HF Llama config keys."""
    ModelConfig, _ = model_classes()
    return ModelConfig.from_hf_dict(hf_config_dict(args))


def hf_config_dict(args: argparse.Namespace) -> dict:
    """config.json contents in Hugging Face Llama format."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 258,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": args.seq_len,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": corpus.BOS_ID,
        "eos_token_id": corpus.EOS_ID,
        "torch_dtype": "float16",
    }


def init_weights(model: torch.nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 style init by parameter name: N(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * num_layers))
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()


def windows_of(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] covering the stream (the last partial one dropped)."""
    n = (stream.numel() - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


@torch.no_grad()
def bits_per_byte(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean negative log2-likelihood of the byte targets (BOS/EOS targets excluded) of every window."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size]
        logits = model.forward_dense(w[:, :-1]).float()  # [B, T, vocab]
        targets = w[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        mask = targets.reshape(-1) < 256
        total += nll[mask].sum().item()
        count += int(mask.sum())
    model.train(was_training)
    return total / count / LN2


def held_out_windows(seq_len: int) -> torch.Tensor:
    """Every held-out window of the corpus of the running Python, [N, seq_len + 1]."""
    _, held = corpus.split_documents()
    return windows_of(torch.tensor(corpus.to_token_stream(held), dtype=torch.long), seq_len)


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` fraction, then cosine from peak down to peak / 10."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def fp16_state_dict(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """HF-named float16 tensors; a tied lm_head is stored once, as model.embed_tokens.weight (as HF does)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to(torch.float16).contiguous().clone()
    return out


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, out_dir: Path, meta: dict) -> None:
    """Write model.safetensors, config.json and generation_config.json."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt", **{k: str(v) for k, v in meta.items()}})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": True,
                  "temperature": 0.8}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def verify_with_transformers(out_dir: Path, model, windows: torch.Tensor) -> float:
    """Max |logits| difference between transformers' LlamaForCausalLM on the saved files and our model (fp32)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(out_dir), torch_dtype=torch.float32)
    hf.eval()
    x = windows[:2, :-1]
    with torch.no_grad():
        ours = model.forward_dense(x).float()
        theirs = hf(input_ids=x).logits.float()
    return (ours - theirs).abs().max().item()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=35.0, help="wall-clock budget for the training loop")
    p.add_argument("--steps", type=int, default=2200, help="optimizer steps (the schedule's length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup as a fraction of training")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step (windows x window length)")
    p.add_argument("--seq-len", type=int, default=1024, help="final window length; also max_position_embeddings")
    p.add_argument("--short-seq-len", type=int, default=256, help="window length of the first phase")
    p.add_argument("--short-fraction", type=float, default=0.6, help="fraction of training in short windows")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--eval-windows", type=int, default=24, help="held-out windows in the periodic evaluation")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-verify", action="store_true", help="skip the transformers cross-check of the saved files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()

    train_docs, held_docs = corpus.split_documents()
    train_stream = torch.tensor(corpus.to_token_stream(train_docs), dtype=torch.long)
    held_windows = windows_of(torch.tensor(corpus.to_token_stream(held_docs), dtype=torch.long), args.seq_len)
    # periodic evaluation: a fixed, evenly spread subset of the held-out windows
    stride = max(1, held_windows.shape[0] // args.eval_windows)
    eval_windows = held_windows[::stride][: args.eval_windows]
    fingerprint = corpus.corpus_fingerprint(train_docs + held_docs)
    print(f"corpus: {corpus.python_version()}, fingerprint {fingerprint}; train {len(train_docs)} documents "
          f"{train_stream.numel()} tokens, held out {len(held_docs)} documents {held_windows.shape[0]} windows "
          f"of {args.seq_len}", flush=True)

    _, CausalLM = model_classes()
    hf_config = hf_config_dict(args)
    cfg = make_config(args)
    model = CausalLM(cfg)
    init_weights(model, args.layers)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params} parameters ({num_params / 1e6:.2f}M), hidden {args.hidden}, layers {args.layers}, "
          f"heads {args.heads}/{args.kv_heads} kv, mlp {args.intermediate}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    budget_s = args.minutes * 60.0
    t_loop = time.monotonic()
    best = (float("inf"), -1, None)  # (held-out bits/byte, step, state)
    time_driven = False
    loss_sum, loss_n = 0.0, 0
    step = 0

    last_eval = -1

    def evaluate_and_keep(at_step: int) -> None:
        nonlocal best, last_eval
        last_eval = at_step
        bpb = bits_per_byte(model, eval_windows)
        mark = ""
        if bpb < best[0]:
            best = (bpb, at_step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            mark = " (best)"
        print(f"eval step {at_step}: held-out {bpb:.4f} bits/byte{mark}", flush=True)

    while step < args.steps:
        elapsed = time.monotonic() - t_loop
        if elapsed >= budget_s:
            print(f"time budget of {args.minutes} minutes reached at step {step}", flush=True)
            break
        progress = step / args.steps
        if elapsed / budget_s > (step + 1) / args.steps:  # behind pace: let the clock drive the decay
            time_driven = True
            progress = elapsed / budget_s
        lr = lr_at(progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr

        seq_len = args.short_seq_len if progress < args.short_fraction else args.seq_len
        starts = torch.randint(0, train_stream.numel() - seq_len - 1, (args.batch_tokens // seq_len,), generator=gen)
        batch = train_stream[starts[:, None] + offsets[None, : seq_len + 1]]  # [B, T + 1]
        logits = model.forward_dense(batch[:, :-1])  # [B, T, vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_sum += loss.item()
        loss_n += 1

        if step % args.log_every == 0:
            el = time.monotonic() - t_loop
            print(f"step {step}/{args.steps}  loss {loss_sum / loss_n:.4f} ({loss_sum / loss_n / LN2:.3f} bits/token)  "
                  f"lr {lr:.2e}  {step * args.batch_tokens / el:.0f} tok/s  T {seq_len}  {el / 60:.1f} min"
                  + ("  [time-driven schedule]" if time_driven else ""), flush=True)
            loss_sum, loss_n = 0.0, 0
        if step % args.eval_every == 0 and seq_len == args.seq_len:  # short-window phases are not candidates
            evaluate_and_keep(step)
    if last_eval != step:
        evaluate_and_keep(step)
    train_minutes = (time.monotonic() - t_loop) / 60

    best_bpb, best_step, best_state = best
    model.load_state_dict(best_state)
    state16 = fp16_state_dict(model, tied=hf_config["tie_word_embeddings"])
    # measure what ships: the fp16 weights, upcast to fp32 as the engine does
    model.load_state_dict({k: v.float() for k, v in state16.items()}, strict=False)
    full_bpb = bits_per_byte(model, held_windows)
    meta = {"python": corpus.python_version(), "corpus_fingerprint": fingerprint, "step": best_step,
            "held_out_bits_per_byte": f"{full_bpb:.4f}", "seed": args.seed,
            "schedule": "time-driven" if time_driven else "step-driven"}
    save_checkpoint(state16, hf_config, args.out, meta)
    size_mb = (args.out / "model.safetensors").stat().st_size / 1e6
    print(f"saved {args.out} (best step {best_step}, {size_mb:.2f} MB); training {train_minutes:.1f} min, "
          f"total {(time.monotonic() - t_start) / 60:.1f} min" + (", time-driven schedule (not bit-reproducible)"
                                                                   if time_driven else ""), flush=True)
    if not args.no_verify:
        diff = verify_with_transformers(args.out, model, held_windows)
        print(f"transformers LlamaForCausalLM on the saved files: max |logit diff| {diff:.2e}", flush=True)
    print(f"final held-out bits/byte: {full_bpb:.4f} ({held_windows.shape[0]} windows of {args.seq_len})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
