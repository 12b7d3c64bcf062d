"""Engine configuration: one frozen object that says how big the pool is and which model fills it."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import EngineError
from .validation import MAX_SEED

_DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype values ("fp8" is e4m3)
_DEVICES = ("cpu", "cuda", "auto")
MAX_TIER_BLOCKS = 1 << 24  # most blocks one lower tier may hold (what memory and disk allow is checked at start)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`Engine` needs to start; frozen so it can cross threads safely."""

    model: str = "builtin"  # "builtin" or a local Hugging Face-style checkpoint directory
    block_size: int = 16  # token slots per physical KV block
    num_blocks: int = 1024  # physical blocks in the pool (per layer, K and V each)
    device: str = "cpu"  # "cpu", "cuda" or "auto" (CUDA when torch sees it)
    dtype: str = "float32"  # dtype of weights, activations and the KV cache
    enable_prefix_caching: bool = True  # share full blocks with identical prefixes through a hash map
    seed: int = 0  # base seed for weights of random models and per-conversation samplers
    max_num_seqs: int = 256  # most conversations decoding in one step
    max_num_batched_tokens: int = 384  # tokens one step computes at most: decodes first, then prefill chunks
    enable_chunked_prefill: bool = True  # split long prompts into chunks under that budget (False: whole prompts)
    compile_attention: bool = False  # decode attention through the torch.compile'd fused kernel
    finished_window: int = 256  # finished or ended conversations kept in snapshots (newest first); older ones drop out
    kv_events_endpoint: str | None = None  # publish vLLM-format KV events on this ZMQ PUB endpoint ("tcp://*:5557")
    kv_events_replay_endpoint: str | None = None  # ROUTER endpoint that replays buffered event batches
    kv_events_topic: str = ""  # topic frame of every KV-event message
    kv_events_curve: str | None = None  # CURVE key directory (--make-keys): only authorized watchers get KV events
    host_tier_blocks: int = 0  # blocks the host-memory tier holds (evicted device blocks go there); 0: off
    disk_tier_blocks: int = 0  # blocks the disk tier holds (host-tier evictions go there); 0: off
    disk_tier_path: str | None = None  # the disk tier's file (made new; only an earlier run's tier file is reused)
    eviction_policy: str = "lru"  # which cached block goes first (engine.kv.policies): lru, fifo, s3fifo, radix, belady
    kv_cache_dtype: str = "auto"  # how the pool stores K/V: "auto" (the model's dtype) or fp8 (engine/kv/fp8.py)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "finished_window", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise EngineError(f"{name} must be an integer, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "compile_attention"):
            if not isinstance(getattr(self, name), bool):
                raise EngineError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.block_size < 1:
            raise EngineError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks < 2:
            raise EngineError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise EngineError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise EngineError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                              f"({self.max_num_seqs}): every running conversation computes one token per step")
        if self.finished_window < 0:
            raise EngineError(f"finished_window must not be negative, got {self.finished_window}")
        if not 0 <= self.seed <= MAX_SEED:
            raise EngineError(f"seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.dtype not in _DTYPES:
            raise EngineError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.device not in _DEVICES:
            raise EngineError(f"device must be one of {', '.join(_DEVICES)}, got {self.device!r}")
        if not isinstance(self.model, str) or not self.model:
            raise EngineError("model must be 'builtin' or the path of a checkpoint directory")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise EngineError(f"{name} must be a ZMQ endpoint such as 'tcp://*:5557' or 'ipc:///tmp/kv.sock', "
                                  f"got {value!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise EngineError("kv_events_replay_endpoint needs kv_events_endpoint as well")
        if not isinstance(self.kv_events_topic, str):
            raise EngineError(f"kv_events_topic must be text, got {self.kv_events_topic!r}")
        if self.kv_events_curve is not None and (not isinstance(self.kv_events_curve, str)
                                                 or not self.kv_events_curve or not self.kv_events_endpoint):
            raise EngineError(f"kv_events_curve must be a CURVE key directory beside kv_events_endpoint, got "
                              f"{self.kv_events_curve!r}")
        self._check_tiers()
        from .kv.policies import NAMES
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in NAMES:
            raise EngineError(f"eviction_policy must be one of {', '.join(NAMES)}, got {self.eviction_policy!r}")

    def _check_tiers(self) -> None:
        """Tier sizes and the disk tier's path (whether the file can be made is checked when the engine starts)."""
        for name in ("host_tier_blocks", "disk_tier_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise EngineError(f"{name} must be an integer, got {value!r}")
            if not 0 <= value <= MAX_TIER_BLOCKS:
                raise EngineError(f"{name} must be from 0 (off) to {MAX_TIER_BLOCKS:,}, got {value}")
        path = self.disk_tier_path
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise EngineError(f"disk_tier_path must be the path of a file, got {path!r}")
        if self.disk_tier_blocks and path is None:
            raise EngineError("disk_tier_blocks needs disk_tier_path: the file the disk tier writes")
        if path is not None and not self.disk_tier_blocks:
            raise EngineError("disk_tier_path is set but disk_tier_blocks is 0; give the disk tier a size")
        if (self.host_tier_blocks or self.disk_tier_blocks) and not self.enable_prefix_caching:
            raise EngineError("host and disk tiers keep prefix-cached blocks: they need enable_prefix_caching=True")
