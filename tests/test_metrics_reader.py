"""``--attach-metrics``: a vLLM server's /metrics read for meaning and within bounds, and compared with its KV events
(issue 46, "Prometheus in and out"). Servers that answer garbage, the wrong thing, impossible numbers, too much,
too slowly or nothing at all are played by a local HTTP server and raw sockets; the live server is in
tests/vllm_live/test_metrics_live.py."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstream.kv_events import KVCacheIndex
from kvstream.kv_events.codec import BlockRemoved, BlockStored, KVEventBatch
from kvstream.metrics import MetricsReader, ServerWatch, VllmMetrics, names, parse_metrics
from kvstream.metrics.compare import _Seen, compare_engine, server_json
from kvstream.metrics.reader import MetricsError, check_url, fetch_text
from tests.helpers import wait_until

VLLM_TEXT = (Path(__file__).parent / "data" / "vllm_0_32_metrics.txt").read_text()  # a real vllm serve's answer


def vllm_text(usage=0.25, queries=640, hits=320, running=2, waiting=0, num_gpu_blocks=40, block_size=32,
              caching="True", engine="0", extra="") -> str:
    """An answer in vLLM 0.32's shape (its families, types and labels) with the figures the test picks."""
    labels = f'engine="{engine}",model_name="m"'
    return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
            f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{{labels}}} {queries}\n"
            f"# TYPE vllm:prefix_cache_queries_created gauge\nvllm:prefix_cache_queries_created{{{labels}}} 1.7e9\n"
            f"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{{labels}}} {hits}\n"
            f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{block_size}\","
            f"enable_prefix_caching=\"{caching}\",engine=\"{engine}\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0\n"
            + extra)


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_parses_a_real_vllm_answer():
    reading = parse_metrics(VLLM_TEXT, "http://x/metrics")
    (engine,) = reading.engines
    assert (engine.engine, engine.model_name, engine.usage, engine.queries, engine.hits) == \
        ("0", "/tmp/prom/ckpt", 0.0, 174.0, 64.0)
    assert (engine.num_gpu_blocks, engine.block_size, engine.prefix_caching, engine.running) == (40, 32, True, 0)
    assert engine.hit_rate == pytest.approx(64 / 174) and engine.used_blocks == 0


def test_our_exporter_speaks_vllms_names_types_labels_and_buckets():
    """Every family we serve exists in a real vLLM 0.32 answer with the same type, the same label names (ours add
    ``tier`` to the block histograms) and the same bucket bounds; and our answer parses back to its figures."""
    ours = VllmMetrics()
    ours.record(pool_figures_of(usage=0.5), "m", {"block_size": 16, "num_gpu_blocks": 64, "engine": "0",
                                                 "enable_prefix_caching": True})
    for tier in ("device", "host"):
        ours.observe(tier, "lifetime", 3.0)
        ours.observe(tier, "idle", 0.004)
        ours.observe(tier, "reuse_gap", 0.2)
    text = generate_latest(ours.registry).decode()
    theirs = {f.name: f for f in text_string_to_metric_families(VLLM_TEXT)}
    mine = {f.name: f for f in text_string_to_metric_families(text)}
    served = [n for n in mine if n.startswith("vllm:") and not n.endswith("_created")]
    assert len(served) == 11  # 3 gauges, the info gauge, 4 counters, 3 histograms
    for name in served:
        assert mine[name].type == theirs[name].type, name
        their_labels = {k for s in theirs[name].samples for k in s.labels} - {"le"}
        my_labels = {k for s in mine[name].samples for k in s.labels} - {"le"}
        if name == names.CACHE_CONFIG_INFO:  # vLLM writes every CacheConfig field; ours the ones it has
            assert my_labels <= their_labels, my_labels - their_labels
        elif mine[name].type == "histogram":
            assert my_labels == their_labels | {"tier"}, name
            bounds = lambda fam: sorted({s.labels["le"] for s in fam.samples if "le" in s.labels}, key=float)
            assert bounds(mine[name]) == bounds(theirs[name]), name
        else:
            assert my_labels == their_labels, name
        assert {s.name for s in mine[name].samples} == {s.name for s in theirs[name].samples}, name
    reading = parse_metrics(text)
    assert reading.engines[0].usage == 0.5 and reading.engines[0].num_gpu_blocks == 64


def pool_figures_of(**kw):
    from kvstream.metrics import PoolFigures
    base = dict(usage=0.0, running=1, waiting=0, queries=100, hits=40, external_queries=0, external_hits=0)
    base.update(kw)
    return PoolFigures(**base)


@pytest.mark.parametrize("text, words", [
    ("<html><body>Not Found</body></html>", "not Prometheus' text format"),
    ("node_cpu_seconds_total{cpu=\"0\"} 12.5\n", "no vLLM cache metrics"),
    (vllm_text(usage=1.5), "past 1 (100%)"),
    (vllm_text(usage="NaN"), "usage is nan"),
    (vllm_text(queries=10, hits=20), "20 prefix-cache hits of 10 queries"),
    (vllm_text(hits=-4), "hits is -4"),
    (vllm_text(running=1.5), "not a whole number"),
    (vllm_text(num_gpu_blocks="lots"), "num_gpu_blocks='lots' is not a number"),
    (vllm_text(block_size=0), "block_size=0 is out of range"),
    ("".join(vllm_text(engine=str(i)) for i in range(300)), "more than 256 engines"),
])
def test_answers_that_make_no_sense_are_refused_with_the_reason(text, words):
    with pytest.raises(MetricsError, match=None) as caught:
        parse_metrics(text)
    assert words in str(caught.value), str(caught.value)


def test_urls():
    assert check_url("http://h:8000") == "http://h:8000/metrics"
    assert check_url("https://h/custom/path?x=1") == "https://h/custom/path?x=1"
    for bad in ("h:8000", "ftp://h/metrics", "http:///metrics", "http://h:99999/metrics", ""):
        with pytest.raises(MetricsError):
            check_url(bad)


# ---- a server that misbehaves -------------------------------------------------------------------------------------
class FakeServer:
    """A local HTTP server whose answer the test sets: (status, content type, body, trickle)."""

    def __init__(self):
        self.answer = (200, "text/plain; version=0.0.4", vllm_text().encode(), False)
        self.release = threading.Event()  # ends a trickle
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                status, kind, body, trickle = fake.answer
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not trickle:
                    self.wfile.write(body)
                    return
                for i in range(min(len(body), 60)):  # a byte at a time until the test lets go (3 s at most)
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    if fake.release.wait(0.05):
                        return

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def test_a_misbehaving_server_is_one_line_and_the_last_good_reading_stays(server):
    reader = MetricsReader(server.url, timeout_s=0.5, max_bytes=64 << 10)
    reader.read_once()
    good = reader.latest
    assert reader.status().state == "ok" and good.engines[0].usage == 0.25
    faults = [
        ((200, "text/plain", b"garbage here\n", False), "not Prometheus' text format"),
        ((200, "text/html", b"<html></html>", False), "answered text/html, not Prometheus text"),
        ((500, "text/plain", b"oops", False), "HTTP 500"),
        ((200, "text/plain", b"x" * (65 << 10), False), "over the 65,536-byte limit"),
        ((200, "text/plain", b"\xff\xfe\xfa" * 10, False), "is not utf-8 text"),
        ((200, "text/plain", vllm_text(usage=2).encode(), False), "past 1 (100%)"),
        ((200, "text/plain", vllm_text().encode() * 50, True), "not complete after 0.5 s"),  # trickled
    ]
    for answer, words in faults:
        server.answer = answer
        server.release.clear()
        reader.read_once()
        server.release.set()
        status = reader.status()
        assert status.state == "error" and words in status.text, (words, status.text)
        assert "\n" not in status.text and status.text.startswith(server.url)
        assert "showing the last good reading" in status.text
        assert reader.latest is good  # nothing changed
    assert reader.status().num_failures == len(faults)


def test_nothing_listening_and_a_server_that_never_answers(server):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    reader = MetricsReader(f"http://127.0.0.1:{port}/metrics", timeout_s=0.5)
    reader.read_once()
    assert reader.status().state == "error" and "cannot connect" in reader.status().text
    assert reader.latest is None
    with socket.socket() as silent:  # accepts connections (the backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        reader = MetricsReader(f"http://127.0.0.1:{silent.getsockname()[1]}/metrics", timeout_s=0.5)
        reader.read_once()
    assert "no answer within 0.5 s" in reader.status().text


def test_the_thread_outlives_every_fault_and_a_restart_drops_the_interval(server):
    reader = MetricsReader(server.url, interval_s=0.01, timeout_s=0.5).start()
    try:
        wait_until(lambda: reader.status().num_readings >= 2, what="two readings")
        server.answer = (200, "text/plain", b"{{{", False)
        wait_until(lambda: reader.status().num_failures >= 2, what="failures")
        assert reader.alive
        server.answer = (200, "text/plain", vllm_text(queries=64, hits=0).encode(), False)  # counters went back
        wait_until(lambda: reader.status().num_restarts == 1, what="the restart")
        latest, previous = reader.readings()
        assert latest.engines[0].queries == 64 and (previous is None or previous.engines[0].queries == 64)
        assert reader.status().state == "ok" and reader.alive
    finally:
        reader.stop()
    assert not reader.alive


def test_fetch_refuses_a_declared_length_over_the_limit(server):
    server.answer = (200, "text/plain", b"#" * 5000, False)
    with pytest.raises(MetricsError, match="answer of 5,000 bytes, over the 4,096-byte limit"):
        fetch_text(server.url, 1.0, 4096)


# ---- beside the KV events -----------------------------------------------------------------------------------------
def _store(index: KVCacheIndex, hashes, parent=None, block_size=32, seq=0):
    tokens = [1] * (block_size * len(hashes))
    stored = BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens),
                         block_size=block_size, lora_id=None, medium="GPU", lora_name=None)
    index.apply_batch(KVEventBatch(ts=0.0, events=(stored,)), seq)


def _compare(index, *texts):
    seen, before, out = _Seen(), None, None
    for text in texts:
        reading = parse_metrics(text).engines[0]
        out = compare_engine(reading, before, index, seen)
        before = reading
    return out


def test_agreeing_figures_say_no_disagreement():
    index = KVCacheIndex("kv")
    _store(index, range(1, 9))  # 8 cached blocks
    c = _compare(index, vllm_text(usage=4 / 39, queries=100, hits=32, running=2),
                 vllm_text(usage=6 / 39, queries=200, hits=96, running=2))
    assert c.disagreements == ()
    assert (c.hit_rate, c.recent_hit_rate, c.recent_queries) == (pytest.approx(96 / 200), pytest.approx(0.64), 100)
    assert c.events_gpu_blocks == 8 and c.events_cached_share == pytest.approx(8 / 39) and c.used_blocks == 6
    assert c.events_stored == 0 and c.events_removed == 0
    lines = c.lines()
    assert lines[0].startswith("server: 48.0% of prompt tokens hit") and "64.0% of 100" in lines[0]
    assert "KV events: 8 GPU blocks hold cached prefixes, 20.5% of the pool" in lines[2]


def test_each_impossible_combination_is_said():
    small = KVCacheIndex("kv")
    _store(small, range(1, 3), block_size=16)
    c = _compare(small, vllm_text(usage=0.0), vllm_text(usage=0.0))
    assert any("blocks hold 16 tokens, the server's 32" in d for d in c.disagreements)

    over = KVCacheIndex("kv")
    _store(over, range(1, 46))  # 45 live blocks in a pool of 40
    c = _compare(over, vllm_text(usage=0.1), vllm_text(usage=0.1))
    assert any("more than the server's pool of 40: removals were lost" in d for d in c.disagreements)

    few = KVCacheIndex("kv")
    _store(few, range(1, 3))  # 2 cached blocks, while requests hold 30
    once = _compare(few, vllm_text(usage=0.0), vllm_text(usage=30 / 39, running=2))
    assert once.disagreements == ()  # one reading may fall between a step's metrics and its events
    c = _compare(few, vllm_text(usage=30 / 39, running=2), vllm_text(usage=30 / 39, running=2))
    assert any("requests hold about 30 blocks, but its KV events show only 2" in d for d in c.disagreements)
    off = _compare(few, vllm_text(usage=30 / 39, caching="False"), vllm_text(usage=30 / 39, caching="False"))
    assert off.disagreements == ()  # without prefix caching nothing is stored: no contradiction

    empty = KVCacheIndex("kv")
    c = _compare(empty, vllm_text(usage=0.0, hits=0, queries=100), vllm_text(usage=0.0, hits=64, queries=200))
    assert any("prompts hit 64 cached tokens" in d and "held no block" in d for d in c.disagreements)


def test_stored_and_removed_count_over_the_interval():
    index = KVCacheIndex("kv")
    _store(index, range(1, 5))
    seen = _Seen()
    compare_engine(parse_metrics(vllm_text()).engines[0], None, index, seen)
    _store(index, range(5, 8), parent=4, seq=1)
    index.apply_batch(KVEventBatch(ts=0.0, events=(BlockRemoved(block_hashes=(1, 2), medium="GPU"),)), 2)
    c = compare_engine(parse_metrics(vllm_text()).engines[0], parse_metrics(vllm_text()).engines[0], index, seen)
    assert (c.events_stored, c.events_removed, c.events_gpu_blocks) == (3, 2, 5)


def test_server_watch_compares_on_the_readers_thread_and_says_it_in_json(server):
    index = KVCacheIndex("tcp://127.0.0.1:5557")
    _store(index, range(1, 9))
    watch = ServerWatch(server.url, [index], interval_s=0.01, timeout_s=0.5).start()
    try:
        wait_until(lambda: watch.comparisons() and watch.comparisons()[0].events_gpu_blocks == 8,
                   what="a comparison")
        data = server_json(watch, index)
        assert data["state"] == "ok" and data["engine"] == "0" and data["usage"] == 0.25
        assert data["hit_rate"] == 0.5 and data["events_gpu_blocks"] == 8 and data["disagreements"] == []
        server.answer = (200, "text/plain", b"nonsense!\n", False)
        wait_until(lambda: watch.status().state == "error", what="the error")
        data = server_json(watch, index)
        assert data["state"] == "error" and "not Prometheus' text format" in data["status"]
        assert data["usage"] == 0.25  # the last good comparison stays
    finally:
        watch.stop()
