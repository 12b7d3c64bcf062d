"""A bfloat16 engine in the window and through a recording: the views do not care about the dtype, and the memory
readout shows half the bytes of the same conversations in float32 (issue 34)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.kv.cache import KVCache
from engine.model.loader import read_model_config
from explorer.widgets.relocation import human_bytes
from kvstream.recording import read_snapshots
from kvstream.summary import fixed_part
from test_gui_support import wait_for_snapshot

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("Pages are not addresses.", "Blocks of four slots each.", "A table maps logical to physical.")


def _config(dtype):
    return EngineConfig(model="builtin", num_blocks=64, block_size=4, dtype=dtype)


def _add_all(engine):
    for prompt in PROMPTS:
        engine.add_conversation(prompt, max_new_tokens=24, temperature=0.0)


@pytest.fixture
def window_for(make_window):
    """window_for(dtype, paused=False, steps=0): the window around an engine of that dtype with the three prompts,
    ``steps`` of them decoded before it opens."""
    def make(dtype, paused=False, steps=0):
        def setup(engine):
            _add_all(engine)
            for _ in range(steps):
                engine.step()
        return make_window(setup=setup, paused=paused, dtype=dtype)
    return make


def test_a_bfloat16_engine_decodes_in_the_window_with_the_tokens_it_gives_headless(qtbot, window_for):
    reference = Engine(_config("bfloat16"))
    _add_all(reference)
    reference.run_until_idle()
    expected = [c.output_token_ids for c in reference.conversations()]
    window = window_for("bfloat16")
    snap = wait_for_snapshot(qtbot, window, lambda s: all(str(c.status) == "finished" for c in s.conversations),
                             timeout=30000)
    assert [c.output_token_ids for c in snap.conversations] == expected
    assert window.errors == []


def test_the_memory_readout_of_a_bfloat16_pool_shows_half_the_bytes(qtbot, window_for):
    texts, mems = {}, {}
    for dtype in ("float32", "bfloat16"):
        window = window_for(dtype, paused=True, steps=3)
        mems[dtype] = window.snapshot.memory
        texts[dtype] = window.relocation.memory_text()
    full, half = mems["float32"], mems["bfloat16"]
    assert half.bytes_per_block * 2 == full.bytes_per_block and half.num_filled_slots == full.num_filled_slots > 0
    assert texts["bfloat16"]["KV in use (filled slots)"] == \
        f"{human_bytes(full.kv_bytes_used // 2)}  ({full.num_filled_slots} slots)"
    assert texts["bfloat16"]["Contiguous reservation"].startswith(human_bytes(full.contiguous_bytes // 2))
    assert texts["bfloat16"] != texts["float32"]


def _run_main(*args, home, timeout=180):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(home))
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_record_and_open_a_bfloat16_run_headless(tmp_path):
    path = tmp_path / "bf16.kvrec"
    recorded = _run_main("--headless", "--json", "--demo", "busy", "--num-blocks", "64", "--block-size", "4",
                         "--dtype", "bfloat16", "--record", str(path), home=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    lines = [json.loads(line) for line in recorded.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1]["source"] == "engine" and lines[-1]["step"] > 0
    # the recording carries the pool's memory figures: two bytes a K/V value
    config = read_model_config("builtin")
    per_block = KVCache.bytes_for(config.num_hidden_layers, 1, 4, config.num_key_value_heads, config.head_dim,
                                  torch.bfloat16)
    memories = [snap.memory for _, snap, _ in read_snapshots(path) if snap.memory is not None]
    assert memories and {m.bytes_per_block for m in memories} == {per_block}
    replay = _run_main("--open", str(path), "--headless", "--json", home=tmp_path, timeout=90)
    assert replay.returncode == 0, replay.stderr
    last = [json.loads(line) for line in replay.stdout.splitlines() if line.startswith("{")][-1]
    assert fixed_part(last) == fixed_part(lines[-1])
    refused = _run_main("--dtype", "float16", "--headless", home=tmp_path, timeout=60)
    assert refused.returncode == 2 and "--dtype" in refused.stderr
