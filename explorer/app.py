"""Start the desktop app: load the engine with a progress dialog, start its thread, show the main window.

Kept apart from main.py so tests and benchmarks can build the same window without going through the CLI.
"""
from __future__ import annotations

import sys

import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from engine.config import EngineConfig
from engine.runner import EngineRunner

from .demo import DEMO_SPEED, DEMOS
from .loader import load_engine_blocking
from .main_window import MainWindow


def application() -> QtWidgets.QApplication:
    """The QApplication, set up for a GUI thread that shares the GIL with a busy engine thread.

    Every paint of a pyqtgraph item calls into Python and must take the GIL; with the default 5 ms switch
    interval the GUI thread waits up to that long each time the engine thread holds it, and frames drop. A 1 ms
    interval keeps the GUI above 25 frames/s without slowing decode measurably (bench/gui.py).
    """
    sys.setswitchinterval(0.001)
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    app.setApplicationName("Paged KV-cache explorer")
    pg.setConfigOptions(antialias=False, imageAxisOrder="row-major")
    return app


def show_example_selection(window: MainWindow, select_conversation: bool = True) -> None:
    """Select a block the second conversation shares (and that conversation), so the first screen also fills
    the side panels."""
    snap = window.runner.latest
    tables = snap.block_tables
    if len(tables) < 2:
        return
    cid = sorted(tables)[1]
    shared = [b for b in tables[cid] if int(snap.ref_count[b]) > 1]
    window.select_block(int(shared[0] if shared else tables[cid][0]))
    if select_conversation:
        window.select_conversation_when_present(cid)


def run_gui(cfg: EngineConfig, demo: str = "none", screenshot: str | None = None,
            quit_after: float | None = None) -> int:
    """Run the app until its window closes; returns the process exit code (2 when the engine cannot load)."""
    app = application()
    engine, error = load_engine_blocking(cfg, DEMOS.get(demo))
    if engine is None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    runner = EngineRunner(engine, max_steps_per_second=DEMO_SPEED if demo in DEMOS else None).start()
    window = MainWindow(runner, cfg)
    window.show()
    if demo == "lesson":
        window.open_lesson()
    elif demo in DEMOS:
        show_example_selection(window, select_conversation=demo == "busy")
    if screenshot:
        def save_and_quit() -> None:
            window.grab().save(screenshot)
            print(f"saved {screenshot}")
            window.close()
        QtCore.QTimer.singleShot(int(1000 * (quit_after if quit_after is not None else 5.0)), save_and_quit)
    elif quit_after is not None:
        QtCore.QTimer.singleShot(int(1000 * quit_after), window.close)
    app.exec()
    window.runner.stop(timeout=1.0)  # closing the window stopped it already; this covers any other way out
    return 0
