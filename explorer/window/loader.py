"""Build an Engine off the GUI thread, with progress marshalled back through Qt signals.

Loading a checkpoint can take seconds; doing it in a worker thread keeps the window painting and the current
engine running. The worker only constructs the engine (and optionally seeds it with demo conversations before any
other thread can see it); the GUI thread receives the finished object through a queued signal.

There is one loader thread for the life of the process and it never exits: when a thread that ran torch ops
exits, libgomp leaves its OpenMP workers spinning and the engine thread runs many times slower (figures:
docs/performance.md, "Threads").
"""
from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import Future
from typing import Callable

from PySide6 import QtCore, QtWidgets

from engine import Engine, EngineConfig, EngineError, ReplayError, TraceError

_USER_ERRORS = (TraceError, ReplayError)  # errors whose message is already the line a user reads
AFTER_TIMEOUT_S = 10.0  # the longest a load waits for the running engine to release what it needs


class EngineLoader(QtCore.QObject):
    """One load at a time; ``loaded`` carries the Engine, ``failed`` a message and a traceback.

    ``setup(engine)``'s return value (a demo's :class:`~explorer.feeds.demo.Seeded`: ids and notes about requests it
    lowered to fit) is in :attr:`setup_result` when ``loaded`` fires, and the trace replay that feeds the engine,
    when ``build`` made one, in :attr:`driver`."""

    progress = QtCore.Signal(str, float)
    loaded = QtCore.Signal(object)
    failed = QtCore.Signal(str, str)
    _worker_progress = QtCore.Signal(str, float)  # emitted by the worker thread, queued on to the public signals,
    _worker_loaded = QtCore.Signal(object, object)  # which then fire on this GUI-thread object's thread
    _worker_failed = QtCore.Signal(str, str)

    def __init__(self, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self.setup_result = None  # what setup(engine) returned for the engine ``loaded`` carries
        self.driver = None  # the trace replay built with it (``build``), which the engine's runner feeds it from
        queued = QtCore.Qt.ConnectionType.QueuedConnection
        self._worker_progress.connect(self.progress, queued)
        self._worker_loaded.connect(self._on_loaded, queued)
        self._worker_failed.connect(self.failed, queued)

    def _on_loaded(self, engine, results) -> None:  # on the GUI thread
        self.setup_result, self.driver = results
        self.loaded.emit(engine)

    def start(self, cfg: EngineConfig, setup: Callable[[object], None] | None = None,
              after: Future | None = None, build=None) -> None:
        """Build the engine on the loader thread. ``after``: a Future to wait for first (the running engine
        letting go of a KV-event endpoint the new one binds); however it ends, the load goes on. ``build(cfg,
        progress)``: what makes the engine instead of ``Engine(cfg)``: a trace replay (read the trace, then
        engine.make_replay), whose ``engine`` is loaded and which is kept as :attr:`driver`."""
        _jobs.put((self._work, cfg, setup, after, build))
        _ensure_worker()

    def _work(self, cfg: EngineConfig, setup, after: Future | None = None, build=None) -> None:
        if after is not None:
            try:
                after.result(timeout=AFTER_TIMEOUT_S)
            except Exception:  # not released (or not in time): the new engine's own error says why, if any
                pass
        driver = None
        try:
            def progress(message, fraction):
                self._worker_progress.emit(str(message), float(fraction))

            if build is not None:
                driver = build(cfg, progress)
                engine = driver.engine
            else:
                engine = Engine(cfg, progress=progress)
            result = setup(engine) if setup is not None else None
        except Exception as exc:  # shown to the user; the caller keeps whatever engine it had
            if driver is not None:
                driver.engine.close()
            # EngineError, and a trace's or a replay's own errors (TraceError, ReplayError), are one line for the user
            message = str(exc) if isinstance(exc, (EngineError, *_USER_ERRORS)) else f"{type(exc).__name__}: {exc}"
            self._worker_failed.emit(message, traceback.format_exc())
            return
        self._worker_loaded.emit(engine, (result, driver))


_jobs: queue.Queue = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _ensure_worker() -> None:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_serve, name="engine-loader", daemon=True)
            _worker.start()


def _serve() -> None:
    while True:
        job = _jobs.get()
        job[0](*job[1:])
        del job  # the finished job's loader, setup and build must not wait here for the next one


def progress_dialog(parent: QtWidgets.QWidget | None, title: str, loader: EngineLoader,
                    why: str = "") -> QtWidgets.QProgressDialog:
    """A progress dialog that follows ``loader``'s progress. ``why``: a line saying which model loads and why (a
    demo that runs SmolLM2 once it is fetched), kept above each progress message."""
    head = f"{why}\n" if why else ""
    dialog = QtWidgets.QProgressDialog(head + title, None, 0, 1000, parent)
    dialog.setWindowTitle(title)
    dialog.setMinimumDuration(0)
    dialog.setAutoClose(False)
    dialog.setAutoReset(False)
    loader.progress.connect(lambda message, fraction: (dialog.setLabelText(head + message),
                                                       dialog.setValue(int(1000 * min(max(fraction, 0), 1)))))
    return dialog


def load_engine_blocking(cfg: EngineConfig, setup=None, why: str = "", build=None, driver_out: list | None = None):
    """Load with a progress dialog and a local event loop (startup, before the window exists). ``why``: which
    model loads and why, said in the dialog above its progress.

    Returns (engine, None, what setup returned) or (None, message, None). ``build``: as for
    :meth:`EngineLoader.start`; the replay it made is appended to ``driver_out``.
    """
    loader = EngineLoader()
    dialog = progress_dialog(None, f"Loading {cfg.model} model…", loader, why)
    result: dict = {}
    loop = QtCore.QEventLoop()
    loader.loaded.connect(lambda engine: (result.setdefault("engine", engine), loop.quit()))
    loader.failed.connect(lambda message, _tb: (result.setdefault("error", message), loop.quit()))
    dialog.show()
    loader.start(cfg, setup, build=build)
    loop.exec()
    dialog.close()
    dialog.deleteLater()
    engine = result.get("engine")
    if engine is not None and driver_out is not None and loader.driver is not None:
        driver_out.append(loader.driver)
    return engine, result.get("error"), loader.setup_result if engine is not None else None
