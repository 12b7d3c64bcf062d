"""The bfloat16 panel GEMM (engine/native/csrc/small_gemm_bf16.c) and the bfloat16 one-call decode step, side by side with
what they replace, in one process, alternating rounds.

1. Kernels: a 135M-shape decode step's 121 linears (30 layers' q|k|v, o, gate|up, down and the tied head) at
   ``--rows`` rows, once through oneDNN's packed bfloat16 GEMM (what the engine took before) and once through the
   panel GEMM; best and median of the rounds, and the weights' read rate at the best.
2. Engine: bench/peers.py's checkpoint of ``--model`` in bfloat16, one engine, decode steps timed one by one
   (``--batch`` sequences, 64-token prompts) with three settings in turn: everything native (the default: the
   one-call step over the panel GEMM), layer by layer from Python over the panel GEMM (``native.decode_stack``
   answering None), and oneDNN's GEMM (``native.use_bf16_gemm(False)``, which also turns the one-call step off);
   where the machine has them, the ``vdpbf16ps`` walk instead of AMX tiles, and decode attention in its own float32
   order instead of torch's (``native.use_bf16_torch_order(False)``).
   Prints each setting's median and fastest step and the ratios of the medians; the tokens of the three are
   compared (no prefix cache: every run computes its prompts the same way; the panel GEMM sums in another order
   than oneDNN, so those two may part where two logits are within a rounding).

    python bench/bf16_gemm.py [--model 135m|3m] [--batch 16] [--rounds 5] [--threads 0] [--rows 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as main.py sets it, before torch's OpenMP starts
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import peers  # noqa: E402
from engine import Engine, EngineConfig, native  # noqa: E402


def kernels(rows: int, rounds: int) -> None:
    m = peers.MODELS["135m"]
    h, inter, heads, kv = m["hidden_size"], m["intermediate_size"], m["num_attention_heads"], m["num_key_value_heads"]
    dim = h // heads
    shapes = [((heads + 2 * kv) * dim, h), (h, heads * dim), (2 * inter, h), (h, inter)] * m["num_hidden_layers"]
    shapes.append((m["vocab_size"], h))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes]
    xs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in shapes}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    panels = [native.pack_panels(w) for w in weights]

    def onednn():
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def panel():
        for w, p in zip(weights, panels):
            native.panel_linear(xs[w.shape[1]], p, w.shape[0], None)

    def walk(amx: bool):
        def run():
            previous = native.use_bf16_amx(amx)
            try:
                panel()
            finally:
                native.use_bf16_amx(previous)
        return run

    runs = {"oneDNN packed bf16 GEMM": onednn, "panel GEMM, vdpbf16ps walk": walk(False)}
    if native.bf16_amx():
        runs["panel GEMM, AMX walk"] = walk(True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):  # round 0 warms up, untimed
        for name in (list(runs) if r % 2 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    total = sum(w.numel() * 2 for w in weights)
    print(f"135M shape's {len(shapes)} linears at {rows} rows, bfloat16, {rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    base = statistics.median(times["oneDNN packed bf16 GEMM"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:<32} median {med * 1e3:7.1f} ms  best {min(values) * 1e3:7.1f} ms  "
              f"{total / min(values) / 1e9:5.1f} GB/s at best  x oneDNN {base / med:.2f}")


def engine_steps(model: str, batch: int, rounds: int, new_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = peers.build_checkpoint(model, Path(tmp))
        eng = Engine(EngineConfig(model=str(path), block_size=16, dtype="bfloat16", enable_prefix_caching=False,
                                  num_blocks=batch * (-(-(peers.PROMPT_LEN + new_tokens) // 16)) + 16))
    vocab = peers.MODELS[model]["vocab_size"]
    stack = native.decode_stack
    amx = native.bf16_amx()
    order = native.bf16_torch_order()
    settings = {"all native (one call, panel GEMM)": (True, stack, amx, order),
                "layer by layer, panel GEMM": (True, lambda *a: None, amx, order),
                "oneDNN GEMM, layer by layer": (False, stack, amx, order)}
    if amx:
        settings["all native, vdpbf16ps walk"] = (True, stack, False, order)
    if order:
        settings["all native, attention's own order"] = (True, stack, amx, False)
    steps: dict[str, list[float]] = {name: [] for name in settings}
    tokens: dict[str, list] = {}
    real_step = eng.step_unprotected
    current: list[float] = []

    def timed_step():
        start = time.perf_counter()
        real_step()
        if not eng.last_step_prefill:
            current.append(time.perf_counter() - start)
    eng.step_unprotected = timed_step
    for r in range(rounds + 1):  # round 0 warms up, untimed
        prompts = peers.prompts(300 + r, batch, vocab)
        order = list(settings)
        for name in order[r % len(order):] + order[: r % len(order)]:
            gemm, decode_stack, walk_amx, torch_order = settings[name]
            previous, previous_amx = native.use_bf16_gemm(gemm), native.use_bf16_amx(walk_amx)
            previous_order = native.use_bf16_torch_order(torch_order)
            native.decode_stack = decode_stack
            current.clear()
            try:
                tokens.setdefault(name, []).append(eng.generate(prompts, max_new_tokens=new_tokens))
            finally:
                native.use_bf16_gemm(previous)
                native.use_bf16_amx(previous_amx)
                native.use_bf16_torch_order(previous_order)
                native.decode_stack = stack
            if r:
                steps[name].extend(current)
    print(f"{model} model in bfloat16, batch {batch}, {peers.PROMPT_LEN}-token prompts, {new_tokens} new tokens, "
          f"{rounds} rounds ({sum(map(len, steps.values()))} decode steps), {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    base = statistics.median(steps[next(iter(settings))])
    for name, values in steps.items():
        med = statistics.median(values)
        print(f"  {name:<38} step median {med * 1e3:7.1f} ms  fastest {min(values) * 1e3:7.1f} ms  "
              f"its time / all native's {med / base:.2f}")
    first = tokens[next(iter(settings))]
    print("  tokens equal to all native's: " + ", ".join(
        f"{name}: {sum(a == b for a, b in zip(first, tokens[name]))} of {len(first)} runs" for name in settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(peers.MODELS), default="135m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=9)
    parser.add_argument("--rows", type=int, default=16, help="rows of the kernel comparison")
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.kernel() is None:
        sys.exit(f"the native kernels are unavailable: {native.error()}")
    if not args.skip_kernels:
        kernels(args.rows, args.rounds)
    engine_steps(args.model, args.batch, args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
