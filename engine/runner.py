"""The engine thread: runs ``Engine.step()`` in a loop, takes commands from a queue, publishes snapshots.

The GUI (or any other client) never touches the engine directly. It sends commands with :meth:`EngineRunner.submit`
and gets a :class:`concurrent.futures.Future` back; it reads :attr:`EngineRunner.latest`, the newest immutable
:class:`PoolSnapshot`, whenever it likes. No lock is shared with the reader: publishing is one reference swap.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .snapshot import PoolSnapshot


@dataclass(frozen=True)
class Command:
    """One request for the engine thread: call ``Engine.<name>(*args, **kwargs)`` between two steps."""

    name: str  # an Engine method, or one of the runner's own: "pause", "resume", "step_once", "set_speed"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future, compare=False)


@dataclass(frozen=True)
class EngineFailure:
    """An exception raised inside ``Engine.step()``; the runner pauses itself when one happens."""

    step_id: int  # last step id published before the failure
    message: str  # str(exception)
    traceback: str  # formatted traceback, for a "details" box


_RUNNER_COMMANDS = {"pause", "resume", "step_once", "set_speed"}
_ENGINE_COMMANDS = {
    "add_conversation", "fork_conversation", "end_conversation", "continue_conversation", "relocate_blocks",
    "relocate_and_verify", "conversation", "inspect_block", "probe_attention", "memory_stats", "tokenize",
}


class EngineRunner:
    """Owns an :class:`Engine` and the thread that steps it."""

    def __init__(self, engine: Engine, *, max_steps_per_second: float | None = None, start_paused: bool = False):
        self.engine = engine
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stop = threading.Event()
        self._paused = start_paused
        self._single_steps = 0
        self._max_steps_per_second = max_steps_per_second
        self._failures: queue.Queue[EngineFailure] = queue.Queue()
        self._step_times: list[float] = []
        self.latest: PoolSnapshot = engine.snapshot()  # newest published snapshot (replaced, never mutated)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ---- client side (any thread) -------------------------------------------------------------------------
    def start(self) -> "EngineRunner":
        self._thread.start()
        return self

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Future:
        """Queue ``Engine.<name>(*args, **kwargs)``; the future holds its result or its EngineError."""
        if name not in _ENGINE_COMMANDS and name not in _RUNNER_COMMANDS:
            raise ValueError(f"unknown engine command {name!r}")
        command = Command(name, args, kwargs)
        self._commands.put(command)
        return command.future

    def pause(self) -> Future:
        return self.submit("pause")

    def resume(self) -> Future:
        return self.submit("resume")

    def step_once(self) -> Future:
        """Run exactly one step (useful while paused)."""
        return self.submit("step_once")

    def set_speed(self, max_steps_per_second: float | None) -> Future:
        """Limit the engine to this many steps per second (None: as fast as it goes)."""
        return self.submit("set_speed", max_steps_per_second)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def max_steps_per_second(self) -> float | None:
        return self._max_steps_per_second

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def steps_per_second(self) -> float:
        """Engine steps per second over the last two seconds."""
        times = self._step_times
        now = time.perf_counter()
        recent = [t for t in list(times) if now - t < 2.0]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0], 1e-6)
        return (len(recent) - 1) / span

    def take_failures(self) -> list[EngineFailure]:
        """Failures since the last call (the GUI shows each once)."""
        out = []
        while True:
            try:
                out.append(self._failures.get_nowait())
            except queue.Empty:
                return out

    def stop(self, timeout: float = 1.0) -> bool:
        """Stop the thread; returns True if it ended within ``timeout`` seconds."""
        self._stop.set()
        self._commands.put(Command("pause"))  # wake a thread blocked on the queue
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- engine thread ------------------------------------------------------------------------------------
    def _run_command(self, command: Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            if command.name == "pause":
                self._paused = True
                result = None
            elif command.name == "resume":
                self._paused = False
                result = None
            elif command.name == "step_once":
                self._single_steps += 1
                result = None
            elif command.name == "set_speed":
                value = command.args[0] if command.args else None
                self._max_steps_per_second = float(value) if value else None
                result = None
            else:
                result = getattr(self.engine, command.name)(*command.args, **command.kwargs)
        except BaseException as exc:  # the client decides what to show; the thread goes on
            command.future.set_exception(exc)
        else:
            command.future.set_result(result)
        self._publish()

    def _publish(self) -> None:
        self.latest = self.engine.snapshot()

    def _loop(self) -> None:
        last_step = 0.0
        while not self._stop.is_set():
            # Drain every queued command first so the user's actions take effect before the next step.
            want_step = (not self._paused or self._single_steps > 0) and self.engine.has_work()
            try:
                command = self._commands.get(timeout=0.0 if want_step else 0.05)
            except queue.Empty:
                command = None
            if command is not None:
                self._run_command(command)
                continue
            if not want_step or self._stop.is_set():
                continue
            if self._max_steps_per_second and self._single_steps == 0:
                wait = last_step + 1.0 / self._max_steps_per_second - time.perf_counter()
                if wait > 0:
                    try:  # sleep, but wake for a command
                        command = self._commands.get(timeout=min(wait, 0.05))
                        self._run_command(command)
                    except queue.Empty:
                        pass
                    continue
            if self._single_steps > 0:
                self._single_steps -= 1
            last_step = time.perf_counter()
            try:
                self.engine.step()
            except Exception as exc:  # surfaces in the GUI; decode stops until resumed
                self._paused = True
                self._failures.put(EngineFailure(self.latest.step_id, f"{type(exc).__name__}: {exc}",
                                                 traceback.format_exc()))
            self._step_times.append(time.perf_counter())
            if len(self._step_times) > 256:
                del self._step_times[:128]
            self._publish()
