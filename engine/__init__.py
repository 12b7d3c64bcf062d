"""Headless paged-KV serving engine. Never imports Qt: usable in tests, benchmarks and the GUI's engine thread."""
import os

# oneDNN (through ideep) keeps a compiled primitive, and scratch memory, for every input shape a pre-packed matmul
# sees, in two caches of 1,024 entries each, so resident memory grows with every new prefill length; 64 entries
# each keep it flat while a steady decode batch always hits (figures: docs/engine.md, "Figures behind the engine's
# choices"). Read when oneDNN first runs, so set before torch is used; a caller's own setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")


def _keep_freed_memory() -> None:
    """glibc hands every allocation of 128 KiB or more (a step's activations) to the kernel with its own mmap and
    gives it back on free; heap memory freed at the top of an arena is given back too. The next step's tensors
    then fault their pages in again, zeroed: a large prefill step spent a good part of its time in those faults
    (figures: docs/engine.md, "Figures behind the engine's choices"). Raising both thresholds keeps freed memory in
    the heap for the next step. A caller's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ win; elsewhere than
    glibc this does nothing."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's largest (allocations above it still get their own mmap)
    mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: free memory kept at an arena's top before it is given back


_keep_freed_memory()

from .attention import dense_attention, paged_attention
from .config import EngineConfig
from .engine import Engine
from .errors import EngineError
from .model.gguf_model import fetch_model, fetched_model
from .model.window_model import window_checkpoint
from .lesson import ToyPagedSequence
from .kv.relocation import RelocationReport
from .runner import EngineFailure, EngineRunner, RunnerStopped
from kvstream.views import (BlockInfo, BlockState, ConversationInfo, EngineMetrics, FinishReason, MemoryStats,
                            PoolSnapshot, Status)

__all__ = [
    "Engine", "EngineConfig", "EngineError", "BlockState", "Status", "FinishReason", "paged_attention",
    "dense_attention", "PoolSnapshot", "ConversationInfo", "BlockInfo", "MemoryStats", "EngineMetrics",
    "EngineRunner", "EngineFailure", "RunnerStopped", "RelocationReport", "ToyPagedSequence",
    "fetch_model", "fetched_model", "window_checkpoint",
]
