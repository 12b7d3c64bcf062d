"""What vLLM-format KV events cost, side by side in one run.

1. Publishing: ``KVEventPublisher.publish`` of one step's batch (one BlockStored of a full 16-token block, and
   every fourth step a BlockRemoved), with a subscriber following in this process and with nobody following,
   against the built-in engine's own decode step
   on the same machine (16 conversations, block size 16): the ratio is the share of a step that publishing
   would add if done on the engine thread.
2. Reading: the typed fast path (vLLM 0.32's current map form) against the lenient path (old array form) for the
   same batches.
3. Following: batches per second a subscriber applies into its index while a publisher sends flat out.
4. End to end: two built-in engines in this process decoding the same 16 conversations (prompt lengths 32..47 at
   block size 16, so some conversation fills a block nearly every step), taking turns step by step, one of them
   publishing in each round (``kv_events_endpoint`` and a replay socket; a watcher in its own process follows);
   prints the step-time ratio on / off, the timed share of ``Engine._publish_kv_events`` in the publishing
   engine's steps, the ZMQ I/O thread's CPU time, and how late the watcher got the batches (see ``end_to_end``).
   ``--e2e-only`` runs just this part.

Rounds alternate and medians are printed; nothing here is asserted (tests never time).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstream.kv_events import (BlockRemoved, BlockStored, KVEventEndpoint, KVEventPublisher,  # noqa: E402
                                KVEventSubscriber, decode_batch, encode_batch, make_batch)

BLOCK = 16


def step_batches(n: int) -> list[list]:
    out = []
    for i in range(n):
        events = [BlockStored(block_hashes=(i + 1,), parent_block_hash=i or None, token_ids=tuple(range(BLOCK)),
                              block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)]
        if i % 4 == 3:
            events.append(BlockRemoved(block_hashes=(i - 2,), medium="GPU"))
        out.append(events)
    return out


def publish_us(pub: KVEventPublisher, batches: list[list]) -> float:
    t = time.perf_counter()
    for events in batches:
        pub.publish(events)
    return (time.perf_counter() - t) / len(batches) * 1e6


class EngineSteps:
    """The built-in engine decoding 16 conversations; ``time(n)`` is the mean of n decode steps in microseconds."""

    def __init__(self) -> None:
        from engine import Engine, EngineConfig
        self.eng = Engine(EngineConfig(model="builtin", block_size=BLOCK, num_blocks=1024, device="cpu", seed=0))
        for i in range(16):
            self.eng.add_conversation(prompt_token_ids=[(7 * i + j) % 200 + 1 for j in range(32)],
                                      max_new_tokens=900)
        for _ in range(3):
            self.eng.step()  # prefill and warm-up

    def time(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.eng.step()
        return (time.perf_counter() - t) / steps * 1e6


class DecodeEngine:
    """One built-in engine decoding 16 conversations (ignore_eos, so the load stays steady), optionally publishing
    KV events; ``time(n)`` returns the mean of n steps in microseconds and adds the time spent publishing to
    ``publish_s``."""

    def __init__(self, steps_needed: int, endpoint: str | None = None, replay: str | None = None) -> None:
        from engine import Engine, EngineConfig
        self.eng = Engine(EngineConfig(model="builtin", block_size=BLOCK, num_blocks=1024, device="cpu", seed=0,
                                       kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay))
        for i in range(16):
            self.eng.add_conversation(prompt_token_ids=[(7 * i + j) % 200 + 1 for j in range(32 + i)],
                                      max_new_tokens=steps_needed + 8, ignore_eos=True)
        self.publish_s = 0.0
        self.step_s = 0.0
        if endpoint is not None:
            real = self.eng._publish_kv_events

            def timed() -> None:
                t = time.perf_counter()
                real()
                self.publish_s += time.perf_counter() - t
            self.eng._publish_kv_events = timed  # the instance's own: the transaction calls self._publish_kv_events
        for _ in range(3):
            self.eng.step()  # prefill and warm-up
        self.publish_s = 0.0

    def time(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.eng.step()
        took = time.perf_counter() - t
        self.step_s += took
        return took / steps * 1e6

    @property
    def batches(self) -> int:
        out = self.eng._kv_events
        return 0 if out is None else out.publisher.next_seq


_WATCHER = """
import statistics, sys, threading, time, msgspec, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
for endpoint in sys.argv[1:]:
    sub.connect(endpoint)
late, done = [], threading.Event()
def wait_for_eof():
    sys.stdin.read()
    done.set()
def take():
    frames = sub.recv_multipart()
    late.append(time.time() - msgspec.msgpack.decode(frames[2])[0])  # the batch's ts is when it was published
threading.Thread(target=wait_for_eof, daemon=True).start()
print("ready", flush=True)
while not done.is_set():
    if sub.poll(100):
        take()
while sub.poll(200):
    take()
print(len(late), statistics.median(late or [0]) * 1e3, max(late or [0]) * 1e3, flush=True)
"""


def zmq_io_cpu_s() -> float:
    """CPU seconds used so far by this process's ZMQ I/O threads (Linux: /proc's schedstat, in ns; 0.0 elsewhere)."""
    import os
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            if (task / "comm").read_text().startswith("ZMQbg/IO"):
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:
            pass
    return total


def end_to_end(rounds: int, steps: int, d: str) -> None:
    """Two engines decoding the same 16 conversations, taking turns step by step; in each round one of them publishes
    (a watcher in another process follows both) and the other's publisher is set aside.

    Which engine publishes alternates by round, and which steps first every two rounds: two engines built one after
    the other differ by a few percent on their own (measured with neither publishing), which a fixed "on" engine would
    be charged. A pair of rounds (A on, B on) gives one on / off figure, the geometric mean of its two ratios, in
    which that difference cancels. Step by step pairing is what makes the figure steady on a shared machine: rounds
    of blocks varied far more (figures: docs/performance.md, "Benchmark method"). Work that a send leaves to ZMQ's
    I/O thread may land in the other engine's step, so the I/O thread's CPU time is measured too (from /proc) and
    printed as a share of the publishing steps' time; the sum of the two excesses bounds the cost from above."""
    import subprocess
    rounds += rounds % 2  # whole pairs
    engines = [DecodeEngine(rounds * steps + 3, f"ipc://{d}/e2e{i}", f"ipc://{d}/e2er{i}") for i in range(2)]
    outs = [e.eng._kv_events for e in engines]
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER] + [e.eng.kv_events_endpoints[0] for e in engines],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert watcher.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    first = sum(e.batches for e in engines)
    ratios, a_over_b, on_ms, off_ms = [], [], [], []
    publish_s = on_s = 0.0
    io0 = zmq_io_cpu_s()
    for r in range(rounds):
        on_i = r % 2  # the engine publishing this round
        for i, e in enumerate(engines):
            if i == on_i:
                e.eng.manager.events_since_publish()  # what it changed while quiet is not this round's to send
            e.eng._kv_events = outs[i] if i == on_i else None
        p0 = engines[on_i].publish_s
        t = [0.0, 0.0]
        order = (0, 1) if (r // 2) % 2 == 0 else (1, 0)
        for _ in range(steps):
            for i in order:
                t[i] += engines[i].time(1)
        publish_s += engines[on_i].publish_s - p0
        on_s += t[on_i] / 1e6
        ratios.append(t[on_i] / t[1 - on_i])
        a_over_b.append(t[0] / t[1])
        on_ms.append(t[on_i] / steps / 1e3)
        off_ms.append(t[1 - on_i] / steps / 1e3)
    io_s = zmq_io_cpu_s() - io0
    for e, out in zip(engines, outs):
        e.eng._kv_events = out
    time.sleep(0.3)
    watcher.stdin.close()  # the watcher counts what it got and exits
    received, late_med, late_max = watcher.stdout.readline().split()
    watcher.wait(timeout=30)
    sent = sum(e.batches for e in engines) - first
    paired = [(ratios[i] * ratios[i + 1]) ** 0.5 for i in range(0, rounds, 2)]
    on_off = statistics.median(paired)
    print(f"end to end, built-in engine decode step, 16 conversations, {rounds} rounds x {steps} steps per engine: "
          f"publishing {statistics.median(on_ms):.2f} ms, not publishing {statistics.median(off_ms):.2f} ms "
          f"(medians of rounds); on / off = {on_off:.4f} median of {len(paired)} round pairs "
          f"({', '.join(f'{x:.3f}' for x in paired)}); engine A / engine B regardless of publishing = "
          f"{statistics.median(a_over_b):.4f}")
    print(f"  _publish_kv_events: {publish_s * 1e3:.1f} ms of {on_s * 1e3:.0f} ms publishing steps = "
          f"{publish_s / on_s:.3%}; ZMQ I/O threads' CPU {io_s * 1e3:.0f} ms = {io_s / on_s:.2%} of those steps; "
          f"CPU publishing takes, engine thread + I/O thread: {(publish_s + io_s) / on_s:.2%}; on / off - 1 + I/O share "
          f"= {on_off - 1 + io_s / on_s:+.2%}")
    print(f"  {sent} batches in {rounds * steps} publishing steps ({publish_s / max(sent, 1) * 1e6:.0f} us each), "
          f"subscriber got {received}, {float(late_med):.2f} ms after publishing (median; at most "
          f"{float(late_max):.1f} ms)")
    for e in engines:
        e.eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--e2e-rounds", type=int, default=6, help="alternating rounds of the end-to-end part")
    ap.add_argument("--e2e-steps", type=int, default=20, help="decode steps per engine per round")
    ap.add_argument("--e2e-only", action="store_true", help="run only the end-to-end part")
    args = ap.parse_args()
    if args.e2e_only:
        with tempfile.TemporaryDirectory(prefix="kvb", dir="/tmp") as d:
            end_to_end(args.e2e_rounds, args.e2e_steps, d)
        return
    batches = step_batches(args.batches)
    with tempfile.TemporaryDirectory(prefix="kvb", dir="/tmp") as d:
        pub = KVEventPublisher(f"ipc://{d}/p", f"ipc://{d}/r", buffer_size=args.batches)
        sub = KVEventSubscriber([KVEventEndpoint(pub.endpoint, pub.replay_endpoint)]).start()
        time.sleep(0.3)
        lone = KVEventPublisher(f"ipc://{d}/q", f"ipc://{d}/qr", buffer_size=args.batches)  # nobody follows it
        engine = EngineSteps()
        pubs, alone, steps = [], [], []
        for _ in range(args.rounds):  # alternate, so all three see the same machine load
            pubs.append(publish_us(pub, batches))
            alone.append(publish_us(lone, batches))
            steps.append(engine.time(args.steps))
        lone.close()
        deadline = time.monotonic() + 20
        while sub.indexes[0].num_batches < args.rounds * args.batches and time.monotonic() < deadline:
            time.sleep(0.05)
        applied = sub.indexes[0].num_batches
        sub.stop()
        pub.close()
        p, s = statistics.median(pubs), statistics.median(steps)
        print(f"publish one step's batch: {p:.1f} us (median of {args.rounds} x {args.batches}); "
              f"built-in engine decode step, 16 conversations: {s:.0f} us; publish / step = {p / s:.2%}")
        print(f"  with no subscriber thread in this process: {statistics.median(alone):.1f} us "
              f"(the in-process subscriber applying batches competes for the GIL); "
              f"subscriber applied {applied} of {args.rounds * args.batches} batches")

        # reading: typed fast path vs lenient path, same batches
        current = [encode_batch(make_batch(ev, 1.0, 0)) for ev in batches]
        old = [msgspec.msgpack.encode([1.0, [[type(e).__name__, *msgspec.structs.astuple(e)[:6]] for e in ev], 0])
               for ev in batches]
        fast, slow = [], []
        for _ in range(args.rounds):
            for payloads, out in ((current, fast), (old, slow)):
                t = time.perf_counter()
                for payload in payloads:
                    decode_batch(payload)
                out.append((time.perf_counter() - t) / len(payloads) * 1e6)
        f, s2 = statistics.median(fast), statistics.median(slow)
        print(f"decode one batch: current map form {f:.1f} us, old array form {s2:.1f} us "
              f"(old / current = {s2 / f:.2f}x)")

        # following: a publisher flat out, the subscriber applying into its index
        pub = KVEventPublisher(f"ipc://{d}/p2", f"ipc://{d}/r2", buffer_size=args.batches * 2)
        with KVEventSubscriber([KVEventEndpoint(pub.endpoint, pub.replay_endpoint)]) as sub:
            time.sleep(0.3)
            t = time.perf_counter()
            for events in batches:
                pub.publish(events)
            while sub.indexes[0].num_batches < len(batches) and time.perf_counter() - t < 20:
                time.sleep(0.001)
            took = time.perf_counter() - t
            st = sub.status()[0]
        pub.close()
        print(f"follow: {sub.indexes[0].num_batches} batches in {took * 1e3:.0f} ms = "
              f"{sub.indexes[0].num_batches / took:,.0f} batches/s (lost {st.num_lost}, replayed {st.num_replayed})")

        end_to_end(args.e2e_rounds, args.e2e_steps, d)


if __name__ == "__main__":
    main()
