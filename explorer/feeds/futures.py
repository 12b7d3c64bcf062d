"""Run a callback on the GUI thread when an engine command's Future completes, without ever waiting on it.

The main window polls the watcher from its frame timer, so results arrive at most one frame late and the GUI
thread never blocks on the engine thread.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable


class FutureWatcher:
    """Pending (future, on_result, on_error) triples, checked by :meth:`poll`."""

    def __init__(self, on_error: Callable[[BaseException], None]):
        self._pending: list[tuple[Future, Callable[[Any], None] | None, Callable[[BaseException], None]]] = []
        self._default_error = on_error

    def watch(self, future: Future, on_result: Callable[[Any], None] | None = None,
              on_error: Callable[[BaseException], None] | None = None) -> Future:
        self._pending.append((future, on_result, on_error or self._default_error))
        return future

    def poll(self) -> None:
        """Call back every finished future (in submission order) and forget it."""
        if not self._pending:
            return
        done, waiting = [], []
        for entry in self._pending:  # one look at each: one that finishes meanwhile waits for the next poll
            (done if entry[0].done() else waiting).append(entry)
        if not done:
            return
        self._pending = waiting
        for future, on_result, on_error in done:
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                on_error(error)
            elif on_result is not None:
                on_result(future.result())

    def clear(self) -> None:
        self._pending.clear()
