"""Demo workloads seed any pool the CLI accepts, within the model's positions."""
from engine import Engine, EngineConfig
from explorer.demo import seed_crowd


def test_crowd_on_a_large_pool_stays_within_the_models_positions():
    # 8 conversations share 64 x 512 slots: a budget of 2048 tokens each, more than the model's 1024 positions
    eng = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=512))
    ids = seed_crowd(eng)
    snap = eng.snapshot()
    assert len(ids) > 8  # the conversations and their forks were all accepted
    longest = max(len(c.prompt_token_ids) + c.max_new_tokens for c in snap.conversations)
    assert longest == snap.max_model_len == 1024
