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
