"""The local engine as a feed: the project's engine in this process, stepped by its EngineRunner thread.

The only kind of source that takes commands and has K/V values. Its published snapshots also become pool-stream
frames (one :class:`~explorer.frames.FrameFanout` observer of the runner) that go to a kvstream History, which gives
it a timeline like a recording's, and to a recorder or publisher when the command line asks for them.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

from engine import EngineConfig, EngineRunner

from .feed import Capabilities, Feed, Problem
from .frames import FrameFanout

DEFAULT_HISTORY_BYTES = 256 << 20  # the timeline's default memory budget (issue 10: about 256 MiB)


def make_history(budget_bytes: int = DEFAULT_HISTORY_BYTES):
    """A kvstream History with that memory budget."""
    from kvstream.history import History
    return History(budget_bytes=budget_bytes)


class EngineFeed(Feed):
    """Wraps a running EngineRunner (and the History it writes to, if any); closing it stops the runner."""

    kind = "engine"

    def __init__(self, runner: EngineRunner, config: EngineConfig, history=None, fanout: FrameFanout | None = None):
        self.runner = runner  # the engine thread; the only way to reach the engine
        self.config = config  # what it was started with (the restart dialog starts from it)
        self._history = history  # kvstream History the runner's frames go to, or None
        self.fanout = fanout  # the observer that encodes frames for the history and the other sinks, or None
        self.recorders: list[tuple[object, FrameFanout]] = []  # File > Record: (recorder, its observer)
        self.capabilities = Capabilities(can_command=True, has_kv_values=True, has_history=history is not None,
                                         has_physical_pool=True)
        self._closed = False
        self._takes_text: bool | None = None  # asked of the engine's tokenizer once, when first needed

    @classmethod
    def start(cls, engine, config: EngineConfig, *, max_steps_per_second: float | None = None,
              start_paused: bool = False, extra_sinks: Sequence[object] = (),
              history_bytes: int | None = DEFAULT_HISTORY_BYTES) -> "EngineFeed":
        """Start a runner for ``engine`` whose frames go to a History (``history_bytes`` budget; None: none) and to
        ``extra_sinks`` (recorder, publisher)."""
        history = make_history(history_bytes) if history_bytes else None
        sinks = ([history] if history is not None else []) + list(extra_sinks)
        fanout = FrameFanout(sinks) if sinks else None
        runner = EngineRunner(engine, max_steps_per_second=max_steps_per_second, start_paused=start_paused,
                              observers=[fanout] if fanout is not None else None).start()
        return cls(runner, config, history, fanout)

    @property
    def title(self) -> str:
        cfg = self.config
        return f"local engine: {cfg.model}, {cfg.num_blocks} blocks × {cfg.block_size} slots, {cfg.device}"

    @property
    def history(self):
        return self._history

    def latest(self):
        return self.runner.latest

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

    def token_text(self, token_id: int) -> str | None:
        try:
            return self.runner.engine.token_text(token_id)  # the tokenizer is read-only after load
        except (AttributeError, ValueError, IndexError, KeyError):
            return None

    @property
    def takes_text(self) -> bool:
        """False for a checkpoint without a tokenizer: its ``tokenize`` refuses any text (a pure function of the
        tokenizer, so asking from the GUI thread is fine)."""
        if self._takes_text is None:
            try:
                self.runner.engine.tokenize("a")
                self._takes_text = True
            except ValueError:  # EngineError: "this checkpoint has no tokenizer.json ..."
                self._takes_text = False
        return self._takes_text

    @property
    def detokenizer(self):
        """The engine's ``detokenize``: a pure function of its tokenizer (read-only after load), so the GUI thread
        may call it directly instead of queueing behind a step. Ids it refuses read as ids."""
        engine = self.runner.engine

        def detokenize(token_ids) -> str:
            try:
                return engine.detokenize(list(token_ids))
            except (ValueError, TypeError, IndexError):
                return " ".join(str(t) for t in token_ids)

        return detokenize

    @property
    def paused(self) -> bool:
        return self.runner.paused

    @property
    def speed(self) -> float | None:
        return self.runner.max_steps_per_second

    def status_text(self) -> str:
        if self.runner.paused:
            return "❚❚ paused"
        snap = self.runner.latest
        idle = snap is not None and not any(c.is_live for c in snap.conversations)
        return "● live (idle)" if idle else "● live"

    def idle(self) -> bool:
        """Nothing left to decode: no conversation waiting, running or preempted in the newest view."""
        snap = self.runner.latest
        return snap is not None and not any(c.is_live for c in snap.conversations)

    # ---- File > Record while running -------------------------------------------------------------------------
    def start_recording(self, recorder) -> None:
        """Write every frame from now on to ``recorder`` (a kvstream Recorder), starting with a keyframe of the
        newest published state (so a paused engine still gives a file that opens)."""
        fanout = FrameFanout([recorder], first=self.runner.latest)
        self.recorders.append((recorder, fanout))
        self.runner.add_observer(fanout)

    def stop_recording(self):
        """Stop the newest recording (closed once the engine thread let go of it); returns its recorder or None."""
        if not self.recorders:
            return None
        recorder, fanout = self.recorders.pop()
        done = self.runner.remove_observer(fanout)
        done.add_done_callback(lambda _f: fanout.close())
        return recorder

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.runner.stop(timeout=1.0)
            for fanout in [self.fanout] + [f for _, f in self.recorders]:
                if fanout is not None:
                    fanout.close()
            self.recorders.clear()
