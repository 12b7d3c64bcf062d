"""Demo workloads, run directly on a fresh engine before any other thread sees it.

"busy" makes the first screen tell the story: two conversations share the system prompt's full blocks (ref
count 2), one is forked (all its blocks shared until copy-on-write), one finishes early (its full blocks stay
cached, muted), and every running conversation has a partially filled tail block.
"""
from __future__ import annotations

from .dialogs import SYSTEM_PROMPT

DEMO_SPEED = 12.0  # steps/s for "busy", slow enough to watch blocks fill


def seed_busy(engine) -> list[int]:
    """Add the busy demo's conversations; returns their ids."""
    a = engine.add_conversation(SYSTEM_PROMPT + "What does a block table store?", max_new_tokens=240,
                                temperature=0.7, seed=1)
    engine.step()  # prefill a, so its full system-prompt blocks are hashed before b arrives
    b = engine.add_conversation(SYSTEM_PROMPT + "Why do tail blocks waste memory?", max_new_tokens=240,
                                temperature=0.7, seed=2)
    c = engine.add_conversation("Write a short poem about memory pages.", max_new_tokens=200, temperature=0.9,
                                seed=3)
    e = engine.add_conversation("Explain copy-on-write in one line.", max_new_tokens=20, temperature=0.0)
    engine.step()
    d = engine.fork_conversation(c, seed=4)
    return [a, b, c, d, e]


def seed_many(engine, count: int, max_new_tokens: int = 64) -> list[int]:
    """``count`` independent conversations (benchmarks, large-pool screenshots)."""
    return [engine.add_conversation(f"Conversation {i}: tell me about page number {i * 7}.",
                                    max_new_tokens=max_new_tokens, temperature=0.8, seed=i) for i in range(count)]
