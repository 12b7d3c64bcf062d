"""The sweep's fast path: csrc/replay.c, built on first use with the machine's C compiler and loaded with ctypes.

It replays a trace instantly through a pool under LRU, FIFO, Belady, S3-FIFO or S3-LRU exactly as the
engine's pool does
(tests/test_traffic_sweep.py compares every eviction with the engine's own), at a small fraction of the cost. Where no
C compiler is found the sweep runs the engine itself (engine.traffic.sweep falls back and says so). The library is
kept beside the native kernels' cache, under a name that carries the source's hash, so an edited source is rebuilt.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("csrc") / "replay.c"
POLICIES = {"lru": 0, "fifo": 1, "belady": 2, "s3fifo": 3, "s3lru": 4}  # the policies replay.c knows
OUTCOMES = ("hit", "cold", "evicted", "after_break")  # replay.c's outcome codes, in order

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    """Where built code is kept (the native kernels' folder: PAGED_KV_EXPLORER_CACHE, XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get("PAGED_KV_EXPLORER_CACHE"):
        return Path(os.environ["PAGED_KV_EXPLORER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paged-kv-explorer"


def _build() -> ctypes.CDLL | None:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"paged-kv-explorer-{os.getuid()}"
        folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"replay-{digest}.so"
    if not target.exists():
        compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
        if compiler is None:
            _state["error"] = "no C compiler (cc, gcc or clang) was found"
            return None
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-std=c11", "-o", tmp, str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                _state["error"] = f"building {SOURCE.name} failed: {done.stderr.strip()[:400]}"
                return None
            os.replace(tmp, target)  # atomic: another process building the same source finds a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    p64, i64 = ctypes.POINTER(ctypes.c_int64), ctypes.c_int64
    lib.replay_instant.argtypes = [i64, p64, p64, i64, p64, i64, ctypes.c_int32, p64, ctypes.POINTER(ctypes.c_int8),
                                   p64, i64, p64]
    lib.replay_instant.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (``why_not()`` says why)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build()
            except (OSError, subprocess.SubprocessError) as exc:
                _state["lib"] = None
                _state["error"] = f"the fast path could not be built: {exc}"
        return _state["lib"]


def why_not() -> str:
    return _state.get("error", "")


def _ptr(array: np.ndarray, ctype=ctypes.c_int64):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def replay(offsets: np.ndarray, nodes: np.ndarray, num_nodes: int, next_pos: np.ndarray, num_blocks: int,
           policy: str, log_evictions: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(hit blocks per request, outcome code per block, evictions as (request, block, node) rows, evictions in
    all). ``log_evictions``: how many evictions to keep rows for."""
    lib = library()
    if lib is None:
        raise RuntimeError(why_not())
    offsets = np.ascontiguousarray(offsets, np.int64)
    nodes = np.ascontiguousarray(nodes, np.int64)
    next_pos = np.ascontiguousarray(next_pos, np.int64)
    hits = np.zeros(len(offsets) - 1, np.int64)
    outcome = np.zeros(len(nodes), np.int8)
    log = np.zeros((max(log_evictions, 1), 3), np.int64)
    count = ctypes.c_int64(0)
    rc = lib.replay_instant(len(hits), _ptr(offsets), _ptr(nodes), num_nodes, _ptr(next_pos), num_blocks,
                            POLICIES[policy], _ptr(hits), _ptr(outcome, ctypes.c_int8), _ptr(log),
                            log_evictions, ctypes.byref(count))
    if rc == -1:
        raise MemoryError("the replay ran out of memory")
    if rc == -2:
        raise ValueError(f"a request of the trace needs more blocks than the pool's {num_blocks}")
    return hits, outcome, log[:min(count.value, log_evictions)], count.value
