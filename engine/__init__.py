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

# The public names load on first use (PEP 562), so that the parts of the engine that need no torch (a trace's
# capacity sweep, the eviction policies, the config) start fast; ``from engine import Engine`` loads torch as before.
_PUBLIC = {
    "Engine": ".engine", "EngineConfig": ".config", "EngineError": ".errors",
    "paged_attention": ".attention", "dense_attention": ".attention",
    "fetch_model": ".model.gguf_model", "fetched_model": ".model.gguf_model",
    "window_checkpoint": ".model.window_model", "ToyPagedSequence": ".lesson",
    "RelocationReport": ".kv.relocation", "EngineRunner": ".runner", "EngineFailure": ".runner",
    "RunnerStopped": ".runner",
    "BlockInfo": "kvstream.views", "BlockState": "kvstream.views", "ConversationInfo": "kvstream.views",
    "EngineMetrics": "kvstream.views", "FinishReason": "kvstream.views", "MemoryStats": "kvstream.views",
    "PoolSnapshot": "kvstream.views", "Status": "kvstream.views",
    # real traffic (engine/traffic): none of these loads torch
    "EVICTION_POLICIES": ".kv.policies", "read_trace": ".traffic.trace", "Trace": ".traffic.trace",
    "TraceError": ".traffic.trace", "Sweep": ".traffic.sweep", "SweepPoint": ".traffic.sweep",
    "SweepError": ".traffic.sweep", "parse_capacity": ".traffic.sweep", "kv_bytes_per_token": ".traffic.sweep",
    "blocks_for_bytes": ".traffic.sweep", "make_replay": ".traffic.replay", "TraceReplay": ".traffic.replay",
    "ReplayError": ".traffic.replay",
}

__all__ = [
    "Engine", "EngineConfig", "EngineError", "BlockState", "Status", "FinishReason", "paged_attention",
    "dense_attention", "PoolSnapshot", "ConversationInfo", "BlockInfo", "MemoryStats", "EngineMetrics",
    "EngineRunner", "EngineFailure", "RunnerStopped", "RelocationReport", "ToyPagedSequence",
    "fetch_model", "fetched_model", "window_checkpoint", "EVICTION_POLICIES", "read_trace", "Trace", "TraceError",
    "Sweep", "SweepPoint", "SweepError", "parse_capacity", "kv_bytes_per_token", "blocks_for_bytes", "make_replay",
    "TraceReplay", "ReplayError",
]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
