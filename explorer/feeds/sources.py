"""What the command line asks to watch, built once for the window and for the headless run alike.

``--open``, ``--attach`` and ``--attach-kv-events`` name sources to watch; without them the local engine is the
source, and ``--record`` and ``--publish`` name where its frames go besides (sinks of its runner: the runner encodes
each frame once and hands the same bytes to every sink). The window and ``--headless`` used to build these each on
its own; :func:`open_sources` is the one place now, and the two differ only in what they say: the window keeps a
History for its timeline and polls frames, the headless run reads the newest view and keeps none.

Qt-free: headless runs on machines without a display.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .demo import DEMO_SPEED, DEMOS


@dataclass
class Sources:
    """The feeds a run watches, the local engine's first where there is one."""

    feeds: list = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # in words, where the local engine publishes for other
    # processes to watch ("the pool stream on tcp://...", "KV events on ..."); a demo is then paced for them


def watches(opts) -> bool:
    """Whether the command line names sources to watch (instead of the local engine)."""
    return bool(opts.open or opts.attach or opts.attach_kv_events)


def open_sources(opts, cfg=None, engine=None, *, window: bool, driver=None, export=None) -> Sources:
    """The sources ``opts`` asks for: the watched feeds, or ``engine`` (built by the caller from ``cfg``; the feed
    owns it from then on) with its sinks. ``window``: for the window (a History for the timeline, frames polled), else
    for the headless run (no History, the newest view read). A headless ``--open`` decodes and checks every frame
    first, so a corrupt file is one line and exit 2. Raises ValueError (EngineError, RecordingError, PublishError),
    OSError or ImportError with a message for the user; nothing is left open then. ``driver``: a trace replay
    feeding ``engine`` from its runner's thread. ``export``: the ``--metrics-port`` exporter
    (explorer.model.metrics_export), which observes the engine's runner from its first update."""
    if watches(opts):
        if opts.open and not window:
            from kvstream.recording import check_recording
            check_recording(opts.open)
        from .stream_feed import open_feeds
        return Sources(open_feeds(opts))
    from .engine_feed import EngineFeed
    sinks = engine_sinks(opts)
    outputs = []
    if opts.publish:
        bound = [s.bound for s in sinks if hasattr(s, "bound")]  # what was bound (port 0: the port chosen)
        outputs.append(f"the pool stream on {bound[0] if bound else opts.publish}")
    if opts.kv_events:
        replay = getattr(opts, "kv_events_replay", None)
        outputs.append(f"KV events on {opts.kv_events}" + (f" (replay on {replay})" if replay else ""))
    observers = [export.observer(cfg)] if export is not None else []
    if export is not None:  # Prometheus scrapes now and then: a headless run stays up for it, as for a watcher
        outputs.append(f"Prometheus metrics on {export.url}")
    demo = opts.demo in DEMOS
    if window:  # a demo unfolds at a pace a person follows
        return Sources([EngineFeed.start(engine, cfg, max_steps_per_second=DEMO_SPEED if demo else None,
                                         extra_sinks=sinks, driver=driver, observers=observers)], outputs)
    # --publish and --kv-events are both for watchers in other processes, so a headless demo is paced for them to see
    # it unfold (and runs until --quit-after or Ctrl+C: the caller's part)
    return Sources([EngineFeed.start(engine, cfg, extra_sinks=sinks, history_bytes=0, polled=False, driver=driver,
                                     max_steps_per_second=DEMO_SPEED if outputs and demo else None,
                                     observers=observers)], outputs)


def engine_sinks(opts) -> list:
    """Sinks for ``--record FILE`` and ``--publish ENDPOINT``; raises ValueError/OSError with a clear message."""
    sinks: list = []
    if not (opts.record or opts.publish):
        return sinks
    try:
        if opts.record:
            from kvstream.recording import Recorder
            sinks.append(Recorder(opts.record))
        if opts.publish:
            from kvstream.poolstream.publisher import PoolStreamPublisher
            sinks.append(PoolStreamPublisher(opts.publish))
    except Exception:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        raise
    return sinks
