"""Traces in the window: open one (File > Open trace…, a file dropped on the window, ``--trace``), replay it live
through the local engine, and keep the Capacity dock on it.

A trace is read and its replay built on the loader thread (explorer.window.loader), through the window's one
restart path: the new engine replaces the running one only once it is built, so a trace that cannot be read is one
line in a message box and the running engine goes on. The replay is the engine runner's driver (it feeds the
engine between steps, on the engine's thread); the Capacity dock sweeps the same trace in the background and marks
the live replay on its curves, and a click on a point restarts the replay at that size and policy.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from PySide6 import QtCore

from ..feeds.engine_feed import EngineFeed
from ..model.capacity import live_marker, policy_name, spec_for
from ..model.trace_rows import TraceRequests
from ..model.words import number
from . import file_dialogs

TRACE_FILTER = "Request traces (*.jsonl *.json);;All files (*)"
SWEEP_WAIT_S = 600.0  # the longest --screenshot waits for the Capacity dock's sweep (a stuck one must not hang it)


@dataclass(frozen=True)
class ReplaySettings:
    """How the window replays a trace (the command line's --replay, --trace-speed, --trace-scale)."""

    mode: str = "timed"  # "timed" (arrivals on the trace's clock, outputs decoded) or "instant"
    speed: float = 1.0  # arrivals come this many times faster than the trace's clock
    scale: float = 1.0  # each request decodes this many times its output length
    steps_per_second: float | None = None  # the engine's pace (a demo's, so a person can follow); None: the window's
    name: str = ""  # what the status bar calls it ("the traffic demo"); "" for the file's name


def settings_from(opts) -> ReplaySettings:
    """The command line's replay settings, with the window's defaults (a timed replay)."""
    return ReplaySettings(opts.replay or "timed", opts.trace_speed or 1.0, opts.trace_scale or 1.0)


def replay_builder(source, settings: ReplaySettings):
    """``build(cfg, progress)`` for the loader: read ``source`` (a path; an already read Trace is used as it is) and
    make the replay of it through an engine made from ``cfg`` (on the loader thread)."""
    def build(cfg, progress):
        from engine import make_replay, read_trace
        trace = read_trace(source) if isinstance(source, str) else source
        return make_replay(cfg, trace, settings.mode, settings.speed, settings.scale, progress=progress)
    return build


def base_config(window):
    """The settings a trace's engine starts from: the running local engine's (its model, pool, tiers, policy), or
    what a restart would start from when the window watches something else."""
    feed = window.source.feed
    return feed.config if isinstance(feed, EngineFeed) else window.engine_config


# ---- opening ----------------------------------------------------------------------------------------------------
def open_trace_dialog(window) -> None:
    path, _ = file_dialogs.open_file_name(window, "Open a request trace", "", TRACE_FILTER)
    if path:
        open_trace(window, path)


def open_trace(window, source, settings: ReplaySettings | None = None, cfg=None, demo: str | None = None,
               config_before_demo=None) -> None:
    """Replay ``source`` (a trace file's path, or a Trace) live on a new local engine made from ``cfg`` (default:
    :func:`base_config`); the running engine stays until the new one is built, and stays if the trace cannot be
    read (one line in a message box)."""
    settings = settings or ReplaySettings()
    cfg = cfg or base_config(window)
    if isinstance(source, str) and not os.path.isfile(source):
        what = "is a folder; give a trace file" if os.path.isdir(source) else "does not exist"
        window.show_error("Cannot open trace", f"{source} {what}.")
        return
    window.restart_engine(cfg, build=replay_builder(source, settings), trace_settings=settings,
                          failed_title="Cannot open trace", demo=demo, config_before_demo=config_before_demo)


def restart_replay(window, policy: str, blocks: int) -> None:
    """The Capacity dock's click: the live trace again, on a pool of ``blocks`` blocks under ``policy``."""
    replay, settings = window.trace_replay, window.trace_settings
    if replay is None or settings is None:
        window.status.showMessage("No trace is being replayed: open one first (File > Open trace…).", 5000)
        return
    cfg = dataclasses.replace(base_config(window), num_blocks=int(blocks), eviction_policy=policy)
    window.status.showMessage(f"Restarting the replay of {replay.trace.name} on {number(blocks)} blocks under "
                              f"{policy_name(policy)}…", 5000)
    window.restart_engine(cfg, build=replay_builder(replay.trace, settings), trace_settings=settings,
                          failed_title="Cannot restart the replay")


# ---- files dropped on the window (files.open_dropped opens them) ------------------------------------------------
def dropped_files(mime) -> list[str]:
    """The local files a drag carries (none for text or remote URLs)."""
    if mime is None or not mime.hasUrls():
        return []
    return [url.toLocalFile() for url in mime.urls() if url.isLocalFile() and os.path.isfile(url.toLocalFile())]


# ---- the Capacity dock ----------------------------------------------------------------------------------------------
def live_replay(window, feed=None):
    """The trace replay feeding the active source's engine, or None."""
    feed = feed or window.source.feed
    replay = window.trace_replay
    if replay is None or not isinstance(feed, EngineFeed) or feed.runner.engine is not replay.engine:
        return None
    return replay


def follow_source(window, feed) -> None:
    """A new source took over: the dock sweeps its trace (as its engine replays it: that engine's context, tiers and
    policy), or says how to open one."""
    replay = live_replay(window, feed)
    window.conversations.set_trace_requests(TraceRequests(replay) if replay is not None else None)
    if replay is None:
        window.capacity.clear()
        return
    cfg = feed.config
    window.capacity.set_trace(replay.trace, spec_for(max_blocks=replay.max_blocks, live_policy=cfg.eviction_policy,
                                                     host_tier_blocks=cfg.host_tier_blocks,
                                                     disk_tier_blocks=cfg.disk_tier_blocks))
    dock = window.docks.get("capacity")
    if dock is not None and not dock.isHidden():
        dock.raise_()  # the trace's curves in front of the tab group they share
    name = window.trace_settings.name if window.trace_settings and window.trace_settings.name else replay.trace.name
    window.status.showMessage(f"Replaying {name} ({replay.mode}): {number(replay.trace.num_requests)} requests on "
                              f"{number(cfg.num_blocks)} blocks under {policy_name(cfg.eviction_policy)}", 8000)


def show_live(window) -> None:
    """The live replay's hit rate on the dock (a few times a second, with the plots)."""
    replay = live_replay(window)
    if replay is None:
        window.capacity.set_live(None)
        return
    cfg = window.source.feed.config
    view = window.source.live
    memory = getattr(view, "memory", None) if view is not None else None
    per_block = memory.bytes_per_block if memory is not None and cfg.model != "none" else 0
    window.capacity.set_live(live_marker(replay, cfg.num_blocks, cfg.eviction_policy), per_block,
                             os.path.basename(str(cfg.model)) or str(cfg.model))


def when_swept(panel, callback, timeout_s: float = SWEEP_WAIT_S) -> QtCore.QTimer | None:
    """Call ``callback()`` once ``panel`` has finished its sweep and answered its target rate, or said why it
    stopped, or after ``timeout_s`` whatever it shows (for --screenshot, which must end)."""
    deadline = time.monotonic() + timeout_s

    def done() -> bool:
        if panel.key is None or time.monotonic() > deadline:  # nothing to sweep, or waited long enough
            return True
        return panel.settled and (panel.result is not None and panel.result.complete and bool(panel.answers)
                                  or bool(panel.error))
    if done():
        callback()
        return None
    timer = QtCore.QTimer(panel)
    timer.setInterval(100)

    def check() -> None:
        if done():
            timer.stop()
            callback()
    timer.timeout.connect(check)
    timer.start()
    return timer


def start_traffic_demo(window, cfg, config_before_demo=None) -> None:
    """Demos > Traffic: the shipped excerpt of Mooncake's trace, replayed as ``--demo traffic`` replays it, on
    ``cfg`` (the demo's model and pool over the window's settings)."""
    from ..feeds import traffic_demo as demo
    settings = ReplaySettings(demo.MODE, demo.SPEED, demo.SCALE, demo.STEPS_PER_SECOND, "the traffic demo")
    open_trace(window, demo.excerpt_path(), settings, cfg, demo=demo.NAME, config_before_demo=config_before_demo)
