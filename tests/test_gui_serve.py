"""Demos that keep living in the window: busy, crowd, tiers and window go on as served traffic once their first
screen is over, serve's arrival rate follows the toolbar's slider, the traffic ends with the engine it fed, and what
an hour of it leaves behind stays bounded."""
import numpy as np

from explorer.feeds.demo import TIERS_SETTINGS, seed_busy, seed_tiers
from kvstream.views import NO_HASH
from test_gui_support import wait_for_snapshot


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


def test_tiers_demo_goes_on_as_served_traffic_on_its_small_pool_and_host_tier(qtbot, make_window):
    """The tiers demo's story (three prefixes pushed down to the host tier and brought back) used to end at about
    step 81 and leave the window idle; it now goes on as served traffic, on the same small pool and host tier."""
    seeded = []
    window = make_window(setup=lambda engine: seeded.extend(seed_tiers(engine)), block_size=16, **TIERS_SETTINGS)
    window.start_traffic("tiers")
    traffic = window.traffic
    assert traffic is not None and not traffic.serving  # the story plays out first
    window.controls.rate.setValue(40)
    snap = wait_for_snapshot(qtbot, window, lambda s: any(c.conversation_id > max(seeded) for c in s.conversations),
                             timeout=60000)
    assert traffic.serving and "host" in snap.tiers and snap.num_blocks == TIERS_SETTINGS["num_blocks"]


def test_a_pool_without_tiers_keeps_no_content_book_or_tier_stories(qtbot, make_window):
    """The tier grids' content book and stories serve a tier's inspector only; fed every STORED event of a pool
    without a tier, they grew for as long as the window ran (an hour of served traffic: tens of MiB)."""
    window = make_window(setup=seed_busy, num_blocks=48, block_size=8)
    pane = window.panes[0]
    wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 12 and s.block_hash is not None
                      and (np.asarray(s.block_hash) != NO_HASH).any(), timeout=30000)
    qtbot.wait(200)  # a few more frames' events
    assert not window.snapshot.tiers
    assert len(pane.tier_grids.book) == 0 and len(pane.tier_grids.stories) == 0
