"""The metric plots read sensibly before and right after the first sample (issue 13: "-400...400, step (x0.001)")."""
import numpy as np

from kvstream.views import PoolSnapshot


def blank(step):
    n = 8
    return PoolSnapshot(step_id=step, block_size=4, num_blocks=n, ref_count=np.zeros(n, np.int32),
                        num_filled=np.zeros(n, np.int32), state=np.zeros(n, np.int8), owner=np.full(n, -1, np.int32),
                        last_access=np.zeros(n, np.int64), block_tables={}, conversations=())


def ranges(panel):
    out = []
    for plot, _ in panel.plot_items:
        (x0, x1), (y0, y1) = plot.getViewBox().viewRange()
        scales = {plot.getAxis(side).autoSIPrefixScale for side in ("left", "bottom")}
        out.append((x0, x1, y0, y1, scales))
    return out


def test_empty_and_one_sample_plots_show_steps_from_zero(qtbot, shown):
    from explorer.widgets.metrics import EMPTY_STEPS, MetricsPanel
    panel = shown(MetricsPanel(), 900, 300)
    panel.redraw()
    for x0, x1, y0, y1, scales in ranges(panel):
        assert (x0, x1, y0, y1) == (0, EMPTY_STEPS, 0, 1) and scales == {1.0}
    panel.record(blank(5))  # one sample: a range of one step would get an SI prefix and a tiny span
    panel.redraw()
    for x0, x1, y0, y1, scales in ranges(panel):
        assert x0 == 5 and x1 == 5 + EMPTY_STEPS and y0 == 0 and y1 >= 1 and scales == {1.0}
    for step in range(6, 40):
        panel.record(blank(step))
    panel.redraw()
    assert all(r[:2] == (5, 39) for r in ranges(panel))


def test_backfill_samples_spread_evenly_with_both_ends():
    from explorer.widgets.metrics_backfill import sample_seqs
    assert sample_seqs([3, 4, 5], most=10) == [3, 4, 5]
    picked = sample_seqs(list(range(10_000)), most=1200)
    assert len(picked) == 1200 and picked[0] == 0 and picked[-1] == 9_999
    gaps = np.diff(picked)
    assert gaps.min() >= 8 and gaps.max() <= 9  # even strides of 9999 / 1199


def test_samples_keep_the_newest_without_shifting_every_frame():
    """Past HISTORY samples the oldest go; the buffer is compacted once per HISTORY samples, not on every one."""
    import dataclasses

    from explorer.model.metrics_history import HISTORY, MetricsHistory
    from kvstream.views import EngineMetrics
    history = MetricsHistory()
    moved = []
    total = 3 * HISTORY + 7
    for step in range(total):
        before = history._buffer[0, :1].copy() if history.count else None
        snap = dataclasses.replace(blank(step), metrics=EngineMetrics(num_generated_tokens=10 * step))
        history.record(snap, now=step * 0.1)
        if before is not None and history._start == 0 and history.count == HISTORY and step >= HISTORY:
            moved.append(step)
    steps = history.series("step")
    assert history.count == HISTORY and list(steps) == list(range(total - HISTORY, total))
    assert steps.flags.c_contiguous and steps.base is not None  # a view, no copy per read
    assert len(moved) <= 3  # compacted about once per HISTORY samples
    assert np.allclose(history.series("tokens_per_s")[5:], 100.0)  # 10 tokens every 0.1 s
    history.record(dataclasses.replace(blank(total), metrics=EngineMetrics(num_generated_tokens=0)), now=1e4)
    assert history.series("tokens_per_s")[-1] == 0.0  # a new engine's counter starts again: no negative rate


def test_backfill_waits_while_the_user_scrubs_then_reads_everything(qtbot):
    """Reading a recording's metrics is 8 ms slices on the GUI thread; while the timeline moves it holds off
    (HOLD_MS after the last move), then reads every frame."""
    from explorer.widgets.metrics import MetricsPanel
    from explorer.widgets.metrics_backfill import HOLD_MS, MetricsBackfill
    from kvstream.history import History
    from kvstream.poolstream import StreamEncoder
    import dataclasses
    from kvstream.views import EngineMetrics
    history, encoder = History(), StreamEncoder()
    for step in range(60):
        history.write(encoder.encode(dataclasses.replace(blank(step), version=step,
                                                         metrics=EngineMetrics(num_generated_tokens=step))))
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    backfill = MetricsBackfill(panel)
    backfill.start(history)
    backfill.hold()  # a seek came in before the first slice
    for _ in range(3):
        qtbot.wait(HOLD_MS // 3)
        backfill.hold()  # the user goes on scrubbing: still nothing read
        assert backfill.active and panel.history.count == 0
    qtbot.waitUntil(lambda: not backfill.active, timeout=HOLD_MS * 10)
    assert list(panel.history.series("step")) == list(range(60))
    backfill.hold()  # finished: holding does nothing, nothing restarts
    qtbot.wait(HOLD_MS + 100)
    assert not backfill.active and panel.history.count == 60


def test_the_axes_are_drawn_from_qts_cache_until_they_change(qtbot, shown, monkeypatch):
    """The plots' axes (each spanning its plot, with the grid lines) were drawn again on every repaint of the dock, a
    large share of the GUI thread in the serve demo (docs/gui.md). Each axis keeps its drawing in Qt's item cache, so a
    repaint that changes no axis (the curves redrawing themselves) takes it from there, and one whose range changed
    draws it anew, with the new ticks. (How often Qt paints is its own business and a busy machine's: bench/gui.py
    measures it.)"""
    import pyqtgraph as pg
    from explorer.widgets.metrics import MetricsPanel
    from explorer.widgets.painting import CACHED
    panel = shown(MetricsPanel(), 900, 300)
    qtbot.waitUntil(lambda: panel.columns == 3)  # laid out for its width (after the resize event)
    for step in range(5, 40):
        panel.record(blank(step))
    panel.redraw()
    axes = [plot.getAxis(side) for plot, _ in panel.plot_items for side in ("left", "bottom")]
    assert all(axis.cacheMode() == CACHED for axis in axes)
    bottom, painted = panel.plot_items[0][0].getAxis("bottom"), []
    monkeypatch.setattr(bottom, "paint", lambda *a: painted.append(1) or pg.AxisItem.paint(bottom, *a))
    panel.plot_items[0][0].setXRange(0, 1000, padding=0)  # an axis that changes is drawn again
    qtbot.waitUntil(lambda: bool(painted), timeout=2000)


def test_a_resize_never_re_lays_out_the_plots_inside_its_event(qtbot, monkeypatch):
    """Issue 48: the launches that crashed in pyqtgraph's AxisItem._updateLabel did so while MetricsPanel removed
    and re-added every plot from inside resizeEvent. The re-layout now runs after the event (a zero-delay timer),
    and only when the column count changes."""
    from explorer.widgets.metrics import MIN_PLOT_WIDTH, MetricsPanel
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    inside, during, removed = [], [], []
    real_resize, real_reflow = MetricsPanel.resizeEvent, MetricsPanel._reflow

    def resize_event(self, event):
        inside.append(True)
        try:
            real_resize(self, event)
        finally:
            inside.pop()

    def reflow(self, columns):
        during.append(bool(inside))
        real_reflow(self, columns)
    monkeypatch.setattr(MetricsPanel, "resizeEvent", resize_event)
    monkeypatch.setattr(MetricsPanel, "_reflow", reflow)
    real_remove = panel.plots.ci.removeItem
    monkeypatch.setattr(panel.plots.ci, "removeItem", lambda item: (removed.append(item), real_remove(item)))
    panel.resize(2 * MIN_PLOT_WIDTH + 10, 300)
    panel.show()
    qtbot.waitExposed(panel)
    qtbot.waitUntil(lambda: panel.columns == 2)
    assert during and not any(during), "the plots were re-laid out inside resizeEvent"
    removed.clear()
    panel.resize(2 * MIN_PLOT_WIDTH + 60, 320)  # the same two columns
    qtbot.waitUntil(lambda: panel.width() == 2 * MIN_PLOT_WIDTH + 60)
    panel.resize(3 * MIN_PLOT_WIDTH + 10, 320)  # three: re-laid once, after the event
    qtbot.waitUntil(lambda: panel.columns == 3)
    assert len(removed) == len(panel.plot_items) and not any(during)


def test_a_resize_keeps_the_history_frame_on_view(qtbot):
    """A resize used to reset what the plots show to the live end (``until`` was set in resizeEvent)."""
    from explorer.widgets.metrics import MetricsPanel
    panel = MetricsPanel()
    qtbot.addWidget(panel)
    panel.redraw()  # before any resize: nothing it needs is missing
    for step in range(1, 30):
        panel.record(blank(step))
    panel.show_until(12)
    panel.resize(700, 300)
    panel.show()
    qtbot.waitExposed(panel)
    panel.redraw()
    assert panel.until == 12 and all(r[1] == 12 for r in ranges(panel))
