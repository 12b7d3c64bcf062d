"""Demos that keep living in the window: busy and crowd go on as served traffic once their first screen is over,
serve's arrival rate follows the toolbar's slider, and the traffic ends with the engine it fed."""
from explorer.feeds.demo import seed_busy
from test_gui_support import make_window, wait_for_snapshot  # noqa: F401  (fixture)


def test_busy_demo_goes_on_as_served_traffic(qtbot, make_window):
    seeded = []
    window = make_window(setup=lambda engine: seeded.extend(seed_busy(engine)), num_blocks=48, block_size=8)
    assert not window.controls.rate_action.isVisible()
    window.start_traffic("busy")
    traffic = window.traffic
    assert traffic is not None and window.controls.rate_action.isVisible()
    window.controls.rate.setValue(40)  # the slider: 4 requests/s
    assert traffic.rate == 4.0 and window.controls.rate_label.text() == "4.0/s"
    # the first screen plays out (busy's five conversations end), then requests keep arriving
    snap = wait_for_snapshot(qtbot, window, lambda s: any(c.conversation_id > max(seeded) for c in s.conversations),
                             timeout=60000)
    assert traffic.serving and any(c.is_live for c in snap.conversations) or traffic.traffic.counts.arrived > 0
    # a restart without a demo ends the traffic with the engine it fed
    old = window.runner
    window.restart_engine(window.config)
    qtbot.waitUntil(lambda: window.runner is not old, timeout=15000)
    assert window.traffic is None and not traffic.alive and not window.controls.rate_action.isVisible()
