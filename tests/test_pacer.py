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
