"""History widget benchmarks, measured side by side in one run (print figures, assert nothing).

1. Timeline: one live update (new range, the new frame's marks, a synchronous repaint) at 1000 x 80 px over
   10,000 frames, with 0, 5,000 and 50,000 marks kept: median ms, the ratio to the mark-free update, and the share
   of a 33 ms frame (30 updates a second).
2. Event log: appending one frame of 300 events (9,000 events a second at 30 frames/s) to a log already holding
   its 10,000-line cap, with a repaint, under the default, all-kinds and block filters; and one filter change over
   10,000 lines.
3. A block's history over 100,000 events with a relocation of 65,536 blocks in the middle.

Times are CPU milliseconds of this process (median), so that other work on a shared machine does not count.

    QT_QPA_PLATFORM=offscreen python bench/history_widgets.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from PySide6 import QtWidgets  # noqa: E402

import explorer  # noqa: E402,F401  (Qt compatibility fix before any Qt call)
from explorer.model.block_history import block_history  # noqa: E402
from explorer.widgets.eventlog import EventLog  # noqa: E402
from explorer.widgets.timeline import Timeline  # noqa: E402
from kvstream.events import NOTABLE_KINDS, BlockEvent, EventKind  # noqa: E402

FRAME_MS = 1000 / 30
K = EventKind


def median_ms(fn, repeats: int) -> float:
    """Median CPU time of this process per call: the machine is shared, and wall time would count other
    processes' turns on the cores (painting offscreen happens in this process, so CPU time is the whole cost)."""
    times = []
    for i in range(repeats):
        t0 = time.process_time()
        fn(i)
        times.append((time.process_time() - t0) * 1000)
    return statistics.median(times)


def bench_timeline(app) -> None:
    rng = np.random.default_rng(0)
    kinds = sorted(NOTABLE_KINDS, key=lambda k: k.value) + [K.ALLOCATED, K.STORED]
    results = {}
    for num_marks in (0, 5_000, 50_000):
        t = Timeline()
        t.resize(1000, 80)
        t.show()
        app.processEvents()
        first, last = 1_000, 11_000
        t.set_range(first, last, lambda seq: seq - 3)
        seqs = np.sort(rng.integers(first, last, num_marks))
        t.set_markers([(int(s), kinds[int(k)]) for s, k in zip(seqs, rng.integers(0, len(kinds), num_marks))])
        t.set_kept(212 << 20, 256 << 20)

        def update(i, t=t):
            t.set_range(first + i, last + i, lambda seq: seq - 3)  # history trims one, gains one
            t.add_markers([(last + i, K.ALLOCATED), (last + i, K.COPIED_ON_WRITE)])
            t.set_kept((212 << 20) + i, 256 << 20)
            t.repaint()

        results[num_marks] = median_ms(update, 300)
        t.close()
    base = results[0]
    for n, ms in results.items():
        print(f"timeline update, 10,000 frames, {n:>6,} marks: {ms:6.3f} ms  ({ms / base:4.2f}x the mark-free update, "
              f"{ms / FRAME_MS:6.2%} of a 30 Hz frame)")


def frame_events(seq: int, n: int = 300) -> list[tuple[int, BlockEvent]]:
    out = []
    for j in range(n):
        c = j % 40
        kind = (K.ALLOCATED, K.STORED, K.SHARED, K.COPIED_ON_WRITE, K.EVICTED)[j % 5]
        if kind == K.COPIED_ON_WRITE:
            e = BlockEvent(seq, kind, c, (j,), (j + 1000,))
        elif kind == K.SHARED:
            e = BlockEvent(seq, kind, c, (j, j + 1), reason="prefix_hit")
        else:
            e = BlockEvent(seq, kind, c, (j,), block_hashes=(j,) if kind != K.ALLOCATED else ())
        out.append((seq, e))
    return out


def bench_eventlog(app) -> None:
    frames = [frame_events(seq) for seq in range(1, 400)]
    results = {}
    for name, kw in (("notable kinds (default)", {}), ("all kinds", {"kinds": list(K)}),
                     ("block 17, all kinds", {"kinds": list(K), "blocks": "17"})):
        log = EventLog()
        log.resize(300, 600)
        log.show()
        log.set_filter(**kw)
        for f in frames[:40]:  # 12,000 events: the 10,000-line cap is reached
            log.append_events(f)
        app.processEvents()

        def append(i, log=log):
            log.append_events(frames[40 + i])
            log.view.viewport().repaint()

        results[name] = median_ms(append, 300)
        if name == "all kinds":
            filter_ms = median_ms(lambda i, log=log: log.set_filter(blocks=str(i % 50)), 20)
        log.close()
    base = results["all kinds"]
    for name, ms in results.items():
        print(f"event log append, 300 events into a full 10,000-line log, {name:<24}: {ms:6.3f} ms  "
              f"({ms / base:4.2f}x all kinds, {ms / FRAME_MS:6.2%} of a 30 Hz frame)")
    print(f"event log filter change over 10,000 lines: {filter_ms:6.2f} ms")


def bench_block_history() -> None:
    pairs = []
    for seq in range(1, 100_001):
        b = seq % 65_536
        kind = K.ALLOCATED if seq % 2 else K.FREED
        pairs.append((seq, BlockEvent(seq, kind, seq % 40, (b,))))
        if seq == 50_000:
            ids = tuple(range(65_536))
            pairs.append((seq, BlockEvent(seq, K.RELOCATED, -1, ids, ids[1:] + ids[:1])))
    ms = median_ms(lambda i: block_history(pairs, 17), 5)
    print(f"block history over {len(pairs):,} events with a 65,536-block relocation: {ms:6.1f} ms")


def main() -> None:
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([])
    bench_timeline(app)
    bench_eventlog(app)
    bench_block_history()


if __name__ == "__main__":
    main()
