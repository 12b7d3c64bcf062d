"""vLLM's Prometheus names, labels and bucket bounds, in one place: what our ``/metrics`` says and what the reader
of a vLLM server's ``/metrics`` looks for.

Why vLLM's and not names of our own: operators watch vLLM through dashboards and alerts written against these
names; a pool explorer that speaks them drops into those dashboards unchanged, and reads a server's own figures
without a mapping table. The names, types, label names and the residency buckets follow vLLM 0.32's Prometheus
stat logger (``vllm/v1/metrics/loggers.py`` and ``buckets.py``); docs/metrics.md lists what each means here.
"""
from __future__ import annotations

# Label names every per-engine series carries, as vLLM's: the served model's name and the engine index (a
# data-parallel rank; "0" for one engine).
LABELS = ("model_name", "engine")
TIER_LABEL = "tier"  # ours, on the block histograms only: "device", "host", "disk" (vLLM's CacheHitSource words)
TIERS = ("device", "host", "disk")

# Gauges
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # 0..1: blocks held by requests over the pool (1 means 100 percent)
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # always 1; the configuration is in its labels

# Counters, in tokens. prometheus_client writes a counter's samples with the suffix ``_total`` (and ``_created``);
# the family name carries none, as in vLLM's code.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # prompt tokens looked up in the device prefix cache
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # of those, tokens found there
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"  # tokens looked up below the device (tiers)
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"  # of those, tokens loaded back from a tier

# Histograms, in seconds
KV_BLOCK_LIFETIME = "vllm:kv_block_lifetime_seconds"
KV_BLOCK_IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
KV_BLOCK_REUSE_GAP = "vllm:kv_block_reuse_gap_seconds"
HISTOGRAM_OF_MEASURE = {"lifetime": KV_BLOCK_LIFETIME, "idle": KV_BLOCK_IDLE_BEFORE_EVICT,
                        "reuse_gap": KV_BLOCK_REUSE_GAP}  # explorer.model.tier_stats' measures -> vLLM's names

# vLLM's "kv_cache_residency" bucket family: a millisecond reuse gap up to a half-hour lifetime. The same upper
# bounds as vLLM's, so a dashboard's histogram_quantile over both kinds of server reads the same buckets.
KV_CACHE_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                              30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)

# cache_config_info's labels that this project fills in, with vLLM's spellings (vLLM writes every field of its
# CacheConfig as a string label, Python's str() of the value: "True", "None", "16").
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_cpu_blocks", "num_gpu_blocks",
                       "engine")
