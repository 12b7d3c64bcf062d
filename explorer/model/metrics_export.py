"""The local engine's ``/metrics`` (``--metrics-port PORT``), headless and in the window.

The engine runner hands each published update (snapshot and block events) to :meth:`EngineMetricsExport.observer`'s
callable on the engine thread, just after the step that made it. There the gauges and counters are set from the
snapshot, and the block events go through the window's own :class:`~explorer.model.tier_stats.BlockDurations`
(lifetime, idle before eviction, reuse gap per tier) with a clock that reads the wall time of the update, so the
histograms hold seconds, as vLLM's do. prometheus_client's HTTP thread serves whatever the last update left.

A restarted engine (the window's File > New engine) gets a fresh observer: block following starts over, the
counters go on growing from where they were, and an update from the engine it replaced is ignored.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from kvstream.metrics import MetricsServer, VllmMetrics, pool_figures

from .tier_stats import BlockDurations, HitRates


def cache_config_labels(config) -> dict[str, object]:
    """vLLM's cache_config_info labels for an EngineConfig: the pool, its block size, the host tier (vLLM's
    ``num_cpu_blocks``; None when off), the KV dtype and whether prefix caching is on."""
    return {"block_size": config.block_size, "num_gpu_blocks": config.num_blocks,
            "num_cpu_blocks": config.host_tier_blocks or None,
            "cache_dtype": getattr(config, "kv_cache_dtype", "auto"),
            "enable_prefix_caching": bool(config.enable_prefix_caching), "engine": "0"}


class EngineMetricsExport:
    """One ``/metrics`` endpoint for the local engine of this process, whichever engine that is now."""

    def __init__(self, port: int | None, host: str = "0.0.0.0", clock: Callable[[], float] = time.monotonic):
        self.metrics = VllmMetrics()
        self._clock = clock
        self._lock = threading.Lock()  # an engine being replaced may still publish while the next one starts
        self._generation = 0
        self._labels: dict[str, object] = {}
        self._model = ""
        self._now = 0.0  # the wall time of the update being taken: every event in it happened in its step
        self._durations = BlockDurations(clock=lambda _step: self._now, on_sample=self.metrics.observe)
        self._sources = HitRates()  # prompt tokens by where they came from: the tiers' hits are vLLM's external ones
        self.server = MetricsServer(self.metrics.registry, port, host) if port is not None else None

    @property
    def url(self) -> str | None:
        return None if self.server is None else self.server.url

    @property
    def said(self) -> str:
        """The line that tells the user where to scrape."""
        return f"serving Prometheus metrics on {self.url} (port {self.server.port}, every interface)"

    def observer(self, config) -> Callable[[object], None]:
        """A runner observer for a new engine built from ``config`` (an EngineConfig); the engine before stops
        counting here."""
        with self._lock:
            self._generation += 1
            self._labels = cache_config_labels(config)
            self._model = str(config.model)
            self._durations.clear()
            self._sources.clear()
            self.metrics.restart()
            return _Observer(self, self._generation)

    def _update(self, generation: int, update) -> None:
        with self._lock:
            if generation != self._generation:  # an engine that was replaced
                return
            self._now = self._clock()
            snapshot = update.snapshot
            self._sources.record(snapshot)
            tier_hits = self._sources.totals["host"] + self._sources.totals["disk"]
            self.metrics.record(pool_figures(snapshot, tier_hits), self._model, self._labels)  # names the model
            self._durations.add_events(update.events)  # for the histograms' samples

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def start_export(port: int) -> EngineMetricsExport:
    """``--metrics-port PORT``: the exporter, serving; OSError naming the flag when the port cannot be had."""
    try:
        return EngineMetricsExport(port)
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: {exc.strerror or exc}") from None


class _Observer:
    """What the runner calls with each update of one engine (named, so that a failure says whose it was)."""

    def __init__(self, export: EngineMetricsExport, generation: int):
        self.export, self.generation = export, generation

    def __call__(self, update) -> None:
        self.export._update(self.generation, update)
