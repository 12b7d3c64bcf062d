"""Headless paged-KV serving engine. Never imports Qt: usable in tests, benchmarks and the GUI's engine thread."""
from .attention import dense_attention, paged_attention
from .config import EngineConfig
from .engine import Engine, RelocationReport
from .errors import EngineError
from .lesson import ToyPagedSequence
from .runner import EngineFailure, EngineRunner
from .snapshot import (BlockInfo, BlockState, ConversationInfo, EngineMetrics, MemoryStats, PoolSnapshot, Status)

__all__ = [
    "Engine", "EngineConfig", "EngineError", "BlockState", "Status", "paged_attention", "dense_attention",
    "PoolSnapshot", "ConversationInfo", "BlockInfo", "MemoryStats", "EngineMetrics", "EngineRunner", "EngineFailure",
    "RelocationReport", "ToyPagedSequence",
]
