"""A bfloat16 pool holds two bytes a K/V value: half a float32 pool's bytes per block, in the memory readout and
in the check that sizes the pool against free memory (issue 34)."""
import pytest
import torch

from engine import Engine, EngineConfig, EngineError
from engine.model import loader
from engine.kv.cache import KVCache

PROMPTS = ("Pages are not addresses.", "Blocks of four slots each.", "A table maps logical to physical.")


def _engine(dtype, num_blocks=64):
    eng = Engine(EngineConfig(model="builtin", num_blocks=num_blocks, block_size=4, dtype=dtype))
    for prompt in PROMPTS:
        eng.add_conversation(prompt, max_new_tokens=12)
    for _ in range(4):
        eng.step()
    return eng


def test_a_bfloat16_pool_takes_half_the_bytes_of_a_float32_one():
    full, half = _engine("float32"), _engine("bfloat16")
    assert half.kv.data.dtype == torch.bfloat16 and half.kv.data.element_size() == 2
    assert half.kv.data.numel() * 2 == half.kv.data.nbytes == full.kv.data.nbytes // 2
    a, b = full.memory_stats(), half.memory_stats()
    assert b.bytes_per_block * 2 == a.bytes_per_block and b.bytes_per_token * 2 == a.bytes_per_token
    assert b.num_filled_slots == a.num_filled_slots > 0  # the same conversations in the same blocks
    assert b.kv_bytes_used * 2 == a.kv_bytes_used and b.tail_waste_bytes * 2 == a.tail_waste_bytes
    assert b.contiguous_bytes * 2 == a.contiguous_bytes
    block = half.inspect_block(half.conversation(0).block_table[0])  # K/V read back as float32 numbers
    assert block.keys.dtype.name == "float32" and block.keys.shape[1] == block.num_filled


def test_the_pool_sizing_check_counts_two_bytes_a_value(monkeypatch):
    """A pool that does not fit in float32 fits in bfloat16; the refusal's advice counts float32's bytes."""
    config = loader.read_model_config("builtin")
    per_block = {name: KVCache.bytes_for(config.num_hidden_layers, 1, 16, config.num_key_value_heads, config.head_dim,
                                         getattr(torch, name)) for name in ("float32", "bfloat16")}
    assert per_block["float32"] == 2 * per_block["bfloat16"]
    blocks = 1000
    # free memory for about 1.5x the bfloat16 pool: the float32 one (2x) is refused, the bfloat16 one is not
    monkeypatch.setattr(loader, "available_memory", lambda device: int(1.5 * blocks * per_block["bfloat16"] / 0.9))
    with pytest.raises(EngineError, match=f"{per_block['float32'] / 2**10:.0f} KiB per block") as refused:
        Engine(EngineConfig(model="builtin", num_blocks=blocks, block_size=16, dtype="float32"))
    assert "use at most" in str(refused.value)
    eng = Engine(EngineConfig(model="builtin", num_blocks=blocks, block_size=16, dtype="bfloat16"))
    assert eng.kv.data.nbytes == blocks * per_block["bfloat16"]
