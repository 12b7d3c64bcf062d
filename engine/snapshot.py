"""The engine's views are the shared ones of :mod:`kvstream.views` (re-exported here for engine code and scripts)."""
from kvstream.views import (NO_HASH, BlockInfo, BlockState, ConversationInfo, EngineMetrics, FinishReason,  # noqa: F401
                            MemoryStats, PoolSnapshot, Status, frozen_array)
