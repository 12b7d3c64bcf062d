"""The window replaying a trace on a 65,536-block pool (issue 45): GUI frames/s, grid redraws/s and event-loop lag
while the Capacity dock sweeps the same trace on its worker thread, against the same window with the dock idle (its
sweep cached), in alternating stretches of one run (print figures, assert nothing).

The live engine is ``--model none`` (full-size prompts; the pool, scheduler, hits and snapshots as for a model)
replaying the shipped hour of Mooncake's trace timed, sped up so requests keep arriving, outputs scaled down so
they turn over; the window is the app's own MainWindow, offscreen. A "sweeping" stretch starts a fresh sweep of the
whole trace (the dock's cache emptied first) and measures while it runs; an "idle" stretch waits for the sweep to end,
then measures. Target: 30 frames/s (the window's, as for the other 65,536-block workloads, docs/gui.md).

    QT_QPA_PLATFORM=offscreen python bench/traffic_window.py [--trace FILE] [--seconds 4] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
NUM_BLOCKS = 65536
SPEED, SCALE = 20.0, 0.05  # arrivals 20x the trace's clock, a twentieth of each output: the pool keeps turning over


def pump(seconds: float) -> None:
    from PySide6 import QtCore
    loop = QtCore.QEventLoop()
    QtCore.QTimer.singleShot(int(seconds * 1000), loop.quit)
    loop.exec()


def pump_until(predicate, timeout: float) -> bool:
    deadline = time.perf_counter() + timeout
    while not predicate() and time.perf_counter() < deadline:
        pump(0.05)
    return predicate()


class Stretch:
    """Frame-timer ticks, grid redraws and how late a frame-period timer fires, from start() to stop()."""

    def __init__(self, window):
        from PySide6 import QtCore

        from explorer.window.main_window import FRAME_MS
        self.window, self.period = window, FRAME_MS
        self.ticks = 0
        window.timer.timeout.connect(self._tick)
        self.lag_timer = QtCore.QTimer()
        self.lag_timer.setInterval(FRAME_MS)
        self.lag_timer.timeout.connect(self._lag)
        self.lags: list[float] = []
        self._last = time.perf_counter()

    def _tick(self) -> None:
        self.ticks += 1

    def _lag(self) -> None:
        now = time.perf_counter()
        self.lags.append(max(0.0, 1000 * (now - self._last) - self.period))
        self._last = now

    def measure(self, seconds: float) -> dict:
        ticks0, redraws0, t0 = self.ticks, self.window.grid.frames_drawn, time.perf_counter()
        self.lags.clear()
        self._last = t0
        self.lag_timer.start()
        pump(seconds)
        self.lag_timer.stop()
        elapsed = time.perf_counter() - t0
        lags = sorted(self.lags) or [0.0]
        return {"fps": (self.ticks - ticks0) / elapsed, "redraws": (self.window.grid.frames_drawn - redraws0) / elapsed,
                "lag_p95_ms": lags[int(0.95 * (len(lags) - 1))], "lag_max_ms": lags[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from engine import EngineConfig, make_replay, read_trace
    from explorer.feeds.engine_feed import EngineFeed
    from explorer.model.capacity import CapacityCache
    from explorer.window import traces
    from explorer.window.app import application
    from explorer.window.main_window import MainWindow

    application()
    trace = read_trace(args.trace)
    cfg = EngineConfig(model="none", num_blocks=NUM_BLOCKS, block_size=16)
    replay = make_replay(cfg, trace, "timed", SPEED, SCALE)
    feed = EngineFeed.start(replay.engine, cfg, driver=replay)
    window = MainWindow(feed=feed, config=cfg)
    window.resize(1600, 1000)
    window.trace_replay = replay
    window.trace_settings = traces.ReplaySettings("timed", SPEED, SCALE)
    window.show()
    stretch = Stretch(window)
    panel = window.capacity
    print(f"{trace.name}: {trace.num_requests:,} requests replayed timed (x{SPEED:g}, outputs x{SCALE:g}) on "
          f"{NUM_BLOCKS:,} blocks, --model none; {args.seconds:g} s stretches, {args.rounds} rounds", flush=True)
    pump(2.0)  # the window settles; requests start arriving
    sides: dict[str, list[dict]] = {"sweeping": [], "idle": []}
    for round_ in range(args.rounds):
        panel.cache = CapacityCache()  # a fresh sweep of the whole trace, as when it is opened the first time
        panel.clear()
        traces.follow_source(window, feed)
        pump_until(lambda: panel.result is not None and panel.result.num_points > 0, 60)
        started = time.perf_counter()
        sweeping = stretch.measure(args.seconds)
        sweeping["still_sweeping"] = panel.busy
        done = pump_until(lambda: not panel.busy, 600)
        sweep_s = time.perf_counter() - started
        idle = stretch.measure(args.seconds)
        sides["sweeping"].append(sweeping)
        sides["idle"].append(idle)
        print(f"round {round_ + 1}: sweeping {sweeping['fps']:.1f} frames/s ({sweeping['redraws']:.1f} redraws/s, "
              f"lag p95 {sweeping['lag_p95_ms']:.0f} ms, max {sweeping['lag_max_ms']:.0f} ms; still sweeping at "
              f"the end: {sweeping['still_sweeping']}) | idle {idle['fps']:.1f} frames/s ({idle['redraws']:.1f} "
              f"redraws/s, lag p95 {idle['lag_p95_ms']:.0f} ms, max {idle['lag_max_ms']:.0f} ms) | sweep "
              f"{'done' if done else 'NOT done'} in {sweep_s:.0f} s, {panel.result.num_points} points", flush=True)
    median = {side: statistics.median(r["fps"] for r in runs) for side, runs in sides.items()}
    print(f"median frames/s: sweeping {median['sweeping']:.1f}, idle {median['idle']:.1f}, ratio "
          f"{median['sweeping'] / max(median['idle'], 1e-9):.2f}; requests done "
          f"{replay.latest['requests_done']:,}, live hit rate "
          f"{replay.latest['hit_blocks'] / max(1, replay.latest['total_blocks']):.1%}", flush=True)
    window.close()
    pump(0.3)


if __name__ == "__main__":
    main()
