"""Served traffic for the demos that keep living: requests arrive as at a real server, and never run dry.

A demo that seeds a dozen conversations is over in half a minute; a server's pool is never at rest. The ``serve``
demo (and the busy and crowd demos, once their first screen has played out) feed the engine a stream of requests:

- arrivals are a Poisson process at a rate the user sets (requests per second of wall-clock time);
- most start from one of a few shared system prompts, so their full blocks are shared by prefix caching;
- some are follow-ups: a finished conversation of the traffic's gets another client turn, and its history's blocks
  are found again in the cache (or recomputed when they were evicted meanwhile);
- some ask for several parallel samples (n > 1, forks that share the prompt's blocks), some bring a long prompt;
- some clients stop early: a running conversation is ended before its last token.

The traffic touches only its own conversations (the ones it sent, and the demo's first screen it goes on from):
a conversation the user added in the window is never replied to or ended by it. The window words what the traffic
does as its clients' ("the client left", "the client replied"), from :attr:`TrafficDriver.own`.

Each request asks for up to a quarter of the pool's slots, so a handful of them oversubscribe it: blocks are evicted
from the cache and conversations preempted without anyone arranging it. Like a server's admission queue, arrivals
are turned away while too many requests wait, so the queue (and the memory) stays bounded however long it runs;
the engine's finished window bounds the finished conversations kept.

:class:`ServeTraffic` decides (no engine, no threads, no Qt: the tests drive it with a fixed clock); a
:class:`TrafficDriver` thread asks it every tick and sends its requests through the feed, as a user's commands go.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer in short, plain sentences, keep each step clear, and say when you are "
    "unsure.",
    "You are a coding assistant for a team that runs language models in production. Prefer small, tested changes "
    "and explain the trade-offs of each.",
    "You are a patient tutor. Explain operating-system ideas with one concrete example each, and check the "
    "student's understanding with a question at the end.",
)
QUESTIONS = (
    "What does a block table store?", "Why do tail blocks waste memory?", "How does copy-on-write save memory?",
    "When is a block evicted from the prefix cache?", "What happens to a request that is preempted?",
    "How big should a KV-cache block be?", "Why does paging let more requests run at once?",
    "Explain reference counts on shared blocks.", "What is a swap-out, and when is recomputation cheaper?",
    "How are two requests with the same system prompt served?", "Write a haiku about memory pages.",
    "Summarize virtual memory in two sentences.",
)
FOLLOW_UPS = ("Can you give an example?", "Why is that?", "Say it in one sentence.", "And what would go wrong "
              "without it?", "Thanks. What should I read next?")
LONG_TEXT = ("Paged attention stores the key and value vectors of each request in fixed-size blocks that need not "
             "be next to each other in memory; a block table maps each request's logical blocks to physical ones. ")
DEFAULT_RATE = 1.0  # requests per second (the slider's starting point)
MAX_RATE = 20.0
WAITING_LIMIT = 6  # arrivals are turned away while this many requests wait for the pool
STOP_RATE = 0.02  # per running conversation and second: the chance its client goes away early


@dataclass(frozen=True)
class Request:
    """One thing a client does: ``kind`` is "new" (``samples`` parallel samples of a new chat), "follow_up" (a
    user turn to the finished ``conversation_id``) or "stop" (the client of ``conversation_id`` went away)."""

    kind: str
    system: str = ""  # the system prompt ("" for none)
    text: str = ""  # the user's message
    max_new_tokens: int = 0
    samples: int = 1
    conversation_id: int = -1
    temperature: float = 0.8
    long: bool = False  # a long prompt (a document pasted in front of the question)
    fixed_length: bool = False  # asks for exactly max_new_tokens (ignore_eos, as benchmark clients do)


@dataclass
class TrafficCounts:
    """What the traffic did so far (shown in the window, printed headless)."""

    arrived: int = 0
    follow_ups: int = 0
    samples: int = 0  # requests with n > 1
    long: int = 0
    stopped: int = 0
    turned_away: int = 0  # arrivals refused because too many requests were waiting
    refused: int = 0  # requests the engine refused (did not fit)


class ServeTraffic:
    """Decides which requests arrive between two ticks. ``rate`` (requests/s) may be changed at any time."""

    def __init__(self, num_blocks: int, block_size: int, *, rate: float = DEFAULT_RATE, seed: int = 0,
                 start: float = 0.0):
        self.slots = num_blocks * block_size
        self.block_size = block_size
        self.rate = rate
        self.rng = random.Random(seed)
        self.last = start
        self.counts = TrafficCounts()

    @property
    def rate(self) -> float:
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= MAX_RATE):
            raise ValueError(f"the arrival rate must be between 0 and {MAX_RATE:g} requests/s, got {value!r}")
        self._rate = float(value)

    def _poisson(self, mean: float) -> int:
        """Knuth's method for the small means of one tick; the normal approximation after a long stall."""
        if mean > 30.0:
            return max(0, round(self.rng.gauss(mean, math.sqrt(mean))))
        limit, k, p = math.exp(-mean), 0, 1.0
        while True:
            p *= self.rng.random()
            if p <= limit:
                return k
            k += 1

    def budget(self) -> int:
        """New tokens one request may ask for: a quarter of the pool, so a few requests oversubscribe it."""
        return max(4, self.slots // 4)

    def tick(self, now: float, snapshot, own=None) -> list[Request]:
        """The requests of the time since the last tick, given the newest view of the pool (None: not yet).
        ``own``: the ids of the conversations this traffic may reply to or stop (None: every one); the others
        (the user's) still count towards the waiting queue, as a server's other clients do."""
        dt, self.last = max(0.0, now - self.last), now
        if snapshot is None or dt == 0.0:
            return []
        conversations = snapshot.conversations
        waiting = sum(1 for c in conversations if str(c.status) in ("waiting", "preempted"))
        mine = conversations if own is None else [c for c in conversations if c.conversation_id in own]
        finished = [c for c in mine if str(c.status) == "finished"]
        running = [c for c in mine if str(c.status) == "running"]
        out: list[Request] = []
        for _ in range(self._poisson(self.rate * dt)):
            if waiting >= WAITING_LIMIT:
                self.counts.turned_away += 1
                continue
            out.append(self._arrival(finished))
            waiting += out[-1].samples
        p_stop = 1.0 - math.exp(-STOP_RATE * dt)
        for c in running:
            if self.rng.random() < p_stop:
                out.append(Request("stop", conversation_id=c.conversation_id))
                self.counts.stopped += 1
        return out

    def _arrival(self, finished) -> Request:
        rng, counts = self.rng, self.counts
        counts.arrived += 1
        wanted = rng.choice((16, 48, 96, 200, 400))
        kind = rng.random()
        if kind < 0.3 and finished:  # a follow-up returns to its cached history
            conv = finished.pop(rng.randrange(len(finished)))
            counts.follow_ups += 1
            return Request("follow_up", text=rng.choice(FOLLOW_UPS), conversation_id=conv.conversation_id,
                           max_new_tokens=wanted)
        system = rng.choice(SYSTEM_PROMPTS)
        text = rng.choice(QUESTIONS)
        if kind > 0.9:  # a document pasted before the question: a long prompt, several blocks of it
            counts.long += 1
            copies = max(1, self.slots // (8 * len(LONG_TEXT)) + 1)
            return Request("new", system, LONG_TEXT * copies + text, min(wanted, 64), long=True)
        samples = rng.choice((2, 3, 4)) if kind > 0.8 else 1
        counts.samples += samples > 1
        return Request("new", system, text, wanted, samples=samples, temperature=0.9 if samples > 1 else 0.7,
                       fixed_length=rng.random() < 0.5)


def command_for(request: Request, feed, snapshot, budget: int) -> tuple[str, tuple, dict] | None:
    """The engine command (name, args, kwargs) for ``request`` on ``feed`` (None: it cannot be sent as text).

    A chat model gets system and user turns in its template; a plain-text model the system prompt and the message as
    one text. The generation budget is lowered to fit the pool and the model's context, as the demos' are."""
    if request.kind == "stop":
        return "end_conversation", (request.conversation_id,), {}
    room = snapshot.num_blocks * snapshot.block_size
    if snapshot.max_model_len:
        room = min(room, snapshot.max_model_len)
    if request.kind == "follow_up":
        conv = snapshot.conversation(request.conversation_id)
        if conv is None:
            return None
        new = min(request.max_new_tokens, budget, room - conv.num_tokens - 64)  # 64: the user turn's own tokens
        if new < 4:
            return None
        return "continue_conversation", (request.conversation_id,), dict(prompt=request.text, max_new_tokens=new)
    if getattr(feed, "chats", False):
        messages = ([{"role": "system", "content": request.system}] if request.system else []) + [
            {"role": "user", "content": request.text}]
        ids = feed.chat_prompt_ids(messages).result()
        kwargs = dict(prompt_token_ids=list(ids))
        length = len(ids)
    else:
        text = (request.system + " " if request.system else "") + request.text
        length = len(feed.tokenize(text).result())
        kwargs = dict(prompt=text)
    share = request.max_new_tokens if request.long else budget - length  # a long prompt asks for little anyway
    new = min(request.max_new_tokens, share, room - length)
    if new < 4:
        return None
    kwargs.update(max_new_tokens=new, temperature=request.temperature)
    if request.fixed_length and not getattr(feed, "chats", False):  # a chat model's words past its end are noise
        kwargs["ignore_eos"] = True
    if request.samples > 1:
        return "add_samples", (), dict(kwargs, n=request.samples)
    return "add_conversation", (), kwargs


class TrafficDriver:
    """Sends a :class:`ServeTraffic`'s requests to an engine feed from its own thread, every ``interval`` seconds,
    until :meth:`stop` or the feed's engine stops. ``wait_until_idle``: start only once the feed has nothing live
    (the busy and crowd demos tell their first-screen story first).

    :attr:`own` holds the ids of the conversations it may touch: those in the feed when it is made (a demo's first
    screen, seeded before the window is handed to the user) and every one it adds. It grows on the engine's thread
    (a set's add is atomic under the GIL) and is read on the GUI thread for the words."""

    def __init__(self, feed, *, rate: float = DEFAULT_RATE, seed: int = 0, wait_until_idle: bool = False,
                 interval: float = 0.1, clock=time.monotonic):
        snap = feed.latest()
        self.own: set[int] = {c.conversation_id for c in snap.conversations}
        self.feed = feed
        self.clock = clock
        self.traffic = ServeTraffic(snap.num_blocks, snap.block_size, rate=rate, seed=seed, start=clock())
        self.wait_until_idle = wait_until_idle
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-traffic", daemon=True)

    @property
    def rate(self) -> float:
        return self.traffic.rate

    def set_rate(self, rate: float) -> None:
        self.traffic.rate = rate  # one float: the thread reads it on its next tick

    @property
    def serving(self) -> bool:
        """Requests are arriving (False while a demo's first screen plays out)."""
        return not self.wait_until_idle

    def start(self) -> "TrafficDriver":
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            runner = getattr(self.feed, "runner", None)
            if runner is None or not runner.alive:
                return
            snapshot = self.feed.latest()
            if self.wait_until_idle:
                if snapshot is None or any(c.is_live for c in snapshot.conversations):
                    self.traffic.last = self.clock()
                    continue
                self.wait_until_idle = False
            self.step(snapshot)

    def step(self, snapshot) -> None:
        """One tick: send what arrived since the last one (refusals are counted, never raised)."""
        for request in self.traffic.tick(self.clock(), snapshot, self.own):
            try:
                command = command_for(request, self.feed, snapshot, self.traffic.budget())
            except (ValueError, TypeError):  # the tokenizer refused the text
                command = None
            if command is None:
                self.traffic.counts.refused += request.kind != "stop"
                continue
            name, args, kwargs = command
            try:
                future = self.feed.submit(name, *args, **kwargs)
            except Exception:  # the runner stopped meanwhile: the next tick ends the thread
                return
            future.add_done_callback(self._answered)

    def _answered(self, future) -> None:
        if future.exception() is not None:  # did not fit, or the conversation moved on meanwhile
            self.traffic.counts.refused += 1
            return
        made = future.result()  # add_conversation: an id; add_samples: the ids; the others: None
        if isinstance(made, int):
            self.own.add(made)
        elif isinstance(made, tuple):
            self.own.update(made)
