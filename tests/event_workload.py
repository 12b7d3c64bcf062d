"""A short real-engine workload recorded as (seq, event) pairs, one frame per engine call, for the tests of the
event log's words and a block's history: forks, copy-on-write, prefix hits, evictions, preemption, relocation,
replies, finishes and an end, from the built-in model on a pool of 40 blocks of 4 slots."""
from __future__ import annotations

import pytest

from engine import Engine, EngineConfig


def engine_frames():
    """(engine, [(seq, BlockEvent)]) after the workload; skips when the engine does not report events yet."""
    if not hasattr(Engine, "take_events"):
        pytest.skip("Engine.take_events() has not landed yet")
    eng = Engine(EngineConfig(model="builtin", block_size=4, num_blocks=40, enable_prefix_caching=True, seed=0))
    pairs = []

    def frame():  # what the runner publishes after each call that changed something
        events = eng.take_events()
        seq = len({s for s, _ in pairs}) + 1
        pairs.extend((seq, e) for e in events)

    system = "The block table maps logical blocks to physical blocks. "
    a = eng.add_conversation(prompt=system + "One", max_new_tokens=12, temperature=0.8)
    frame()
    for _ in range(3):
        eng.step()
        frame()
    eng.fork_conversation(a)
    frame()
    c = eng.add_conversation(prompt=system + "Two", max_new_tokens=30)
    frame()
    for _ in range(4):
        eng.step()
        frame()
    eng.relocate_blocks(seed=1)
    frame()
    for i in range(4):
        eng.add_conversation(prompt=f"Another prompt number {i} that is long enough to need blocks",
                             max_new_tokens=20)
        frame()
    for _ in range(10):
        eng.step()
        frame()
    eng.end_conversation(c)
    frame()
    while eng.conversation(a).status != "finished":  # the fork's parent, sampled at temperature 0.8
        eng.step()
        frame()
    eng.continue_conversation(a, prompt=" and more", max_new_tokens=4)
    frame()
    while any(info.is_live for info in eng.snapshot().conversations):
        eng.step()
        frame()
    return eng, pairs


def grouped_engine_frames(directory):
    """(engine, [(seq, BlockEvent)]) of a workload on a model of two KV cache groups (the window demo's
    checkpoint with a window of 8, blocks of 4): sliding-window releases (reason "sliding_window", group 1), per-group
    prefix hits, a fork with copy-on-write in both groups, a relocation, a preemption and finishes."""
    from engine.model.window_model import write_window_checkpoint
    path = write_window_checkpoint(directory / "window-8", window=8)
    eng = Engine(EngineConfig(model=str(path), block_size=4, num_blocks=34, enable_prefix_caching=True, seed=0,
                              max_num_batched_tokens=64, max_num_seqs=8))
    pairs = []

    def frame():
        events = eng.take_events()
        seq = len({s for s, _ in pairs}) + 1
        pairs.extend((seq, e) for e in events)

    system = "The block table maps logical blocks. "
    a = eng.add_conversation(prompt=system + "One", max_new_tokens=16)
    frame()
    for _ in range(3):
        eng.step()
        frame()
    eng.fork_conversation(a)
    frame()
    eng.add_conversation(prompt=system + "Two", max_new_tokens=24, ignore_eos=True)
    frame()
    for _ in range(4):
        eng.step()
        frame()
    eng.relocate_blocks(seed=1)
    frame()
    for i in range(3):
        eng.add_conversation(prompt=f"Another prompt number {i} that is long enough", max_new_tokens=20,
                             ignore_eos=True)
        frame()
    while eng.has_work():
        eng.step()
        frame()
    return eng, pairs
