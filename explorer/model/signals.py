"""A signal without Qt: the model layer says what changed, and whoever listens is called.

The window's model (:class:`~explorer.model.pool_source.PoolSource`) is plain Python so that it runs and is tested
without a display, as napari's model layer does with its own events. Its signals have Qt's spelling
(``connect``/``disconnect``/``emit``), so the window may hand it Qt signals instead (the adapter in
:mod:`explorer.window.qt_source`) and every panel connects to either the same way.
"""
from __future__ import annotations

from typing import Any, Callable


class Signal:
    """Listeners called in the order they connected, on the thread that emits, with the emitted arguments."""

    def __init__(self):
        self._slots: list[Callable[..., Any]] = []

    def connect(self, slot: Callable[..., Any]) -> None:
        self._slots.append(slot)

    def disconnect(self, slot: Callable[..., Any]) -> None:
        """Forget ``slot`` (ValueError if it was never connected, as Qt's RuntimeError says)."""
        self._slots.remove(slot)

    def emit(self, *args: Any) -> None:
        for slot in list(self._slots):
            slot(*args)
