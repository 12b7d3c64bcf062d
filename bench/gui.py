"""GUI benchmarks, measured side by side in one run (print figures, assert nothing).

1. grid: median time to turn a 65,536-block snapshot into the RGBA grid image and hand it to the ImageItem (also
   with the ImageItem's conversion to a QImage, which Qt does at paint time). Target <= 10 ms.
2. scale: the real window (offscreen) while 256 conversations decode on a 65,536-block pool: GUI frames/s, grid
   redraws/s, event-loop lag (how late a timer at the window's frame period fires: p95 and max), and engine decode tokens/s with the
   window against headless (the same runner without a window), in alternating rounds, both timing the same steps
   (WARMUP_STEPS to WARMUP_STEPS + seconds * STEPS_PER_SECOND after the start: same work, the window settled).
   Then the same comparison interleaved on one engine (interleaved_rates): the window on and off every 0.5 s,
   each "on" stretch against the "off" stretches either side, 14 times, in 2 fresh processes.
   Targets (issue 12): 30 frames/s, decode with the window >= 0.9x headless.
3. arrangements: how the engine thread waits and how many threads it computes with, each in its own process
   (OpenMP reads its settings once): OpenMP's default spin-then-sleep, OMP_WAIT_POLICY=PASSIVE (what main.py sets),
   bounded spinning (GOMP_SPINCOUNT), one intra-op thread for the engine thread, and the engine in its own process
   publishing the pool stream to a window in another. Each reports decode inside the app against headless decode
   with OpenMP's default policy (measured in the same round), frames/s and event-loop lag.
4. scrub: a 65,536-block recording opened in the window (--recording FILE, or one of --scrub-steps steps of 256
   conversations recorded on the spot), the timeline moved as a user moves it: one frame back or forward every
   10 ms timer tick (the arrow keys), then the cursor dragged with the mouse in jumps of 1-50 frames (mouse
   events sent to the strip). GUI frames/s, moves asked for, frames put on view and grid redraws per second, and
   event-loop lag. Target (issue 10): 30 frames/s.

5. tiers: the real window (offscreen) on a 65,536-block device pool with a 262,144-block host tier (issue 30), block
   size 1 (so that filling the device pool with cached blocks takes 65,536 prefill tokens, not a million; a 1 GiB
   host tier, faulted in by the engine's populator thread while the pool fills) while 256 conversations decode over a pool full of cached blocks, so
   every step evicts 256 blocks and offloads them to host: GUI frames/s, the tier grids' GUI-thread milliseconds
   per host-grid redraw (taking the snapshot, drawing) and a second (the content book and stories), event-loop lag,
   and the cyclic collector's runs (full ones, their longest pause, time on the GUI thread). Beside it, the same window and workload with
   the host tier off (what the tier grids add). Per side one engine and one window, ``--rounds`` stretches of
   ``--seconds`` measured one after another, the tier side first. Target: 30 frames/s.

    QT_QPA_PLATFORM=offscreen python bench/gui.py [--sections grid scale arrangements scrub tiers] [--seconds 6]
                                                [--rounds 2] [--recording FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MARK = "@@GUI "  # prefix of a worker's result line

# name: (environment for the process, intra-op threads of the engine thread or None for torch's default, split)
ARRANGEMENTS = {
    "OpenMP default": ({}, None, False),
    "PASSIVE (main.py today)": ({"OMP_WAIT_POLICY": "PASSIVE"}, None, False),
    "GOMP_SPINCOUNT=3000": ({"GOMP_SPINCOUNT": "3000"}, None, False),
    "GOMP_SPINCOUNT=10000": ({"GOMP_SPINCOUNT": "10000"}, None, False),
    "GOMP_SPINCOUNT=100000": ({"GOMP_SPINCOUNT": "100000"}, None, False),
    "PASSIVE, engine 1 thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1, False),
    "default, engine 1 thread": ({}, 1, False),
    "engine in its own process": ({}, None, True),
}


# ---- 1. the grid image --------------------------------------------------------------------------------------------
def synthetic_snapshot(num_blocks: int, block_size: int = 16, seed: int = 0):
    """A busy pool: 70% used by ~2,000 conversations, some shared, some cached, partial tails."""
    import numpy as np
    from kvstream.views import PoolSnapshot
    rng = np.random.default_rng(seed)
    state = rng.choice([0, 1, 2], size=num_blocks, p=[0.2, 0.7, 0.1]).astype(np.int8)
    ref = np.where(state == 1, rng.choice([1, 2, 3], size=num_blocks, p=[0.85, 0.12, 0.03]), 0).astype(np.int32)
    filled = np.where(state == 1, rng.integers(1, block_size + 1, num_blocks),
                      np.where(state == 2, block_size, 0)).astype(np.int32)
    owner = np.where(state > 0, rng.integers(0, 2000, num_blocks), -1).astype(np.int32)
    last = rng.integers(0, 1000, num_blocks).astype(np.int64)
    return PoolSnapshot(step_id=1000, block_size=block_size, num_blocks=num_blocks, ref_count=ref, num_filled=filled,
                        state=state, owner=owner, last_access=last, block_tables={}, conversations=())


def bench_grid(repeats: int = 40) -> None:
    import pyqtgraph as pg
    import explorer  # noqa: F401  (Qt compatibility fix before any Qt call)
    from explorer.window.app import application
    from explorer.render.grid import grid_geometry, snapshot_to_rgba
    application()
    snap = synthetic_snapshot(65536)
    geo = grid_geometry(snap.num_blocks, snap.block_size)
    item = pg.ImageItem(axisOrder="row-major")
    for mode in ("owner", "age"):
        build, handoff, qimage = [], [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            image = snapshot_to_rgba(snap, mode, selected_block=i, geometry=geo)
            t1 = time.perf_counter()
            item.setImage(image, autoLevels=False)
            t2 = time.perf_counter()
            item.render()  # the QImage conversion Qt would do when painting
            t3 = time.perf_counter()
            build.append(t1 - t0)
            handoff.append(t2 - t0)
            qimage.append(t3 - t0)
        ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
        print(f"grid 65,536 blocks ({image.shape[1]}x{image.shape[0]} px, colour by {mode}): "
              f"image {ms(build):.2f} ms, image + setImage {ms(handoff):.2f} ms (target <= 10), "
              f"+ QImage conversion {ms(qimage):.2f} ms")
    bench_changed_blocks(snap, repeats)


def bench_changed_blocks(before, repeats: int) -> None:
    """Finding the blocks a step changed, as the grid does before redrawing only those: from the frame's change
    record (FeedFrame.changes) against comparing the four arrays a tile is drawn from; alternating, one step of 256
    conversations (each block of theirs may have grown), the same answer both ways."""
    import dataclasses

    import numpy as np
    from explorer.render.grid import changed_blocks
    from kvstream.views import ChangeRecord, block_masks
    rng = np.random.default_rng(1)
    touched = np.zeros(before.num_blocks, bool)
    touched[rng.choice(before.num_blocks, 256, replace=False)] = True
    filled = np.array(before.num_filled)
    filled[touched] = np.minimum(filled[touched] + 1, before.block_size)
    after = dataclasses.replace(before, num_filled=filled, version=before.version + 1, step_id=before.step_id + 1)
    touched.setflags(write=False)
    record = ChangeRecord(before, block_masks(after, before, touched))
    assert set(changed_blocks(before, after, "owner")) <= set(changed_blocks(before, after, "owner", changes=record))
    times = {"record": [], "compare": []}
    for i in range(2 * repeats):
        use_record = i % 2 == 0
        t0 = time.perf_counter()
        changed_blocks(before, after, "owner", changes=record if use_record else ChangeRecord())
        times["record" if use_record else "compare"].append(time.perf_counter() - t0)
    record_ms, compare_ms = (1000 * statistics.median(times[k]) for k in ("record", "compare"))
    print(f"changed blocks of one step (256 of 65,536): from the frame's record {record_ms:.3f} ms, comparing the "
          f"arrays {compare_ms:.3f} ms ({compare_ms / record_ms:.1f}x), {repeats} rounds each, alternating")


# ---- measuring one engine -----------------------------------------------------------------------------------------
def make_engine(conversations: int, num_blocks: int):
    """``conversations`` decoding on the builtin model, prefilled (not timed), each with ~900 tokens to go."""
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import seed_many
    cfg = EngineConfig(model="builtin", block_size=16, num_blocks=num_blocks)
    engine = Engine(cfg)
    seed_many(engine, conversations, max_new_tokens=900, ignore_eos=True)  # ~950 tokens each: within 1,024
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    return engine, cfg


def thread_setter(threads: int | None):
    """An observer that, on its first call (on the engine thread), gives that thread ``threads`` intra-op threads
    (OpenMP's thread count is per calling thread, so the GUI thread keeps torch's default)."""
    done = []

    def observe(update) -> None:
        if not done and threads:
            import torch
            torch.set_num_threads(threads)
            done.append(threads)
    return observe


def generated(runner) -> int:
    return runner.latest.metrics.num_generated_tokens


WARMUP_STEPS = 120  # steps from the runner's start to the first one measured: the window is built and shown, and its
# pacer has settled (it takes seconds to widen the gap between live frames from every tick to its cap at 256
# conversations on 65,536 blocks: docs/performance.md, "Benchmark method"), about 3 s at that scale
STEPS_PER_SECOND = 30  # steps measured per --seconds (so both sides time the very same steps)


class StepClock:
    """An observer of the runner (on the engine thread): the time and the tokens generated when the engine publishes
    step ``first`` and step ``last``."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.start: tuple[float, int, int] | None = None  # (perf_counter, tokens generated, step id)
        self.end: tuple[float, int, int] | None = None

    def __call__(self, update) -> None:
        snapshot = update.snapshot
        step = snapshot.step_id
        if self.start is None and step >= self.first:
            self.start = (time.perf_counter(), snapshot.metrics.num_generated_tokens, step)
        elif self.start is not None and self.end is None and step >= self.last:
            self.end = (time.perf_counter(), snapshot.metrics.num_generated_tokens, step)


def decode_rate(runner, seconds: float, pump=None, base_step: int | None = None, started=None) -> float:
    """Tokens/s the runner generates (pumping the Qt event loop meanwhile if given). With ``base_step`` (the
    engine's step when its runner started) it times steps base_step + WARMUP_STEPS to that plus ``seconds`` *
    STEPS_PER_SECOND, the same steps whichever side measures: headless and windowed engines that start alike do the
    same work there (the steps slow down as the conversations grow, so a side that measured later steps would be
    measured on heavier work). Without it, ``seconds`` of wall time from 0.5 s on. ``started()`` is called (on
    this thread) when the timed steps begin."""
    wait = pump or time.sleep
    if base_step is None:
        wait(0.5)  # the first steps after a start or a thread change are not typical
        start_tokens, start = generated(runner), time.perf_counter()
        while time.perf_counter() - start < seconds:
            wait(0.05)
        return (generated(runner) - start_tokens) / (time.perf_counter() - start)
    first = base_step + WARMUP_STEPS
    clock = StepClock(first, first + max(1, round(seconds * STEPS_PER_SECOND)))
    runner.add_observer(clock).result(timeout=30)
    deadline = time.perf_counter() + 600
    while clock.end is None and time.perf_counter() < deadline:
        wait(0.05)  # the clock is exact (stamped on the engine thread); this is only how often to look
        if started is not None and clock.start is not None:
            started()
            started = None
    runner.remove_observer(clock)
    if clock.end is None or clock.start[2] != first:
        raise RuntimeError(f"could not time steps {first}-{clock.last}: the engine was at step "
                           f"{runner.latest.step_id} (the window took too long to start, or decode ended)")
    return (clock.end[1] - clock.start[1]) / (clock.end[0] - clock.start[0])


def pump_events(duration: float) -> None:
    from PySide6 import QtCore
    loop = QtCore.QEventLoop()
    QtCore.QTimer.singleShot(int(duration * 1000), loop.quit)
    loop.exec()


class LagMeter:
    """How late a Qt timer of ``period_ms`` fires: the GUI thread's responsiveness, in ms. The window's own frame
    period (30 ms; 33 ms before 2026-12-03, 18:00) where the GUI thread's CPU time is measured too: a 10 ms timer's 100 Python calls a second took
    a share of a core there that the window does not spend (figures: docs/performance.md, "Benchmark method")."""

    def __init__(self, period_ms: int = 10):
        from PySide6 import QtCore
        self.period_ms = period_ms
        self.lags: list[float] = []
        self._last = time.perf_counter()
        self.timer = QtCore.QTimer()
        self.timer.setInterval(period_ms)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.lags.append(max(0.0, (now - self._last) * 1000 - self.period_ms))
        self._last = now

    def stop(self) -> dict:
        self.timer.stop()
        lags = sorted(self.lags) or [0.0]
        return {"lag_p95_ms": lags[int(0.95 * (len(lags) - 1))], "lag_max_ms": lags[-1]}


class GcMeter:
    """The cyclic collector's pauses while it runs, by generation and thread (gc.callbacks): a long event-loop
    lag that lines up with a full collection is the collector's, not painting's."""

    def __init__(self):
        self.pauses: list[tuple[int, float, bool]] = []  # (generation, ms, on the GUI thread)
        self._start = {}
        self._gui = threading.get_ident()
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._start[me] = time.perf_counter()
        elif me in self._start:
            self.pauses.append((info["generation"], 1000 * (time.perf_counter() - self._start.pop(me)),
                                me == self._gui))

    def stop(self) -> dict:
        gc.callbacks.remove(self._callback)
        full = [ms for gen, ms, _ in self.pauses if gen == 2]
        gui = [ms for _, ms, on_gui in self.pauses if on_gui]
        return {"gc_full": len(full), "gc_full_max_ms": max(full, default=0.0),
                "gc_gui_ms": sum(gui), "gc_max_ms": max((ms for _, ms, _ in self.pauses), default=0.0),
                "gc_count": len(self.pauses)}


def show_window(feed, cfg):
    """The app's main window on ``feed``, shown, after a second of the event loop, with the first block of the
    lowest conversation selected (so the inspector follows one block, as a user's would)."""
    from explorer.window.main_window import MainWindow
    window = MainWindow(feed=feed, config=cfg)
    window.show()
    pump_events(1.0)
    snap = feed.latest()
    if snap is not None and snap.block_tables:
        window.select_block(int(snap.block_tables[sorted(snap.block_tables)[0]][0]))
    return window


def headless_rate(conversations: int, num_blocks: int, seconds: float, threads: int | None = None) -> float:
    from engine import EngineRunner
    engine, _ = make_engine(conversations, num_blocks)
    base = engine.step_id
    runner = EngineRunner(engine, observers=[thread_setter(threads)]).start()
    try:
        return decode_rate(runner, seconds, base_step=base)
    finally:
        runner.stop(timeout=10)
        del engine, runner
        gc.collect()


def app_rate(conversations: int, num_blocks: int, seconds: float, threads: int | None = None, feed=None) -> dict:
    """Decode tokens/s, frames/s, grid redraws/s and event-loop lag of the real window over ``seconds``; the local
    engine as the app runs it (EngineFeed with its History), or ``feed`` (another process's pool stream)."""
    import explorer  # noqa: F401
    from explorer.window.app import application
    from explorer.feeds.engine_feed import EngineFeed
    from explorer.window.main_window import FRAME_MS
    application()
    cfg = base = None
    if feed is None:
        engine, cfg = make_engine(conversations, num_blocks)
        base = engine.step_id
        feed = EngineFeed.start(engine, cfg)
        feed.runner.add_observer(thread_setter(threads))
    window = show_window(feed, cfg)
    lag = LagMeter(FRAME_MS)  # the window's own frame period
    marks = {}

    def started() -> None:  # the GUI's figures over the timed steps too (the lag meter's from here)
        marks.update(frames=window.grid.frames_drawn, t=time.perf_counter(), cpu=time.thread_time())
        lag.lags.clear()
    started()
    rate = decode_rate(feed.runner, seconds, pump_events, base, started) if cfg is not None else \
        (pump_events(seconds) or 0.0)
    frames0, t0, cpu0 = marks["frames"], marks["t"], marks["cpu"]
    elapsed = time.perf_counter() - t0
    pacer = getattr(window, "pacer", None)  # None in a tree before the pacer
    result = {"app": rate, "redraws": (window.grid.frames_drawn - frames0) / elapsed, "fps": window.gui_fps(),
              "gui_cpu": (time.thread_time() - cpu0) / elapsed, "gap_ms": 1000 * (pacer.interval if pacer else 0.0),
              **lag.stop()}
    window.close()
    pump_events(0.2)
    gc.collect()
    return result


# ---- 2. the window at scale ---------------------------------------------------------------------------------------
def bench_scale(seconds: float, rounds: int, conversations: int = 256, num_blocks: int = 65536) -> None:
    from explorer.window.main_window import FRAME_MS
    headless, app = [], []
    for _ in range(rounds):  # alternate, so drift in machine load hits both sides alike
        headless.append(headless_rate(conversations, num_blocks, seconds))
        app.append(app_rate(conversations, num_blocks, seconds))
    ratios = [a["app"] / h for a, h in zip(app, headless)]
    mean = lambda key: statistics.mean(a[key] for a in app)  # noqa: E731
    print(f"window with {conversations} conversations decoding on {num_blocks:,} blocks x 16, {rounds} rounds of "
          f"{seconds:.0f} s: GUI {mean('fps'):.1f} frames/s (target >= 30), grid redraws {mean('redraws'):.1f}/s, "
          f"event-loop lag p95 {mean('lag_p95_ms'):.0f} ms, max {max(a['lag_max_ms'] for a in app):.0f} ms; "
          f"GUI thread {100 * mean('gui_cpu'):.1f}% of a core (with this bench's {FRAME_MS} ms lag timer), live frames "
          f"{mean('gap_ms'):.0f} ms apart at the end (explorer.model.pacer; 0: every tick)")
    print(f"engine decode: headless {statistics.median(headless):.0f} tokens/s, with the window "
          f"{statistics.median(a['app'] for a in app):.0f} tokens/s, ratio {statistics.median(ratios):.2f} "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.9)")


def interleaved_rates(conversations: int, num_blocks: int, pairs: int = 14, window_s: float = 0.4) -> dict:
    """One engine and its window, switched on and off every ``window_s``: "on" is the window as the app runs it
    (its timer ticking, the History encoding every step), "off" is neither (the timer stopped, the History's
    encoder detached: the runner alone, as headless). Each "on" stretch's decode rate over the mean of the "off"
    stretches either side of it, ``pairs`` times. Machine load that drifts over seconds, and the steps slowing as
    the conversations grow, hit both sides alike, which separate rounds of a few seconds each cannot promise on a
    shared host. The rates come from the time and the tokens of the first and last step published in each stretch
    (stamped on the engine thread). An "on" stretch is measured from the switch, so it carries the window's catch-up:
    the encoder's first frame after an "off" stretch is a larger delta, and the window takes the newest frame and
    the events it missed at once. The pacer starts measuring afresh at each "on" (a stopped stretch measured as idle
    would make it take more frames) and keeps the gap it settled at before the first switch."""
    import explorer  # noqa: F401
    from explorer.window.app import application
    from explorer.feeds.engine_feed import EngineFeed
    application()
    engine, cfg = make_engine(conversations, num_blocks)
    feed = EngineFeed.start(engine, cfg)
    runner = feed.runner
    stamps: list[tuple[float, int]] = []  # (time, tokens generated) of every published step, on the engine thread
    runner.add_observer(lambda u: stamps.append((time.perf_counter(), u.snapshot.metrics.num_generated_tokens)))
    window = show_window(feed, cfg)
    pump_events(2.5)  # the pacer settles (2-3 s at this scale)
    on = [True]
    cpu = []  # the GUI thread's share of a core over each "on" stretch

    def stretch(want_on: bool) -> float:
        if want_on != on[0]:
            (runner.add_observer if want_on else runner.remove_observer)(feed.fanout).result(timeout=10)
            if want_on:  # the pacer measures its thread's CPU share over wall time: a stopped stretch would look
                window.pacer._start = None  # idle and make it take more frames; start its measuring afresh
                window.timer.start()
            else:
                window.timer.stop()
            on[0] = want_on
        wait = pump_events if want_on else time.sleep
        if not want_on:  # the engine's last steps with the window go by; an "on" stretch is measured from the
            wait(0.1)    # switch, with the window's catch-up (the frame and events it missed, the encoder's delta)
        first, c0, t0 = len(stamps), time.thread_time(), time.perf_counter()
        wait(window_s + (0.1 if want_on else 0.0))
        if want_on:
            cpu.append((time.thread_time() - c0) / (time.perf_counter() - t0))
        seg = stamps[first:]
        if len(seg) < 3:
            raise RuntimeError("decode ended, or the engine made fewer than 3 steps in a stretch")
        return (seg[-1][1] - seg[0][1]) / (seg[-1][0] - seg[0][0])

    ratios = []
    try:
        before = stretch(False)
        for _ in range(pairs):
            with_window = stretch(True)
            after = stretch(False)
            ratios.append(with_window / ((before + after) / 2))
            before = after
    finally:
        window.close()
        pump_events(0.2)
    return {"ratios": ratios, "gui_cpu": statistics.mean(cpu)}


def bench_interleaved(conversations: int = 256, num_blocks: int = 65536, runs: int = 2) -> None:
    for run in range(runs):  # each in a fresh process (a window and its 4 GiB pool each)
        out = run_worker(["--worker", "interleaved", "--conversations", str(conversations), "--num-blocks",
                          str(num_blocks)], {})
        r = sorted(out["ratios"])
        q = lambda f: r[round(f * (len(r) - 1))]  # noqa: E731
        print(f"interleaved, run {run + 1}: one engine, {len(r)} stretches of 0.5 s with the window on between "
              f"stretches of 0.4 s with it off: decode on / off median {statistics.median(r):.2f} (quartiles "
              f"{q(0.25):.2f}-{q(0.75):.2f}, range {r[0]:.2f}-{r[-1]:.2f}; target >= 0.9); GUI thread "
              f"{100 * out['gui_cpu']:.1f}% of a core while on")


# ---- 3. arrangements ----------------------------------------------------------------------------------------------
def run_worker(args: list[str], env_extra: dict, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"worker {args} failed ({proc.returncode}): {tail}")


def split_run(conversations: int, num_blocks: int, seconds: float, env_extra: dict) -> dict:
    """The engine headless in one process, publishing the pool stream; the window attached in another."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    common = ["--conversations", str(conversations), "--num-blocks", str(num_blocks), "--seconds", str(seconds),
              "--endpoint", endpoint]
    engine = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "publish", *common],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        window = run_worker(["--worker", "attach", *common], env_extra)
        out, err = engine.communicate(timeout=600)
    finally:
        if engine.poll() is None:
            engine.kill()
    for line in out.splitlines():
        if line.startswith(MARK):
            return {**window, "app": json.loads(line[len(MARK):])["app"]}
    raise RuntimeError(f"publishing engine failed: {(err.strip().splitlines() or ['no output'])[-1]}")


def bench_arrangements(seconds: float, rounds: int, conversations: int, num_blocks: int, names: list[str]) -> None:
    common = ["--conversations", str(conversations), "--num-blocks", str(num_blocks), "--seconds", str(seconds)]
    reference: list[float] = []
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        reference.append(run_worker(["--worker", "headless", *common], {})["headless"])
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            env, threads, split = ARRANGEMENTS[name]
            if split:
                results[name].append(split_run(conversations, num_blocks, seconds, env))
            else:
                extra = ["--threads", str(threads)] if threads else []
                results[name].append(run_worker(["--worker", "app", *common, *extra], env))
    ref = statistics.median(reference)
    print(f"arrangements, {conversations} conversations on {num_blocks:,} blocks, {rounds} rounds of {seconds:.0f} s; "
          f"reference: headless with OpenMP's default policy, {ref:.0f} tokens/s "
          f"({min(reference):.0f}-{max(reference):.0f})")
    print(f"  {'arrangement':<28} {'app tok/s':>10} {'x headless':>11} {'frames/s':>9} {'lag p95':>8} {'lag max':>8}")
    for name, rows in results.items():
        ratios = [row["app"] / h for row, h in zip(rows, reference)]
        print(f"  {name:<28} {statistics.median(r['app'] for r in rows):>10.0f} {statistics.median(ratios):>5.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) {statistics.mean(r['fps'] for r in rows):>5.1f} "
              f"{statistics.mean(r['lag_p95_ms'] for r in rows):>6.0f}ms {max(r['lag_max_ms'] for r in rows):>6.0f}ms")


# ---- workers ------------------------------------------------------------------------------------------------------

# ---- 4. scrubbing a recording -------------------------------------------------------------------------------------
def record_for_scrub(steps: int, conversations: int = 256, num_blocks: int = 65536) -> Path:
    """A recording of ``steps`` steps of ``conversations`` decoding on ``num_blocks`` blocks (kept full: a finished
    conversation is replaced, so every frame differs from the one before), written as the app's --record writes
    it."""
    import random
    import tempfile
    from kvstream.poolstream import StreamEncoder
    from kvstream.recording import Recorder
    engine, _ = make_engine(conversations, num_blocks)
    rng = random.Random(0)
    path = Path(tempfile.mkdtemp(prefix="bench-gui-")) / "scrub.kvpool"
    encoder = StreamEncoder()
    added = conversations
    with Recorder(path) as recorder:
        for step in range(steps):
            engine.step()
            snap = engine.snapshot()
            recorder.write(encoder.encode(snap, engine.take_events(), engine.change_record(snap)))
            if step % 8 == 0:
                live = sum(c.is_live for c in engine.conversations())
                for _ in range(conversations - live):
                    engine.add_conversation(f"Conversation {added}: tell me about page number {added * 7}.",
                                            max_new_tokens=rng.randrange(100, 900), temperature=0.8, seed=added,
                                            ignore_eos=True)
                    added += 1
    return path


def bench_scrub(path: Path, seconds: float) -> None:
    import random
    import explorer  # noqa: F401
    from PySide6 import QtCore
    from explorer.window.app import application
    from explorer.window.main_window import MainWindow
    from explorer.feeds.stream_feed import RecordingFeed
    application()
    feed = RecordingFeed.open(str(path))
    window = MainWindow(feed=feed)
    window.show()
    pump_events(1.0)
    timeline = window.pane.timeline
    snap = feed.latest()
    if snap.block_tables:
        window.select_block(int(snap.block_tables[sorted(snap.block_tables)[0]][0]))
    first, last = timeline.first_seq, timeline.last_seq
    print(f"scrub: {path} ({path.stat().st_size / 2**20:.1f} MiB, frames {first:,}-{last:,}, "
          f"{snap.num_blocks:,} blocks)")
    rng = random.Random(0)
    track = timeline.track
    views = [0]
    window.source.viewChanged.connect(lambda _snap: views.__setitem__(0, views[0] + 1))

    def mouse(kind, seq):  # the cursor on the strip at frame seq (a fractional x: every frame is a position)
        from PySide6 import QtGui
        r = track.strip()
        x = r.left() + (seq - first) * (r.width() - 1) / max(1, last - first)
        left, none = QtCore.Qt.MouseButton.LeftButton, QtCore.Qt.MouseButton.NoButton
        event = QtGui.QMouseEvent(kind, QtCore.QPointF(x, r.center().y()), track.mapToGlobal(QtCore.QPointF(x, 0)),
                                  none if kind == QtCore.QEvent.Type.MouseMove else left, left,
                                  QtCore.Qt.KeyboardModifier.NoModifier)
        QtCore.QCoreApplication.sendEvent(track, event)

    # one frame a tick with the arrow keys (each one a seek, decoded on the GUI thread); then the cursor dragged
    # with the mouse in jumps of 1-50 frames (far frames decode on a worker while the window keeps its pace)
    for name, move, drag in (("one frame per tick (keys)", lambda: 1, False),
                             ("dragged, jumps of 1-50 frames", lambda: rng.randint(1, 50), True)):
        way = [-1]
        timeline.seek(last)
        pump_events(0.3)
        pos = [last]
        if drag:
            mouse(QtCore.QEvent.Type.MouseButtonPress, last)

        def tick():
            step = move()
            if not first <= pos[0] + way[0] * step <= last:
                way[0] = -way[0]
            pos[0] = max(first, min(last, pos[0] + way[0] * step))
            if drag:
                mouse(QtCore.QEvent.Type.MouseMove, pos[0])
            else:
                timeline.seek(pos[0])
            asked[0] += 1

        asked = [0]
        timer = QtCore.QTimer()
        timer.setInterval(10)
        timer.timeout.connect(tick)
        lag = LagMeter()
        frames0, views0, t0 = window.grid.frames_drawn, views[0], time.perf_counter()
        timer.start()
        pump_events(seconds)
        timer.stop()
        took = time.perf_counter() - t0
        out = lag.stop()
        if drag:
            mouse(QtCore.QEvent.Type.MouseButtonRelease, pos[0])
        print(f"  {name}: GUI {window.gui_fps():.1f} frames/s (target >= 30), {asked[0] / took:.1f} moves/s, "
              f"{(views[0] - views0) / took:.1f} frames on view/s, grid redraws "
              f"{(window.grid.frames_drawn - frames0) / took:.1f}/s, event-loop lag p95 {out['lag_p95_ms']:.0f} ms, "
              f"max {out['lag_max_ms']:.0f} ms")
    window.close()
    pump_events(0.2)


# ---- 5. the window with a host tier --------------------------------------------------------------------------------
TIER_DEVICE_BLOCKS, TIER_HOST_BLOCKS, TIER_BLOCK_SIZE = 65536, 262144, 1


def make_tier_engine(conversations: int = 256, host: bool = True):
    """A 65,536-block device pool full of cached blocks (finished conversations of 256 tokens), a 262,144-block
    host tier, and ``conversations`` decoding: each step takes ``conversations`` new blocks, each evicting a cached
    one, which is offloaded to host (so the host tier grid changes every frame)."""
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import seed_many
    cfg = EngineConfig(model="builtin", block_size=TIER_BLOCK_SIZE, num_blocks=TIER_DEVICE_BLOCKS,
                       host_tier_blocks=TIER_HOST_BLOCKS if host else 0, max_num_batched_tokens=16384,
                       max_num_seqs=conversations)
    engine = Engine(cfg)
    vocab, length = engine.vocab_size, 256
    fillers = TIER_DEVICE_BLOCKS * TIER_BLOCK_SIZE // length - conversations // 2
    for i in range(fillers):
        engine.add_conversation(prompt_token_ids=[(i * 7919 + k * 104729) % (vocab - 3) + 2 for k in range(length)],
                                max_new_tokens=1)
    engine.run_until_idle()
    seed_many(engine, conversations, max_new_tokens=900, ignore_eos=True)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    while engine.pool.free_queue:  # from here on every new block evicts (and offloads) a cached one
        engine.step()
    return engine, cfg


def tier_app_rate(seconds: float, rounds: int = 1, host: bool = True) -> list[dict]:
    """Frames/s of the real window on the tiered engine, and the GUI-thread time the tier grids take per frame,
    over ``rounds`` stretches of ``seconds``."""
    import explorer  # noqa: F401
    from explorer.window.app import application
    from explorer.feeds.engine_feed import EngineFeed
    from explorer.widgets.tier_grids import TierGrids
    from explorer.window.main_window import FRAME_MS
    application()
    engine, cfg = make_tier_engine(host=host)
    spent = {"set": 0.0, "render": 0.0, "add": 0.0}
    real_set, real_render, real_add = TierGrids.set_snapshot, TierGrids.render, TierGrids.add_events

    def timed(key, fn):
        def wrapper(self, *a):
            start = time.perf_counter()
            try:
                return fn(self, *a)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper
    TierGrids.set_snapshot, TierGrids.render = timed("set", real_set), timed("render", real_render)
    TierGrids.add_events = timed("add", real_add)
    try:
        feed = EngineFeed.start(engine, cfg)
        window = show_window(feed, cfg)
        pump_events(2.0)  # the window settles (its pacer widens the gap between live frames)
        tiers = window.pane.tier_grids
        results = []
        for _ in range(rounds):
            lag, collector = LagMeter(FRAME_MS), GcMeter()
            frames0, t0, step0 = window.grid.frames_drawn, time.perf_counter(), feed.runner.latest.step_id
            evictions = engine.manager.num_evictions
            offloaded = engine.tiers.num_offloaded if host else 0
            spent.update(set=0.0, render=0.0, add=0.0)
            grid = tiers.grids.get("host")
            host_frames0 = grid.frames_drawn if host else 0
            partial0 = grid.partial_draws if host else 0
            pump_events(seconds)
            elapsed = time.perf_counter() - t0
            host_frames = grid.frames_drawn - host_frames0 if host else 0
            results.append({"fps": window.gui_fps(), "redraws": (window.grid.frames_drawn - frames0) / elapsed,
                            "host_frames": host_frames / elapsed,
                            "tier_ms_per_host_frame": 1000 * (spent["set"] + spent["render"]) / max(host_frames, 1),
                            "tier_books_ms_per_s": 1000 * spent["add"] / elapsed,
                            "steps": (feed.runner.latest.step_id - step0) / elapsed,
                            "partial_host": grid.partial_draws - partial0 if host else 0,
                            "evicted": engine.manager.num_evictions - evictions,
                            "offloaded": engine.tiers.num_offloaded - offloaded if host else 0, **lag.stop(),
                            **collector.stop()})
        window.close()
        pump_events(0.2)
    finally:
        TierGrids.set_snapshot, TierGrids.render, TierGrids.add_events = real_set, real_render, real_add
    gc.collect()
    return results


def bench_tiers(seconds: float, rounds: int) -> None:
    sides = {}
    for host in (True, False):
        sides[host] = runs = tier_app_rate(seconds, rounds, host)
        for i, r in enumerate(runs):
            print(f"  host tier {'on ' if host else 'off'}, round {i + 1}: GUI {r['fps']:.1f} frames/s, device grid "
                  f"redraws {r['redraws']:.1f}/s, "
                  + (f"host grid redraws {r['host_frames']:.1f}/s ({r['tier_ms_per_host_frame']:.1f} ms of the GUI "
                     f"thread each, taking the snapshot and drawing; {r['partial_host']} of them partial; the content book and "
                     f"stories {r['tier_books_ms_per_s']:.0f} ms a second), "
                     if host else "") + f"engine {r['steps']:.1f} steps/s, {r['evicted']:,} evicted, "
                  f"{r['offloaded']:,} offloaded, lag p95 {r['lag_p95_ms']:.0f} ms max {r['lag_max_ms']:.0f} ms; "
                  f"collector: {r['gc_count']} collections, {r['gc_full']} full (longest {r['gc_full_max_ms']:.0f} ms), "
                  f"longest {r['gc_max_ms']:.0f} ms, {r['gc_gui_ms']:.0f} ms on the GUI thread",
                  flush=True)
    mean = lambda host, key: statistics.mean(r[key] for r in sides[host])  # noqa: E731
    print(f"window with a {TIER_HOST_BLOCKS:,}-block host tier beside {TIER_DEVICE_BLOCKS:,} device blocks x "
          f"{TIER_BLOCK_SIZE} (offscreen), {rounds} stretches of {seconds:.0f} s per side: GUI {mean(True, 'fps'):.1f} "
          f"frames/s (target >= 30) against {mean(False, 'fps'):.1f} with the host tier off; host tier grid "
          f"{mean(True, 'tier_ms_per_host_frame'):.1f} ms per redraw, {mean(True, 'host_frames'):.1f} redraws/s")


def worker(args) -> None:
    def reply(**fields) -> None:
        print(MARK + json.dumps(fields), flush=True)

    n, blocks, seconds = args.conversations, args.num_blocks, args.seconds
    if args.worker == "headless":
        reply(headless=headless_rate(n, blocks, seconds, args.threads))
    elif args.worker == "app":
        reply(**app_rate(n, blocks, seconds, args.threads))
    elif args.worker == "publish":  # the engine alone, its frames published for a window in another process
        from engine import EngineRunner
        from kvstream.fanout import FrameFanout
        from kvstream.poolstream.publisher import PoolStreamPublisher
        engine, _ = make_engine(n, blocks)
        base = engine.step_id
        publisher = PoolStreamPublisher(args.endpoint)
        runner = EngineRunner(engine, observers=[FrameFanout([publisher])]).start()
        deadline = time.perf_counter() + 120
        while publisher.subscriptions == 0 and time.perf_counter() < deadline:
            time.sleep(0.05)  # the window process is starting
        rate = decode_rate(runner, seconds, base_step=base)  # the same steps as the headless reference
        runner.stop(timeout=10)
        publisher.close()
        reply(app=rate)
    elif args.worker == "interleaved":
        reply(**interleaved_rates(n, blocks))
    elif args.worker == "tiers":
        reply(rounds=tier_app_rate(seconds, args.rounds))
    elif args.worker == "attach":
        from explorer.feeds.stream_feed import AttachFeed
        feed = AttachFeed.connect(args.endpoint, None)
        reply(**app_rate(n, blocks, seconds, feed=feed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["grid", "scale", "arrangements", "scrub"],
                        choices=["grid", "scale", "arrangements", "scrub", "tiers"])
    parser.add_argument("--recording", type=Path, help="scrub this recording (default: record one on the spot)")
    parser.add_argument("--scrub-steps", type=int, default=400, help="steps to record for the scrub section")
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per side per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=64, help="for the arrangements (scale uses 256)")
    parser.add_argument("--num-blocks", type=int, default=4096, help="for the arrangements (scale uses 65,536)")
    parser.add_argument("--arrangements", nargs="+", default=list(ARRANGEMENTS), choices=list(ARRANGEMENTS))
    parser.add_argument("--worker", choices=["headless", "app", "publish", "attach", "interleaved", "tiers"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} in this process; "
          f"{os.cpu_count()} CPUs")
    if "grid" in args.sections:
        bench_grid()
    if "scale" in args.sections:
        bench_scale(args.seconds, args.rounds)
        bench_interleaved()
    if "arrangements" in args.sections:
        bench_arrangements(args.seconds, args.rounds, args.conversations, args.num_blocks, args.arrangements)
    if "scrub" in args.sections:
        bench_scrub(args.recording or record_for_scrub(args.scrub_steps), args.seconds)
    if "tiers" in args.sections:
        bench_tiers(args.seconds, args.rounds)


if __name__ == "__main__":
    main()
