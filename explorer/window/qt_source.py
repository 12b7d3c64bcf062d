"""The window's model as Qt sees it: a :class:`~explorer.model.pool_source.PoolSource` whose signals are Qt's.

The source is plain Python (tested without a display); the window wants its signals to be Qt signals so that panels
connect to them like to any widget's, pytest-qt can wait on them, and a connection dies with the QObject it was made
from. The adapter is only that: one QObject with the eight signals, handed to the source as its ``signals``.
"""
from __future__ import annotations

from PySide6 import QtCore

from ..feeds.feed import Feed
from ..model.pool_source import PoolSource


class QtSourceSignals(QtCore.QObject):
    """The eight signals of :class:`PoolSource` (its docstring says what each carries), as Qt signals."""

    sourceChanged = QtCore.Signal(object)
    frameArrived = QtCore.Signal(object)
    viewChanged = QtCore.Signal(object)
    viewingChanged = QtCore.Signal(object)
    eventsArrived = QtCore.Signal(object, bool)
    eventsDropped = QtCore.Signal(int)
    historyChanged = QtCore.Signal()
    problem = QtCore.Signal(object)


def qt_pool_source(feed: Feed | None, parent: QtCore.QObject | None = None) -> PoolSource:
    """A source of ``feed`` whose signals are Qt's, living as long as ``parent`` keeps their QObject."""
    return PoolSource(feed, signals=QtSourceSignals(parent))
