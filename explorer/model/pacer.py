"""How often the window takes a new live frame: at every tick of its timer, unless following the frames costs the GUI
thread more than its share of the machine.

With hundreds of conversations decoding on a large pool the engine steps many times a second, and every new frame
costs the GUI thread several milliseconds (the grid's image, the event log and timeline marks, the readouts, Qt's
painting). On a 2-core machine the engine thread and its second torch thread give up whatever the window takes.
Showing fewer of those frames (the newest one each time, with every event of the frames in between) keeps the GUI
thread within its budget, and the window's timer, so mouse, keys and scrubbing, keeps its 30-33 ticks a second.

The budget is the window's whole cost to decoding less what pacing cannot lower (the History's encoder thread turns
every step into a frame, however few the window shows). How the budget was chosen, and what it gives, measured with
bench/gui.py: docs/gui.md, "What the GUI thread does at scale" and its figures.

:class:`LivePacer` measures the GUI thread's CPU time over each half second and widens the gap between live frames
while that is over the budget (the further over, the faster). It narrows the gap again, down to every tick, once the
GUI thread is well under its budget, or while the engine keeps up with a speed limit (the demos run at 10 steps a
second): an engine that waits between steps has no use for what the window would give up. Qt-free, with its clocks injectable, so the control loop is tested on its own.
"""
from __future__ import annotations

import os
import time
from typing import Callable

MACHINE_SHARE = 0.025  # the GUI thread's budget for following live frames: 2.5% of the machine's CPU time (5% of a
# core on 2 cores, where it matters; 40% of a core on 16, where the window has cores of its own and never waits)
MAX_INTERVAL = 0.25  # but a new live frame at least 4 times a second, however costly
WINDOW_S = 0.5  # the GUI thread's CPU share is measured over this much wall time
STEP = 1.4  # the gap widens or narrows by this factor per window (widens by up to MAX_STEP, as far over budget as the
MAX_STEP = 2.0  # share was: from every tick to the cap in 3 windows at twice the budget, instead of 7)
LOW = 0.7  # and narrows only under this fraction of the budget (a band, so it settles instead of swinging)
SLACK = 0.9  # an engine held to a speed limit that makes at least this share of it has time to spare


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class LivePacer:
    """The least time between two live frames the window takes (``interval``; 0: every tick), from the GUI thread's
    measured CPU share. Call :meth:`tick` from the GUI thread at every tick of its timer."""

    def __init__(self, budget: float | None = None, tick_s: float = 0.033, max_interval: float = MAX_INTERVAL,
                 clock: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time):
        self.budget = MACHINE_SHARE * available_cpus() if budget is None else budget  # of one core
        self.tick_s = tick_s  # the timer's period: the first step up from 0 starts there
        self.max_interval = max_interval
        self.interval = 0.0
        self.share: float | None = None  # the GUI thread's CPU share over the last full window (of one core)
        self._clock, self._cpu = clock, cpu
        self._start: tuple[float, float] | None = None  # (wall, cpu) when the current window began

    def tick(self, slack: bool = False) -> float:
        """Measure; at the end of each window, widen or narrow the gap. ``slack``: the engine keeps up with a speed
        limit (:func:`engine_has_slack`), so nothing the window gives up would make it faster: narrow. Returns the
        gap now (seconds)."""
        now, cpu = self._clock(), self._cpu()
        if self._start is None:
            self._start = (now, cpu)
            return self.interval
        elapsed = now - self._start[0]
        if elapsed < WINDOW_S:
            return self.interval
        share = (cpu - self._start[1]) / elapsed
        self.share, self._start = share, (now, cpu)
        if share > self.budget and not slack:
            factor = min(MAX_STEP, max(STEP, share / self.budget)) if self.budget > 0 else MAX_STEP
            self.interval = min(self.max_interval, max(self.interval, self.tick_s) * factor)
        elif (share < LOW * self.budget or slack) and self.interval > 0:
            narrower = self.interval / STEP
            self.interval = narrower if narrower >= self.tick_s * STEP else 0.0
        return self.interval

    def reset(self) -> None:
        """Every tick again (a new source: its cost is not the old one's)."""
        self.interval, self.share, self._start = 0.0, None, None


def engine_has_slack(speed: float | None, steps_per_second: float) -> bool:
    """Whether an engine held to ``speed`` steps a second (None: unlimited) makes nearly all of them
    (SLACK): then it waits between steps anyway, and the window's cost slows nothing."""
    return speed is not None and speed > 0 and steps_per_second >= SLACK * speed


PANEL_INTERVAL = 0.1  # tables, text and readouts follow at most 10 times a second; the grid at every frame
PANEL_SHARE = 1 / 80  # and their refresh takes at most this share of the GUI thread's time (their painting then
# costs about as much again, and more): on a large pool at 10 refreshes a second the panels take a core's share the
# engine's second torch thread waits for (bench/gui.py); at this share they follow a few times a second there, and
# 10 times a second on a small pool (figures: docs/performance.md, "Window panels")
PANEL_MAX_INTERVAL = 0.5  # but at least twice a second, however costly
PLOT_INTERVAL = 0.5  # metric plots and the status line: repainting axes is the costliest thing the GUI does
PLOTS_PER_GAP = 4  # while live frames are paced (LivePacer), the plots every 4 gaps: once a second at most
PANELS_PER_GAP = 2  # and the tables every 2 gaps (twice a second at the cap: PANEL_MAX_INTERVAL)


class FramePace:
    """What the window does at one tick of its frame timer, and what it leaves for a later one: the gap live frames
    keep (:class:`LivePacer`), whether the panels (tables, text, readouts) refresh, whether the plots and the status
    line redraw. The grid follows every frame it is given; the rest follows as often as its cost allows.

    The window calls :meth:`tick` first, then asks :meth:`panels_due` and :meth:`plots_due` with the same ``now``;
    Qt-free, with the clocks injectable (through ``pacer``), so the pace is tested without a window."""

    def __init__(self, pacer: LivePacer):
        self.pacer = pacer
        self.gap = 0.0  # the live frames' gap at this tick (0: every tick)
        self.panel_interval = PANEL_INTERVAL  # from the refreshes' cost (PANEL_SHARE)
        self.panel_cost = 0.0  # seconds a refresh takes, smoothed
        self.last_panels = self.last_plots = 0.0  # when they were last refreshed (the clock's seconds)

    def tick(self, slack: bool) -> float:
        """A tick of the frame timer: the gap live frames keep now (``slack``: :func:`engine_has_slack`)."""
        self.gap = self.pacer.tick(slack)
        return self.gap

    def panels_due(self, now: float) -> bool:
        """Whether stale panels refresh at this tick: at most every ``panel_interval``, every PANELS_PER_GAP gaps
        while live frames are paced, and at least every PANEL_MAX_INTERVAL."""
        due = min(PANEL_MAX_INTERVAL, max(self.panel_interval, PANELS_PER_GAP * self.gap))
        return now - self.last_panels >= due

    def panels_refreshed(self, now: float, cost: float) -> None:
        """The panels refreshed at ``now`` and took ``cost`` seconds: the next refresh waits for the smoothed cost.
        Each sample counts at most 4x the average so far: one slow refresh (a garbage collection) must not hold them
        back for seconds."""
        self.last_panels = now
        cost = min(cost, 4 * max(self.panel_cost, PANEL_INTERVAL * PANEL_SHARE))
        self.panel_cost = 0.7 * self.panel_cost + 0.3 * cost
        self.panel_interval = min(PANEL_MAX_INTERVAL, max(PANEL_INTERVAL, self.panel_cost / PANEL_SHARE))

    def moved(self) -> None:
        """The user moved the view (not in a drag): the panels follow at the next tick."""
        self.last_panels = 0.0

    def plots_due(self, now: float) -> bool:
        """Whether the plots and the status line redraw at this tick (every PLOT_INTERVAL; every PLOTS_PER_GAP gaps
        while live frames are paced); a yes counts as done."""
        if now - self.last_plots < max(PLOT_INTERVAL, PLOTS_PER_GAP * self.gap):
            return False
        self.last_plots = now
        return True

    def reset(self) -> None:
        """A new source: its cost is not the old one's."""
        self.pacer.reset()
