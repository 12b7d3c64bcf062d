"""Tiny checkpoints written with the project's own model class, for fast engine tests."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.causal_lm import CausalLM, ModelConfig


def write_tiny_checkpoint(path: Path, *, vocab_size: int = 97, seed: int = 0, std: float = 0.3,
                          eos_token_id=None, num_kv_heads: int = 2) -> Path:
    """A random Llama-style model whose weights are large enough that greedy outputs vary from token to token."""
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=12,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_ids=() if eos_token_id is None else (eos_token_id,))
    model = CausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(std / 0.02)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


_ORDINALS = {1: "first", 2: "second", 3: "third"}


def fail_forward_on_call(monkeypatch, engine, n: int) -> None:
    """Make ``engine``'s model forward raise ``RuntimeError("injected fault on the third forward call")`` (for n = 3)
    on its ``n``-th call from now (the calls before it run for real): a fault in the middle of a multi-step
    operation such as generate()."""
    real, calls = engine.runner.forward, []

    def forward(prepared):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(f"injected fault on the {_ORDINALS.get(n, f'{n}th')} forward call")
        return real(prepared)

    monkeypatch.setattr(engine.runner, "forward", forward)


def used_blocks(tables: dict, num_blocks: int):
    """(state, ref_count) arrays of a pool whose only used blocks are those ``tables`` name, each block's ref count
    the number of table entries naming it (the pool's own invariant)."""
    import numpy as np

    from kvstream.views import BlockState
    state = np.zeros(num_blocks, np.int8)
    ref = np.zeros(num_blocks, np.int32)
    for table in tables.values():
        for b in table:
            state[b] = BlockState.USED
            ref[b] += 1
    return state, ref
