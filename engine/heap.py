"""Giving freed heap memory back to the system, now and then, so a long run's resident memory stays flat.

A decode step allocates and frees tensors whose sizes change with the batch (prefill chunks of every length, logits
of every batch size). The engine raises glibc's mmap and trim thresholds at import (engine/__init__.py) so that a
step reuses the memory the one before freed instead of faulting fresh pages in; the price is that freed memory
stays in the arenas (up to the trim threshold at each arena's top, and in the holes varying sizes leave), so the
process's resident memory creeps up for hours without any object being kept
(a headless served run grew steadily, almost none of it in Python objects, and stayed flat once ``malloc_trim``
ran every few seconds: docs/performance.md, "Resident memory of a long run"). ``malloc_trim(0)``
returns the free pages of every arena. It walks the heaps, and the step after it faults in what it gave back, so it
runs on a schedule, between steps, not every step: the thresholds keep their speed for the steps in between.
Where the C library has no ``malloc_trim`` (not glibc), nothing is done.

The opposite need, pages faulted in ahead of their first use, is :class:`Populator`'s (the host tier's buffer).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_EVERY_S = 10.0  # wall-clock seconds between trims (each takes a few milliseconds on a heap of hundreds of MiB)


def _libc_function(name: str, argtypes: list, restype, use_errno: bool = False):
    """glibc's function ``name`` with its C signature, or None where the C library has none (not glibc)."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=use_errno), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def available() -> bool:
    """Whether this process can give freed heap back (glibc)."""
    return _TRIM is not None


def trim_now() -> bool:
    """Give the free pages of every malloc arena back to the system; True if any were released."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class HeapTrimmer:
    """Calls :func:`trim_now` at most every ``every_s`` seconds; the engine thread asks after each step."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock=time.monotonic):
        self.every_s = float(every_s)
        self._clock = clock
        self._next = clock() + self.every_s
        self.trims = 0  # how many times it trimmed (for tests and benchmarks)

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last trim; True if it trimmed."""
        now = self._clock()
        if now < self._next or _TRIM is None:
            return False
        self._next = now + self.every_s
        trim_now()
        self.trims += 1
        return True


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their bytes
POPULATE_CHUNK = 2 << 20  # bytes per madvise call: small, because each holds the process's memory-map lock (other
#                           threads' mmap and page faults wait behind it), and the thread checks for a stop between
POPULATE_LIMIT = 1 << 30  # bytes faulted in at most: the first slots handed out; the rest fault in when first written


_MADVISE = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int,
                          use_errno=True)


class Populator:
    """Faults the first ``limit`` bytes of a large buffer in on a thread of its own, ahead of their first use.

    The host tier is one zeroed array whose pages the kernel hands out when first written: without this, the first
    pass over the tier paid for every page fault inside the offloads of decode steps, where a fresh page can cost
    far more than the copy into it (on a virtual machine above all: docs/performance.md, "Tiers and fresh pages").
    vLLM allocates its CPU offloading buffer pinned, all at start; this does that work without holding the engine
    up: ``MADV_POPULATE_WRITE`` maps each page writable but never changes a byte, so it is safe beside the offloads
    writing the same array. Only the start of the buffer (:data:`POPULATE_LIMIT`): a tier hands its free slots out
    in order, so those are the ones used first, and a tier sized near the machine's free memory is not made resident
    all at once (a restart builds the new engine while the old one still holds its tier). Where the kernel or the C
    library lacks the call, nothing happens (the pages fault in on first write, as before)."""

    def __init__(self, array, limit: int = POPULATE_LIMIT, start: bool = True):
        import threading
        self._stop = threading.Event()
        self.done = threading.Event()
        self.populated = 0  # bytes faulted in so far
        self.supported = _MADVISE is not None
        self.error = ""  # why it stopped early, when it did
        self._array = array  # kept alive until the thread is done
        self._limit = int(limit)
        self._thread = threading.Thread(target=self._run, name="tier-populate", daemon=True)
        if start:
            self.start()

    def start(self) -> "Populator":
        self._thread.start()
        return self

    def _run(self) -> None:
        import errno
        import mmap
        try:
            array = self._array
            if _MADVISE is None or array.nbytes == 0:
                return
            page = mmap.PAGESIZE
            start = array.ctypes.data
            first = -(-start // page) * page  # madvise wants a page-aligned start; the partial page is left
            end = min(start + array.nbytes, first + self._limit)
            at = first
            while at < end and not self._stop.is_set():
                size = min(POPULATE_CHUNK, end - at)
                if _MADVISE(at, size, MADV_POPULATE_WRITE) != 0:
                    code = ctypes.get_errno()
                    if code == errno.EINTR:
                        continue  # interrupted by a signal: ask again
                    if code in (errno.EINVAL, errno.ENOSYS):  # before Linux 5.14: first writes fault pages in
                        self.supported = False
                    else:  # ENOMEM and the like: stop here; the rest faults in when first written
                        self.error = errno.errorcode.get(code, str(code))
                    return
                at += size
                self.populated = at - first
        finally:
            self._array = None
            self.done.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop between chunks and wait for the thread (so the buffer may go)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
