"""Start the desktop app: build the sources the command line asks for, show the window, take screenshots.

Kept apart from main.py so tests and benchmarks can build the same window without going through the CLI.
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import time

import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from engine import EngineConfig

from ..feeds.demo import DEMOS
from ..feeds import trace_export
from ..feeds.sources import SourceSpec, open_sources
from .layout import LayoutMemory
from .loader import load_engine_blocking
from .main_window import MainWindow
from . import traces

GC_GEN0 = 10_000  # containers allocated between young-generation collections (see application)
SCREENSHOT_STEPS = 3  # engine steps to wait for before a screenshot, so the first tokens are on screen
SCREENSHOT_TIMEOUT_S = 10.0  # take it anyway after this long (an idle or silent source)
SCREENSHOT_MIN_S = 1.5  # and not before this: the status line's rates need a second of frames


def application() -> QtWidgets.QApplication:
    """The QApplication, set up for a GUI thread that shares the GIL with a busy engine thread.

    Every paint of a pyqtgraph item calls into Python and must take the GIL; with the default 5 ms switch
    interval the GUI thread waits up to that long each time the engine thread holds it, and frames drop. A 1 ms
    interval keeps the GUI's frame rate up without slowing decode measurably (bench/gui.py; figures:
    docs/performance.md, "Threads").

    The collector's first generation is collected every GC_GEN0 new containers instead of 700: decoding history
    makes and drops thousands a frame (token lists, conversation infos), and at 700 a long recording's scrub spent
    much of its time in young collections that each walked the live token lists (bench/gui.py --sections scrub;
    figures: docs/performance.md, "Threads").
    """
    sys.setswitchinterval(0.001)
    threshold = gc.get_threshold()
    if threshold[0] < GC_GEN0:
        gc.set_threshold(GC_GEN0, *threshold[1:])
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    app.setApplicationName("Paged KV-cache explorer")
    app.setOrganizationName("paged-kv-explorer")
    pg.setConfigOptions(antialias=False, imageAxisOrder="row-major")
    return app


def show_example_selection(window: MainWindow, select_conversation: bool = True) -> None:
    """Select a block the second conversation shares (and that conversation), so the first screen also fills
    the side panels."""
    snap = window.source.feed.latest()
    if snap is None:
        return
    tables = snap.block_tables
    if len(tables) < 2:
        return
    cid = sorted(tables)[1]
    shared = [b for b in tables[cid] if int(snap.ref_count[b]) > 1]
    window.select_block(int(shared[0] if shared else tables[cid][0]))
    if select_conversation:
        window.select_conversation_when_present(cid)


def when_drawn(window: MainWindow, callback, steps: int = SCREENSHOT_STEPS,
               timeout_s: float = SCREENSHOT_TIMEOUT_S) -> QtCore.QTimer:
    """Call ``callback()`` once the window is drawn and, if its source is decoding, a few steps were shown."""
    start = time.perf_counter()
    first_step: list[int] = []
    timer = QtCore.QTimer(window)
    timer.setInterval(100)

    def check() -> None:
        view = window.source.view
        pool = window.source.capabilities.has_physical_pool
        drawn = window.isVisible() and (not pool or (window.grid.frames_drawn > 0 and view is not None))
        if drawn and not first_step:
            first_step.append(view.step_id if view is not None else 0)
        working = view is not None and any(c.is_live for c in view.conversations)
        ready = drawn and (not working or view.step_id >= first_step[0] + steps) \
            and time.perf_counter() - start >= SCREENSHOT_MIN_S
        if ready or time.perf_counter() - start > timeout_s:
            timer.stop()
            callback()

    timer.timeout.connect(check)
    timer.start()
    return timer


def save_screenshot(window: MainWindow, path: str, lesson: bool = False) -> bool:
    """Save the window (or the lesson's) as a PNG; False, said on stderr, when it could not be written."""
    target = window.lesson_window if lesson and window.lesson_window is not None else window
    QtWidgets.QApplication.processEvents()
    if target.grab().save(path):
        print(f"saved {path}", flush=True)
        return True
    print(f"error: could not save the screenshot to {path}", file=sys.stderr, flush=True)
    return False


def run_gui(opts, cfg: EngineConfig, spec: SourceSpec) -> int:
    """Run the app until its window closes; returns the process exit code (2 when a source cannot start)."""
    app = application()
    layout = LayoutMemory.user_settings()
    demo = opts.demo
    engine = seeded = export = None
    exported = trace_export.TraceExport() if opts.export_trace else None  # --export-trace: written at the end
    replay, settings = [], None  # --trace: the replay the loader builds, and how it replays
    if getattr(opts, "trace", None):
        settings = traces.settings_from(opts)
        if getattr(opts, "traffic_demo", False):
            from ..feeds import traffic_demo
            settings = dataclasses.replace(settings, steps_per_second=traffic_demo.STEPS_PER_SECOND,
                                           name="the traffic demo")
    if not spec.watch:
        if getattr(opts, "metrics_port", None) is not None:  # a port in use is said before the model loads
            from ..model.metrics_export import start_export
            try:
                export = start_export(opts.metrics_port)
            except OSError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        build = traces.replay_builder(opts.trace, settings) if settings is not None else None
        engine, error, seeded = load_engine_blocking(cfg, DEMOS.get(demo), getattr(opts, "model_note", ""),
                                                     build=build, driver_out=replay)
        if engine is None:
            if export is not None:
                export.close()
            print(f"error: {error}", file=sys.stderr)
            return 2
    driver = replay[0] if replay else None
    try:
        pace = settings.steps_per_second if settings is not None else None
        feeds = open_sources(spec, cfg, engine, window=True, export=export, driver=driver,  # as --headless builds them
                             max_steps_per_second=pace, traffic=exported if engine is not None else None).feeds
    except (ValueError, OSError, ImportError) as exc:
        if engine is not None:
            engine.close()  # its KV-event sockets
        if export is not None:
            export.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    window = MainWindow(feed=feeds[0], extra_feeds=feeds[1:], config=cfg, settings=layout, size=opts.size,
                        fit_size=not opts.screenshot)  # a --geometry larger than the screen is clamped, and said
    window.metrics_export = export  # owned by the window from now on: a new engine feeds it too
    window.trace_export = exported if engine is not None else None
    if export is not None:
        print(export.said, file=sys.stderr, flush=True)
        window.status.showMessage(export.said, 15000)
    if driver is not None:  # the Capacity dock follows the trace the engine replays
        window.trace_replay, window.trace_settings = driver, settings
        traces.follow_source(window, window.source.feed)
    if engine is not None:
        if getattr(opts, "model_note", ""):  # which model the demo runs and why, said in the window too
            window.status.showMessage(opts.model_note, 15000)
        window.show_demo_notes(seeded)  # what the demo lowered to fit the pool, if anything
        if demo in DEMOS:
            window.start_traffic(demo)  # the demo keeps living: served traffic (busy, crowd: after the first screen)
    window.show()
    if getattr(opts, "check_prompt", None):
        window.why.watch_file(opts.check_prompt)  # would this prompt hit? answered as the file changes
    if demo == "lesson":
        window.open_lesson()
    elif demo in DEMOS:
        show_example_selection(window, select_conversation=demo == "busy")
    lesson = demo == "lesson"
    unsaved: list[str] = []  # screenshots that could not be written: the exit status says so (1)
    if opts.screenshot:
        def first_shot() -> None:
            if not save_screenshot(window, opts.screenshot, lesson):
                unsaved.append(opts.screenshot)
            if opts.quit_after is None:
                window.close()
        if driver is not None:  # a trace: the shot shows its Capacity dock's curves once swept
            window.screenshot_timer = when_drawn(window, lambda: traces.when_swept(window.capacity, first_shot))
        else:
            window.screenshot_timer = when_drawn(window, first_shot)
    if opts.quit_after is not None:
        def last_shot_and_quit() -> None:
            if opts.screenshot and not save_screenshot(window, opts.screenshot, lesson):  # the end, as asked
                unsaved.append(opts.screenshot)
            window.close()
        QtCore.QTimer.singleShot(int(1000 * opts.quit_after), last_shot_and_quit)
    app.exec()
    for source in window.sources:  # closing the window closed them already; this covers any other way out
        source.close()
    if exported is not None and not trace_export.write_for(exported, opts.export_trace, opts.open):
        return 2
    return 1 if unsaved else 0
