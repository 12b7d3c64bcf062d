"""Our pool's figures in Prometheus' format, under vLLM's names (``--metrics-port``).

Why a registry of our own and prometheus_client's metric objects: a process may serve two exporters (tests do),
and prometheus_client already knows the exposition format, the counters' ``_total`` suffix, histogram buckets and
thread safety (the HTTP thread reads while the engine thread writes). This module only decides what each value is.

The exporter is fed with plain figures (:meth:`VllmMetrics.record`, :meth:`VllmMetrics.observe`); what turns the
local engine's updates into them lives in the window.s model (explorer/model/metrics_export.py), which also
follows block events for the three histograms.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..views import BlockState, PoolSnapshot, Status
import kvstream.metrics.names as names

_RUNNING = (Status.RUNNING,)
_WAITING = (Status.WAITING, Status.PREEMPTED)  # vLLM puts a preempted request back in its waiting queue


@dataclass(frozen=True)
class PoolFigures:
    """One moment of a pool, as the gauges and counters say it."""

    usage: float  # 0..1: used blocks over the pool (cached-but-free blocks count as free, as in vLLM)
    running: int  # requests decoding now
    waiting: int  # requests queued (preempted ones included)
    queries: int  # prompt tokens looked up in the prefix cache, since the engine started
    hits: int  # of those, tokens found in the device pool
    external_queries: int  # tokens looked up in the lower tiers (those the device pool did not hold)
    external_hits: int  # of those, tokens loaded back from a tier
    tiers: tuple[str, ...] = ("device",)  # the tiers the pool has: "device", then "host" and "disk" when on


def pool_figures(snapshot: PoolSnapshot, tier_hit_tokens: int = 0) -> PoolFigures:
    """The figures of ``snapshot``. ``tier_hit_tokens``: prompt tokens loaded back from the host or disk tier since
    the engine started (the engine's ``prefix_cache_hits`` counts them with the device's hits; vLLM counts them as
    external hits, so they are taken out here)."""
    used = int(np.count_nonzero(np.asarray(snapshot.state) == BlockState.USED)) if snapshot.num_blocks else 0
    statuses = [c.status for c in snapshot.conversations]
    metrics = snapshot.metrics
    queries, hits = int(metrics.prefix_cache_queries), int(metrics.prefix_cache_hits)
    tier_hits = max(0, min(int(tier_hit_tokens), hits))
    tiers = ("device",) + tuple(t for t in ("host", "disk") if t in snapshot.tiers)
    return PoolFigures(usage=used / snapshot.num_blocks if snapshot.num_blocks else 0.0,
                       running=sum(s in _RUNNING for s in statuses), waiting=sum(s in _WAITING for s in statuses),
                       queries=queries, hits=hits - tier_hits,
                       external_queries=queries - (hits - tier_hits) if len(tiers) > 1 else 0,
                       external_hits=tier_hits, tiers=tiers)


class VllmMetrics:
    """The gauges, counters and histograms of one engine, in a registry of their own.

    Counters only grow: each :meth:`record` adds what the engine's totals grew by since the last one; after
    :meth:`restart` (a new engine) its totals count from zero again, and a total that went back without one is not
    counted until it passes what was counted. When the model
    changes, the gauges of the old one are taken away (a stale "3 running" would lie); its counters and histograms
    stay, as Prometheus expects of a series that stopped."""

    def __init__(self, registry: CollectorRegistry | None = None, engine: str = "0"):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine = str(engine)  # the "engine" label (vLLM's data-parallel rank)
        r, labels = self.registry, names.LABELS
        self.usage = Gauge(names.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", labels,
                             registry=r)
        self.waiting = Gauge(names.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", labels,
                             registry=r)
        self.cache_config = Gauge(names.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                  names.CACHE_CONFIG_LABELS, registry=r)
        self.queries = Counter(names.PREFIX_CACHE_QUERIES,
                               "Prefix cache queries, in terms of number of queried tokens.", labels, registry=r)
        self.hits = Counter(names.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
                            labels, registry=r)
        # as vLLM, served with or without lower tiers (0 without)
        self.external_queries = Counter(names.EXTERNAL_PREFIX_CACHE_QUERIES,
                                        "External prefix cache queries (the host and disk tiers), in terms of "
                                        "number of queried tokens.", labels, registry=r)
        self.external_hits = Counter(names.EXTERNAL_PREFIX_CACHE_HITS,
                                     "External prefix cache hits (the host and disk tiers), in terms of number "
                                     "of cached tokens.", labels, registry=r)
        histogram_labels = labels + (names.TIER_LABEL,)
        docs = {"lifetime": "Histogram of KV cache block lifetime, from its content's arrival in a tier to its "
                            "leaving it, per tier.",
                "idle": "Histogram of idle time before KV cache block eviction, per tier.",
                "reuse_gap": "Histogram of time gaps from a KV cache block's last use to its reuse by a prefix hit, "
                             "per tier."}
        self.histograms = {measure: Histogram(name, docs[measure], histogram_labels,
                                              buckets=names.KV_CACHE_RESIDENCY_BUCKETS, registry=r)
                           for measure, name in names.HISTOGRAM_OF_MEASURE.items()}
        self._lock = threading.Lock()  # record (engine thread) and restart (the window's) may meet
        self._last = (0, 0, 0, 0)  # the engine totals counted so far: queries, hits, external queries and hits
        self._model: str | None = None  # the model_name label of the gauges now
        self._config: tuple | None = None  # the cache_config_info labels now

    def restart(self) -> None:
        """A new engine follows: its totals start from zero, the counters go on from where they are."""
        with self._lock:
            self._last = (0, 0, 0, 0)

    def record(self, figures: PoolFigures, model_name: str, config: dict[str, object]) -> None:
        """Set the gauges and grow the counters to ``figures``; ``config``: cache_config_info's labels (values
        become strings as vLLM writes them)."""
        model = str(model_name)
        labels = (model, self.engine)
        with self._lock:
            if model != self._model:
                if self._model is not None:
                    for gauge in (self.usage, self.running, self.waiting):
                        gauge.remove(self._model, self.engine)
                self._model = model
            info = tuple(str(config.get(name, self.engine if name == "engine" else None))
                         for name in names.CACHE_CONFIG_LABELS)
            if info != self._config:
                if self._config is not None:
                    self.cache_config.remove(*self._config)
                self.cache_config.labels(*info).set(1)
                self._config = info
            self.usage.labels(*labels).set(_fraction(figures.usage))
            self.running.labels(*labels).set(max(0, int(figures.running)))
            self.waiting.labels(*labels).set(max(0, int(figures.waiting)))
            totals = (figures.queries, figures.hits, figures.external_queries, figures.external_hits)
            counters = (self.queries, self.hits, self.external_queries, self.external_hits)
            for counter, now, before in zip(counters, totals, self._last):
                child = counter.labels(*labels)  # served from the first record on, at 0 until something counts
                if now > before:
                    child.inc(now - before)
            self._last = tuple(max(now, before) for now, before in zip(totals, self._last))
            for tier in figures.tiers:  # empty histograms of each tier, as vLLM serves its own before any sample
                for histogram in self.histograms.values():
                    histogram.labels(model, self.engine, tier)

    def observe(self, tier: str, measure: str, seconds: float) -> None:
        """One block duration in ``tier`` ("device", "host", "disk") for ``measure`` ("lifetime", "idle",
        "reuse_gap"). Before the first :meth:`record` names the model, "" stands for it."""
        histogram = self.histograms.get(measure)
        if histogram is None or not math.isfinite(seconds):
            return
        histogram.labels(self._model or "", self.engine, str(tier)).observe(max(0.0, float(seconds)))


def _fraction(value: float) -> float:
    value = float(value)
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


class MetricsServer:
    """``/metrics`` over HTTP for one registry, on a thread of prometheus_client's (``port`` 0: a free port, read
    back from :attr:`port`). Closing stops the thread and frees the port."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0"):
        from prometheus_client import start_http_server
        self.host = host
        self._server, self._thread = start_http_server(int(port), addr=host, registry=registry)
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)
