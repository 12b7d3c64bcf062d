"""Fuzz the pool-stream decoder and the recording reader with mutations of real frames (issue 32).

Every mutated input must end in one of two clean outcomes: refused with a StreamError / RecordingError, or
accepted as frames whose pools pass kvstream.poolstream.validate's rules. Anything else (another exception, an
accepted impossible pool, an allocation past the bound) is counted as non-clean and printed.

    python tools/fuzz_poolstream.py --inputs 100000 [--seed 0] [--only decoder|recording]

Mutations: truncation, bit flips, overwritten, inserted, deleted and repeated byte ranges, and, on the decoded
msgpack structure, extreme integers, values of the wrong type, swapped, dropped and repeated fields; in a recording
the mutated frame gets a fresh checksum (so the mutation reaches the decoder instead of the CRC check) or its
length field is changed (the mutations themselves: tools/mutate.py, shared with tools/fuzz_kv_events.py).
tests/test_fuzz_poolstream.py runs the same mutations under hypothesis for a few seconds.
"""
from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from kvstream.poolstream import StreamDecoder, StreamError  # noqa: E402
from kvstream.poolstream.validate import check_snapshot  # noqa: E402
from kvstream.recording import MAGIC, Recorder, RecordingError, open_recording, read_snapshots  # noqa: E402
from tools.mutate import EXTREME_INTS, WRONG_TYPES, mutate_bytes, nodes, set_at  # noqa: E402

MAX_ALLOC = 64 << 20  # the most one input may allocate (traced peak); real frames here take well under 1 MiB
_PREFIX = struct.Struct("<II")


# ---- mutations ----------------------------------------------------------------------------------------------
def mutate_structure(rng: random.Random, payload: bytes) -> bytes:
    """One random mutation of the msgpack structure of ``payload`` (re-encoded): an extreme integer, a value of
    the wrong type, swapped, dropped or repeated list items, a dropped or unknown map key, mutated bytes inside."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):  # an earlier mutation broke the msgpack itself
        return mutate_bytes(rng, payload)
    path, value = rng.choice(list(nodes(obj)))
    kind = rng.randrange(6)
    if kind == 0:
        obj = set_at(obj, path, rng.choice(EXTREME_INTS))
    elif kind == 1:
        obj = set_at(obj, path, rng.choice(WRONG_TYPES))
    elif kind == 2 and isinstance(value, list) and len(value) >= 2:
        i, j = rng.sample(range(len(value)), 2)
        value[i], value[j] = value[j], value[i]
    elif kind == 3 and isinstance(value, list) and value:
        i = rng.randrange(len(value))
        if rng.random() < 0.5:
            del value[i]
        else:
            value.insert(i, value[i])
    elif kind == 4 and isinstance(value, dict) and value:
        if rng.random() < 0.5:
            del value[rng.choice(list(value))]
        else:
            value[rng.choice(["zz", "kind", "i", "p", "num_blocks"])] = rng.choice(EXTREME_INTS + WRONG_TYPES)
    elif isinstance(value, bytes) and value:
        obj = set_at(obj, path, mutate_bytes(rng, value))
    else:
        obj = set_at(obj, path, rng.choice(EXTREME_INTS + WRONG_TYPES))
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, ValueError, OverflowError):
        return mutate_bytes(rng, payload)


def mutate_payload(rng: random.Random, payload: bytes) -> bytes:
    return mutate_structure(rng, payload) if rng.random() < 0.6 else mutate_bytes(rng, payload)


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """(offset of the length prefix, payload length) of each frame of a recording's bytes."""
    (hlen, _) = _PREFIX.unpack_from(data, len(MAGIC))
    at, out = len(MAGIC) + _PREFIX.size + hlen, []
    while at + _PREFIX.size <= len(data):
        length, _ = _PREFIX.unpack_from(data, at)
        out.append((at, length))
        at += _PREFIX.size + length
    return out


def mutate_recording(rng: random.Random, data: bytes, spans: list[tuple[int, int]]) -> bytes:
    """One random mutation of a recording: a frame's payload mutated with a fresh checksum, a length field changed,
    or the file's bytes mutated."""
    kind = rng.randrange(3)
    if kind == 0:
        at, length = rng.choice(spans)
        payload = mutate_payload(rng, data[at + _PREFIX.size:at + _PREFIX.size + length])
        return data[:at] + _PREFIX.pack(len(payload), zlib.crc32(payload)) + payload + \
            data[at + _PREFIX.size + length:]
    if kind == 1:
        at, length = rng.choice(spans)
        new = rng.choice([0, 1, length - 1, length + 1, length * 2, 2 ** 32 - 1, 1 << 30, rng.randrange(2 ** 32)])
        return data[:at] + struct.pack("<I", new % 2 ** 32) + data[at + 4:]
    return mutate_bytes(rng, data)


# ---- outcomes -----------------------------------------------------------------------------------------------
class NotClean(AssertionError):
    """An outcome other than a clean refusal or an accepted pool that can exist."""


def decode_outcome(start: StreamDecoder, payload: bytes) -> str:
    """Feed ``payload`` to a copy of ``start``: "refused" or "accepted"; NotClean otherwise."""
    dec = start.copy()
    if dec.seq is not None:
        dec.snapshot()  # checked whole: the mutated frame is then checked where it changed (as a subscriber does)
    try:
        snap, _events, _seq = dec.feed(payload)
    except StreamError:
        return "refused"
    except Exception as exc:
        raise NotClean(f"decoder raised {type(exc).__name__}: {exc}") from exc
    try:
        check_snapshot(snap)  # every block, from nothing: what the decoder's incremental check accepted must pass
    except StreamError as exc:
        raise NotClean(f"decoder accepted an impossible pool: {exc}") from exc
    return "accepted"


def recording_outcome(path: str) -> str:
    """Read the file at ``path`` every way a program does: "refused" or "accepted"; NotClean otherwise."""
    outcome = "accepted"
    try:
        for _seq, snap, _events in read_snapshots(path):
            check_snapshot(snap)
    except RecordingError:
        outcome = "refused"
    except Exception as exc:
        raise NotClean(f"read_snapshots raised {type(exc).__name__}: {exc}") from exc
    try:
        with open_recording(path) as history:
            for seq in (history.seqs()[len(history) // 2], history.last_seq):
                try:
                    check_snapshot(history.snapshot_at(seq))
                except StreamError:
                    outcome = "refused"
    except RecordingError:
        outcome = "refused"
    except Exception as exc:
        raise NotClean(f"open_recording raised {type(exc).__name__}: {exc}") from exc
    return outcome


def bounded(fn, *args):
    """``fn(*args)``, with the traced allocation peak checked against MAX_ALLOC (when tracemalloc is on; the long
    run bounds the address space instead, see run)."""
    if not tracemalloc.is_tracing():
        try:
            return fn(*args)
        except MemoryError as exc:
            raise NotClean("an input needed more memory than the bound") from exc
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = fn(*args)
    peak = tracemalloc.get_traced_memory()[1] - base
    if peak > MAX_ALLOC:
        raise NotClean(f"allocated {peak / 2 ** 20:.0f} MiB for one input")
    return out


# ---- the corpus -------------------------------------------------------------------------------------------------
def corpus(frames: int = 40):
    """Real frames of the engine workload (keyframes every 8): the payloads and a decoder positioned before each."""
    from tests.poolstream_helpers import encode_all, workload
    _, out = encode_all(workload()[:frames], keyframe_interval=8)
    starts, dec = [], StreamDecoder()
    for f in out:
        starts.append(dec.copy())
        dec.feed(f.payload)
    return out, starts


def recording_bytes(frames) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "base.kvpool")
        with Recorder(path) as rec:
            for f in frames:
                rec.write(f)
        return Path(path).read_bytes()


def _bound_address_space(extra: int) -> None:
    """Let this process grow by at most ``extra`` bytes of address space from now (an input that allocates more
    gets a MemoryError, counted as not clean): the bounded-allocation check of the long run, at no cost per input
    (tracemalloc halves the rate)."""
    import resource
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _count(name: str, inputs: int, make_input, report) -> Counter:
    """Outcomes of ``inputs`` inputs: ``make_input(i)`` gives (what to call it, the outcome function, its
    arguments); a NotClean one is counted and reported."""
    counts = Counter()
    t0 = time.perf_counter()
    for i in range(inputs):
        label, outcome, *args = make_input(i)
        try:
            counts[bounded(outcome, *args)] += 1
        except NotClean as exc:
            counts["not clean"] += 1
            report(f"{label}: {exc}")
        if (i + 1) % 10_000 == 0:
            report(f"  {name}: {i + 1:,} inputs, {time.perf_counter() - t0:.0f} s: {dict(counts)}")
    report(f"{name}: {inputs:,} inputs in {time.perf_counter() - t0:.0f} s: {dict(counts)}")
    return counts


def run(inputs: int, seed: int, only: str | None, report=print, trace: bool = True) -> dict[str, Counter]:
    frames, starts = corpus()
    rng = random.Random(seed)
    results = {}
    if trace:
        tracemalloc.start()
    else:
        _bound_address_space(1 << 30)
    try:
        if only in (None, "decoder"):
            def decoder_input(i: int):
                k = rng.randrange(len(frames))
                return f"decoder input {i} (frame {k})", decode_outcome, starts[k], \
                    mutate_payload(rng, frames[k].payload)
            results["decoder"] = _count("decoder", inputs, decoder_input, report)
        if only in (None, "recording"):
            data = recording_bytes(frames[:12])
            spans = frame_spans(data)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "fuzz.kvpool")

                def recording_input(i: int):
                    Path(path).write_bytes(mutate_recording(rng, data, spans))
                    return f"recording input {i}", recording_outcome, path
                results["recording"] = _count("recording", inputs, recording_input, report)
    finally:
        if trace:
            tracemalloc.stop()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000, help="mutated inputs per decoder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("decoder", "recording"))
    parser.add_argument("--no-trace", action="store_true", help="bound the address space (1 GiB more than at the "
                        "start) instead of tracing each input's allocations (twice as fast)")
    args = parser.parse_args(argv)
    results = run(args.inputs, args.seed, args.only, report=lambda line: print(line, flush=True),
                  trace=not args.no_trace)
    return 1 if any(c["not clean"] for c in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
