"""Pool-stream benchmarks, measured side by side in one run on the real engine (print figures, assert nothing).

1. record: cost of encoding a frame and writing it to a recording at 65,536 blocks with 256 conversations decoding
   (target: at most 1 ms per frame on top of the step), and decode speed with recording against without it: two
   engines taking turns step by step, one of them recording in each round (target: at least 0.95x). Then as the
   app records, on the fanout's own thread: the engine thread's cost per step, and decode with recording against
   without in alternating blocks of steps of one engine.
2. jump: a recording of --jump-steps steps (default 10,000) of the same workload, kept at 256 conversations by
   adding one whenever one finishes; then opening it and jumping to random frames, to the frames furthest from a
   keyframe (the worst case) and scrubbing one frame back and forth (target: at most 50 ms per jump).
3. bytes: bytes per frame on disk for the busy demo (the app's default pool of 128 blocks) and the crowd demo
   (4,096 and 65,536 blocks).

    python bench/stream.py [--sections record,jump,bytes] [--jump-steps 10000] [--rounds 10] [--steps-per-round 8]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, EngineConfig  # noqa: E402
from explorer.feeds.demo import seed_busy, seed_crowd, seed_many  # noqa: E402
from kvstream.poolstream import StreamEncoder  # noqa: E402
from kvstream.recording import Recorder, open_recording  # noqa: E402

BIG = dict(model="builtin", num_blocks=65536, block_size=16)  # the pool of the performance targets
CONVERSATIONS = 256


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def take_events(engine):
    take = getattr(engine, "take_events", None)
    return take() if take is not None else []


def heavy_engine(max_new_tokens: int) -> Engine:
    engine = Engine(EngineConfig(**BIG))
    seed_many(engine, CONVERSATIONS, max_new_tokens=max_new_tokens, ignore_eos=True)
    for _ in range(3):  # prefill
        engine.step()
    take_events(engine)
    return engine


def bench_record(rounds: int, steps: int) -> None:
    """Two engines with the same 256 conversations take turns step by step; in each round one of them records
    (encode + write to a file) and which one alternates, so the few percent by which two engines differ on their own
    cancels in each pair of rounds (geometric mean of its two ratios). Rounds of one engine switching recording on
    and off varied far more on a shared machine than step by step pairs do (figures: docs/performance.md,
    "Benchmark method")."""
    rounds += rounds % 2
    print(f"== record: {BIG['num_blocks']} blocks, {CONVERSATIONS} conversations decoding, two engines taking turns "
          f"step by step, {rounds} rounds of {steps} steps, one of them recording in each")
    engines = [heavy_engine(max_new_tokens=rounds * steps + 16) for _ in range(2)]
    d = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    encoders = [StreamEncoder() for _ in engines]
    recorders = [Recorder(d / f"record{i}.kvpool") for i in range(2)]
    for engine, encoder, recorder in zip(engines, encoders, recorders):
        snap = engine.snapshot()
        recorder.write(encoder.encode(snap, take_events(engine), engine.change_record(snap)))
    pending = [[], []]  # events since a quiet engine's last frame (its next frame carries them: as a live source)
    ratios, rec_ms, base_ms, encode_ms, write_ms, sizes = [], [], [], [], [], []
    for r in range(rounds):
        on = r % 2  # the engine recording this round
        t = [0.0, 0.0]
        order = (0, 1) if (r // 2) % 2 == 0 else (1, 0)
        for _ in range(steps):
            for i in order:
                engine = engines[i]
                start = time.perf_counter()
                engine.step()
                snap = engine.snapshot()  # the runner snapshots every step either way (the GUI's latest)
                events = take_events(engine)
                if i == on:
                    t0 = time.perf_counter()
                    frame = encoders[i].encode(snap, pending[i] + events, engine.change_record(snap))  # as the app
                    t1 = time.perf_counter()
                    recorders[i].write(frame)
                    t2 = time.perf_counter()
                    pending[i] = []
                    encode_ms.append((t1 - t0) * 1e3)
                    write_ms.append((t2 - t1) * 1e3)
                    sizes.append(len(frame.payload))
                else:
                    pending[i] += events
                t[i] += time.perf_counter() - start
        ratios.append(t[1 - on] / t[on])  # speed with recording / without
        rec_ms.append(t[on] / steps * 1e3)
        base_ms.append(t[1 - on] / steps * 1e3)
    for recorder in recorders:
        recorder.close()
    paired = [(ratios[i] * ratios[i + 1]) ** 0.5 for i in range(0, rounds, 2)]
    cost = [e + w for e, w in zip(encode_ms, write_ms)]
    print(f"step without recording: {statistics.median(base_ms):.1f} ms (median of rounds); with: "
          f"{statistics.median(rec_ms):.1f} ms")
    print(f"decode with recording / without: {statistics.median(paired):.3f}x median of {len(paired)} round pairs "
          f"({', '.join(f'{x:.3f}' for x in paired)})")
    print(f"encode: median {statistics.median(encode_ms):.3f} ms, p90 {pct(encode_ms, 0.9):.3f} ms; write+flush: "
          f"median {statistics.median(write_ms):.3f} ms; encode+write median {statistics.median(cost):.3f} ms, "
          f"p90 {pct(cost, 0.9):.3f} ms, max {max(cost):.3f} ms ({len(cost)} frames)")
    print(f"bytes per frame: median {statistics.median(sizes):.0f}")
    del engines
    bench_record_threaded(rounds, steps)


def bench_record_threaded(rounds: int, steps: int) -> None:
    """As the app records: a threaded FrameFanout (kvstream/fanout.py) encodes and writes on its own thread, and
    the engine thread only hands the snapshot over. One engine, blocks of ``steps`` steps with the fanout fed and
    without, alternating (two engines taking turns would put the fanout's work into the other engine's steps):
    the engine thread's cost per step, and decode with recording against without, per adjacent pair of blocks."""
    from kvstream.fanout import FrameFanout
    blocks = 2 * rounds + 1  # starts and ends without recording
    engine = heavy_engine(max_new_tokens=blocks * steps + 16)  # decoding all along
    print(f"== record, threaded (as the app): one engine, {blocks} blocks of {steps} steps, recording in every "
          "other one")
    path = Path(tempfile.mkdtemp(prefix="bench-stream-")) / "threaded.kvpool"
    recorder = Recorder(path)
    fanout = FrameFanout([recorder], threaded=True)
    fanout(engine.snapshot(), take_events(engine))
    fanout.flush()
    handed, times, pending = [], [], []
    for b in range(blocks):
        on = b % 2 == 1
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
            snap, events = engine.snapshot(), take_events(engine)
            if on:
                t0 = time.perf_counter()
                fanout(snap, pending + events)
                handed.append((time.perf_counter() - t0) * 1e3)
                pending = []
            else:
                pending += events
        if on:
            fanout.flush()  # inside the block: the frames it encodes are paid for by the steps they came from
        times.append(time.perf_counter() - start)
    fanout.close()
    # each recording block against the mean of the blocks on either side of it (steps slow down as the contexts
    # grow: a neighbour on one side only would count that drift); the first two blocks warm up
    ratios = [(times[i - 1] + times[i + 1]) / 2 / times[i] for i in range(3, blocks - 1, 2)]  # without / with
    print(f"engine-thread cost per frame: median {statistics.median(handed):.3f} ms, max {max(handed):.3f} ms; "
          f"decode with recording / without: {statistics.median(ratios):.3f}x median of {len(ratios)} blocks "
          f"({', '.join(f'{x:.3f}' for x in ratios)}); {fanout.frames} frames, {path.stat().st_size / 2**20:.1f} MiB")


def record_jump_workload(num_steps: int) -> Path:
    print(f"== jump: a {num_steps}-step recording, {BIG['num_blocks']} blocks, {CONVERSATIONS} conversations "
          "decoding (replenished as they finish)")
    rng = random.Random(0)
    engine = Engine(EngineConfig(**BIG))
    live = [engine.add_conversation(f"Conversation {i}: tell me about page number {i * 7}.", ignore_eos=True,
                                    max_new_tokens=rng.randrange(100, 900), temperature=0.8, seed=i)
            for i in range(CONVERSATIONS)]
    path = Path(tempfile.mkdtemp(prefix="bench-stream-")) / "jump.kvpool"
    encoder = StreamEncoder()
    added = CONVERSATIONS
    cost, start = [], time.perf_counter()
    with Recorder(path) as recorder:
        for step in range(num_steps):
            engine.step()
            snap, events = engine.snapshot(), take_events(engine)
            t0 = time.perf_counter()
            recorder.write(encoder.encode(snap, events, engine.change_record(snap)))
            cost.append(time.perf_counter() - t0)
            snap_convs = {c.conversation_id: c for c in engine.conversations()} if step % 8 == 0 else None
            if snap_convs is not None:
                for i, cid in enumerate(live):
                    if not snap_convs[cid].is_live:
                        live[i] = engine.add_conversation(
                            f"Conversation {added}: tell me about page number {added * 7}.", ignore_eos=True,
                            max_new_tokens=rng.randrange(100, 900), temperature=0.8, seed=added)
                        added += 1
            if (step + 1) % 1000 == 0:
                print(f"  {step + 1} steps, {time.perf_counter() - start:.0f} s, {path.stat().st_size / 2**20:.0f} MiB")
    metrics = engine.snapshot().metrics
    size = path.stat().st_size
    print(f"recorded {recorder.frames_written} frames, {size / 2**20:.1f} MiB ({size / recorder.frames_written:.0f} "
          f"bytes/frame incl. keyframes); {added} conversations, {metrics.num_evictions} evictions; "
          f"encode + write: median {statistics.median(cost) * 1e3:.2f} ms, p99 {pct(cost, 0.99) * 1e3:.2f} ms")
    return path


def bench_jump(path: Path) -> None:
    print(f"== jump: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    t0 = time.perf_counter()
    history = open_recording(path)
    print(f"open: {time.perf_counter() - t0:.2f} s for {len(history)} frames "
          f"({len(history.keyframe_seqs())} keyframes)")
    gc.collect()
    gc.freeze()  # as the app does once a recording is open (explorer/feeds/stream_feed.py): full collections skip it
    from explorer.window.app import GC_GEN0
    gc.set_threshold(max(gc.get_threshold()[0], GC_GEN0), *gc.get_threshold()[1:])  # as the window sets it
    keys = history.keyframe_seqs() + [history.last_seq + 1]
    worst = [k - 1 for k in keys[1:]]  # the frame before each keyframe: the longest run of deltas to decode
    rng = random.Random(1)

    def timed(seq, cold):  # (wall ms, CPU ms): CPU time is what the jump costs when the machine is shared
        if cold:
            history.drop_cache()  # nothing cached helps: decode from the keyframe before it
        t, c = time.perf_counter(), time.process_time()
        history.snapshot_at(seq)
        return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3

    def show(what, runs):
        wall, cpu = [w for w, _ in runs], [c for _, c in runs]
        print(f"{what}: wall median {statistics.median(wall):.1f} ms, max {max(wall):.1f} ms; CPU median "
              f"{statistics.median(cpu):.1f} ms, max {max(cpu):.1f} ms ({len(runs)} jumps)")

    show("jump, cold, random frame", [timed(rng.randrange(len(history)), True) for _ in range(30)])
    show("jump, cold, frame before a keyframe (worst)", [timed(s, True) for s in rng.sample(worst, min(15, len(worst)))])
    show("jump, warm (decode cache, checkpoints), random frame",
         [timed(s, False) for s in rng.sample(range(len(history)), 30)])

    def jump_then_back(seq):  # a cold jump to the end of a run, then the first step back (the costliest step back)
        timed(seq, True)
        return timed(seq - 1, False)

    show("one frame back right after a cold jump to a run's end (worst step back)",
         [jump_then_back(s) for s in rng.sample(worst, min(15, len(worst)))])
    mid = worst[len(worst) // 2]
    show("scrub one frame back, then forward",
         [timed(s, False) for s in list(range(mid, mid - 40, -1)) + list(range(mid - 40, mid))])
    history.close()


def bench_bytes(max_steps: int) -> None:
    print("== bytes per frame on disk")
    for name, seed, blocks in (("busy", seed_busy, 128), ("crowd", seed_crowd, 4096), ("crowd", seed_crowd, 65536)):
        engine = Engine(EngineConfig(model="builtin", num_blocks=blocks, block_size=16))
        seed(engine)
        path = Path(tempfile.mkdtemp(prefix="bench-stream-")) / f"{name}.kvpool"
        encoder = StreamEncoder()
        deltas, keys = [], []
        with Recorder(path) as recorder:
            for _ in range(max_steps):
                if not engine.has_work():
                    break
                engine.step()
                snap = engine.snapshot()
                frame = encoder.encode(snap, take_events(engine), engine.change_record(snap))
                recorder.write(frame)
                (keys if frame.keyframe else deltas).append(len(frame.payload))
        frames = len(deltas) + len(keys)
        print(f"{name:5s} {blocks:6d} blocks, {len(engine.conversations()):3d} conversations, {frames} frames: "
              f"{path.stat().st_size / frames:.0f} bytes/frame on disk; deltas median {statistics.median(deltas):.0f}"
              f" (max {max(deltas)}), keyframes median {statistics.median(keys):.0f} ({len(keys)} of them)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="record,jump,bytes")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=8)
    parser.add_argument("--jump-steps", type=int, default=10000)
    parser.add_argument("--jump-file", type=Path, help="jump around this recording instead of recording one")
    parser.add_argument("--bytes-steps", type=int, default=400)
    args = parser.parse_args()
    sections = args.sections.split(",")
    if "bytes" in sections:
        bench_bytes(args.bytes_steps)
    if "record" in sections:
        bench_record(args.rounds, args.steps_per_round)
    if "jump" in sections:
        bench_jump(args.jump_file or record_jump_workload(args.jump_steps))


if __name__ == "__main__":
    main()
