"""What vLLM-format KV events cost, side by side in one run.

1. Publishing: ``KVEventPublisher.publish`` of one step's batch (one BlockStored of a full 16-token block, and
   every fourth step a BlockRemoved), with a subscriber following in this process and with nobody following,
   against the built-in engine's own decode step
   on the same machine (16 conversations, block size 16): the ratio is the share of a step that publishing
   would add if done on the engine thread.
2. Reading: the typed fast path (vLLM 0.32's current map form) against the lenient path (old array form) for the
   same batches.
3. Following: batches per second a subscriber applies into its index while a publisher sends flat out.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
