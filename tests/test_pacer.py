"""The window's live-frame pacer (explorer.model.pacer): the gap between live frames widens while the GUI thread's CPU
share is over its budget, up to its cap, holds inside the band, and narrows back to every tick once well under, or
while the engine keeps up with a speed limit."""
import pytest

from explorer.model import pacer
from explorer.model.pacer import LivePacer


class Clocks:
    """Wall time and the GUI thread's CPU time, moved by the test: ``run(seconds, share)``."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def run(self, seconds: float, share: float, p: LivePacer, slack: bool = False, tick: float = 0.033) -> float:
        steps = round(seconds / tick)
        for _ in range(steps):
            self.wall += tick
            self.cpu += tick * share
            p.tick(slack)
        return p.interval


@pytest.fixture
def clocks():
    return Clocks()


def make(clocks, budget=0.10) -> LivePacer:
    p = LivePacer(budget=budget, tick_s=0.033, clock=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    p.tick()
    return p


def test_every_tick_while_under_budget(clocks):
    p = make(clocks)
    assert clocks.run(5, 0.09, p) == 0.0 and p.share == pytest.approx(0.09, abs=0.01)


def test_over_budget_widens_to_the_cap_then_narrows_back_to_every_tick(clocks):
    p = make(clocks)
    clocks.run(pacer.WINDOW_S + 0.05, 0.12, p)
    assert p.interval == pytest.approx(0.033 * pacer.STEP)  # one window a little over: one step
    clocks.run(pacer.WINDOW_S, 0.50, p)
    assert p.interval == pytest.approx(0.033 * pacer.STEP * pacer.MAX_STEP)  # far over: a longer step
    gaps = [clocks.run(pacer.WINDOW_S, 0.20, p) for _ in range(12)]
    assert gaps == sorted(gaps) and gaps[-1] == pacer.MAX_INTERVAL  # wider each window, never past the cap
    clocks.run(3, 0.09, p)  # inside the band (0.07-0.10): it holds
    assert p.interval == pacer.MAX_INTERVAL
    clocks.run(10, 0.03, p)  # well under: back to every tick
    assert p.interval == 0.0


def test_reset_and_the_default_budget(clocks, monkeypatch):
    p = make(clocks)
    clocks.run(3, 0.5, p)
    assert p.interval > 0
    p.reset()
    assert p.interval == 0.0 and p.share is None
    monkeypatch.setattr(pacer, "available_cpus", lambda: 2)
    assert LivePacer().budget == pytest.approx(0.05)  # 2.5% of a 2-core machine: a twentieth of a core
    monkeypatch.setattr(pacer, "available_cpus", lambda: 16)
    assert LivePacer().budget == pytest.approx(0.40)


def test_not_paced_while_the_engine_keeps_up_with_a_speed_limit(clocks):
    """A GUI thread over its budget beside an engine held to a speed it reaches (the demos' 10 steps a second) takes
    nothing the engine could use: every frame stays, and a gap already there narrows back."""
    p = make(clocks)
    assert clocks.run(5, 0.30, p, slack=True) == 0.0
    assert clocks.run(5, 0.30, p) == pacer.MAX_INTERVAL
    assert clocks.run(10, 0.30, p, slack=True) == 0.0
    assert pacer.engine_has_slack(10.0, 9.5) and not pacer.engine_has_slack(10.0, 8.0)
    assert not pacer.engine_has_slack(None, 40.0) and not pacer.engine_has_slack(0.0, 40.0)  # unlimited: no


class Paced:
    """A FramePace on the test's clocks; ``ticks(seconds, share, refresh_cost)`` runs the window's frame timer: each
    tick refreshes the panels when they are due (and they cost ``refresh_cost``), and redraws the plots when due.
    Returns (the times the panels refreshed, the times the plots redrew)."""

    def __init__(self, clocks, budget=0.10):
        self.clocks = clocks
        self.pace = pacer.FramePace(make(clocks, budget))

    def ticks(self, seconds: float, share: float = 0.0, refresh_cost: float = 0.001, tick: float = 0.033):
        panels, plots = [], []
        for _ in range(round(seconds / tick)):
            self.clocks.wall += tick
            self.clocks.cpu += tick * share
            now = self.clocks.wall
            self.pace.tick(slack=False)
            if self.pace.panels_due(now):
                panels.append(now)
                self.pace.panels_refreshed(now, refresh_cost)
            if self.pace.plots_due(now):
                plots.append(now)
        return panels, plots


def _gaps(times):
    return [round(b - a, 3) for a, b in zip(times, times[1:])]


def test_panels_refresh_ten_times_a_second_and_plots_twice_while_cheap(clocks):
    panels, plots = Paced(clocks).ticks(3)
    assert min(_gaps(panels)) >= pacer.PANEL_INTERVAL and max(_gaps(panels)) < pacer.PANEL_INTERVAL + 0.034
    assert min(_gaps(plots)) >= pacer.PLOT_INTERVAL and max(_gaps(plots)) < pacer.PLOT_INTERVAL + 0.034


def test_a_costly_refresh_follows_less_often_but_at_least_twice_a_second(clocks):
    """A refresh that takes 10 ms (a large pool on a loaded machine) may take PANEL_SHARE of the GUI thread: once
    every 0.8 s, capped at PANEL_MAX_INTERVAL; one slow refresh alone (a garbage collection) moves the pace little."""
    paced = Paced(clocks)
    paced.ticks(2)  # cheap first: every PANEL_INTERVAL
    paced.pace.panels_refreshed(clocks.wall, 1.0)  # one refresh of a second counts as 4x the average so far
    assert paced.pace.panel_interval < pacer.PANEL_MAX_INTERVAL / 2
    paced = Paced(clocks)
    paced.ticks(5, refresh_cost=0.01)
    assert paced.pace.panel_interval == pacer.PANEL_MAX_INTERVAL
    panels, _ = paced.ticks(3, refresh_cost=0.01)
    assert min(_gaps(panels)) >= pacer.PANEL_MAX_INTERVAL and max(_gaps(panels)) < pacer.PANEL_MAX_INTERVAL + 0.034


def test_paced_live_frames_space_the_panels_and_plots_by_their_gap(clocks):
    """While live frames are paced to MAX_INTERVAL (a GUI thread over its budget), the tables follow every
    PANELS_PER_GAP gaps and the plots every PLOTS_PER_GAP; back under budget, at their own pace again."""
    paced = Paced(clocks)
    paced.ticks(8, share=0.5)  # far over budget: the gap widens to its cap
    assert paced.pace.gap == pacer.MAX_INTERVAL
    panels, plots = paced.ticks(4, share=0.5)
    assert min(_gaps(panels)) >= pacer.PANELS_PER_GAP * pacer.MAX_INTERVAL
    assert min(_gaps(plots)) >= pacer.PLOTS_PER_GAP * pacer.MAX_INTERVAL
    paced.ticks(10, share=0.0)  # well under: every tick again
    panels, plots = paced.ticks(2)
    assert paced.pace.gap == 0.0 and max(_gaps(panels)) < pacer.PANEL_INTERVAL + 0.034
    assert max(_gaps(plots)) < pacer.PLOT_INTERVAL + 0.034


def test_a_move_refreshes_the_panels_at_the_next_tick(clocks):
    paced = Paced(clocks)
    paced.ticks(5, refresh_cost=0.01)  # slow panels: every PANEL_MAX_INTERVAL
    panels, _ = paced.ticks(0.033)
    assert panels == [] or paced.ticks(0.033)[0] == []  # not due again this soon
    paced.pace.moved()
    assert paced.ticks(0.033)[0] != []
