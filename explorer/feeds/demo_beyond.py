"""Demos for what lies beyond the paper's one pool: lower tiers (``--demo tiers``) and a sliding window
(``--demo window``). Public Engine API only; each comes with the engine settings it needs, applied where the user
left the command line's default (:func:`demo_settings`).

"tiers": a small device pool and a larger host tier. Three long conversations are answered first; a queue of
other long prompts then pushes their cached blocks out of the device pool, into the host tier; last, each of the
three comes back with a follow-up question on the same prefix, and its prefix is loaded back from the host tier
instead of being recomputed (the conversations table's "prompt from" column and the LOADED marks say so).

"window": the project's mixed checkpoint (the built-in weights, every other layer a sliding window of 64 tokens),
two KV cache groups in one pool. Long conversations keep a bounded number of sliding-group blocks while the
full-attention group's tables keep growing: a window drops KV because the model never reads it again, paging
alone never does.
"""
from __future__ import annotations

from .demo import Seeded, _Adder

TIERS_SETTINGS = {"num_blocks": 64, "host_tier_blocks": 1024}  # a device pool the queue overflows; a host tier
#                                                                 that keeps what it evicts
_TOPICS = ("the block table", "copy-on-write", "prefix caching", "preemption", "chunked prefill", "eviction",
           "the free queue", "ref counts", "sliding windows")


def _long_prompt(topic: str, n: int) -> str:
    """A prompt of about ``n`` characters about ``topic`` (distinct from every other topic's first block on)."""
    text = f"Notes on {topic}: "
    while len(text) < n:
        text += f"{topic} keeps the pool honest; "
    return text[:n]


def seed_tiers(engine) -> Seeded:
    """Returning conversations whose prefix comes back from the host tier (see the module's docstring)."""
    adder = _Adder(engine)
    slots = adder.num_blocks * adder.block_size
    prompt_len = max(adder.block_size * 4, slots // 6)  # each conversation's prefix: a sixth of the device pool
    budget = prompt_len + 48
    first = [adder.add(_long_prompt(t, prompt_len), 24, budget, temperature=0.0) for t in _TOPICS[:3]]
    for t in _TOPICS[3:]:  # the queue that pushes the first three's cached blocks down to the host tier
        adder.add(_long_prompt(t, prompt_len), 24, budget, temperature=0.0)
    for t in _TOPICS[:3]:  # they come back: the same prefix, a new question after it
        adder.add(_long_prompt(t, prompt_len) + " So what happens next?", 32, budget + 32, temperature=0.0)
    del first
    return adder.result()


def seed_window(engine) -> Seeded:
    """Long conversations on a model with a sliding-window group (see the module's docstring)."""
    adder = _Adder(engine)
    slots = adder.num_blocks * adder.block_size
    for i, t in enumerate(_TOPICS[:4]):
        adder.add(_long_prompt(t, 96), 700, max(slots // 2, 128), temperature=0.8, seed=i)
    return adder.result()


def demo_settings(demo: str, given: dict) -> dict:
    """EngineConfig fields the demo needs, for those the user left at the command line's default (``given``: the
    fields the user set). The window demo runs the project's mixed checkpoint unless a model was named."""
    out = {}
    if demo == "tiers":
        out = {k: v for k, v in TIERS_SETTINGS.items() if k not in given}
    elif demo == "window" and "model" not in given:
        from engine import window_checkpoint
        out["model"] = str(window_checkpoint())
    return out


BEYOND_DEMOS = {"tiers": seed_tiers, "window": seed_window}
