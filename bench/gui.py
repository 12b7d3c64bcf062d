"""GUI benchmarks, measured side by side in one run (print figures, assert nothing).

1. Grid image: median time to turn a 65,536-block snapshot into the RGBA grid image and hand it to the ImageItem
   (also with the ImageItem's conversion to a QImage, which Qt does at paint time). Target <= 10 ms.
2. Frames/s of the running app while 32 conversations decode on the real engine. Target >= 25.
3. Engine decode tokens/s with the GUI running versus headless (same runner, same workload). Target ratio >= 0.8.

    QT_QPA_PLATFORM=offscreen python bench/gui.py [--seconds 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import explorer  # noqa: E402,F401  (Qt compatibility fix before any Qt call)
from engine import Engine, EngineConfig, EngineRunner  # noqa: E402
from engine.snapshot import PoolSnapshot  # noqa: E402
from explorer.app import application  # noqa: E402
from explorer.demo import seed_many  # noqa: E402
from explorer.grid import grid_geometry, snapshot_to_rgba  # noqa: E402
from explorer.main_window import MainWindow  # noqa: E402


def synthetic_snapshot(num_blocks: int, block_size: int = 16, seed: int = 0) -> PoolSnapshot:
    """A busy pool: 70% used by ~2,000 conversations, some shared, some cached, partial tails."""
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


def make_engine(conversations: int) -> Engine:
    engine = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=2048))
    # ~900 tokens each: the pool holds them all (no preemption), and ignore_eos keeps all 32 decoding throughout
    seed_many(engine, conversations, max_new_tokens=900, ignore_eos=True)
    for _ in range(2):
        engine.step()  # prefill before timing
    return engine


def decode_rate(runner: EngineRunner, seconds: float, pump=None) -> float:
    start_tokens = runner.latest.metrics.num_generated_tokens
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        if pump is not None:
            pump(0.05)
        else:
            time.sleep(0.05)
    return (runner.latest.metrics.num_generated_tokens - start_tokens) / (time.perf_counter() - start)


def bench_app(seconds: float, conversations: int = 32) -> None:
    from PySide6 import QtCore
    app = application()

    def pump(duration: float) -> None:
        loop = QtCore.QEventLoop()
        QtCore.QTimer.singleShot(int(duration * 1000), loop.quit)
        loop.exec()

    headless, gui, fps, redraws = [], [], [], []
    for _ in range(2):  # alternate, so drift in machine load hits both sides alike
        runner = EngineRunner(make_engine(conversations)).start()
        headless.append(decode_rate(runner, seconds))
        runner.stop()

        cfg = EngineConfig(model="builtin", block_size=16, num_blocks=2048)
        runner = EngineRunner(make_engine(conversations)).start()
        window = MainWindow(runner, cfg)
        window.show()
        pump(0.5)
        window.conversations.select_conversation(0)
        window.select_block(int(next(iter(runner.latest.block_tables.values()))[0]))
        frames0, t0 = window.grid.frames_drawn, time.perf_counter()
        gui.append(decode_rate(runner, seconds, pump))
        redraws.append((window.grid.frames_drawn - frames0) / (time.perf_counter() - t0))
        fps.append(window.gui_fps())  # frame-timer ticks over the last second
        window.close()
    print(f"app with {conversations} conversations decoding (2,048 blocks x 16): GUI {statistics.mean(fps):.1f} "
          f"frames/s (target >= 25), grid redraws {statistics.mean(redraws):.1f}/s")
    h, g = statistics.mean(headless), statistics.mean(gui)
    print(f"engine decode: headless {h:.0f} tokens/s, with GUI {g:.0f} tokens/s, ratio {g / h:.2f} (target >= 0.8)")
    app.processEvents()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per side per round")
    args = parser.parse_args()
    bench_grid()
    bench_app(args.seconds)


if __name__ == "__main__":
    main()
