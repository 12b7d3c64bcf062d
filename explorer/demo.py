"""Demo workloads, run directly on a fresh engine before any other thread sees it.

"busy" makes the first screen tell the story: two conversations share the system prompt's full blocks (ref
count 2), one is forked (all its blocks shared until copy-on-write), one finishes early (its full blocks stay
cached, muted), and every running conversation has a partially filled tail block.
"""
from __future__ import annotations

SYSTEM_PROMPT = ("You are a careful assistant. Answer in short, plain sentences, keep each step clear, and say when "
                 "you are unsure. ")  # long enough to fill several full blocks that prefix caching can share
DEMO_SPEED = 10.0  # steps/s for "busy", slow enough to watch blocks fill


def seed_busy(engine) -> list[int]:
    """Add the busy demo's conversations; returns their ids. Generation lengths shrink to fit small pools."""
    snap = engine.snapshot()
    budget = snap.num_blocks * snap.block_size // 4  # slots one long conversation may aim for

    def add(prompt: str, wanted: int, **kwargs) -> int:
        room = budget - len(engine.tokenize(prompt))
        return engine.add_conversation(prompt, max_new_tokens=max(4, min(wanted, room)), **kwargs)

    a = add(SYSTEM_PROMPT + "What does a block table store?", 240, temperature=0.7, seed=1)
    engine.step()  # prefill a, so its full system-prompt blocks are hashed before b arrives
    b = add(SYSTEM_PROMPT + "Why do tail blocks waste memory?", 240, temperature=0.7, seed=2)
    c = add("Write a short poem about memory pages.", 200, temperature=0.9, seed=3)
    e = add("Explain copy-on-write in one line.", 20, temperature=0.0)
    engine.step()
    d = engine.fork_conversation(c, seed=4)
    return [a, b, c, d, e]


def seed_many(engine, count: int, max_new_tokens: int = 64, ignore_eos: bool = False) -> list[int]:
    """``count`` independent conversations (benchmarks, large-pool screenshots)."""
    return [engine.add_conversation(f"Conversation {i}: tell me about page number {i * 7}.",
                                    max_new_tokens=max_new_tokens, temperature=0.8, seed=i, ignore_eos=ignore_eos)
            for i in range(count)]


def seed_crowd(engine) -> list[int]:
    """Many conversations of mixed lengths for large pools: a third share the system prompt, some are forked,
    the short ones finish early and leave cached blocks behind."""
    snap = engine.snapshot()
    count = int(min(128, max(8, snap.num_blocks // 128)))
    budget = max(8, snap.num_blocks * snap.block_size // (2 * count))
    ids = []
    for i in range(count):
        prompt = (SYSTEM_PROMPT if i % 3 == 0 else "") + f"Question {i}: how is page {i * 7} laid out?"
        wanted = (24, 400, 1200)[i % 3]
        prompt_len = len(engine.tokenize(prompt))
        room = max(4, min(wanted, budget - prompt_len, snap.max_model_len - prompt_len))
        ids.append(engine.add_conversation(prompt, max_new_tokens=room, temperature=0.8, seed=i))
        if i % 12 == 0:
            engine.step()  # let the first system-prompt conversation fill its blocks before others share them
    engine.step()
    for parent in ids[1:count // 4:8]:
        ids.append(engine.fork_conversation(parent, seed=1000 + parent))
    return ids


DEMOS = {"busy": seed_busy, "crowd": seed_crowd}  # --demo name -> what seeds a fresh engine (the lesson has no engine)
