"""``--metrics-port``: the local engine's /metrics under vLLM's names, scraped over HTTP and read back with
prometheus_client's own parser (issue 46, "Prometheus in and out")."""
from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig
from explorer.feeds.engine_feed import EngineFeed
from explorer.model.metrics_export import EngineMetricsExport
from explorer.model.tier_stats import BlockDurations
from kvstream.metrics import names
from kvstream.summary import json_summary
from kvstream.views import PoolUpdate
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
STEP_S = 0.25  # the fake clock's seconds per engine step


def scrape(url: str) -> dict:
    """{family name: Metric} of one GET of ``url``, parsed by prometheus_client."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.headers.get_content_type() == "text/plain"
        text = answer.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    """The one sample of ``name`` (or of its sample name ``sample``) whose labels include ``labels``."""
    found = [s.value for s in families[name].samples
             if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, sample, labels, families[name].samples)
    return found[0]


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * k) % 250 + 2 for i in range(length)] for k in range(n)]


class Driven:
    """An engine stepped on the test's thread, each step's update handed to the exporter's observer, as the
    runner hands it on its own thread; the clock says STEP_S seconds per step, so seconds are steps exactly."""

    def __init__(self, export: EngineMetricsExport, cfg: EngineConfig):
        self.eng = Engine(cfg)
        self.observe = export.observer(cfg)
        self.steps = BlockDurations()  # what the window computes from the same events, in steps
        self._publish()

    def _publish(self) -> None:
        events = self.eng.take_events()
        self.steps.add_events(events)
        self.observe(PoolUpdate.of(self.eng.snapshot(), events))

    def run(self) -> None:
        while any(c.is_live for c in self.eng.snapshot().conversations):
            self.eng.step()
            self._publish()

    def add(self, **kw) -> int:
        cid = self.eng.add_conversation(**kw)
        self._publish()
        return cid


def _export(clock_steps=None) -> EngineMetricsExport:
    if clock_steps is None:
        return EngineMetricsExport(0, host="127.0.0.1")
    return EngineMetricsExport(0, host="127.0.0.1", clock=lambda: STEP_S * clock_steps[0])


def _returning_workload(d: Driven, n=3, length=24, new=4) -> list[int]:
    """Conversations one after another on a small pool, then each comes back (its prefix evicted meanwhile)."""
    ids = []
    for prompt in _prompts(n, length):
        ids.append(d.add(prompt_token_ids=prompt, max_new_tokens=new))
        d.run()
    for k, cid in enumerate(ids):
        d.eng.continue_conversation(cid, prompt_token_ids=[3, 4 + k], max_new_tokens=new)
        d._publish()
        d.run()
    return ids


def test_scrape_has_vllm_names_types_labels_and_buckets():
    export = _export()
    try:
        cfg = EngineConfig(model="builtin", block_size=4, num_blocks=32, seed=0)
        d = Driven(export, cfg)
        shared = _prompts(1, 12)[0]
        d.add(prompt_token_ids=shared, max_new_tokens=3)
        d.run()
        d.add(prompt_token_ids=shared + [9, 9, 9], max_new_tokens=3)  # its first blocks hit the prefix cache
        d.eng.step()
        d._publish()
        families = scrape(export.url)
    finally:
        export.close()
    kinds = {names.KV_CACHE_USAGE: "gauge", names.NUM_REQUESTS_RUNNING: "gauge",
             names.NUM_REQUESTS_WAITING: "gauge", names.CACHE_CONFIG_INFO: "gauge",
             names.PREFIX_CACHE_QUERIES: "counter", names.PREFIX_CACHE_HITS: "counter",
             names.KV_BLOCK_LIFETIME: "histogram", names.KV_BLOCK_IDLE_BEFORE_EVICT: "histogram",
             names.KV_BLOCK_REUSE_GAP: "histogram"}
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    for name in (names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_HITS):  # counters are written name_total
        assert {s.name for s in families[name].samples} == {name + "_total"}
        assert all(s.labels == {"model_name": "builtin", "engine": "0"} for s in families[name].samples)
    for name in (names.KV_BLOCK_LIFETIME, names.KV_BLOCK_IDLE_BEFORE_EVICT, names.KV_BLOCK_REUSE_GAP):
        bounds = sorted({s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"},
                        key=float)
        assert [float(b) for b in bounds] == list(names.KV_CACHE_RESIDENCY_BUCKETS) + [math.inf]
        assert {s.labels["tier"] for s in families[name].samples} == {"device"}  # tiers off: the device only
    info = families[names.CACHE_CONFIG_INFO].samples
    assert len(info) == 1 and info[0].value == 1
    assert {k: info[0].labels[k] for k in ("num_gpu_blocks", "block_size", "enable_prefix_caching", "engine",
                                           "num_cpu_blocks")} == {"num_gpu_blocks": "32", "block_size": "4",
                                                                  "enable_prefix_caching": "True", "engine": "0",
                                                                  "num_cpu_blocks": "None"}
    snap = d.eng.snapshot()
    summary = json_summary(snap)
    assert value(families, names.KV_CACHE_USAGE) == summary["used"] / summary["num_blocks"] > 0
    assert value(families, names.NUM_REQUESTS_RUNNING) == 1 and value(families, names.NUM_REQUESTS_WAITING) == 0
    assert value(families, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_QUERIES + "_total") == \
        snap.metrics.prefix_cache_queries == 12 + 15
    assert value(families, names.PREFIX_CACHE_HITS, names.PREFIX_CACHE_HITS + "_total") == \
        snap.metrics.prefix_cache_hits == 12  # three full blocks of 4


def test_histograms_hold_the_windows_durations_in_seconds_per_tier(tmp_path):
    """With host and disk tiers and a pool too small to keep anything, every tier's lifetime, idle and reuse-gap
    histograms hold exactly the durations the window's BlockDurations computes from the same events, in seconds
    (STEP_S a step); and the tiers' hits are vLLM's external hits, the device's its prefix_cache_hits."""
    steps = [0]
    export = _export(steps)
    try:
        cfg = EngineConfig(model="builtin", block_size=4, num_blocks=16, host_tier_blocks=8, disk_tier_blocks=32,
                           disk_tier_path=str(tmp_path / "disk.bin"), max_num_seqs=4, seed=0)
        d = Driven(export, cfg)
        original = d._publish

        def publish():  # the clock reads the engine's step as the runner's update would arrive after it
            steps[0] = d.eng.snapshot().step_id
            original()
        d._publish = publish
        _returning_workload(d, n=3, length=24)
        families = scrape(export.url)
    finally:
        export.close()
    measures = {"lifetime": names.KV_BLOCK_LIFETIME, "idle": names.KV_BLOCK_IDLE_BEFORE_EVICT,
                "reuse_gap": names.KV_BLOCK_REUSE_GAP}
    checked = 0
    for tier in ("device", "host", "disk"):
        for measure, name in measures.items():
            samples = d.steps.durations.of(tier, measure)
            count = value(families, name, name + "_count", tier=tier)
            total = value(families, name, name + "_sum", tier=tier)
            assert count == len(samples), (tier, measure)
            assert total == pytest.approx(STEP_S * float(samples.sum())), (tier, measure)
            for bound in (0.5, 2.0, 5.0):  # a few buckets: cumulative counts of the same samples
                le = value(families, name, name + "_bucket", tier=tier, le=str(bound))
                assert le == int((STEP_S * samples <= bound).sum()), (tier, measure, bound)
            checked += count > 0
    assert checked >= 7  # every measure on the device and the host tier; reuse gaps on the disk tier
    for tier in ("device", "host", "disk"):  # blocks came back from every tier
        assert value(families, names.KV_BLOCK_REUSE_GAP, names.KV_BLOCK_REUSE_GAP + "_count", tier=tier) > 0
    snap = d.eng.snapshot()
    sources = [d.eng.prompt_token_sources(c.conversation_id) for c in snap.conversations]
    tier_tokens = sum(s["host"] + s["disk"] for s in sources)
    hits = value(families, names.PREFIX_CACHE_HITS, names.PREFIX_CACHE_HITS + "_total")
    external = value(families, names.EXTERNAL_PREFIX_CACHE_HITS, names.EXTERNAL_PREFIX_CACHE_HITS + "_total")
    queries = value(families, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_QUERIES + "_total")
    external_queries = value(families, names.EXTERNAL_PREFIX_CACHE_QUERIES,
                             names.EXTERNAL_PREFIX_CACHE_QUERIES + "_total")
    assert external == tier_tokens > 0  # the first admissions were cold: the continued ones' tier hits are all
    assert hits + external == snap.metrics.prefix_cache_hits
    assert queries == snap.metrics.prefix_cache_queries and external_queries == queries - hits
    assert {s.labels["num_cpu_blocks"] for s in families[names.CACHE_CONFIG_INFO].samples} == {"8"}


def test_counters_only_grow_across_a_new_engine_and_gauges_follow_the_model(tmp_path):
    """The window's File > New engine: the second engine's counts add to the first's, a new model's gauges replace
    the old model's, and an update from the replaced engine changes nothing."""
    export = _export()
    try:
        cfg = EngineConfig(model="builtin", block_size=4, num_blocks=32, seed=0)
        first = Driven(export, cfg)
        first.add(prompt_token_ids=_prompts(1, 12)[0], max_new_tokens=2)
        first.run()
        before = scrape(export.url)
        q1 = first.eng.snapshot().metrics.prefix_cache_queries
        from tests.helpers import write_tiny_checkpoint
        other = EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "tiny", vocab_size=258)), block_size=4,
                             num_blocks=16, seed=0)
        second = Driven(export, other)
        second.add(prompt_token_ids=_prompts(1, 8)[0], max_new_tokens=2)
        first.add(prompt_token_ids=_prompts(2, 40)[1], max_new_tokens=2)  # the old engine, still publishing
        second.run()
        after = scrape(export.url)
    finally:
        export.close()
    q2 = second.eng.snapshot().metrics.prefix_cache_queries
    total = names.PREFIX_CACHE_QUERIES + "_total"
    assert value(before, names.PREFIX_CACHE_QUERIES, total, model_name="builtin") == q1 == 12
    assert value(after, names.PREFIX_CACHE_QUERIES, total, model_name="builtin") == q1  # its series stopped
    assert value(after, names.PREFIX_CACHE_QUERIES, total, model_name=other.model) == q2 == 8
    assert {s.labels["model_name"] for s in after[names.KV_CACHE_USAGE].samples} == {other.model}
    assert [s.labels["num_gpu_blocks"] for s in after[names.CACHE_CONFIG_INFO].samples] == ["16"]


def test_runner_feeds_the_exporter_and_usage_agrees_with_json():
    """Wired as the app wires it: the runner's observer on the engine thread, prometheus_client's HTTP thread."""
    export = _export()
    cfg = EngineConfig(model="builtin", block_size=4, num_blocks=32, seed=0)
    feed = EngineFeed.start(Engine(cfg), cfg, history_bytes=None, polled=False, observers=[export.observer(cfg)],
                            start_paused=True)
    try:
        for prompt in _prompts(3, 10):
            feed.submit("add_conversation", prompt_token_ids=prompt, max_new_tokens=40).result(timeout=30)
        feed.submit("step_once").result(timeout=30)

        def settled():
            snap = feed.latest()
            families = scrape(export.url)
            return snap.step_id >= 1 and value(families, names.NUM_REQUESTS_RUNNING) == 3 and (snap, families)
        snap, families = wait_until(settled, 30, what="the first step's figures")
        summary = json_summary(snap)
        assert value(families, names.KV_CACHE_USAGE) == summary["used"] / summary["num_blocks"] == 9 / 32
        assert value(families, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_QUERIES + "_total") == 30
    finally:
        feed.close()
        export.close()
    with pytest.raises(OSError):  # closed: the port is free again, nothing answers
        urllib.request.urlopen(export.url, timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_headless_serves_until_quit_and_a_busy_port_is_one_line(tmp_path):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "main.py", "--headless", "--metrics-port", str(port)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1].startswith(f"error: --metrics-port {port}: ")
    proc = subprocess.Popen([sys.executable, "main.py", "--headless", "--model", "builtin", "--demo", "busy",
                             "--metrics-port", "0", "--quit-after", "300"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = None
        for line in proc.stderr:
            found = re.search(r"Prometheus metrics on (http://\S+/metrics)", line)
            if found:
                url = found.group(1)
                break
        assert url is not None

        def served():
            families = scrape(url)
            return value(families, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_QUERIES + "_total") > 0 and \
                families
        families = wait_until(served, 60, what="the demo's first prompts")
        assert value(families, names.CACHE_CONFIG_INFO, block_size="16", num_gpu_blocks="128") == 1
        proc.send_signal(signal.SIGINT)  # as Ctrl+C: the last line printed, the port closed
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("argv, words", [
    (["--metrics-port", "70000"], "--metrics-port must be a port 1-65535"),
    (["--attach-kv-events", "tcp://127.0.0.1:5557", "--metrics-port", "9100"], "--metrics-port run the local engine"),
    (["--trace", "t.jsonl", "--sweep", "100", "--headless", "--metrics-port", "9100"], "would serve nothing"),
    (["--attach-metrics", "http://h:8000"], "add --attach-kv-events ENDPOINT of the same server"),
    (["--attach-kv-events", "tcp://127.0.0.1:5557", "--attach-metrics", "h:8000"], "give an http:// or https://"),
])
def test_the_flags_refuse_what_cannot_work(argv, words):
    from explorer.cli import UsageError, parse_args
    with pytest.raises(UsageError) as caught:
        parse_args(argv)
    assert words in str(caught.value), str(caught.value)


def test_attach_metrics_gets_vllms_path():
    from explorer.cli import parse_args
    opts = parse_args(["--attach-kv-events", "tcp://127.0.0.1:5557", "--attach-metrics", "http://h:8000"])
    assert opts.attach_metrics == "http://h:8000/metrics"
