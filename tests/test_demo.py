"""Demo workloads seed any pool the CLI accepts, within the model's positions, and say what they lowered."""
from engine import Engine, EngineConfig
from explorer.feeds.demo import Seeded, seed_busy, seed_crowd


def test_crowd_on_a_large_pool_stays_within_the_models_positions():
    # 64 conversations share 64 x 512 slots: up to 1024 tokens each by the pool, which the model also allows
    eng = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=512))
    seeded = seed_crowd(eng)
    snap = eng.snapshot()
    assert len(seeded) > 8  # the conversations and their forks were all accepted
    longest = max(len(c.prompt_token_ids) + c.max_new_tokens for c in snap.conversations)
    assert longest == snap.max_model_len == 1024
    lowered = [n for n in seeded.notes if "context of 1024 tokens" in n]
    assert lowered and all("from 1200 to" in n for n in lowered)  # the 1200-token asks met the model's limit


def test_a_demo_says_which_requests_it_lowered_and_to_what():
    eng = Engine(EngineConfig(model="builtin", num_blocks=40, block_size=16))  # 640 slots: 160 per busy request
    seeded = seed_busy(eng)
    assert isinstance(seeded, Seeded) and len(seeded.ids) == 5
    snap = eng.snapshot()
    for note in seeded.notes:
        cid = int(note.split()[1].rstrip(":"))
        granted = snap.conversation(cid).max_new_tokens
        assert f"to {granted} to fit its share of the pool (160 of 640 slots)" in note
    assert len(seeded.notes) == 3  # the two 240-token system-prompt asks and the 200-token poem
    assert seeded.summary().startswith("Demo: 3 of 5 requests were lowered")
    roomy = seed_busy(Engine(EngineConfig(model="builtin", num_blocks=512, block_size=16)))
    assert roomy.notes == () and roomy.summary() == ""


# ---- served traffic (--demo serve; busy and crowd once their first screen is over) -------------------------------
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from explorer.feeds import traffic as tr  # noqa: E402
from tests.helpers import wait_until  # noqa: E402


@dataclass
class _Conv:
    conversation_id: int
    status: str
    num_tokens: int = 10


@dataclass
class _View:
    conversations: tuple


def test_arrivals_are_poisson_at_the_rate_the_user_sets():
    traffic = tr.ServeTraffic(128, 16, rate=2.0, seed=7)
    counts, now = [], 0.0
    for _ in range(5000):  # 500 s in ticks of 0.1 s, nothing waiting
        now += 0.1
        counts.append(sum(r.kind == "new" or r.kind == "follow_up" for r in traffic.tick(now, _View(()))))
    total = sum(counts)
    assert 900 < total < 1100  # 2/s for 500 s
    mean = total / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / len(counts)
    assert 0.8 < var / mean < 1.2  # Poisson: the variance equals the mean
    kinds = traffic.counts
    assert kinds.samples > 50 and kinds.long > 50  # some parallel samples, some long prompts
    traffic.rate = 0.0
    assert traffic.tick(now + 100.0, _View(())) == []
    for bad in (-1.0, float("nan"), tr.MAX_RATE + 1, "2"):
        with pytest.raises(ValueError, match="arrival rate"):
            traffic.rate = bad


def test_follow_ups_return_to_finished_conversations_and_a_full_queue_turns_arrivals_away():
    traffic = tr.ServeTraffic(128, 16, rate=10.0, seed=1)
    view = _View(tuple(_Conv(i, "finished") for i in range(20)) + (_Conv(99, "running"),))
    requests = traffic.tick(20.0, view)  # 200 arrivals, capped by the waiting limit
    follow = [r for r in requests if r.kind == "follow_up"]
    assert follow and all(0 <= r.conversation_id < 20 for r in follow)
    assert len({r.conversation_id for r in follow}) == len(follow)  # one reply at a time to each
    assert all(r.conversation_id == 99 for r in requests if r.kind == "stop")  # only a running one is stopped
    assert sum(r.samples for r in requests if r.kind != "stop") <= tr.WAITING_LIMIT + 3
    assert traffic.counts.turned_away > 150
    full = _View(tuple(_Conv(i, "waiting") for i in range(tr.WAITING_LIMIT)))
    before = traffic.counts.turned_away
    assert [r for r in traffic.tick(40.0, full) if r.kind != "stop"] == []
    assert traffic.counts.turned_away > before
    # early stops: about STOP_RATE per running conversation and second
    traffic.rate, now, stops = 0.0, 40.0, 0
    running = _View(tuple(_Conv(i, "running") for i in range(10)))
    for _ in range(1000):  # 100 s: about 20 of the 10 x 100 conversation-seconds end early
        now += 0.1
        stops += sum(r.kind == "stop" for r in traffic.tick(now, running))
    assert 8 < stops < 40


def test_the_traffic_replies_to_and_stops_only_its_own_conversations():
    """The user's conversations (ids not in ``own``) are never replied to or ended, however long it runs; they
    still count towards the waiting queue."""
    traffic = tr.ServeTraffic(128, 16, rate=10.0, seed=5)
    mine, users = set(range(0, 20, 2)), set(range(1, 20, 2))
    view = _View(tuple(_Conv(i, "finished") for i in range(20)) + tuple(_Conv(i, "running") for i in range(20, 40)))
    own = mine | set(range(20, 40, 2))
    touched, now = [], 0.0
    for _ in range(200):  # 20 s at 10 arrivals/s: follow-ups and early stops both happen
        now += 0.1
        touched += [r for r in traffic.tick(now, view, own) if r.kind in ("follow_up", "stop")]
    assert {r.kind for r in touched} == {"follow_up", "stop"}
    assert all(r.conversation_id in own for r in touched)
    assert not {r.conversation_id for r in touched} & (users | set(range(21, 40, 2)))
    waiting = _View(tuple(_Conv(i, "waiting") for i in range(tr.WAITING_LIMIT)))
    assert [r for r in traffic.tick(now + 5.0, waiting, own=set()) if r.kind == "new"] == []  # the user's wait too


def test_the_driver_owns_what_it_sent_and_the_demo_it_went_on_from_not_the_users():
    from engine import Engine, EngineConfig
    from explorer.feeds.engine_feed import EngineFeed
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=16)
    engine = Engine(cfg)
    seeded = engine.add_conversation("a demo's first screen", max_new_tokens=4)
    feed = EngineFeed.start(engine, cfg, history_bytes=0)
    driver = tr.TrafficDriver(feed, rate=8.0, interval=0.05, seed=2)
    user = feed.submit("add_conversation", "the user's own question", max_new_tokens=400, ignore_eos=True).result(10)
    driver.start()
    try:
        wait_until(lambda: len(driver.own) >= 4, 60, what="the traffic's own requests")
    finally:
        driver.stop()
        feed.close()
    assert seeded in driver.own and user not in driver.own
    assert driver.own <= {c.conversation_id for c in feed.latest().conversations}


def test_served_traffic_keeps_the_pool_under_pressure_with_bounded_memory():
    """A real engine under the driver: evictions happen on their own, follow-ups and samples are sent, and the
    conversations kept stay within the finished window."""
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import seed_serve
    from explorer.feeds.engine_feed import EngineFeed
    cfg = EngineConfig(model="builtin", num_blocks=24, block_size=16, finished_window=16)
    engine = Engine(cfg)
    seed_serve(engine)
    feed = EngineFeed.start(engine, cfg, history_bytes=0)
    driver = tr.TrafficDriver(feed, rate=6.0, interval=0.05, seed=3).start()
    try:
        counts = driver.traffic.counts
        wait_until(lambda: (m := feed.latest().metrics).num_evictions and counts.follow_ups >= 2 and counts.samples
                   and m.num_steps > 300, 60, what="evictions, follow-ups and samples")
        snap = feed.latest()
    finally:
        driver.stop()
        feed.close()
    assert snap.metrics.num_evictions > 0  # preemption is not asserted here: see the report (issue 33)
    assert driver.traffic.counts.follow_ups >= 2 and driver.traffic.counts.samples >= 1
    done = [c for c in snap.conversations if not c.is_live]
    assert len(done) <= 16 and len(snap.conversations) <= 16 + 64
    assert not driver.alive


def test_headless_serve_runs_until_quit_after():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "main.py"), "--demo", "serve", "--headless", "--model", "builtin",
                          "--quit-after", "4", "--num-blocks", "32"], capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert out.returncode == 0, out.stderr
    assert "serving traffic" in out.stderr
    steps = [int(line.split(":")[0].split()[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    # it went on decoding until --quit-after ("stopped", not "idle"), however many steps a loaded machine allowed
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0]
    assert "stopped after" in out.stdout and " 1 tokens" not in out.stdout


def test_tiers_demo_brings_prefixes_back_from_the_host_tier():
    """--demo tiers: the conversations that come back load their prefix from the host tier (not recomputed)."""
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import TIERS_SETTINGS, demo_settings, seed_tiers
    assert demo_settings("tiers", {"num_blocks"}) == {"host_tier_blocks": TIERS_SETTINGS["host_tier_blocks"]}
    eng = Engine(EngineConfig(model="builtin", block_size=16, **TIERS_SETTINGS))
    seeded = seed_tiers(eng)
    eng.run_until_idle()
    returning = [eng.conversation(cid).prompt_token_sources for cid in seeded.ids[-3:]]
    assert sum(s["host"] for s in returning) >= 2 * 160  # most of two prefixes came back from host
    for cid, sources in zip(seeded.ids[-3:], returning):  # the last admission's tokens (a preempted one's include
        info = eng.conversation(cid)                       # what it had generated before it was readmitted)
        if info.num_preemptions == 0:
            assert sum(sources.values()) == len(info.prompt_token_ids)
    assert eng.snapshot().tiers["host"].state.any()


def test_tiers_demo_sizes_its_prompts_in_tokens_for_any_tokenizer(tmp_path):
    """On SmolLM2 (about four characters a token) --demo tiers never reached the host tier: its prompts were sized in
    characters. Here a word-level tokenizer (one token a word) stands in for it."""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine import Engine, EngineConfig
    from explorer.feeds.demo import _TOPICS, TIERS_SETTINGS, _long_prompt, seed_tiers
    from tests.helpers import write_tiny_checkpoint
    words = sorted({w for t in _TOPICS for w in re.findall(r"\w+|[^\w\s]+", _long_prompt(t, 4000) +
                                                            " So what happens next?")})
    path = write_tiny_checkpoint(tmp_path / "m", vocab_size=len(words) + 1)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    eng = Engine(EngineConfig(model=str(path), block_size=16, **TIERS_SETTINGS))
    assert len(eng.tokenize("keeps the pool honest;")) <= 6  # words, not characters
    seeded = seed_tiers(eng)
    slots = TIERS_SETTINGS["num_blocks"] * 16
    assert len(eng.conversation(seeded.ids[0]).prompt_token_ids) >= slots // 6
    eng.run_until_idle()
    assert sum(eng.conversation(cid).prompt_token_sources["host"] for cid in seeded.ids[-3:]) > 0


def test_window_demo_keeps_the_sliding_group_bounded(tmp_path, monkeypatch):
    """--demo window: the mixed checkpoint's sliding group holds at most ceil(window / block size) + 1 blocks per
    conversation while its full-attention group keeps every block."""
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import demo_settings, seed_window
    model = demo_settings("window", set())["model"]
    eng = Engine(EngineConfig(model=model, block_size=16, num_blocks=256))
    seeded = seed_window(eng)
    groups = eng.kv_cache_groups
    assert [g.kind for g in groups] == ["full_attention", "sliding_window"]
    bound = -(-groups[1].sliding_window // 16) + 1
    for _ in range(60):
        eng.step()
    for cid in seeded.ids:
        full, sliding = eng.conversation(cid).group_block_tables
        assert len([b for b in sliding if b >= 0]) <= bound and -1 not in full
    assert any(-1 in eng.conversation(cid).group_block_tables[1] for cid in seeded.ids)
