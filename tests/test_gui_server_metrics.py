"""The metrics dock beside a KV-event source with ``--attach-metrics``: the server's own hit rate and usage next to
what its events say, a disagreement in words, a server gone bad in one line while the window runs on."""
from __future__ import annotations

import shutil
import tempfile

import pytest

from explorer.feeds.kv_event_feed import KVEventFeed
from explorer.window.main_window import MainWindow
from kvstream.kv_events import BlockStored, KVEventEndpoint, KVEventPublisher
from tests.test_metrics_reader import FakeServer, vllm_text

OTHER_DOCKS = ("inspector", "legend", "memory", "conversations", "block-history", "events")


@pytest.fixture
def stream():
    sockdir = tempfile.mkdtemp(prefix="kvm", dir="/tmp")
    pub = KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r")
    pub.publish([BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None, token_ids=tuple(range(12)),
                             block_size=4, lora_id=None, medium="GPU", lora_name=None)])
    yield pub
    pub.close()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def server():
    fake = FakeServer()
    fake.answer = (200, "text/plain", vllm_text(usage=2 / 39, queries=200, hits=100, running=1, block_size=4).encode(),
                   False)
    yield fake
    fake.close()


def test_the_dock_shows_the_servers_figures_beside_the_events_and_says_when_they_disagree(qtbot, stream, server):
    feed = KVEventFeed.connect([KVEventEndpoint(stream.endpoint, stream.replay_endpoint, name="vllm-0")],
                               metrics_url=server.url)
    feed.server.reader.interval_s = 0.05
    window = MainWindow(feed=feed, size=(1600, 1000))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    view = window.metrics.server
    try:
        qtbot.waitUntil(lambda: "3 GPU blocks hold cached prefixes" in view.plain_text(), timeout=10000)
        assert window.docks["metrics"].isVisible() and view.isVisible()
        assert not window.metrics.plots.isVisible()  # no step plots for a source without a pool
        assert not any(window.docks[key].isVisible() for key in OTHER_DOCKS)
        text = view.plain_text()
        assert f"vLLM server {server.url}" in text and "engine 0 · KV events vllm-0" in text
        assert "server: 50.0% of prompt tokens hit the prefix cache" in text
        assert "server: KV usage 5.1% (2 of 40 blocks held by requests)" in text
        assert "disagree" not in text
        server.answer = (200, "text/plain", vllm_text(usage=2 / 39, queries=300, hits=100, block_size=16).encode(),
                         False)
        qtbot.waitUntil(lambda: "disagree: the KV events' blocks hold 4 tokens, the server's 16" in view.plain_text(),
                        timeout=10000)
        assert "color:#e0443e" in view.body.text().replace(" ", "")  # said in red
        server.answer = (200, "application/json", b"{}", False)
        qtbot.waitUntil(lambda: "answered application/json, not Prometheus text" in view.plain_text(),
                        timeout=10000)
        assert "showing the last good reading" in view.plain_text()
        qtbot.waitUntil(lambda: "not Prometheus text" in window.status.labels["live"].text(), timeout=5000)
        assert feed.server.reader.alive and window.timer.isActive()  # nothing died, nothing stopped
        server.answer = (200, "text/plain", vllm_text(usage=0.0, queries=400, hits=200, block_size=4).encode(),
                         False)
        qtbot.waitUntil(lambda: "showing the last good reading" not in view.plain_text() and
                        "server: 50.0% of prompt tokens hit" in view.plain_text(), timeout=10000)
    finally:
        window.close()
    assert not feed.server.reader.alive  # closing the window stopped the reader


def test_the_windows_metrics_follow_a_new_engine_and_close_with_the_window(qtbot):
    """--metrics-port in the window: File > New engine's engine feeds the same /metrics (its counts add to the
    first engine's, its pool replaces the first one's in cache_config_info); closing the window frees the port."""
    import urllib.request

    from engine import Engine, EngineConfig
    from explorer.feeds.engine_feed import EngineFeed
    from explorer.model.metrics_export import EngineMetricsExport
    from kvstream.metrics import names
    from tests.test_metrics_export import scrape, value

    export = EngineMetricsExport(0, host="127.0.0.1")
    cfg = EngineConfig(model="builtin", block_size=4, num_blocks=32, seed=0)
    feed = EngineFeed.start(Engine(cfg), cfg, observers=[export.observer(cfg)])
    window = MainWindow(feed=feed, config=cfg, size=(1280, 800))
    window.metrics_export = export
    qtbot.addWidget(window)
    total = names.PREFIX_CACHE_QUERIES + "_total"

    def queries():
        return value(scrape(export.url), names.PREFIX_CACHE_QUERIES, total)
    try:
        feed.submit("add_conversation", prompt_token_ids=list(range(2, 14)), max_new_tokens=2).result(timeout=30)
        qtbot.waitUntil(lambda: queries() == 12, timeout=20000)
        other = EngineConfig(model="builtin", block_size=8, num_blocks=16, seed=0)
        window.swap_engine(Engine(other), other)
        window.source.feed.submit("add_conversation", prompt_token_ids=list(range(2, 22)),
                                  max_new_tokens=2).result(timeout=30)
        qtbot.waitUntil(lambda: queries() == 12 + 20, timeout=20000)
        info = scrape(export.url)[names.CACHE_CONFIG_INFO].samples
        assert [(s.labels["num_gpu_blocks"], s.labels["block_size"]) for s in info] == [("16", "8")]
    finally:
        window.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(export.url, timeout=5)
