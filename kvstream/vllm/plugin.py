"""The vLLM general plugin: a vLLM server publishes its physical block pool as the project's pool stream.

Registered under the ``vllm.general_plugins`` entry point (pyproject.toml), so vLLM calls :func:`register` in every
process it starts: the API server, the engine core, the workers. It does nothing unless the environment variable
``PAGED_KV_EXPLORER_PUBLISH`` names a ZMQ endpoint (``tcp://*:5561``, ``ipc:///tmp/pool.sock``; with
``,curve=DIR`` or ``PAGED_KV_EXPLORER_CURVE=DIR`` only watchers holding a key authorized in DIR get frames, see
:mod:`kvstream.curve`; without, one bound beyond loopback logs once that anyone reaching it reads the prompts).
Then it hooks ``Scheduler.__init__`` (installed lazily, when vLLM imports its scheduler module, so processes that
never build a scheduler never import it), and the one process that builds vLLM's scheduler, the engine core, attaches a
:class:`~kvstream.vllm.tap.VllmPoolTap` to it and publishes a frame after scheduler steps:
``python main.py --attach tcp://HOST:5561`` shows it.

Frames are rate-limited: at most ``PAGED_KV_EXPLORER_MAX_HZ`` per second (default 20), and never more often than
keeps the plugin's own time under ``PAGED_KV_EXPLORER_BUDGET`` (default 0.02, 2%) of the wall clock, measured as it
runs; events between two frames travel with the later one, and a server that goes idle publishes its last state at
once. Data-parallel ranks publish on the endpoint's port + rank (``ipc`` and ``inproc`` paths get ``_dp<rank>``).

On a vLLM this plugin does not know (version or internals), on a model it cannot read (KV cache groups other than
full-attention and sliding-window ones, or block sizes that differ), or
if anything in it fails, it logs one line and stays inert: the server runs exactly as without it.
"""
from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

ENV_ENDPOINT = "PAGED_KV_EXPLORER_PUBLISH"  # ZMQ endpoint to bind; unset or empty: the plugin does nothing
ENV_MAX_HZ = "PAGED_KV_EXPLORER_MAX_HZ"  # most frames per second (default 20)
ENV_BUDGET = "PAGED_KV_EXPLORER_BUDGET"  # largest share of wall time the plugin may spend (default 0.02)
ENV_ANY_VERSION = "PAGED_KV_EXPLORER_ANY_VLLM"  # "1": try vLLM versions not tested (internals are still checked)
ENV_CURVE = "PAGED_KV_EXPLORER_CURVE"  # a CURVE key directory (kvstream.curve): only authorized watchers get frames

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
ATTRIBUTE = "_paged_kv_explorer"  # set on the scheduler instance: its PoolPublisher (tests and debugging reach it)

logger = logging.getLogger("vllm.paged_kv_explorer")  # a child of vLLM's logger: shows in the server's log


def register() -> None:
    """The entry point. Cheap and idempotent: vLLM may call it several times, in every process."""
    endpoint = os.environ.get(ENV_ENDPOINT, "").strip()
    if not endpoint:
        return
    module = sys.modules.get(SCHEDULER_MODULE)
    if module is not None:
        _hook(module)
    elif not any(isinstance(f, _SchedulerImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _SchedulerImportHook())


class _SchedulerImportHook(importlib.abc.MetaPathFinder):
    """Hooks vLLM's Scheduler the moment its module is imported, and not before (workers never import it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != SCHEDULER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # whoever would have found it (site-packages, an editable install)
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module):
            exec_module(module)
            _hook(module)
        loader.exec_module = exec_and_hook
        return spec


def _hook(module) -> None:
    """Wrap ``Scheduler.__init__`` once; every scheduler built in this process then gets a publisher."""
    try:
        cls = module.Scheduler
        if getattr(cls.__init__, "_paged_kv_explorer_hook", False):
            return
        original = cls.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            attach(self)
        __init__._paged_kv_explorer_hook = True  # type: ignore[attr-defined]
        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = __init__
    except Exception as exc:  # never break vLLM's import
        logger.warning("paged-kv-explorer: cannot hook vLLM's scheduler (%s); not publishing", exc)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` binds: the one rule of :func:`kvstream.endpoints.endpoint_for_rank`
    (tcp port + rank, port 0 stays 0; ipc and inproc paths + _dp<rank>), with the endpoint checked."""
    from kvstream.endpoints import endpoint_for_rank
    return endpoint_for_rank(endpoint, rank)


def attach(scheduler: Any) -> "PoolPublisher | None":
    """Give ``scheduler`` a publisher on the configured endpoint; None (and one log line) when that cannot be."""
    endpoint = os.environ.get(ENV_ENDPOINT, "").strip()
    if not endpoint or getattr(scheduler, ATTRIBUTE, None) is not None:
        return None
    try:
        import vllm
        version = getattr(vllm, "__version__", "unknown")
        from kvstream.vllm.tap import UnsupportedVllm, VllmPoolTap
        rank = int(getattr(getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None),
                           "data_parallel_rank", 0) or 0)
        from kvstream.endpoints import stream_spec
        endpoint, curve = stream_spec(endpoint, bind=True, what=ENV_ENDPOINT)  # ENDPOINT[,curve=DIR]
        curve = curve or os.environ.get(ENV_CURVE, "").strip() or None
        endpoint = rank_endpoint(endpoint, rank)
        try:
            tap = VllmPoolTap(scheduler, version=version, any_version=os.environ.get(ENV_ANY_VERSION) == "1")
        except UnsupportedVllm as exc:
            logger.warning("paged-kv-explorer: not publishing the block pool: %s", exc)
            return None
        try:
            sink = StreamSink(endpoint, curve=curve)
            publisher = PoolPublisher(tap, sink, max_hz=_env_float(ENV_MAX_HZ, 20.0),
                                      budget=_env_float(ENV_BUDGET, 0.02))
        except Exception:
            tap.detach()  # e.g. the endpoint is taken: vLLM goes on exactly as without the plugin
            raise
        setattr(scheduler, ATTRIBUTE, publisher)
        logger.info("paged-kv-explorer: publishing vLLM %s's block pool (%d blocks of %d tokens) on %s%s",
                    version, tap.num_blocks, tap.block_size, sink.bound,
                    f" (CURVE: only the keys in {curve}/authorized may watch)" if curve else "")
        return publisher
    except Exception as exc:
        logger.warning("paged-kv-explorer: not publishing the block pool (%s: %s)", type(exc).__name__, exc)
        return None


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        logger.warning("paged-kv-explorer: %s=%r is not a positive number; using %s", name, text, default)
        return default
    return value


class StreamSink:
    """``sink(snapshot, events)``: encodes one pool-stream frame and hands it to a PoolStreamPublisher on
    ``endpoint`` (bound at construction; late subscribers get a keyframe from the publisher's catch-up)."""

    def __init__(self, endpoint: str, curve: str | None = None):
        from kvstream.poolstream import StreamEncoder
        from kvstream.poolstream.publisher import PoolStreamPublisher
        self.encoder = StreamEncoder()  # keyframe, then deltas
        # its own thread owns the socket: write() never blocks; with curve, only authorized watchers get frames
        self.publisher = PoolStreamPublisher(endpoint, curve=curve)

    def __call__(self, snapshot, events) -> None:
        self.publisher.write(self.encoder.encode(snapshot, events))

    @property
    def bound(self) -> str:
        """The endpoint the publisher bound (the port chosen, for port 0)."""
        return self.publisher.bound

    def close(self) -> None:
        self.publisher.close()


class FrameGate:
    """When the next frame may go: at most ``max_hz`` a second, and spaced so that frames take at most ``budget``
    of the wall clock (a frame that took c seconds holds the next one back c / budget seconds)."""

    def __init__(self, max_hz: float = 20.0, budget: float = 0.02):
        self.min_interval = 1.0 / max_hz  # seconds between frames at the most
        self.budget = budget  # share of wall time frames may take
        self.next_at = 0.0  # clock before which no frame goes, unless forced

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def spent(self, started: float, ended: float) -> None:
        self.next_at = ended + max(self.min_interval, (ended - started) / self.budget)


class PoolPublisher:
    """Publishes a tap's frames through ``sink(snapshot, events)``, rate-limited by a FrameGate.

    Called on vLLM's engine-core thread after every step and every finish from outside; a frame goes when the gate
    says so, or at once when the server has gone idle (nothing else would publish its final state). Counts what it
    did, for the benchmark and for the log line it writes on close."""

    def __init__(self, tap, sink: Callable, *, max_hz: float = 20.0, budget: float = 0.02,
                 clock: Callable[[], float] = time.perf_counter):
        self.tap = tap  # the VllmPoolTap it publishes
        self.sink = sink  # write(snapshot, events)
        self.gate = FrameGate(max_hz, budget)
        self.clock = clock
        self.num_frames = 0  # frames published
        self.seconds = 0.0  # time spent building and publishing them
        self._lock = threading.Lock()  # publish() from the engine thread; close() from wherever vLLM shuts down
        tap.after_step = self.maybe_publish
        tap._on_error = self._failed
        self.publish()  # the empty pool, so that a recorder or the explorer sees its shape at once

    def maybe_publish(self) -> None:
        if not self.tap.pending:
            return
        if self.tap.idle or self.gate.due(self.clock()):
            self.publish()

    def publish(self) -> None:
        with self._lock:
            started = self.clock()
            snapshot, events = self.tap.frame()
            self.sink(snapshot, events)
            ended = self.clock()
            self.gate.spent(started, ended)
            self.num_frames += 1
            self.seconds += ended - started

    def _failed(self, exc: BaseException) -> None:
        logger.warning("paged-kv-explorer: stopped publishing after an error (%s: %s); vLLM goes on without it",
                       type(exc).__name__, exc)
        self.close()

    def close(self) -> None:
        """Detach from vLLM and close the socket (a later ``attach`` may start again)."""
        self.tap.detach()
        if getattr(self.tap.scheduler, ATTRIBUTE, None) is self:
            delattr(self.tap.scheduler, ATTRIBUTE)
        close = getattr(self.sink, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
