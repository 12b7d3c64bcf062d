"""Headless paged-KV serving engine. Never imports Qt: usable in tests, benchmarks and the GUI's engine thread."""
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
