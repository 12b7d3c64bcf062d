"""The content view with tiers (issue 30): per-tier counts, each block's media and how its content is known,
content-less placeholders, and "Across instances" saying per instance which tiers hold each prefix and the per-tier
longest match of a prompt."""
from __future__ import annotations

from explorer.widgets.content_view import ContentView
from kvstream.kv_events import BlockRemoved, BlockStored, KVCacheIndex, make_batch
from tests.helpers import wait_until


def gpu(hashes, parent, tokens):
    return BlockStored(tuple(hashes), parent, tuple(tokens), 2, None, "GPU", None, group_idx=0)


def placeholder(h, medium):
    return BlockStored((h,), None, (), 0, None, medium, None, group_idx=0, locality="LOCAL", ownership="cpu")


def rows(model, parent=None):
    from PySide6 import QtCore
    parent = parent or QtCore.QModelIndex()
    return [tuple(model.data(model.index(r, c, parent)) for c in range(model.columnCount()))
            for r in range(model.rowCount(parent))]


def test_tiers_in_the_instance_pane_and_across(qtbot):
    a, b = KVCacheIndex("node-a"), KVCacheIndex("node-b")
    a.apply_batch(make_batch([gpu([11, 12], None, [1, 2, 3, 4])], 1.0), 0)
    a.apply_batch(make_batch([placeholder(11, "CPU"), placeholder(12, "CPU"), placeholder(999, "CPU"),
                              BlockRemoved((12,), "GPU", group_idx=0)], 2.0), 1)
    b.apply_batch(make_batch([gpu([21], None, [1, 2])], 1.0), 0)
    view = ContentView([a, b])
    qtbot.addWidget(view)
    view.refresh()
    pane = view.panes[0]
    assert "by tier: GPU 1, CPU 3, STORAGE 0" in pane.counts_label.text()
    top = rows(pane.model)
    assert top[0][0] == "1 2" and top[0][2] == "CPU+GPU · content known from its GPU store"
    assert top[-1][0] == "(content not sent)" and top[-1][2] == "CPU · content not sent"
    tip = pane.model.item(0, 2).toolTip()
    assert "CPU · group 0 · LOCAL · owner cpu" in tip and "GPU · group 0" in tip
    assert "by tier" not in view.panes[1].counts_label.text()  # GPU only: the line stays as it was
    across = view.across
    first = rows(across.model)[0]
    assert first[:4] == ("1 2", "2 of 2", "CPU+GPU", "GPU")
    across.prompt.setText("1 2 3 4")
    text = across.route_label.text()
    assert "node-a: 2 blocks; node-b: 1 block" in text  # any tier
    assert "Per tier: node-a: GPU 1, CPU 2, STORAGE 0." in text and "node-b: GPU" not in text


def test_the_feeds_json_has_the_kv_event_keys(tmp_path):
    """--json of a KV-event source: DESIGN.md's stored_hashes_by_medium, and the stream's malformed, lost, odd
    events and last error from its status."""
    from explorer.feeds.kv_event_feed import KVEventFeed
    from kvstream.kv_events import KVEventEndpoint, KVEventPublisher, KVEventSubscriber
    ep = KVEventEndpoint(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r")
    with KVEventPublisher(ep.endpoint, ep.replay_endpoint) as pub:
        pub.publish([gpu([11, 12], None, [1, 2, 3, 4]), placeholder(11, "CPU")])
        feed = KVEventFeed(KVEventSubscriber([ep]).start())
        try:
            wait_until(lambda: feed.subscriber.status()[0].num_batches >= 1)
            summary = feed.summaries(final=True)[0]
        finally:
            feed.close()
    assert summary["stored_hashes_by_medium"] == {"GPU": 2, "CPU": 1, "STORAGE": 0}
    assert summary["malformed"] == 0 and summary["lost"] == 0 and summary["odd_events"] == 0
    assert summary["last_error"] is None and summary["stored_hashes"] == 2
