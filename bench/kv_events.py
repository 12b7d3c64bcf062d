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
   block size 16, so some conversation fills a block nearly every step), one with ``kv_events_endpoint`` (and a
   replay socket, a raw SUB socket connected) and one without, timed in alternating rounds; prints the step-time
   ratio on / off and the timed share of ``Engine._publish_kv_events`` in the publishing engine's steps.
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
import sys, threading, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
count, done = [0], threading.Event()
def wait_for_eof():
    sys.stdin.read()
    done.set()
threading.Thread(target=wait_for_eof, daemon=True).start()
print("ready", flush=True)
while not done.is_set():
    if sub.poll(100):
        sub.recv_multipart()
        count[0] += 1
while sub.poll(200):
    sub.recv_multipart()
    count[0] += 1
print(count[0], flush=True)
"""


def end_to_end(rounds: int, steps: int, d: str) -> None:
    import zmq
    on = DecodeEngine(rounds * steps + 3, f"ipc://{d}/e2e", f"ipc://{d}/e2er")
    off = DecodeEngine(rounds * steps + 3)
    # the watcher in a process of its own, as a router or the explorer is: an in-process SUB would share this
    # process's ZMQ I/O thread and the GIL, which a real subscriber does not
    import subprocess
    import sys
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, on.eng.kv_events_endpoints[0]],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert watcher.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    first_batch = on.batches
    t_on, t_off, paired = [], [], []
    for r in range(rounds):
        # Within a round the two engines take turns step by step (which goes first alternates by round), so a
        # change in machine load falls on both; each round's figure is the sum of its steps.
        on_us = off_us = 0.0
        for _ in range(steps):
            a, b = ((on.time(1), off.time(1)) if r % 2 == 0 else tuple(reversed((off.time(1), on.time(1)))))
            on_us, off_us = on_us + a, off_us + b
            paired.append(a / b)
        t_on.append(on_us / steps)
        t_off.append(off_us / steps)
    time.sleep(0.3)
    watcher.stdin.close()  # the watcher counts what it got and exits
    received = int(watcher.stdout.readline())
    watcher.wait(timeout=30)
    sent = on.batches - first_batch
    ratios = [a / b for a, b in zip(t_on, t_off)]
    print(f"end to end, built-in engine decode step, 16 conversations, {rounds} rounds x {steps} steps each: "
          f"publishing {statistics.median(t_on) / 1e3:.1f} ms, not publishing {statistics.median(t_off) / 1e3:.1f} ms "
          f"(medians of rounds); on / off = {statistics.median(ratios):.4f} median of rounds "
          f"({', '.join(f'{x:.3f}' for x in ratios)}), {statistics.median(paired):.4f} median of paired steps, "
          f"{sum(t_on) / sum(t_off):.4f} of totals")
    print(f"  _publish_kv_events: {on.publish_s * 1e3:.1f} ms of {on.step_s * 1e3:.0f} ms timed steps = "
          f"{on.publish_s / on.step_s:.3%} of the publishing engine's step time; {sent} batches in "
          f"{rounds * steps} steps ({on.publish_s / max(sent, 1) * 1e6:.0f} us each), subscriber got {received}")
    on.eng.close()


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
