"""The local engine as a feed: the project's engine in this process, stepped by its EngineRunner thread.

The only kind of source that takes commands and has K/V values. Its frames also go to a kvstream History (one of
the runner's sinks) when the runner and the pool stream support it, which gives it a timeline like a recording's.
"""
from __future__ import annotations

import inspect
from concurrent.futures import Future
from typing import Any, Sequence

from engine import EngineConfig, EngineRunner

from .feed import Capabilities, Feed, Problem

DEFAULT_HISTORY_BYTES = 256 << 20  # the timeline's default memory budget (issue 10: about 256 MiB)


def runner_takes_sinks() -> bool:
    """Whether this engine's EngineRunner hands frames to sinks (the pool-stream runner)."""
    return "sinks" in inspect.signature(EngineRunner.__init__).parameters


def make_history(budget_bytes: int = DEFAULT_HISTORY_BYTES):
    """A kvstream History, or None when the pool stream is not available."""
    try:
        from kvstream.poolstream import History
    except ImportError:
        return None
    return History(budget_bytes=budget_bytes)


def start_runner(engine, *, max_steps_per_second: float | None = None, start_paused: bool = False,
                 sinks: Sequence[object] = ()) -> EngineRunner:
    """Start a runner for ``engine`` with ``sinks`` when the runner takes them (else without)."""
    kwargs: dict[str, Any] = dict(max_steps_per_second=max_steps_per_second, start_paused=start_paused)
    if sinks and runner_takes_sinks():
        kwargs["sinks"] = list(sinks)
    return EngineRunner(engine, **kwargs).start()


class EngineFeed(Feed):
    """Wraps a running EngineRunner (and the History it writes to, if any); closing it stops the runner."""

    kind = "engine"

    def __init__(self, runner: EngineRunner, config: EngineConfig, history=None):
        self.runner = runner  # the engine thread; the only way to reach the engine
        self.config = config  # what it was started with (the restart dialog starts from it)
        self._history = history  # kvstream History the runner writes frames to, or None
        self.capabilities = Capabilities(can_command=True, has_kv_values=True, has_history=history is not None,
                                         has_physical_pool=True)
        self._closed = False

    @classmethod
    def start(cls, engine, config: EngineConfig, *, max_steps_per_second: float | None = None,
              start_paused: bool = False, extra_sinks: Sequence[object] = (),
              history_bytes: int | None = DEFAULT_HISTORY_BYTES) -> "EngineFeed":
        """Start a runner for ``engine`` with a history (``history_bytes`` budget, None: no history; only where the
        runner takes sinks) and ``extra_sinks`` (recorder, publisher)."""
        history = make_history(history_bytes) if history_bytes and runner_takes_sinks() else None
        sinks = ([history] if history is not None else []) + list(extra_sinks)
        runner = start_runner(engine, max_steps_per_second=max_steps_per_second, start_paused=start_paused,
                              sinks=sinks)
        return cls(runner, config, history)

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
        problems = [Problem("Engine error", f"The engine failed after step {f.step_id}: {f.message}\n\nThe engine "
                            "is paused; press Run to try again, or restart it.", f.traceback)
                    for f in self.runner.take_failures()]
        take_sinks = getattr(self.runner, "take_sink_failures", None)
        if take_sinks is not None:  # a recorder or publisher that failed was detached; decoding goes on
            problems += [Problem("Output stopped", str(f)) for f in take_sinks()]
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

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.runner.stop(timeout=1.0)
