"""A real vLLM server started after the viewer (issue 32, finding 12): open the viewer, then start vLLM.

The watcher (our KVEventSubscriber, as ``--attach-kv-events 'ipc://...kv.sock,replay=ipc://...replay.sock'``
builds it) starts first and waits; the server comes up, answers its requests at once and goes idle, so what it
published before our live socket reconnected (ZMQ backs off to 2 s between tries) is only in its replay buffer.
The live set must equal the hashes in vLLM's own block pool, with nothing lost."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from kvstream.kv_events import KVEventEndpoint, KVEventSubscriber, json_summary
from tests.helpers import holds_for, wait_until
from tests.vllm_live.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]

SERVER = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    if __name__ == "__main__":
        checkpoint, kv, replay = sys.argv[1], sys.argv[2], sys.argv[3]
        said = os.fdopen(int(sys.argv[4]), "w", buffering=1)  # vLLM logs to stdout: answers go through a pipe
        llm = LLM(model=checkpoint, block_size=32, num_gpu_blocks_override=40, max_model_len=512, max_num_seqs=8,
                  enforce_eager=True, enable_prefix_caching=True, dtype="float32", seed=0,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv,
                                                  replay_endpoint=replay))
        prefix = "The block table maps each logical block of a sequence to a physical block. "
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        llm.generate([prefix + "first question", prefix + "a second question", "Something else entirely. " * 4],
                     greedy)
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        hashes = sorted(maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache)
        print("done", json.dumps(hashes), file=said)
        sys.stdin.readline()  # idle until the test has looked
""")


def test_watcher_started_before_vllm_catches_up(checkpoint, tmp_path):
    kv, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    sub = KVEventSubscriber([KVEventEndpoint(kv, replay)], replay_timeout_s=1.0).start()
    # the viewer is up and waits, long enough for ZMQ's reconnect back-off to grow past the server's first batches
    holds_for(lambda: sub.status()[0].state == "connecting", 1.5, what="connecting, with nothing to connect to")
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    server = ServerProcess([sys.executable, str(script), str(checkpoint), kv, replay], env, tmp_path,
                           tmp_path / "server.log", deadline=300)
    try:
        line = server.said.readline().split(maxsplit=1)
        assert line[:1] == ["done"], server.tail()
        vllm_hashes = set(json.loads(line[1]))
        index = sub.indexes[0]
        wait_until(lambda: index.live_hashes() == vllm_hashes, 30, what="vLLM's hashes",
                   seen=lambda: len(index.live_hashes()))
        wait_until(lambda: (sub.status()[0].num_batches, sub.status()[0].last_seq) == (index.num_batches,
                                                                                       index.last_seq))
        st = sub.status()[0]
        summary = json_summary(index, st)
        assert index.live_hashes() == vllm_hashes and len(vllm_hashes) >= 4, (st, len(index.live_hashes()))
        assert st.num_lost == 0 and st.num_malformed == 0 and st.num_odd_events == 0 and sub.failure is None
        assert summary["stored_hashes_by_medium"] == {"GPU": len(vllm_hashes), "CPU": 0, "STORAGE": 0}
        assert summary["stored_hashes_by_group"] == {"0": len(vllm_hashes)}  # vLLM 0.32 sends group_idx
    finally:
        sub.stop()
        server.stop("quit")
