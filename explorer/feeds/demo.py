"""Demo workloads, run directly on a fresh engine before any other thread sees it (public Engine API only).

"busy" makes the first screen tell the story: two conversations share the system prompt's full blocks (ref
count 2), one is forked (all its blocks shared until copy-on-write), one finishes early (its full blocks stay
cached, muted), and every running conversation has a partially filled tail block.

"serve" is a server's traffic that never runs dry (explorer.feeds.traffic); every other demo goes on as served
traffic once its first screen has played out (SERVED_AT_ONCE says which do not wait), so the window never sits idle: on the tiers demo's
small device pool, evictions keep offloading to the host tier and a follow-up whose prefix left the device loads it
back; on the window demo's mixed checkpoint the sliding-window group keeps releasing blocks.

"crowd" oversubscribes the pool on purpose: each request asks for up to twice its fair share of the pool's slots,
which paging admits (blocks are taken only as tokens arrive, and most requests stop early) while a contiguous
max-length allocator of the same memory has to keep many waiting (the contiguous view shows both).

Both demos shrink a request whose generation budget would not fit the pool (or the model's context), and a prompt
that could not fit at all loses its system prompt, then its tail, so that a demo runs on any pool. A demo that
lowers a request says so: every seed function returns a :class:`Seeded` with a note per lowered request, which
the window shows.
"""
from __future__ import annotations

from dataclasses import dataclass

SYSTEM_PROMPT = ("You are a careful assistant. Answer in short, plain sentences, keep each step clear, and say when "
                 "you are unsure. ")  # long enough to fill several full blocks that prefix caching can share
SERVED_AT_ONCE = {"serve"}  # demos whose traffic starts at once; every other one's waits for its first screen
DEMO_SPEED = 10.0  # steps/s for "busy", slow enough to watch blocks fill
MIN_NEW_TOKENS = 4  # a demo request never asks for fewer new tokens than this


@dataclass(frozen=True)
class Seeded:
    """What a demo added: the conversation ids, and one sentence for each request it lowered to fit."""

    ids: tuple[int, ...]  # every conversation the demo added (forks included), in the order added
    notes: tuple[str, ...] = ()  # "conversation 3: max new tokens lowered from 1200 to 340 ..." per lowered request

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)

    def summary(self) -> str:
        """One line for a status bar: how many requests were lowered, or '' when none was."""
        if not self.notes:
            return ""
        if len(self.notes) == 1:
            return f"Demo: {self.notes[0]}"
        return (f"Demo: {len(self.notes)} of {len(self.ids)} requests were lowered to fit the pool or the model "
                f"({self.notes[0]}; …)")


class _Adder:
    """Adds demo conversations, lowering each generation budget to ``room(prompt length)`` and noting it."""

    def __init__(self, engine):
        self.engine = engine
        snap = engine.snapshot()
        self.num_blocks, self.block_size, self.max_model_len = snap.num_blocks, snap.block_size, snap.max_model_len
        self.chat = getattr(engine, "chat_template", None) is not None  # prompts go as chat turns
        self.ids: list[int] = []
        self.notes: list[str] = []

    def add(self, prompt: str, wanted: int, budget: int, system: str = "", **kwargs) -> int:
        """Add ``prompt`` (after the ``system`` prompt) asking for ``wanted`` new tokens, but at most ``budget`` slots
        in all (prompt + new) and within the model's positions. A chat model gets them as system and user turns.
        A prompt that cannot fit the whole pool (or the model) at all loses its system prompt first, then its tail:
        the demo runs on any pool, saying what it cut."""
        ids = self._prompt_ids(prompt, system)
        limit = self.num_blocks * self.block_size
        if self.max_model_len:
            limit = min(limit, self.max_model_len)
        least = min(MIN_NEW_TOKENS, max(1, limit // 2))  # new tokens a request keeps at the least
        where = (f"the model's context of {self.max_model_len} tokens" if limit == self.max_model_len else
                 f"the pool ({limit} slots)")
        cut = ""
        if len(ids) + least > limit and system:  # the shared system prompt goes first: the question is the request
            ids, system, cut = self._prompt_ids(prompt, ""), "", "its system prompt left out"
        if len(ids) + least > limit:
            before, ids = len(ids), ids[:limit - least]
            cut = f"{cut + ' and ' if cut else ''}its prompt cut from {before} to {len(ids)} tokens"
        prompt_len = len(ids)
        pool_room = budget - prompt_len
        model_room = self.max_model_len - prompt_len if self.max_model_len else pool_room
        granted = min(max(least, min(wanted, pool_room, model_room)), limit - prompt_len)
        if self.chat or cut:
            cid = self.engine.add_conversation(prompt_token_ids=ids, max_new_tokens=granted, **kwargs)
        else:
            cid = self.engine.add_conversation(system + prompt, max_new_tokens=granted, **kwargs)
        self.ids.append(cid)
        if cut:
            self.notes.append(f"conversation {cid}: {cut} to fit {where}")
        if granted < wanted:
            reason = (f"the model's context of {self.max_model_len} tokens" if model_room <= pool_room else
                      f"its share of the pool ({budget} of {self.num_blocks * self.block_size} slots)")
            self.notes.append(f"conversation {cid}: max new tokens lowered from {wanted} to {granted} to fit {reason}")
        return cid

    def prompt_tokens(self, prompt: str) -> int:
        """How many tokens ``prompt`` takes as :meth:`add` sends it (no system prompt)."""
        return len(self._prompt_ids(prompt, ""))

    def _prompt_ids(self, prompt: str, system: str) -> list[int]:
        if self.chat:  # a real chat model answers a user turn; bare text would only be continued
            return self.engine.chat_prompt_ids(([{"role": "system", "content": system.strip()}] if system else [])
                                               + [{"role": "user", "content": prompt}])
        return self.engine.tokenize(system + prompt)

    def fork(self, parent: int, **kwargs) -> int:
        cid = self.engine.fork_conversation(parent, **kwargs)
        self.ids.append(cid)
        return cid

    def result(self) -> Seeded:
        return Seeded(tuple(self.ids), tuple(self.notes))


def seed_busy(engine) -> Seeded:
    """Add the busy demo's conversations. Generation lengths shrink to fit small pools (each note says so)."""
    adder = _Adder(engine)
    budget = adder.num_blocks * adder.block_size // 4  # slots one long conversation may aim for
    adder.add("What does a block table store?", 240, budget, system=SYSTEM_PROMPT, temperature=0.7, seed=1)
    engine.step()  # prefill a, so its full system-prompt blocks are hashed before b arrives
    adder.add("Why do tail blocks waste memory?", 240, budget, system=SYSTEM_PROMPT, temperature=0.7, seed=2)
    c = adder.add("Write a short poem about memory pages.", 200, budget, temperature=0.9, seed=3)
    adder.add("Explain copy-on-write in one line.", 20, budget, temperature=0.0)
    engine.step()
    adder.fork(c, seed=4)
    return adder.result()


def seed_many(engine, count: int, max_new_tokens: int = 64, ignore_eos: bool = False) -> Seeded:
    """``count`` independent conversations (benchmarks, large-pool screenshots); nothing is lowered."""
    ids = tuple(engine.add_conversation(f"Conversation {i}: tell me about page number {i * 7}.",
                                        max_new_tokens=max_new_tokens, temperature=0.8, seed=i, ignore_eos=ignore_eos)
                for i in range(count))
    return Seeded(ids)


def seed_crowd(engine) -> Seeded:
    """Many conversations of mixed lengths: a third share the system prompt, some are forked, the short ones finish
    early and leave cached blocks behind. Each may reserve up to twice its fair share of the pool."""
    adder = _Adder(engine)
    slots = adder.num_blocks * adder.block_size
    count = int(min(128, max(8, slots // 512)))  # one conversation per 512 slots of the pool
    budget = min(max(8, 2 * slots // count), slots)  # twice the fair share; one request always fits the pool
    for i in range(count):
        adder.add(f"Question {i}: how is page {i * 7} laid out?", (24, 400, 1200)[i % 3], budget,
                  system=SYSTEM_PROMPT if i % 3 == 0 else "", temperature=0.8, seed=i)
        if i % 12 == 0:
            engine.step()  # let the first system-prompt conversation fill its blocks before others share them
    engine.step()
    live = {c.conversation_id for c in engine.snapshot().conversations if c.is_live}
    for parent in adder.ids[1:count // 4:8]:
        if parent in live:  # a parent that already stopped (end-of-sequence) cannot be forked
            adder.fork(parent, seed=1000 + parent)
    return adder.result()


def pick_model(requested: str | None, demo: str) -> tuple[str, str]:
    """(the model to run, a line telling the user which one, or ''): ``--model`` when given; otherwise a demo runs
    the real chat model once it has been fetched (``--fetch-model smollm2``) and the built-in one before that."""
    if requested is not None:
        return requested, ""
    if demo in DEMOS:
        from engine import fetched_model
        title = fetched_model("smollm2")
        if title is not None:
            return "smollm2", f"{demo} demo: running {title} (fetched; --model builtin runs the built-in model)"
        return "builtin", (f"{demo} demo: running the built-in byte model (python main.py --fetch-model smollm2 "
                           f"for a real chat model)")
    return "builtin", ""


def seed_serve(engine) -> Seeded:
    """The serve demo's first requests (a few chats on the shared system prompts), so its first screen is not empty;
    the served traffic (explorer.feeds.traffic) goes on from there."""
    from .traffic import QUESTIONS, SYSTEM_PROMPTS
    adder = _Adder(engine)
    budget = adder.num_blocks * adder.block_size // 4
    for i in range(4):
        try:
            adder.add(QUESTIONS[i], (96, 200, 48, 400)[i], budget, system=SYSTEM_PROMPTS[i % 2] + " ",
                      temperature=0.7, seed=i)
        except ValueError:  # a pool too small for this prompt: the traffic's own requests are sized to fit
            continue
        if i == 0:
            engine.step()  # its system-prompt blocks are hashed before the next one arrives, so they are shared
    return adder.result()


# ---- beyond one pool: lower tiers ("tiers") and a sliding window ("window") ---------------------------------------
# "tiers": a small device pool and a larger host tier. Three long conversations are answered first; a queue of other
# long prompts then pushes their cached blocks out of the device pool into the host tier; last, each of the three
# comes back with a follow-up on the same prefix, and its prefix is loaded back from the host tier instead of being
# recomputed (the conversations table's "prompt from" column and the LOADED marks say so).
# "window": the project's mixed checkpoint (the built-in weights, every other layer a 64-token sliding window), two
# KV cache groups in one pool: long conversations keep a bounded number of sliding-group blocks while the
# full-attention group's tables keep growing (a window drops KV the model never reads again; paging never does).

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


def _prompt_of_tokens(adder: _Adder, topic: str, n: int) -> str:
    """A :func:`_long_prompt` about ``topic`` of at least ``n`` tokens in the engine's tokenizer (a byte model takes
    about one a character, SmolLM2's about one in four: sized in characters, its prompts were too short to ever
    leave the device pool for the host tier)."""
    chars = n
    for _ in range(6):
        text = _long_prompt(topic, chars)
        have = adder.prompt_tokens(text)
        if have >= n:
            return text
        chars = chars * n // max(have, 1) + 16
    return text


def seed_tiers(engine) -> Seeded:
    """Returning conversations whose prefix comes back from the host tier (see the module's docstring)."""
    adder = _Adder(engine)
    slots = adder.num_blocks * adder.block_size
    prompt_len = max(adder.block_size * 4, slots // 6)  # each conversation's prefix, in tokens: a sixth of the pool
    budget = prompt_len + 48
    prompts = {t: _prompt_of_tokens(adder, t, prompt_len) for t in _TOPICS}
    first = [adder.add(prompts[t], 24, budget, temperature=0.0) for t in _TOPICS[:3]]
    for t in _TOPICS[3:]:  # the queue that pushes the first three's cached blocks down to the host tier
        adder.add(prompts[t], 24, budget, temperature=0.0)
    for t in _TOPICS[:3]:  # they come back: the same prefix, a new question after it
        adder.add(prompts[t] + " So what happens next?", 32, budget + 32, temperature=0.0)
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
    elif demo == "traffic":
        from .traffic_demo import SETTINGS
        out = {k: v for k, v in SETTINGS.items() if k not in given}
    return out


def menu_demo_config(current, demo: str, before_demo=None):
    """(the EngineConfig a demo picked from the window's menu starts, the config to go back to once the user picks a
    demo that needs nothing of its own; None when this demo changed nothing). ``before_demo``: that config, when the
    engine runs a demo's settings now. The tiers demo needs its small device pool and host tier, the window demo the
    mixed checkpoint (and no tiers: its story is what the window lets go of, on the device); busy, crowd and serve run on the user's own
    settings, so picking one after the tiers demo undoes its pool, not keeps it."""
    import dataclasses
    base = before_demo if before_demo is not None else current
    settings = demo_settings(demo, set())
    if demo in ("window", "traffic"):
        settings.update(host_tier_blocks=0, disk_tier_blocks=0)
    if demo == "traffic":  # its pool is sized for LRU to lose what the trace needs again
        settings.update(eviction_policy="lru")
    if not settings:
        return base, None
    return dataclasses.replace(base, **settings), base


DEMOS = {"busy": seed_busy, "crowd": seed_crowd, "serve": seed_serve, "tiers": seed_tiers,
         "window": seed_window}  # --demo name -> what seeds a fresh engine (the lesson has no engine)
