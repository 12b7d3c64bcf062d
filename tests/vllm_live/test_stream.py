"""The plugin end to end: vLLM's pool published as a pool stream over ZMQ, read back the way ``--attach`` reads it
(PoolStreamSubscriber into a History), and compared with vLLM's own state; and a vLLM server in its real process
layout (engine core in a process of its own) loading the plugin from its entry point, checked against vLLM's own
KV-event stream."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvstream.vllm import plugin as vllm_plugin
from kvstream.events import EventKind, PoolModel
from kvstream.kv_events.subscriber import KVEventSubscriber
from kvstream.poolstream.subscriber import PoolStreamSubscriber
from kvstream.views import BlockState, Status
from kvstream.vllm.hash import hash64
from tests.helpers import wait_until
from tests.vllm_live.reference import BLOCK_SIZE, compare, read_state, scheduler_of
from tests.vllm_live.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "The block table maps each logical block of a sequence to a physical block. "


@pytest.fixture
def published(engine, tmp_path, monkeypatch):
    """The plugin's publisher on the session engine (a frame after every step), and a subscriber reading it."""
    monkeypatch.setenv("PAGED_KV_EXPLORER_PUBLISH", f"ipc://{tmp_path}/pool.sock")
    monkeypatch.setenv("PAGED_KV_EXPLORER_MAX_HZ", "1000000")
    monkeypatch.setenv("PAGED_KV_EXPLORER_BUDGET", "1000000")
    publisher = vllm_plugin.attach(scheduler_of(engine))
    assert publisher is not None
    subscriber = PoolStreamSubscriber(os.environ["PAGED_KV_EXPLORER_PUBLISH"])
    wait_until(subscriber.latest, 30, what="the first keyframe")
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


def test_attached_stream_matches_vllm_every_step(engine, published):
    from vllm import SamplingParams
    publisher, subscriber = published
    scheduler = scheduler_of(engine)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PREFIX + "first question", greedy)
    engine.add_request("b", PREFIX + "a second question", greedy)
    engine.add_request("c", "Fork this prompt into three samples. " * 2,
                       SamplingParams(max_tokens=30, n=3, temperature=1.0, seed=3, ignore_eos=True))
    encoder = publisher.sink.encoder
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        wait_until(lambda: subscriber.status.last_seq == encoder.last_seq, 30, what=f"frame {encoder.last_seq}")
        assert compare(subscriber.latest(), read_state(scheduler)) == [], f"step {steps}"
    final = subscriber.latest()
    assert final.source == "vllm" and final.block_size == BLOCK_SIZE and final.num_blocks == len(
        scheduler.kv_cache_manager.block_pool.blocks)
    # the events that came over the wire replay to the same pool
    history = subscriber.history
    model = PoolModel(final.num_blocks)
    events = [e for _, e in history.events()]
    for e in events:
        model.apply(e)
    truth = read_state(scheduler)
    assert np.array_equal(model.state[1:], truth.state[1:]) and not model.ref_count[1:].any()
    # inspector facts: request ids as labels, tokens of a cached block from its STORED event
    labels = sorted(c.label.split("-")[0] for c in final.conversations)
    assert labels == ["0_c", "1_c", "2_c", "a", "b"] and all(c.status == Status.FINISHED for c in final.conversations)
    a = next(c for c in final.conversations if c.label.startswith("a-"))
    stored = next(e for e in events if e.kind == EventKind.STORED and e.conversation_id == a.conversation_id)
    block = stored.block_ids[0]
    assert final.state[block] == BlockState.CACHED
    assert history.block_tokens(block, history.last_seq) == a.prompt_token_ids[:BLOCK_SIZE]
    assert set(final.block_hash[final.state == BlockState.CACHED].tolist()) == truth.stored_hashes


def test_attach_refuses_an_unknown_version_with_one_line(engine, tmp_path, monkeypatch):
    import vllm
    scheduler = scheduler_of(engine)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.paged_kv_explorer")
    log.addHandler(handler)
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    monkeypatch.setenv("PAGED_KV_EXPLORER_PUBLISH", f"ipc://{tmp_path}/never.sock")
    before = set(vars(scheduler))
    try:
        assert vllm_plugin.attach(scheduler) is None
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "paged-kv-explorer: not publishing the block pool: vLLM 0.31.9 is not a supported version (supported: "
        "0.32.x; set PAGED_KV_EXPLORER_ANY_VLLM=1 to try anyway)"]
    assert set(vars(scheduler)) == before and not (tmp_path / "never.sock").exists()


SERVER = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    if __name__ == "__main__":
        checkpoint, kv_events = sys.argv[1], sys.argv[2]
        said = os.fdopen(int(sys.argv[3]), "w", buffering=1)  # vLLM logs to stdout: answers go through a pipe
        llm = LLM(model=checkpoint, block_size=32, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=8,
                  enforce_eager=True, enable_prefix_caching=True, dtype="float32", seed=0,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events))
        print("ready", os.getpid(), file=said)
        sys.stdin.readline()
        prefix = "The block table maps each logical block of a sequence to a physical block. "
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        outs = llm.generate([prefix + "first question", prefix + "a second question"], greedy)
        outs += llm.generate(["Fork this prompt into three samples. " * 2],
                             SamplingParams(max_tokens=30, n=3, temperature=1.0, seed=3, ignore_eos=True))
        print("done", json.dumps(sum(len(c.token_ids) for o in outs for c in o.outputs)), file=said)
        sys.stdin.readline()
""")


def test_server_process_publishes_from_its_engine_core(checkpoint, tmp_path):
    """vLLM as deployed: the API side in one process, the engine core in another (VLLM_ENABLE_V1_MULTIPROCESSING
    on). The plugin comes from the entry point, publishes from the engine core only, and what ``--attach`` rebuilds
    agrees with vLLM's own KV events: the same stored hashes, all of them cached once the requests finished."""
    pool, kv = f"ipc://{tmp_path}/pool.sock", f"ipc://{tmp_path}/kv.sock"
    env = dict(os.environ, PAGED_KV_EXPLORER_PUBLISH=pool, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log_path = tmp_path / "server.log"
    server = ServerProcess([sys.executable, str(script), str(checkpoint), kv], env, tmp_path, log_path,
                           deadline=300)  # its engine core joins its process group
    subscriber = kv_subscriber = None
    try:
        line = server.said.readline().split()
        assert line[:1] == ["ready"], server.tail()
        front_pid = int(line[1])
        subscriber = PoolStreamSubscriber(pool)
        kv_subscriber = KVEventSubscriber(kv).start()
        wait_until(subscriber.latest, 30, what="the pool stream's first keyframe")
        # the KV-event SUB socket is connected (its subscription goes out on that connection at once; vLLM's first
        # batch comes after a forward pass)
        wait_until(lambda: kv_subscriber.status()[0].connected, 30, what="the KV-event socket to connect")
        server.send("go")
        line = server.said.readline().split()
        assert line[:1] == ["done"], server.tail()
        generated = json.loads(line[1])

        def settled():
            snap = subscriber.latest()
            return snap is not None and len(snap.conversations) == 5 and not snap.block_tables and \
                all(not c.is_live for c in snap.conversations) and snap
        final = wait_until(settled, 30, what="the last frame", seen=lambda: (subscriber.status, [
            (c.label, c.status.value) for c in subscriber.latest().conversations], subscriber.latest().block_tables))
        index = kv_subscriber.indexes[0]
        wait_until(lambda: len(index.live_hashes()) == int(np.count_nonzero(final.block_hash)), 30,
                   what="vLLM's KV events")
        cached = final.block_hash[final.state == BlockState.CACHED]
        assert {hash64(h) for h in index.live_hashes()} == set(final.block_hash[final.block_hash != 0].tolist()) \
            == set(cached.tolist())
        assert len(cached) >= 2 + 1  # a's two prefix blocks (b shared them) and the samples' prompt block
        assert final.memory.num_used_blocks == 1 and final.metrics.num_generated_tokens == generated == 170
        shared = [e for _, e in subscriber.history.events() if e.kind == EventKind.SHARED]
        assert shared and all(e.reason == "prefix_hit" for e in shared)
    finally:
        for s in (subscriber, kv_subscriber):
            if s is not None:
                (s.close if hasattr(s, "close") else s.stop)()
        server.stop("quit")
    err = log_path.read_text()
    lines = [ln for ln in err.splitlines() if "paged-kv-explorer: publishing" in ln]
    assert len(lines) == 1, err[-3000:]
    assert f"pid={front_pid}" not in lines[0] and "EngineCore" in lines[0]


def test_register_hooks_the_scheduler_when_vllm_imports_it():
    """register() only leaves an import hook; the scheduler class is wrapped when vLLM imports its module."""
    code = textwrap.dedent("""
        import os, sys
        os.environ["PAGED_KV_EXPLORER_PUBLISH"] = "ipc:///tmp/never-bound.sock"
        from kvstream.vllm import plugin as vllm_plugin
        vllm_plugin.register()
        before = "vllm.v1.core.sched.scheduler" in sys.modules
        from vllm.v1.core.sched.scheduler import Scheduler
        print(before, getattr(Scheduler.__init__, "_paged_kv_explorer_hook", False))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stderr[-2000:]
