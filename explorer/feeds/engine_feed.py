"""The local engine as a feed: the project's engine in this process, stepped by its EngineRunner thread.

The only kind of source that takes commands and has K/V values. The runner hands each published update (snapshot,
events, change record) to a :class:`~explorer.feeds.frames.FrameBuffer`, which the window's poll takes as one
frame with its events, and to a :class:`~kvstream.fanout.FrameFanout` that encodes it as a pool-stream frame for a
kvstream History (the timeline's past, like a recording's) and for a recorder or publisher when the command line
asks for them. The window's live view and events never wait for the History, and need none.

Outputs are closed only once the engine thread has ended (it may be in a step that still writes a frame): a
headless ``--record`` keeps its last frame. A restart hands the ``--publish`` publishers to the next engine (its
subscribers see the source restart and follow), while recordings end with the engine they recorded.
"""
from __future__ import annotations

import os

import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

from engine import EngineConfig, EngineRunner
from kvstream.fanout import FrameFanout
from kvstream.history import DEFAULT_BUDGET  # the timeline's memory budget: the History's own default

from .engine_text import EngineText
from .feed import Capabilities, Feed, Problem
from .frames import FeedFrame, FrameBuffer
from .joining_fanout import JoiningFanout

STOP_TIMEOUT_S = 10.0  # how long closing waits for the engine thread to end its step before closing the outputs


def make_history(budget_bytes: int = DEFAULT_BUDGET):
    """A kvstream History with that memory budget."""
    from kvstream.history import History
    return History(budget_bytes=budget_bytes)


def _is_recorder(sink) -> bool:
    from kvstream.recording import Recorder
    return isinstance(sink, Recorder)


def _endpoint_key(endpoint: str | None):
    """What two endpoints must share to clash when both bind: a tcp port, an ipc path, an inproc name."""
    if not endpoint:
        return None
    if endpoint.startswith("tcp://"):
        return ("tcp", endpoint.rsplit(":", 1)[-1])
    return endpoint


def model_name(model: str) -> str:
    """A model as the window's title names it: a checkpoint's folder or file name, not its whole path (the window
    demo's title was a cache path as wide as the screen)."""
    return os.path.basename(model.rstrip("/\\")) or model if ("/" in model or "\\" in model) else model


class EngineFeed(Feed):
    """Wraps a running EngineRunner (and the History it writes to, if any); closing it stops the runner."""

    kind = "engine"

    def __init__(self, runner: EngineRunner, config: EngineConfig, history=None, fanout: FrameFanout | None = None,
                 outputs: Sequence[object] = (), frames: FrameBuffer | None = None, polled: bool = True):
        self.runner = runner  # the engine thread; the only way to reach the engine (but for its tokenizer)
        self.config = config  # what it was started with (the restart dialog starts from it)
        self._history = history  # kvstream History the runner's frames go to, or None
        self.fanout = fanout  # the observer that encodes frames for the history and the other sinks, or None
        self.outputs = list(outputs)  # the command line's sinks among the fanout's (--record, --publish)
        self.recorders: list[tuple[object, JoiningFanout]] = []  # File > Record: (recorder, its observer)
        self.text = EngineText(runner.engine)  # the tokenizer, called from the GUI thread
        # the tokenizer never changes after the engine loads: what a prompt may be, read once
        self.takes_text, self.chats, self.detokenizer = self.text.takes_text, self.text.chats, self.text.detokenize
        if frames is None and polled:  # a runner started without one: it joins now, from the runner's newest
            frames = FrameBuffer()  # snapshot (at once: the first poll has a frame); the events of what the runner
            frames.prime(runner.latest)  # publishes before the engine thread adds the observer go to nobody
            runner.add_observer(frames)
        self.frames = frames  # the runner's updates the window has not taken yet (poll); None: nobody polls
        self.capabilities = Capabilities(can_command=True, has_kv_values=True, has_history=history is not None,
                                         has_physical_pool=True, can_record=True)
        self._closed = False

    @classmethod
    def start(cls, engine, config: EngineConfig, *, max_steps_per_second: float | None = None,
              start_paused: bool = False, extra_sinks: Sequence[object] = (),
              history_bytes: int | None = DEFAULT_BUDGET, polled: bool = True, driver=None,
              observers: Sequence[object] = ()) -> "EngineFeed":
        """Start a runner for ``engine`` whose frames go to a History (``history_bytes`` budget; None: none) and to
        ``extra_sinks`` (recorder, publisher: the feed's ``outputs``). ``polled=False`` for a reader that never
        calls :meth:`poll` (the headless run reads ``latest()``): no frame buffer then, whose events would pile up
        to its cap for nobody. ``driver``: a trace replay the runner feeds the engine from (its thread).
        ``observers``: more runner observers from the first update on (the /metrics exporter's)."""
        history = make_history(history_bytes) if history_bytes else None
        sinks = ([history] if history is not None else []) + list(extra_sinks)
        fanout = FrameFanout(sinks, threaded=True) if sinks else None  # encodes off the engine thread
        frames = FrameBuffer() if polled else None  # observes from the first update, as the fanout: both number
        observers = [o for o in (frames, fanout) if o is not None] + list(observers)  # the frames alike
        runner = EngineRunner(engine, max_steps_per_second=max_steps_per_second, start_paused=start_paused,
                              observers=observers, driver=driver).start()
        return cls(runner, config, history, fanout, outputs=extra_sinks, frames=frames, polled=polled)

    @property
    def title(self) -> str:
        cfg = self.config
        return f"local engine: {model_name(cfg.model)}, {cfg.num_blocks} blocks × {cfg.block_size} slots, {cfg.device}"

    @property
    def history(self):
        return self._history

    def latest(self):
        return self.runner.latest

    def poll(self) -> FeedFrame | None:
        """The runner's newest update since the last poll, with the events of every update since then, straight
        from the engine thread (never through the History, which may trail it by the frames its encoder has not
        written yet)."""
        if self.frames is None:
            raise RuntimeError("this engine feed was started for a reader that does not poll (polled=False)")
        return self.frames.take()

    def take_problems(self) -> list[Problem]:
        problems = []
        for f in self.runner.take_failures():
            if getattr(f, "fatal", False):
                problems.append(Problem("Engine stopped", f"The engine thread stopped after step {f.step_id}: "
                                        f"{f.message}\n\nRestart the engine to go on.", f.traceback))
            else:
                problems.append(Problem("Engine error", f"The engine failed after step {f.step_id}: {f.message}"
                                        "\n\nThe engine is paused; press Run to try again, or restart it.",
                                        f.traceback))
        for fanout in [self.fanout] + [f for _, f in self.recorders]:
            if fanout is not None:  # a recorder or publisher that failed was dropped; decoding goes on
                problems += [Problem("Output stopped", message) for message in fanout.take_failures()]
        return problems

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Future:
        return self.runner.submit(name, *args, **kwargs)

    def inspect_live(self, block_id: int) -> Future:
        return self.runner.submit("inspect_block", block_id)

    def check_prompt(self, token_ids) -> Future:
        """Asked of the engine itself, between two steps (its pool, tiers and eviction book: exact)."""
        future: Future = Future()
        asked = self.runner.submit("check_prompt", prompt_token_ids=list(token_ids))

        def answered(done: Future) -> None:
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result([done.result()])
        asked.add_done_callback(answered)
        return future

    def tokenize_prompt(self, text: str) -> list[int]:
        return self.text.tokenize(text).result()

    # ---- the tokenizer (thread-safe: called directly, see explorer.feeds.engine_text) ------------------------------
    def tokenize(self, text: str, continuation: bool = False) -> Future:
        return self.text.tokenize(text, continuation)

    def token_text(self, token_id: int) -> str | None:
        return self.text.token_text(token_id)

    def chat_prompt_ids(self, messages) -> Future:
        return self.text.chat_prompt_ids(messages)

    @property
    def paused(self) -> bool:
        return self.runner.paused

    @property
    def speed(self) -> float | None:
        return self.runner.max_steps_per_second

    def status_text(self) -> str:
        if self.runner.paused:
            return "❚❚ paused"
        return "● live (idle)" if self.idle() else "● live"

    def idle(self) -> bool:
        """Nothing left to decode: no conversation waiting, running or preempted in the newest view, and no trace
        request still to come."""
        driver = self.runner.driver
        if driver is not None and not driver.done:
            return False
        snap = self.runner.latest
        return snap is not None and not any(c.is_live for c in snap.conversations)

    @property
    def trace(self):
        """The trace replay feeding this engine, or None."""
        return self.runner.driver

    def summaries(self, final: bool = False) -> list[dict]:
        out = super().summaries(final)
        driver = self.runner.driver
        if driver is not None:  # the trace's own figures beside the pool's (a reference swap: safe to read here)
            out[0] = {**out[0], "trace": dict(driver.latest)}
        return out

    # ---- KV events: a new engine that binds the same endpoint ----------------------------------------------
    def kv_events_clash(self, config: EngineConfig) -> str | None:
        """The endpoint this engine publishes KV events on that an engine built from ``config`` would bind too
        (a restart with the same --kv-events), or None."""
        mine = {_endpoint_key(e): e for e in (self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint)
                if e}
        for endpoint in (config.kv_events_endpoint, config.kv_events_replay_endpoint):
            if endpoint and _endpoint_key(endpoint) in mine:
                return mine[_endpoint_key(endpoint)]
        return None

    def release_kv_events(self) -> Future:
        """Close this engine's KV-event sockets (on its thread, between two steps), so that a new engine can bind
        the same endpoint; the engine decodes on without publishing KV events. The Future resolves once done."""
        if self.runner.alive:
            return self.runner.submit("close")
        future: Future = Future()  # the thread is gone (stopped, or died): nothing else touches the engine now
        try:
            self.runner.engine.close()
            future.set_result(None)
        except Exception as exc:  # reported by whoever waits on it
            future.set_exception(exc)
        return future

    # ---- File > Record while running -------------------------------------------------------------------------
    def start_recording(self, recorder) -> None:
        """Write every frame from now on to ``recorder`` (a kvstream Recorder), starting with a keyframe of the
        newest published state, taken on the engine thread once the runner holds the observer (so the file starts
        where its frames continue, and a paused engine still gives a file that opens)."""
        joining = JoiningFanout([recorder])
        self.recorders.append((recorder, joining))
        added = self.runner.add_observer(joining)
        added.add_done_callback(lambda _f: joining.prime(self.runner.latest))  # on the engine thread, in order

    def stop_recording(self) -> tuple[object, Future] | None:
        """Stop the newest recording: (its recorder, a Future that resolves to it once the engine thread let go of
        it and it is closed), or None when nothing is being recorded."""
        if not self.recorders:
            return None
        recorder, joining = self.recorders.pop()
        closed: Future = Future()

        def close() -> None:
            try:
                joining.close()  # waits for the frames handed over: not on the engine thread
            except Exception as exc:  # said by whoever waits on it
                closed.set_exception(exc)
            else:
                closed.set_result(recorder)

        # the done callback runs on the engine thread once the runner let go of the observer
        self.runner.remove_observer(joining).add_done_callback(
            lambda _removed: threading.Thread(target=close, name="close recording", daemon=True).start())
        return recorder, closed

    # ---- closing -------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._shut_down(keep_publishers=False)

    def hand_over(self) -> tuple[list, list]:
        """Stop this engine for the next one (a restart): returns (its publishers, which go on publishing the next
        engine's frames, and (path, frames) of every recording it ended: a recording holds one engine's run).
        Once closed (or after :meth:`close`) it returns ([], [])."""
        return self._shut_down(keep_publishers=True)

    def _shut_down(self, keep_publishers: bool) -> tuple[list, list]:
        if self._closed:
            return [], []
        self._closed = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        stopped = self.runner.stop(timeout=STOP_TIMEOUT_S)
        fanouts = [f for f in [self.fanout] + [f for _, f in self.recorders] if f is not None]
        # the fanouts' threads write what the engine handed over before the outputs are counted and closed; the
        # command line's publishers go on with the next engine once the main fanout let go of them, whatever a
        # File > Record recorder is stuck in
        ended_fanouts = [stopped and f.stop(timeout=max(0.0, deadline - time.monotonic())) for f in fanouts]
        main_done = stopped if self.fanout is None else ended_fanouts[0]
        stopped = all(ended_fanouts)
        sinks = list(dict.fromkeys([s for f in fanouts for s in f.sinks] + self.outputs
                                   + [r for r, _ in self.recorders]))
        kept = [s for s in self.outputs if main_done and keep_publishers and not _is_recorder(s) and s in sinks]
        ended = [(r.path, r.frames_written) for r in sinks if _is_recorder(r)]
        self.recorders.clear()
        closing = [s for s in sinks if s not in kept]
        if stopped:
            _close_all(closing)
        else:  # the engine thread is still in a step, or a fanout in a write: close the outputs once they ended
            threading.Thread(target=_close_when_stopped, args=(self.runner, fanouts, closing), name="close outputs",
                             daemon=True).start()
        return kept, ended


def _close_all(sinks) -> None:
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is not None:
            close()


def _close_when_stopped(runner: EngineRunner, fanouts, sinks) -> None:
    runner.stop(timeout=None)  # joins the engine thread, then closes the engine's sockets
    for f in fanouts:
        f.stop(timeout=None)
    _close_all(sinks)
