"""Why a prompt missed, and would it hit, against a real vLLM (issue 46).

- The plugin's tap records each prompt block's outcome at admission from vLLM's own lookup: its hits equal vLLM's
  ``num_cached_tokens`` for every request, and its misses have the cause the pool's history gives (cold, evicted by
  LRU for the request that needed the room, the last token, a cache salt).
- A KV-event watcher answers "would this prompt hit?" before the prompt is sent: ``cached_tokens`` equals the
  ``num_cached_tokens`` vLLM then reports, for a held prompt plus a few tokens, a shared prefix with a new tail,
  fresh tokens, and a held prompt exactly (whose last block vLLM recomputes).
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from kvstream.kv_events import KVEventEndpoint, KVEventSubscriber
from kvstream.vllm.tap import VllmPoolTap
from tests.helpers import wait_until
from tests.vllm_live.reference import BLOCK_SIZE, scheduler_of
from tests.vllm_live.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
BS = BLOCK_SIZE


def _ids(start: int, n: int) -> list[int]:
    """n byte-level token ids that no other prompt of these tests shares by accident."""
    return [(start + 7 * i) % 250 + 3 for i in range(n)]


def _params(**kw):
    from vllm import SamplingParams
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_tokens", 1)
    return SamplingParams(**kw)


@pytest.fixture
def tap(engine):
    t = VllmPoolTap(scheduler_of(engine), on_error=lambda exc: pytest.fail(f"tap failed: {exc!r}"))
    yield t
    t.detach()


def _run(engine, tap, rid: str, ids: list[int], salt: str | None = None):
    """Send one prompt, step vLLM until it is done (a tap frame per step), return (vLLM's num_cached_tokens, the
    tap's info of it)."""
    prompt = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    engine.add_request(rid, prompt, _params())
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and (out.request_id == rid or out.request_id.startswith(rid + "-")):
                cached = out.num_cached_tokens
        tap.frame()
    snap, _ = tap.frame()
    info = next(c for c in snap.conversations if c.label == rid or c.label.startswith(rid + "-"))
    return cached, info, snap


def _hits(info) -> int:
    return sum(1 for o in info.prompt_block_outcomes if o.hit)


def test_tap_outcomes_agree_with_vllms_cached_tokens(engine, tap):
    a = _ids(1, 4 * BS + 5)
    cached, info, _ = _run(engine, tap, "a", a)
    assert [o.outcome for o in info.prompt_block_outcomes] == ["cold"] * 4 + ["partial"] and cached == 0
    cached, info, _ = _run(engine, tap, "b", a[:4 * BS] + _ids(90, 9))
    assert [o.outcome for o in info.prompt_block_outcomes] == ["device"] * 4 + ["partial"]
    assert cached == 4 * BS == _hits(info) * BS
    cached, info, _ = _run(engine, tap, "c", a[:4 * BS])  # held whole: vLLM recomputes the last token's block
    assert [o.outcome for o in info.prompt_block_outcomes] == ["device"] * 3 + ["last_token"]
    assert cached == 3 * BS == _hits(info) * BS
    cached, info, _ = _run(engine, tap, "salted", a[:4 * BS] + [5], salt="another tenant")
    assert [o.outcome for o in info.prompt_block_outcomes] == ["salted"] * 4 + ["partial"] and cached == 0
    thieves = []
    for i in range(3):  # 3 x 15 blocks through a pool of 40: LRU gives up a's blocks
        _, thief, _ = _run(engine, tap, f"thief{i}", _ids(300 + 40 * i, 15 * BS - 1))
        thieves.append(thief.conversation_id)
    cached, info, snap = _run(engine, tap, "back", a)
    evicted = [o for o in info.prompt_block_outcomes if o.outcome == "evicted"]
    assert evicted and evicted[0].index == 0, info.prompt_block_outcomes
    assert all(o.evicted_by == "lru" and o.evicted_for in thieves and o.evicted_step is not None
               and o.idle_steps is not None for o in evicted)
    assert cached == _hits(info) * BS
    totals = snap.metrics.prompt_block_totals
    assert totals["device"] == 4 + 3 and totals["salted"] == 4 and totals["evicted"] == len(evicted)
    assert totals["last_token"] == 1 and totals["partial"] == 4 + 3  # a, b, salted, back and the three thieves


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
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        print("ready", file=said)
        for line in sys.stdin:
            ids = json.loads(line)
            if ids is None:
                break
            out = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
            hashes = sorted(maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache)
            print("done", out.num_cached_tokens, json.dumps(hashes), file=said)
""")


def test_kv_event_prompt_check_equals_vllms_cached_tokens(checkpoint, tmp_path):
    kv, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    sub = KVEventSubscriber([KVEventEndpoint(kv, replay)], replay_timeout_s=1.0).start()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    server = ServerProcess([sys.executable, str(script), str(checkpoint), kv, replay], env, tmp_path,
                           tmp_path / "server.log", deadline=600)
    index = sub.indexes[0]

    def send(ids):
        """Send a prompt, wait for vLLM's answer and for the watcher to hold what vLLM's pool holds then."""
        server.send(json.dumps(ids))
        line = server.said.readline().split(maxsplit=2)
        assert line[:1] == ["done"], server.tail()
        held = set(json.loads(line[2]))
        wait_until(lambda: index.live_hashes() == held, 30, what="vLLM's hashes", seen=lambda: len(index.live_hashes()))
        return int(line[1])

    try:
        assert server.said.readline().strip() == "ready", server.tail()
        held = _ids(1, 5 * BS + 7)
        assert send(held) == 0
        probes = {"held prompt plus a few tokens": held + _ids(200, 5),
                  "shared prefix, new tail": held[:2 * BS] + _ids(120, 3 * BS + 11),
                  "fresh tokens": _ids(57, 3 * BS + 2),
                  "held prompt exactly (its last block is recomputed)": held[:5 * BS]}
        seen = {}
        for name, ids in probes.items():
            check = index.check_prompt(ids)  # read before sending
            actual = send(ids)
            seen[name] = (check.cached_tokens, actual)
            assert check.cached_tokens == actual, (name, check.as_json())
        assert seen["held prompt plus a few tokens"][0] == 5 * BS
        assert seen["shared prefix, new tail"][0] == 2 * BS
        assert seen["fresh tokens"][0] == 0
        assert seen["held prompt exactly (its last block is recomputed)"][0] == 4 * BS
        last = index.check_prompt(held[:5 * BS]).blocks
        assert [b.outcome for b in last] == ["device"] * 4 + ["last_token"]
    finally:
        sub.stop()
        server.stop("null")
