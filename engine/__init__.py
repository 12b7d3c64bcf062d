"""Headless paged-KV serving engine. Never imports Qt: usable in tests, benchmarks and the GUI's engine thread."""
import os

# oneDNN (through ideep) keeps a compiled primitive, and scratch memory, for every input shape a pre-packed matmul
# sees, in two caches of 1,024 entries each: 2.1 MiB per new prefill length here, 2.9 GB over 1,000 lengths. 64
# entries each keep RSS flat (+66 MiB over 400 lengths) while a steady decode batch always hits. Read when oneDNN
# first runs, so set before torch is used; a caller's own setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

from .attention import dense_attention, paged_attention
from .config import EngineConfig
from .engine import Engine
from .errors import EngineError
from .lesson import ToyPagedSequence
from .relocation import RelocationReport
from .runner import EngineFailure, EngineRunner, RunnerStopped
from .snapshot import (BlockInfo, BlockState, ConversationInfo, EngineMetrics, FinishReason, MemoryStats,
                       PoolSnapshot, Status)

__all__ = [
    "Engine", "EngineConfig", "EngineError", "BlockState", "Status", "FinishReason", "paged_attention",
    "dense_attention", "PoolSnapshot", "ConversationInfo", "BlockInfo", "MemoryStats", "EngineMetrics",
    "EngineRunner", "EngineFailure", "RunnerStopped", "RelocationReport", "ToyPagedSequence",
]
