"""Keep PySide6 6.12 from crashing the interpreter on Python 3.11.

PySide6 6.12.0 (an abi3 wheel) drops one reference to None on calls such as ``QLabel.setText`` and one to True
on ``Signal(int).emit``. On Python 3.12+ these singletons are immortal and nothing happens; on 3.11 their counts
drift towards zero and, a few minutes into a session, ``Fatal Python error: none_dealloc`` kills the process.
Adding a large constant to their counts makes them immortal in practice, as they are on 3.12. Nothing else is
touched, and on 3.12+ this does nothing. The proper fix is a Python 3.12+ environment.
"""
from __future__ import annotations

import ctypes
import sys

_BALLAST = 1 << 40  # far more releases than any session can make


def make_singletons_immortal() -> None:
    if sys.version_info >= (3, 12) or getattr(sys, "_explorer_singletons_pinned", False):
        return
    for obj in (None, True, False):
        ctypes.c_ssize_t.from_address(id(obj)).value += _BALLAST
    sys._explorer_singletons_pinned = True
