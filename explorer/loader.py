"""Build an Engine off the GUI thread, with progress marshalled back through Qt signals.

Loading a checkpoint can take seconds; doing it in a worker thread keeps the window painting and the current
engine running. The worker only constructs the engine (and optionally seeds it with demo conversations before any
other thread can see it); the GUI thread receives the finished object through a queued signal.
"""
from __future__ import annotations

import threading
import traceback
from typing import Callable

from PySide6 import QtCore, QtWidgets

from engine.config import EngineConfig


class EngineLoader(QtCore.QObject):
    """One load at a time; ``loaded`` carries the Engine, ``failed`` a message and a traceback."""

    progress = QtCore.Signal(str, float)
    loaded = QtCore.Signal(object)
    failed = QtCore.Signal(str, str)
    _worker_progress = QtCore.Signal(str, float)  # emitted by the worker thread ...
    _worker_done = QtCore.Signal(object, str, str)  # ... and queued to slots of this GUI-thread object

    def __init__(self, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self.thread: threading.Thread | None = None
        self._worker_progress.connect(self._relay_progress, QtCore.Qt.ConnectionType.QueuedConnection)
        self._worker_done.connect(self._relay_done, QtCore.Qt.ConnectionType.QueuedConnection)

    @QtCore.Slot(str, float)
    def _relay_progress(self, message: str, fraction: float) -> None:
        self.progress.emit(message, fraction)

    @QtCore.Slot(object, str, str)
    def _relay_done(self, engine, message: str, details: str) -> None:
        if engine is not None:
            self.loaded.emit(engine)
        else:
            self.failed.emit(message, details)

    def start(self, cfg: EngineConfig, setup: Callable[[object], None] | None = None) -> None:
        self.thread = threading.Thread(target=self._work, args=(cfg, setup), name="engine-loader", daemon=True)
        self.thread.start()

    def _work(self, cfg: EngineConfig, setup) -> None:
        try:
            from engine import Engine  # heavy (torch); imported in the worker on purpose
            engine = Engine(cfg, progress=lambda message, fraction: self._worker_progress.emit(str(message),
                                                                                               float(fraction)))
            if setup is not None:
                setup(engine)
        except Exception as exc:  # shown to the user; the caller keeps whatever engine it had
            message = str(exc) if _is_engine_error(exc) else f"{type(exc).__name__}: {exc}"
            self._worker_done.emit(None, message, traceback.format_exc())
            return
        self._worker_done.emit(engine, "", "")


def _is_engine_error(exc: BaseException) -> bool:
    from engine.errors import EngineError
    return isinstance(exc, EngineError)


def progress_dialog(parent: QtWidgets.QWidget | None, title: str) -> QtWidgets.QProgressDialog:
    dialog = QtWidgets.QProgressDialog(title, None, 0, 1000, parent)
    dialog.setWindowTitle(title)
    dialog.setMinimumDuration(0)
    dialog.setAutoClose(False)
    dialog.setAutoReset(False)
    return dialog


def load_engine_blocking(cfg: EngineConfig, setup=None, parent=None):
    """Load with a progress dialog and a local event loop (startup, before the window exists).

    Returns (engine, None) or (None, message).
    """
    loader = EngineLoader()
    dialog = progress_dialog(parent, f"Loading {cfg.model} model…")
    result: dict = {}
    loop = QtCore.QEventLoop()
    loader.progress.connect(lambda message, fraction: (dialog.setLabelText(message),
                                                       dialog.setValue(int(1000 * min(max(fraction, 0), 1)))))
    loader.loaded.connect(lambda engine: (result.setdefault("engine", engine), loop.quit()))
    loader.failed.connect(lambda message, _tb: (result.setdefault("error", message), loop.quit()))
    dialog.show()
    loader.start(cfg, setup)
    loop.exec()
    dialog.close()
    dialog.deleteLater()
    return result.get("engine"), result.get("error")
