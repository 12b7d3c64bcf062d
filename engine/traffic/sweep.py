"""Capacity sweeps: a trace's hit rate for each eviction policy at each pool size, beside the infinite pool.

Each point is an instant replay (engine.traffic.replay): requests in trace order, one at a time, so the figures
depend only on the policy and the capacity. LRU, FIFO and Belady run on the fast path (engine.traffic.fastpath, the
pool's rules in C, held to the engine's evictions by a test); other policies, and sweeps with lower tiers, run the
engine itself with ``model="none"``. A capacity is a block count or a byte budget for a model's shape
(:func:`blocks_for_bytes`: a Hugging Face config.json and a KV cache dtype give bytes per block).

``warmup``: the first ``warmup`` fraction of the requests fill the pool and are not counted, as kvcache-simulator
does; the figures are those of the rest.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from ..kv.policies import NAMES, POLICIES
from . import fastpath
from .replay import STRIDE
from .trace import Trace

NEVER = 1 << 62
CAUSES = ("cold", "evicted", "after_break")


class SweepError(ValueError):
    """A sweep that cannot run as asked (the message is the one line the user sees)."""


@dataclass(frozen=True)
class SweepPoint:
    """One policy at one capacity: what the counted requests hit and missed."""

    policy: str  # an eviction policy's name, or "infinite" for the pool that never evicts
    blocks: int | None  # the pool's size (None: infinite)
    hit_blocks: int
    total_blocks: int
    hit_tokens: int
    total_tokens: int
    requests: int  # requests counted (after the warmup)
    misses: dict  # {"cold": n, "evicted": n, "after_break": n}
    hit_blocks_by_medium: dict = field(default_factory=dict)  # {"GPU": n, "CPU": n, "STORAGE": n}
    capacity: str = ""  # the capacity as given ("8GiB"), when it was not a block count
    engine: str = "fast path"  # "fast path" or "engine": which replayed it

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def prefill_speedup(self) -> float:
        """What a prefill-bound server gains: 1 / (1 - token hit rate) (infinite at 100%)."""
        return math.inf if self.token_hit_rate >= 1 else 1.0 / (1.0 - self.token_hit_rate)

    def as_json(self) -> dict:
        out = asdict(self)
        out["hit_rate"] = round(self.hit_rate, 6)
        out["token_hit_rate"] = round(self.token_hit_rate, 6)
        out["prefill_speedup"] = None if math.isinf(self.prefill_speedup) else round(self.prefill_speedup, 4)
        if not out["capacity"]:
            del out["capacity"]
        return out


class Sweep:
    """A trace prepared once for many points: prefix nodes, each lookup's next use, block weights in tokens."""

    def __init__(self, trace: Trace, warmup: float = 0.0):
        if not 0.0 <= warmup < 1.0:
            raise SweepError(f"--warmup must be at least 0 and below 1, got {warmup}")
        self.trace = trace
        self.nodes, self.num_nodes = trace.nodes
        ids, self.offsets = trace.flat
        self.first_counted = int(math.floor(warmup * trace.num_requests))
        lengths = np.diff(self.offsets)
        request_of = np.repeat(np.arange(trace.num_requests, dtype=np.int64), lengths)
        position = np.arange(len(self.nodes), dtype=np.int64) - np.repeat(self.offsets[:-1], lengths)
        global_pos = request_of * STRIDE + position
        order = np.argsort(self.nodes, kind="stable")  # each node's lookups, in trace order
        self.next_pos = np.full(len(self.nodes), NEVER, np.int64)
        same = self.nodes[order[1:]] == self.nodes[order[:-1]]
        self.next_pos[order[:-1][same]] = global_pos[order[1:][same]]
        inputs = trace.input_length
        bs = trace.block_size
        self.weights = np.clip(np.repeat(inputs, lengths) - position * bs, 1, bs)  # tokens each block stands for
        self.counted = request_of >= self.first_counted  # blocks of counted requests
        self.request_of, self.position = request_of, position
        self.longest = int(lengths.max(initial=0))

    @property
    def requests_counted(self) -> int:
        return self.trace.num_requests - self.first_counted

    def _point(self, policy: str, blocks: int | None, hit_per_request: np.ndarray, outcome: np.ndarray,
               by_medium: dict | None = None, engine: str = "fast path", capacity: str = "") -> SweepPoint:
        counted = self.counted
        hit = (self.position < hit_per_request[self.request_of]) & counted
        codes = np.bincount(outcome[counted], minlength=len(fastpath.OUTCOMES))
        misses = {name: int(codes[i]) for i, name in enumerate(fastpath.OUTCOMES) if name != "hit"}
        hit_blocks = int(hit.sum())
        inputs = int(self.trace.input_length[self.first_counted:].sum())
        return SweepPoint(policy, blocks, hit_blocks, int(counted.sum()), int(self.weights[hit].sum()), inputs,
                          self.requests_counted, misses, by_medium or {"GPU": hit_blocks}, capacity, engine)

    def point(self, policy: str, blocks: int, capacity: str = "", host_tier_blocks: int = 0,
              disk_tier_blocks: int = 0, disk_tier_path: str | None = None) -> SweepPoint:
        """``policy`` at ``blocks`` blocks (with lower tiers when sizes are given)."""
        if policy not in NAMES:
            raise SweepError(f"unknown eviction policy {policy!r}; choose from {', '.join(NAMES)}")
        if blocks < self.longest:
            raise SweepError(f"{blocks} blocks cannot hold the trace's longest prompt ({self.longest} blocks)")
        tiers = host_tier_blocks or disk_tier_blocks
        if policy in fastpath.POLICIES and not tiers and fastpath.library() is not None:
            hits, outcome, _, _ = fastpath.replay(self.offsets, self.nodes, self.num_nodes, self.next_pos, blocks,
                                                  policy)
            return self._point(policy, blocks, hits, outcome, capacity=capacity)
        return self._engine_point(policy, blocks, capacity, host_tier_blocks, disk_tier_blocks, disk_tier_path)

    def infinite(self) -> SweepPoint:
        """The pool that never evicts: every miss is cold or after a cold block."""
        blocks = self.num_nodes + self.longest
        if fastpath.library() is not None:
            hits, outcome, _, _ = fastpath.replay(self.offsets, self.nodes, self.num_nodes, self.next_pos, blocks,
                                                  "lru")
        else:
            hits, outcome = self._infinite_numpy()
        return self._point("infinite", None, hits, outcome)

    def _infinite_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        seen = np.zeros(self.num_nodes, bool)
        hits = np.zeros(self.trace.num_requests, np.int64)
        outcome = np.zeros(len(self.nodes), np.int8)
        for r in range(self.trace.num_requests):
            nd = self.nodes[self.offsets[r]:self.offsets[r + 1]]
            held = seen[nd]
            k = int(np.argmin(held)) if not held.all() else len(nd)
            hits[r] = k
            outcome[self.offsets[r]:self.offsets[r + 1]] = np.where(np.arange(len(nd)) < k, 0,
                                                                    np.where(held, 3, 1))
            seen[nd] = True
        return hits, outcome

    def _engine_point(self, policy: str, blocks: int, capacity: str, host: int, disk: int,
                      path: str | None) -> SweepPoint:
        """The engine itself (model none), for policies the fast path lacks and for lower tiers."""
        from .. import EngineConfig
        from .replay import make_replay
        cfg = EngineConfig(model="none", num_blocks=blocks, block_size=16, eviction_policy=policy,
                           host_tier_blocks=host, disk_tier_blocks=disk, disk_tier_path=path)
        replay = make_replay(cfg, self.trace, "instant")
        try:
            replay.run()
            outcome = np.zeros(len(self.nodes), np.int8)
            hits = np.zeros(self.trace.num_requests, np.int64)
            by_medium = {"GPU": 0, "CPU": 0, "STORAGE": 0}
            codes = {name: i for i, name in enumerate(fastpath.OUTCOMES)}  # hits (every medium) are code 0
            for o in replay.outcomes:
                hits[o.index] = o.hit_blocks
                start = int(self.offsets[o.index])
                for j, cause in enumerate(o.block_outcomes):
                    outcome[start + j] = codes.get(cause, 0)
                if o.index >= self.first_counted:
                    for medium, n in o.hits_by_medium.items():
                        by_medium[medium] += n
        finally:
            replay.engine.close()
        return self._point(policy, blocks, hits, outcome, by_medium, "engine", capacity)


# ---- capacities --------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def parse_capacity(text: str) -> tuple[int | None, int | None]:
    """``"5000"`` -> (5000 blocks, None); ``"8GiB"`` -> (None, 8 * 2^30 bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not match:
        raise SweepError(f"a capacity is a block count (5000) or a size (8GiB, 500MB), got {text!r}")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:
        if "." in number:
            raise SweepError(f"a block count is a whole number, got {text!r}")
        blocks = int(number)
        if blocks < 1:
            raise SweepError(f"a capacity must be at least 1 block, got {text!r}")
        return blocks, None
    if unit not in _UNITS:
        raise SweepError(f"unknown unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, KiB, MiB, GiB or TiB")
    return None, int(float(number) * _UNITS[unit])


def kv_bytes_per_token(config_path: str, kv_cache_dtype: str) -> tuple[int, str]:
    """(K/V bytes one token takes in every layer, a description) for a Hugging Face config.json: 2 (K and V) x
    layers x KV heads x head size x the dtype's bytes. ``kv_cache_dtype`` "auto" takes the config's torch_dtype."""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SweepError(f"--kv-shape {config_path}: cannot read it as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SweepError(f"--kv-shape {config_path} is not a config.json object")
    if isinstance(config.get("text_config"), dict):  # multimodal checkpoints keep the language model's shape here
        config = {**config, **config["text_config"]}

    def whole(name: str, default=None) -> int:
        value = config.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 20:
            raise SweepError(f"--kv-shape {config_path}: {name} must be a positive whole number, got {value!r}")
        return value

    layers, heads = whole("num_hidden_layers"), whole("num_attention_heads")
    kv_heads = whole("num_key_value_heads", heads)
    hidden = whole("hidden_size")
    head_dim = config.get("head_dim") or hidden // heads
    head_dim = whole("head_dim", head_dim) if "head_dim" in config else head_dim
    dtype = kv_cache_dtype
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in KV_DTYPE_BYTES:
        raise SweepError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
    per_token = 2 * layers * kv_heads * head_dim * KV_DTYPE_BYTES[dtype]
    return per_token, f"{layers} layers x {kv_heads} KV heads x {head_dim} dims x 2 (K, V) x {dtype}"


def blocks_for_bytes(nbytes: int, bytes_per_token: int, block_tokens: int) -> int:
    """Whole blocks of ``block_tokens`` tokens a budget of ``nbytes`` holds."""
    return nbytes // (bytes_per_token * block_tokens)
