"""Prometheus' text format, out and in, under vLLM's names: the local engine's ``/metrics`` (``--metrics-port``,
:mod:`.exporter`) and a vLLM server's ``/metrics`` read beside its KV events (``--attach-metrics``, :mod:`.reader`,
:mod:`.compare`). prometheus_client and the standard library only: no torch, no Qt."""
from .compare import EngineComparison, ServerWatch
from .exporter import MetricsServer, PoolFigures, VllmMetrics, pool_figures
from .reader import MetricsError, MetricsReader, ServerReading, check_url, parse_metrics

__all__ = ["EngineComparison", "MetricsError", "MetricsReader", "MetricsServer", "PoolFigures", "ServerReading",
           "ServerWatch", "VllmMetrics", "check_url", "parse_metrics", "pool_figures"]
