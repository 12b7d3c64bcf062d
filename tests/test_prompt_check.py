"""Would this prompt hit? (issue 46): the one counting rule, the local engine's answer held to its own admissions,
a KV-event stream's and a pool stream's answers, the --check-prompt file watch, and the --json totals of why
prompt blocks missed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, EngineError
from kvstream.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheIndex, make_batch
from kvstream.prompt_check import Held, Removal, classify_prompt, prompt_ids_from_text
from kvstream.summary import json_summary
from kvstream.views import HIT_MEDIA, MISS_CAUSES
from tests.helpers import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outcomes(check):
    return [b.outcome for b in check.blocks]


# ---- the counting rule -------------------------------------------------------------------------------------------
def test_the_counting_rule():
    on = Held("device", 7, 1)
    # a prompt held whole but for its partial tail: every full block hits
    c = classify_prompt(10, 4, [on, on])
    assert _outcomes(c) == ["device", "device", "partial"] and c.cached_tokens == 8
    # held whole, block-aligned: the block holding the last token is recomputed (vLLM: num_tokens - 1)
    c = classify_prompt(8, 4, [on, on])
    assert _outcomes(c) == ["device", "last_token"] and c.cached_tokens == 4
    assert classify_prompt(8, 4, [on, on], recompute_last=False).cached_tokens == 8  # a prefill-only request
    # a held block after a miss is recomputed; the miss says when it left where the source knows
    gone = Removal(12, None, "lru", 3, 5)
    c = classify_prompt(13, 4, [on, None, on], lambda i: gone if i == 1 else None)
    assert _outcomes(c) == ["device", "evicted", "after_break", "partial"] and c.blocks[1].removal == gone
    assert c.cached_tokens == 4
    # never stored; shorter than one block
    assert _outcomes(classify_prompt(9, 4, [None, None])) == ["cold", "cold", "partial"]
    c = classify_prompt(3, 4, [])
    assert _outcomes(c) == ["partial"] and c.cached_tokens == 0
    # the source serves fewer than it holds (a sliding window let them go)
    assert _outcomes(classify_prompt(13, 4, [on, on, on], hits=1)) == ["device", "window", "window", "partial"]
    # a lower tier's hit is a hit from that tier
    c = classify_prompt(9, 4, [Held("host", None, 1), Held("disk", None, 2)])
    assert _outcomes(c) == ["host", "disk", "partial"] and c.cached_tokens == 8
    with pytest.raises(ValueError, match="empty"):
        classify_prompt(0, 4, [])
    with pytest.raises(ValueError, match="held entries"):
        classify_prompt(9, 4, [on])


def test_prompt_files_as_token_ids():
    assert prompt_ids_from_text(" [1, 2, 3]\n") == [1, 2, 3]
    assert prompt_ids_from_text("Hello [world]") is None  # text: tokenised
    for bad, words in (("[1, 2,", "does not parse"), ("[1, -2]", "token id 1"), ("[1, true]", "token id 1"),
                       ("[]", "empty"), ("[1.5]", "token id 0")):
        with pytest.raises(ValueError, match=words):
            prompt_ids_from_text(bad)


# ---- the local engine: its answer is what its admission then does ------------------------------------------------
def _engine(**kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 16)
    return Engine(EngineConfig(model="none", **kw))


PREFIXES = [list(range(10 * p + 1, 10 * p + 9)) for p in range(4)]  # two blocks each


@st.composite
def workloads(draw):
    prompts = []
    for _ in range(draw(st.integers(3, 9))):
        head = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(1, 60), max_size=9))
        prompts.append((head + tail, draw(st.integers(2, 3))))
    return draw(st.sampled_from(["lru", "fifo", "s3lru", "radix"])), draw(st.booleans()), prompts


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_the_engines_answer_is_what_its_admission_does(tmp_path_factory, work):
    """Before each prompt is added, check_prompt says how many tokens will come from the cache and how each block
    fares; the admission then records exactly that (cached tokens, outcome per block, when and why an evicted
    block went), under every policy, with and without a host tier."""
    policy, tier, prompts = work
    eng = _engine(eviction_policy=policy, num_blocks=12, host_tier_blocks=4 if tier else 0)
    try:
        for ids, new in prompts:
            check = eng.check_prompt(prompt_token_ids=ids)
            cid = eng.add_conversation(prompt_token_ids=ids, max_new_tokens=new)
            eng.step()  # admitted: it holds the blocks the check named
            table = eng.conversation(cid).block_table
            assert [b.held.block_id for b in check.blocks if b.outcome == "device"] == \
                list(table[:len(check.hit_blocks)]) or any(b.outcome != "device" for b in check.hit_blocks)
            eng.run_until_idle()
            info = eng.conversation(cid)
            assert check.cached_tokens == info.num_cached_tokens
            assert _outcomes(check) == [o.outcome for o in info.prompt_block_outcomes]
            for b, o in zip(check.blocks, info.prompt_block_outcomes):
                if o.outcome == "evicted":
                    gone = b.removal
                    assert (gone.step, gone.for_conversation, gone.by, gone.idle_steps) == \
                        (o.evicted_step, o.evicted_for, o.evicted_by, o.idle_steps)
    finally:
        eng.close()


def test_checking_changes_nothing_and_refuses_bad_prompts():
    eng = _engine(eviction_policy="fifo")
    eng.add_conversation(prompt_token_ids=list(range(1, 14)), max_new_tokens=2)
    eng.run_until_idle()
    eng.take_events()
    policy = eng.pool.policy.state()
    before = (eng.snapshot().version, eng.pool.next_free(16), eng.metrics())
    check = eng.check_prompt(prompt_token_ids=list(range(1, 14)) + [7])
    assert check.cached_tokens == 12 and check.source == "engine" and check.step == eng.step_id
    assert [b.held.block_id for b in check.hit_blocks] == list(eng.snapshot().block_tables.get(0, ())) or \
        all(eng.snapshot().state[b.held.block_id] == 2 for b in check.hit_blocks)  # cached now
    assert (eng.snapshot().version, eng.pool.next_free(16), eng.metrics()) == before
    assert all(np.array_equal(a, b) for a, b in zip(eng.pool.policy.state(), policy))
    assert eng.take_events() == []
    for bad, words in (([], "empty"), ([1, -1], "token"), ("text", "tokenizer")):
        with pytest.raises(EngineError, match=words):
            if isinstance(bad, str):
                eng.check_prompt(bad)
            else:
                eng.check_prompt(prompt_token_ids=bad)
    assert eng.snapshot().version == before[0]


def test_a_check_through_the_engine_thread(tmp_path):
    from engine import EngineRunner
    from explorer.feeds.engine_feed import EngineFeed
    eng = _engine()
    feed = EngineFeed.start(eng, eng.cfg, history_bytes=None)
    try:
        feed.submit("add_conversation", prompt_token_ids=list(range(1, 11)), max_new_tokens=1).result(10)
        wait_until(feed.idle, 20, what="the engine to go idle")
        checks = feed.check_prompt(list(range(1, 11)) + [3]).result(10)
        assert len(checks) == 1 and checks[0].cached_tokens == 8 and _outcomes(checks[0]) == ["device"] * 2 + \
            ["partial"]
        with pytest.raises(EngineError, match="empty"):
            feed.check_prompt([]).result(10)
    finally:
        feed.close()
    assert EngineRunner  # the runner takes check_prompt as a command


# ---- --json totals -----------------------------------------------------------------------------------------------
def test_json_totals_count_every_admission_and_roll_back(monkeypatch):
    eng = _engine(eviction_policy="fifo", num_blocks=10)
    for ids in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8], list(range(20, 56)), [1, 2, 3, 4, 5]):
        eng.add_conversation(prompt_token_ids=ids, max_new_tokens=1)
        eng.run_until_idle()
    summary = json_summary(eng.snapshot())
    seen = {name: 0 for name in HIT_MEDIA + MISS_CAUSES}
    for info in eng.snapshot().conversations:
        for o in info.prompt_block_outcomes:
            seen[o.outcome] += 1
    assert summary["misses"] == {c: seen[c] for c in MISS_CAUSES}
    assert summary["hits_by_medium"] == {m: seen[m] for m in HIT_MEDIA}
    assert summary["misses"]["evicted"] > 0 and summary["hits_by_medium"]["device"] > 0
    # a step that fails after its admissions counted them leaves the totals as they were
    eng.add_conversation(prompt_token_ids=[1, 2, 3, 4, 50, 51], max_new_tokens=1)
    before = eng.metrics()

    def fail(*args, **kwargs):
        raise RuntimeError("injected fault after the admission")
    monkeypatch.setattr(eng, "_postprocess", fail)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng.metrics() == before
    monkeypatch.undo()
    eng.run_until_idle()
    after = eng.metrics()
    assert after.prompt_blocks_device == before.prompt_blocks_device + 1 and after.prompt_blocks_partial == \
        before.prompt_blocks_partial + 1


def _old_keyframe(snapshot):
    from kvstream import poolstream as ps
    from kvstream.poolstream import StreamEncoder, read_head
    from kvstream.poolstream import schema as ps_schema
    frame = StreamEncoder().encode(snapshot)
    head = read_head(frame.payload)
    body = msgspec.msgpack.decode(head.body, type=ps.Body)
    metrics = {k: v for k, v in body.metrics.items() if not k.startswith("prompt_blocks_")}
    env = ps_schema._Envelope(ps.MAGIC, ps.FORMAT_VERSION, head.stream_id, head.seq, head.step_id, head.keyframe,
                              head.events, msgspec.structs.replace(body, metrics=metrics))
    return msgspec.msgpack.encode(env)


def test_an_older_stream_without_the_totals_reads_as_not_counted():
    from kvstream.poolstream import StreamDecoder
    eng = _engine()
    eng.add_conversation(prompt_token_ids=list(range(1, 11)), max_new_tokens=1)
    eng.run_until_idle()
    snap = eng.snapshot()
    assert json_summary(snap)["misses"]["cold"] == 2
    decoded = StreamDecoder().feed(_old_keyframe(snap))[0]
    assert decoded.metrics.prefix_cache_queries > 0 and decoded.metrics.prompt_blocks_cold == 0
    summary = json_summary(decoded)
    assert summary["misses"] is None and summary["hits_by_medium"] is None


# ---- a KV-event stream: matched by the tokens BlockStored carries ------------------------------------------------
def _stored(hashes, parent, tokens, medium="GPU", size=4):
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, None, medium, None)


def test_a_kv_event_stream_answers_by_content():
    idx = KVCacheIndex("vllm-0")
    toks = list(range(1, 17))
    idx.apply_batch(make_batch([_stored((11, 12, 13, 14), None, toks)], 100.0), 1)
    c = idx.check_prompt(toks + [99])
    assert _outcomes(c) == ["device"] * 4 + ["partial"] and c.cached_tokens == 16 and c.step == 1
    assert [b.held.block_hash for b in c.blocks[:4]] == [11, 12, 13, 14]
    assert idx.check_prompt(toks).cached_tokens == 12  # held whole: the last token's block is recomputed
    # another server's hash function, same tokens: matched all the same (a hash the index never saw)
    other = KVCacheIndex("sglang")
    other.apply_batch(make_batch([_stored((b"\x01" * 32, b"\x02" * 32), None, toks[:8])], 1.0), 1)
    assert other.check_prompt(toks).cached_tokens == 8
    # removed: said with the removing batch's time; the blocks after it are still held but recomputed
    idx.apply_batch(make_batch([BlockRemoved((12,), "GPU")], 105.0), 2)
    c = idx.check_prompt(toks + [99])
    assert _outcomes(c) == ["device", "evicted", "after_break", "after_break", "partial"]
    assert c.blocks[1].removal.at == 105.0 and c.cached_tokens == 4
    # a copy on the host tier: a hit from the host
    idx.apply_batch(make_batch([_stored((12,), 11, toks[4:8], medium="CPU")], 106.0), 3)
    assert _outcomes(idx.check_prompt(toks + [99]))[:2] == ["device", "host"]
    # cleared: every block went at that moment
    idx.apply_batch(make_batch([AllBlocksCleared()], 110.0), 4)
    c = idx.check_prompt(toks + [99])
    assert _outcomes(c) == ["evicted"] * 4 + ["partial"] and {b.removal.by for b in c.blocks[:4]} == {"cleared"}
    # stored again: held again; content the stream never carried: cold, and nothing after it can be found
    idx.apply_batch(make_batch([_stored((11,), None, toks[:4])], 120.0), 5)
    assert _outcomes(idx.check_prompt(toks[:4] + [5, 5, 5, 5] + toks[8:16] + [1])) == \
        ["device", "cold", "cold", "cold", "partial"]
    with pytest.raises(ValueError, match="block size is unknown"):
        KVCacheIndex("empty").check_prompt([1, 2, 3])
    assert KVCacheIndex("empty").check_prompt([1, 2, 3], block_size=2).blocks[0].outcome == "cold"


def test_departed_content_stays_bounded():
    idx = KVCacheIndex("x")
    idx.DEPARTED_LIMIT = 8
    for i in range(40):
        idx.apply_batch(make_batch([_stored((1000 + i,), None, [i] * 4), BlockRemoved((1000 + i,), "GPU")], i), i)
    assert len(idx._departed) == len(idx._departed_when) == 8
    assert sum(len(k) for k in idx._departed_kids.values()) == 8
    assert idx.check_prompt([39] * 4 + [1]).blocks[0].outcome == "evicted"
    assert idx.check_prompt([0] * 4 + [1]).blocks[0].outcome == "cold"  # forgotten: the oldest went first


# ---- a pool stream: content from its STORED events, the pool now from its frame ---------------------------------
def _recorded(tmp_path, steps):
    """Record an engine while ``steps(engine)`` runs; returns (engine, the recording's feed)."""
    from explorer.feeds.stream_feed import RecordingFeed
    from kvstream.fanout import FrameFanout
    from kvstream.recording import Recorder
    from kvstream.views import PoolUpdate
    eng = _engine(eviction_policy="fifo", num_blocks=12, host_tier_blocks=2)
    path = tmp_path / "run.kvpool"
    rec = Recorder(str(path))
    fanout = FrameFanout([rec], threaded=False)
    seq = [0]

    def publish():
        fanout(PoolUpdate(eng.snapshot(), tuple(eng.take_events()), seq=seq[0]))
        seq[0] += 1
    publish()
    steps(eng, publish)
    fanout.close()
    rec.close()
    return eng, RecordingFeed.open(str(path))


def each_to_its_end(prompts):
    """A _recorded workload: each prompt added (two new tokens) and stepped to its end, every step published."""
    def steps(eng, publish):
        for ids in prompts:
            eng.add_conversation(prompt_token_ids=ids, max_new_tokens=2)
            while eng.has_work():
                eng.step()
                publish()
    return steps


def test_a_pool_stream_answers_as_the_engine_that_wrote_it(tmp_path):
    prompts = [list(range(1, 14)), list(range(100, 121)), list(range(1, 9)) + [70, 71, 72, 73, 74],
               list(range(200, 221))]

    eng, feed = _recorded(tmp_path, each_to_its_end(prompts))
    try:
        asked = [list(range(1, 14)) + [5], list(range(100, 121)), [9] * 9, list(range(200, 221)) + [1, 2]]
        for ids in asked:
            mine = eng.check_prompt(prompt_token_ids=ids)
            theirs = feed.check_prompt(ids).result()[0]
            assert _outcomes(theirs) == _outcomes(mine) and theirs.cached_tokens == mine.cached_tokens, ids
            assert [b.held for b in theirs.blocks] == [b.held for b in mine.blocks]
            for a, b in zip(theirs.blocks, mine.blocks):
                if b.outcome == "evicted":
                    assert (a.removal.step, a.removal.for_conversation) == (b.removal.step, b.removal.for_conversation)
        assert any(b.outcome == "evicted" for ids in asked for b in feed.check_prompt(ids).result()[0].blocks)
    finally:
        feed.close()
        eng.close()


def test_a_stream_joined_late_knows_what_its_conversations_hold():
    """A book that saw no STORED event learns the content of blocks a conversation holds from the frame itself,
    and says what it cannot know."""
    from explorer.feeds.prompt_book import LATE_NOTE, PromptBook
    eng = _engine()
    eng.add_conversation(prompt_token_ids=list(range(1, 11)), max_new_tokens=50)
    for _ in range(3):
        eng.step()
    snap = eng.snapshot()
    book = PromptBook()
    book.joined_late = True
    c = book.check(list(range(1, 11)) + [4], snap)
    assert _outcomes(c) == ["device", "device", "partial"] and c.note == LATE_NOTE
    eng.close()


# ---- --check-prompt FILE -----------------------------------------------------------------------------------------
class _Feed:
    """A feed that answers with a classification of whatever ids it is asked, and tokenises text by bytes."""

    def __init__(self):
        self.asked = []

    def check_prompt(self, ids):
        from concurrent.futures import Future
        self.asked.append(list(ids))
        f = Future()
        f.set_result([classify_prompt(len(ids), 4, [None] * (len(ids) // 4))])
        return f

    def tokenize_prompt(self, text):
        return list(text.encode())


def test_the_prompt_file_is_waited_for_read_again_and_its_faults_said(tmp_path):
    from explorer.feeds.prompt_watch import MAX_FILE_BYTES, PromptWatch
    path = tmp_path / "prompt.txt"
    feed = _Feed()
    watch = PromptWatch(str(path), [feed], recheck_s=1e9)
    watch.tick(now=0.0)
    assert watch.state_of(feed).status == "waiting" and watch.json_for(feed)["cached_tokens"] is None
    path.write_text("abcdefghij")
    watch.tick(now=1.0)
    watch.tick(now=2.0)
    state = watch.state_of(feed)
    assert state.status == "checked" and state.checks[0].num_tokens == 10 and feed.asked == [list(b"abcdefghij")]
    data = watch.json_for(feed)
    assert data["status"] == "checked" and data["num_tokens"] == 10 and len(data["blocks"]) == 3
    assert isinstance(data["checked_at"], float)
    watch.tick(now=3.0)
    assert len(feed.asked) == 1  # unchanged, not due: not asked again
    path.write_text("[5, 6, 7, 8, 9]")
    os.utime(path, ns=(10**18, 10**18))
    watch.tick(now=4.0)
    watch.tick(now=5.0)
    assert feed.asked[-1] == [5, 6, 7, 8, 9] and watch.state_of(feed).checks[0].num_tokens == 5
    path.write_text("[5, 6,")
    os.utime(path, ns=(2 * 10**18, 2 * 10**18))
    watch.tick(now=6.0)
    assert watch.state_of(feed).status == "error" and "does not parse" in watch.state_of(feed).error
    path.unlink()
    watch.tick(now=7.0)
    assert watch.state_of(feed).status == "waiting"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    w2 = PromptWatch(str(fifo), [feed])
    w2.tick()  # refused at once: a FIFO would block the reader
    assert w2.state_of(feed).status == "error" and "not a regular file" in w2.state_of(feed).error
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    w3 = PromptWatch(str(big), [feed])
    w3.tick()
    assert "at most" in w3.state_of(feed).error


def test_the_unchanged_prompt_is_checked_again_as_the_pool_moves(tmp_path):
    from explorer.feeds.prompt_watch import PromptWatch
    path = tmp_path / "p"
    path.write_text("[1, 2, 3, 4, 5]")
    feed = _Feed()
    watch = PromptWatch(str(path), [feed], recheck_s=1.0)
    for t in (0.0, 0.5, 1.2, 1.3, 2.5):
        watch.tick(now=t)
    assert len(feed.asked) == 3


def _run_main(*args, timeout=240):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, "main.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_headless_json_lines_carry_the_prompt_check(tmp_path):
    """--open a recording, --check-prompt a JSON list of ids: the last --json line carries the answer, and the
    totals by cause and medium."""
    prompts = [list(range(1, 14)), list(range(1, 9)) + [60, 61]]

    eng, feed = _recorded(tmp_path, each_to_its_end(prompts))
    feed.close()
    ask = list(range(1, 13)) + [3]
    expected = eng.check_prompt(prompt_token_ids=ask)
    eng.close()
    prompt = tmp_path / "ask.json"
    prompt.write_text(json.dumps(ask))
    done = _run_main("--open", str(tmp_path / "run.kvpool"), "--headless", "--json", "--check-prompt", str(prompt))
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.strip().splitlines()[-1])
    check = last["prompt_check"]
    assert check["status"] == "checked" and check["file"] == str(prompt) and check["num_tokens"] == 13
    assert check["cached_tokens"] == expected.cached_tokens == 12
    assert [b["outcome"] for b in check["blocks"]] == _outcomes(expected)
    assert last["misses"]["cold"] == 3 + 0 and last["hits_by_medium"]["device"] == 2


def test_the_command_line_refuses_what_cannot_be_checked(tmp_path):
    from explorer.cli import UsageError, parse_args
    with pytest.raises(UsageError, match="is a folder"):
        parse_args(["--check-prompt", str(tmp_path)])
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(UsageError, match="runs none"):
        parse_args(["--trace", str(trace), "--sweep", "10", "--headless", "--check-prompt", str(tmp_path / "p")])
    assert parse_args(["--check-prompt", str(tmp_path / "not-yet")]).check_prompt == str(tmp_path / "not-yet")
