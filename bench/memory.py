"""RSS growth of the engine over many distinct prompt lengths and over a long soak of conversations.

Two figures, each measured after a warm-up in the same process (RSS from /proc/self/status, after gc):
- 1,000 distinct prefill lengths (one conversation at a time, prompts of 17..1,016 tokens, 1 new token): memory that
  grows per new shape (oneDNN keeps per-shape state for pre-packed weights, in caches capped at 64 shapes, which
  the warm-up fills);
- a 1,000-conversation soak (16 at a time, mixed lengths, some forked, all finished or ended): memory that grows
  with finished conversations (snapshots and the engine must keep a bounded window of them).
Target: at most +100 MiB each. Also times snapshot() at the end of the soak.

Two more, each run in a fresh process of its own (``--model-memory``, ``--switches``):
- SmolLM2-135M loaded in float32 and in bfloat16, headless (an Engine, a few decode steps) and in the window
  (MainWindow offscreen, ``--model smollm2``, the busy demo running a few seconds): VmRSS (steady) and VmHWM
  (peak, loading included) against the weights' bytes in that dtype, target at most the weights + 600 MB;
- ten Demos-menu switches in the window on the built-in model: VmRSS after each, after a collection.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig  # noqa: E402


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def distinct_lengths(eng: Engine, count: int) -> float:
    # warm-up: prompts of 1-16 tokens, and 96 lengths that oneDNN serves (a prefill of more rows than the panel
    # kernel takes): more shapes than its per-shape caches hold (64 each, engine/__init__.py), so that they are full
    # before the measured window, whichever kernel serves the small rows. Each prompt differs from the one before
    # from its first token: a prefix hit would leave only the last block's rows to compute
    oneDNN = eng.model.panel_rows + 1
    for n in [*range(1, 17), *range(oneDNN, oneDNN + 96)]:
        eng.generate([[(i * 11 + n) % 250 + 1 for i in range(n)]], max_new_tokens=1)
    before = rss_mib()
    for n in range(17, 17 + count):
        eng.generate([[(i * 7 + n) % 250 + 1 for i in range(n)]], max_new_tokens=1)
    return rss_mib() - before


def soak(eng: Engine, count: int) -> tuple[float, float]:
    def batch(first: int) -> None:
        ids = []
        for i in range(first, first + 16):
            ids.append(eng.add_conversation(prompt_token_ids=[(i * 13 + j) % 250 + 1 for j in range(8 + i % 40)],
                                            max_new_tokens=4 + i % 12, temperature=0.8, seed=i))
        eng.step()
        ids.append(eng.fork_conversation(ids[0]))
        eng.end_conversation(ids[1])
        eng.run_until_idle()
        eng.take_events()

    batch(0)
    before = rss_mib()
    for first in range(16, count, 16):
        batch(first)
        eng.snapshot()
    growth = rss_mib() - before
    start = time.perf_counter()
    for _ in range(100):  # a new snapshot after a change (conversation infos are cached by their own version)
        eng.views._snapshot = None
        eng.snapshot()
    return growth, (time.perf_counter() - start) / 100 * 1000


def status_mib() -> dict:
    """VmRSS and VmHWM of this process, in MiB (after a collection)."""
    gc.collect()
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f
                if line.startswith(("VmRSS:", "VmHWM:"))}


TARGET_MARGIN_MB = 600  # the window may hold at most the weights plus this much
POOL_BLOCKS = 128  # main.py's --num-blocks default: the pool of the window as a user opens it (and as issue 49 measured)


def model_memory(dtype: str, window: bool) -> dict:
    """(in this fresh process) SmolLM2 in ``dtype``: headless, an Engine and 8 decode steps; in the window, the busy
    demo for a few seconds. Its RSS and peak, and the weights' bytes in that dtype."""
    from engine.model.loader import parameter_count, read_model_config
    weights = parameter_count(read_model_config("smollm2")) * (4 if dtype == "float32" else 2) / 2**20
    if not window:
        eng = Engine(EngineConfig(model="smollm2", dtype=dtype, num_blocks=POOL_BLOCKS))
        eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, max_new_tokens=8)
    else:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        from PySide6 import QtCore, QtWidgets
        app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([])
        from engine import EngineRunner
        from explorer.feeds.demo import DEMOS
        from explorer.window.main_window import MainWindow
        cfg = EngineConfig(model="smollm2", dtype=dtype, num_blocks=POOL_BLOCKS)
        eng = Engine(cfg)
        DEMOS["busy"](eng)
        win = MainWindow(EngineRunner(eng).start(), cfg)
        win.show()
        end = time.monotonic() + 8
        while time.monotonic() < end or win.snapshot is None:
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 50)
        win.close()
    pool = eng.kv.data.numel() * eng.kv.data.element_size() / 2**20
    return {**status_mib(), "weights": weights, "pool": pool}


def switches(count: int) -> list[float]:
    """(in this fresh process) the window on the built-in model, ``count`` Demos-menu switches through the menu's
    own code path; VmRSS after the start and after each switch (a collection first)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6 import QtCore, QtWidgets
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([])
    from engine import EngineRunner
    from explorer.window import files
    from explorer.window.main_window import MainWindow

    def spin(seconds: float, until=lambda: True) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end or not until():
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 50)

    cfg = EngineConfig(model="builtin", num_blocks=256, block_size=16)
    win = MainWindow(EngineRunner(Engine(cfg)).start(), cfg)
    win.show()
    spin(2, lambda: win.snapshot is not None)
    rss = [status_mib()["VmRSS"]]
    demos = ["busy", "crowd", "serve", "tiers", "window"]
    for i in range(count):
        old = win.runner
        files.start_demo(win, demos[i % len(demos)], confirm=False)
        spin(2, lambda: win.runner is not old and win.source.live is not None and win._loader is None)
        del old
        QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete)
        rss.append(status_mib()["VmRSS"])
    win.close()
    return rss


def in_fresh_process(*args: str) -> object:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--model-memory", nargs=2, metavar=("DTYPE", "headless|window"), help=argparse.SUPPRESS)
    parser.add_argument("--switches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-growth", action="store_true", help="only the model and switch figures")
    args = parser.parse_args()
    if args.model_memory:
        print(json.dumps(model_memory(args.model_memory[0], args.model_memory[1] == "window")))
        return
    if args.switches:
        print(json.dumps(switches(args.switches)))
        return
    from engine.model.gguf_model import is_fetched
    if is_fetched("smollm2"):
        for where in ("headless", "window"):
            for dtype in ("float32", "bfloat16"):
                m = in_fresh_process("--model-memory", dtype, where)
                target = m["weights"] + TARGET_MARGIN_MB / 1.048576
                print(f"SmolLM2 {dtype}, {where}: RSS {m['VmRSS']:.0f} MiB, peak {m['VmHWM']:.0f} MiB; weights "
                      f"{m['weights']:.0f} MiB, the pool ({POOL_BLOCKS} blocks) {m['pool']:.0f} MiB, "
                      f"target <= {target:.0f} MiB (weights + 600 MB): "
                      f"{'within' if max(m['VmRSS'], m['VmHWM']) <= target else 'OVER'}")
    else:
        print("SmolLM2 figures skipped: fetch it first (python main.py --fetch-model smollm2)")
    rss = in_fresh_process("--switches", "10")
    print(f"ten Demos-menu switches (built-in model, window): RSS {rss[1]:.0f} MiB after the first, "
          f"{rss[-1]:.0f} MiB after the tenth (started at {rss[0]:.0f}); after each: "
          f"{', '.join(f'{r:.0f}' for r in rss[1:])}")
    if args.skip_growth:
        return
    eng = Engine(EngineConfig(model="builtin", num_blocks=2048, block_size=16))
    print(f"distinct prefill lengths ({args.lengths}): RSS +{distinct_lengths(eng, args.lengths):.0f} MiB "
          f"(target <= 100)")
    eng = Engine(EngineConfig(model="builtin", num_blocks=2048, block_size=16))
    growth, ms = soak(eng, args.conversations)
    print(f"soak of {args.conversations} conversations: RSS +{growth:.0f} MiB (target <= 100); snapshot() "
          f"{ms:.2f} ms with {len(eng.snapshot().conversations)} conversations in view")


if __name__ == "__main__":
    main()
