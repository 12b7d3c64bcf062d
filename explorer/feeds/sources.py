"""What the command line asks to watch, built once for the window and for the headless run alike.

``--open``, ``--attach`` and ``--attach-kv-events`` name sources to watch; without them the local engine is the
source, and ``--record`` and ``--publish`` name where its frames go besides (sinks of its runner: the runner encodes
each frame once and hands the same bytes to every sink). The window and ``--headless`` used to build these each on
its own; :func:`open_sources` is the one place now, and the two differ only in what they say: the window keeps a
History for its timeline and polls frames, the headless run reads the newest view and keeps none.

The command line's namespace stops at explorer/cli.py: it turns the flags once into a :class:`SourceSpec` (what to
watch, where the engine's frames go, which demo), and the rooms below take that, so a new flag is read in one place
and the feeds can be driven from a test or a script without building an argparse namespace.

Qt-free: headless runs on machines without a display.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .demo import DEMO_SPEED, DEMOS


@dataclass(frozen=True)
class WatchSpec:
    """Sources to watch instead of the local engine (``--open``, ``--attach``, ``--attach-kv-events``), with the
    tokenizer that turns their token ids into text and a vLLM server's ``/metrics`` read beside its KV events."""

    open: str | None = None
    attach: tuple[str, ...] = ()
    attach_kv_events: tuple[str, ...] = ()
    tokenizer: str | None = None
    attach_metrics: str | None = None

    def __bool__(self) -> bool:
        return bool(self.open or self.attach or self.attach_kv_events)


@dataclass(frozen=True)
class SinkSpec:
    """Where the local engine's frames and events go besides the window: a recording, the pool stream, KV events (the
    engine itself publishes those; they are here to be said to the user)."""

    record: str | None = None
    publish: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None


@dataclass(frozen=True)
class SourceSpec:
    """What one run reads and writes: the watched sources (empty: the local engine), its sinks, and its demo."""

    watch: WatchSpec = WatchSpec()
    sinks: SinkSpec = SinkSpec()
    demo: str | None = None


@dataclass
class Sources:
    """The feeds a run watches, the local engine's first where there is one."""

    feeds: list = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # in words, where the local engine publishes for other
    # processes to watch ("the pool stream on tcp://...", "KV events on ..."); a demo is then paced for them


def open_sources(spec: SourceSpec, cfg=None, engine=None, *, window: bool, driver=None, export=None,
                 max_steps_per_second: float | None = None, traffic=None) -> Sources:
    """The sources ``spec`` asks for: the watched feeds, or ``engine`` (built by the caller from ``cfg``; the feed
    owns it from then on) with its sinks. ``window``: for the window (a History for the timeline, frames polled), else
    for the headless run (no History, the newest view read). A headless ``--open`` decodes and checks every frame
    first, so a corrupt file is one line and exit 2. Raises ValueError (EngineError, RecordingError, PublishError),
    OSError or ImportError with a message for the user; nothing is left open then. ``driver``: a trace replay
    feeding ``engine`` from its runner's thread. ``export``: the ``--metrics-port`` exporter
    (explorer.model.metrics_export), which observes the engine's runner from its first update.
    ``max_steps_per_second``: the window's engine pace (a traffic demo's; a seeded demo is paced by itself).
    ``traffic``: the ``--export-trace`` exporter (explorer.feeds.trace_export), which sees every step of the engine."""
    if spec.watch:
        if spec.watch.open and not window:
            from kvstream.recording import check_recording
            check_recording(spec.watch.open)
        from .stream_feed import open_feeds
        return Sources(open_feeds(spec.watch))
    from .engine_feed import EngineFeed
    sinks = engine_sinks(spec.sinks)
    outputs = []
    if spec.sinks.publish:
        bound = [s.bound for s in sinks if hasattr(s, "bound")]  # what was bound (port 0: the port chosen)
        outputs.append(f"the pool stream on {bound[0] if bound else spec.sinks.publish}")
    if spec.sinks.kv_events:
        replay = spec.sinks.kv_events_replay
        outputs.append(f"KV events on {spec.sinks.kv_events}" + (f" (replay on {replay})" if replay else ""))
    observers = [export.observer(cfg)] if export is not None else []
    if traffic is not None:
        observers.append(traffic.observer())
    if export is not None:  # Prometheus scrapes now and then: a headless run stays up for it, as for a watcher
        outputs.append(f"Prometheus metrics on {export.url}")
    demo = spec.demo in DEMOS
    if window:  # a demo unfolds at a pace a person follows
        pace = max_steps_per_second or (DEMO_SPEED if demo else None)
        return Sources([EngineFeed.start(engine, cfg, max_steps_per_second=pace, extra_sinks=sinks, driver=driver,
                                         observers=observers)], outputs)
    # --publish and --kv-events are both for watchers in other processes, so a headless demo is paced for them to see
    # it unfold (and runs until --quit-after or Ctrl+C: the caller's part)
    return Sources([EngineFeed.start(engine, cfg, extra_sinks=sinks, history_bytes=0, polled=False, driver=driver,
                                     max_steps_per_second=DEMO_SPEED if outputs and demo else None,
                                     observers=observers)], outputs)


def engine_sinks(spec: SinkSpec) -> list:
    """Sinks for ``--record FILE`` and ``--publish ENDPOINT``; raises ValueError/OSError with a clear message."""
    sinks: list = []
    if not (spec.record or spec.publish):
        return sinks
    try:
        if spec.record:
            from kvstream.recording import Recorder
            sinks.append(Recorder(spec.record))
        if spec.publish:
            from kvstream.poolstream.publisher import PoolStreamPublisher
            sinks.append(PoolStreamPublisher(spec.publish))
    except Exception:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        raise
    return sinks
