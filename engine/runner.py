"""The engine thread: runs ``Engine.step()`` in a loop, takes commands from a queue, publishes snapshots.

The GUI (or any other client) never touches the engine directly. It sends commands with :meth:`EngineRunner.submit`
and gets a :class:`concurrent.futures.Future` back; it reads :attr:`EngineRunner.latest`, the newest immutable
:class:`PoolSnapshot`, whenever it likes. No lock is shared with the reader: publishing is one reference swap.

A snapshot is published only when the engine's ``version`` changed (a step, or a command that changed something;
read-only queries publish nothing). Each published snapshot goes to every *observer* on the engine thread (the
GUI's history, a recorder, a network publisher) as one :class:`~kvstream.views.PoolUpdate`: the snapshot, the block
events since the previous one, and the engine's record of what changed, together. Anything that goes wrong
in the loop (a step, a command's side effects, an observer, publishing) reaches :meth:`take_failures`; the thread
never dies silently, and every future resolves, including those still queued when the runner stops.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstream.events import BlockEvent
from kvstream.rules import Rate

from kvstream.views import PoolSnapshot, PoolUpdate

from .engine import Engine
from .heap import HeapTrimmer

Observer = Callable[[PoolUpdate], None]


@dataclass(frozen=True)
class Command:
    """One request for the engine thread: call ``Engine.<name>(*args, **kwargs)`` between two steps."""

    name: str  # an Engine method, or one of the runner's own (see _RUNNER_COMMANDS)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future, compare=False)


@dataclass(frozen=True)
class EngineFailure:
    """Something that went wrong on the engine thread; after a failed step the runner pauses itself."""

    step_id: int  # last step id published before the failure
    message: str  # one line for the user
    traceback: str  # formatted traceback, for a "details" box
    fatal: bool = False  # the engine thread has stopped (the window should say so)


class RunnerStopped(RuntimeError):
    """A command that never ran because the runner was stopped."""


_RUNNER_COMMANDS = {"pause", "resume", "step_once", "set_speed", "add_observer", "remove_observer"}
_ENGINE_COMMANDS = {
    "add_conversation", "add_samples", "fork_conversation", "end_conversation", "continue_conversation",
    "relocate_blocks", "relocate_and_verify", "reset_prefix_cache", "conversation", "inspect_block",
    "probe_attention", "memory_stats", "tokenize", "detokenize", "check_prompt", "close",
}


class EngineRunner:
    """Owns an :class:`Engine` and the thread that steps it."""

    def __init__(self, engine: Engine, *, max_steps_per_second: float | None = None, start_paused: bool = False,
                 observers: list[Observer] | None = None, driver=None):
        """``driver``: a source of conversations that must act on the engine thread between steps (a trace
        replay, engine.traffic.replay.TraceReplay): its ``feed()`` is called before each step while running."""
        self.engine = engine
        self.driver = driver
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stop = threading.Event()
        self._stopped = False  # set once the queue has been drained at the end: later submits fail at once
        self._lock = threading.Lock()  # orders submit() against that final drain
        self._paused = start_paused
        self._step_requests: deque[Future] = deque()  # step_once futures, each resolved after the step it asked for
        self._max_steps_per_second = max_steps_per_second
        self._failures: queue.Queue[EngineFailure] = queue.Queue()
        self._steps = Rate(window=2.0)
        self.heap = HeapTrimmer()  # gives freed heap back every few seconds, between steps
        self._observers: list[Observer] = list(observers or [])
        self.published = 0  # updates handed to the observers so far: the next one's number (PoolUpdate.seq)
        self.latest: PoolSnapshot = engine.snapshot()  # newest published snapshot (replaced, never mutated)
        self._published_version = self.latest.version
        self._notify(self.latest, engine.take_events())  # the state before the first step (observers' first update)
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # ---- client side (any thread) -------------------------------------------------------------------------
    def start(self) -> "EngineRunner":
        self._thread.start()
        return self

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Future:
        """Queue ``Engine.<name>(*args, **kwargs)``; the future holds its result or its EngineError."""
        if name not in _ENGINE_COMMANDS and name not in _RUNNER_COMMANDS:
            raise ValueError(f"unknown engine command {name!r}")
        command = Command(name, args, kwargs)
        with self._lock:  # against _fail_pending: a command is either queued before it drains, or refused here
            if not self._stopped and not self._stop.is_set():
                self._commands.put(command)
                return command.future
        command.future.set_exception(RunnerStopped("the engine has stopped; the command was not run"))
        return command.future

    def pause(self) -> Future:
        return self.submit("pause")

    def resume(self) -> Future:
        return self.submit("resume")

    def step_once(self) -> Future:
        """Run one step (useful while paused), under the speed limit like any other. The future resolves once that
        step has run and its snapshot is published (True), or at once with False when there is nothing to do: a
        request never waits for work that comes later. While running, the next step answers it."""
        return self.submit("step_once")

    def set_speed(self, max_steps_per_second: float | None) -> Future:
        """Limit the engine to this many steps per second (None: as fast as it goes)."""
        return self.submit("set_speed", max_steps_per_second)

    def add_observer(self, observer: Observer) -> Future:
        """Call ``observer(update)`` (a :class:`PoolUpdate`) on the engine thread for every published snapshot from
        now on."""
        return self.submit("add_observer", observer)

    def remove_observer(self, observer: Observer) -> Future:
        return self.submit("remove_observer", observer)

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
        return self._steps.per_second()

    def take_failures(self) -> list[EngineFailure]:
        """Failures since the last call (the GUI shows each once)."""
        out = []
        while True:
            try:
                out.append(self._failures.get_nowait())
            except queue.Empty:
                return out

    def stop(self, timeout: float = 1.0) -> bool:
        """Stop the thread; returns True if it ended within ``timeout`` seconds. Commands still queued fail with
        :class:`RunnerStopped`; later submits fail at once. Once the thread has ended, the engine's sockets (KV-event
        publishing) are closed, so a new engine can bind the same endpoint."""
        self._stop.set()
        self._commands.put(Command("pause"))  # wake a thread blocked on the queue
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._fail_pending()
        self.engine.close()
        return True

    # ---- engine thread ------------------------------------------------------------------------------------
    def _fail(self, message: str, fatal: bool = False) -> None:
        self._failures.put(EngineFailure(self.latest.step_id, message, traceback.format_exc(), fatal))

    def _answer_steps(self, exc: BaseException | None = None) -> None:
        """The step just run answers the oldest step_once request (its error too, when it failed)."""
        if self._step_requests:
            future = self._step_requests.popleft()
            if exc is None:
                future.set_result(True)
            else:
                future.set_exception(exc)

    def _fail_pending(self) -> None:
        with self._lock:
            self._stopped = True
        while self._step_requests:
            self._step_requests.popleft().set_exception(RunnerStopped("the engine stopped before this step ran"))
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if not command.future.done():
                command.future.set_exception(RunnerStopped("the engine stopped before this command ran"))

    def _run_command(self, command: Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            name = command.name
            if name == "pause":
                self._paused, result = True, None
            elif name == "resume":
                self._paused, result = False, None
            elif name == "step_once":
                if self.engine.has_work():
                    self._step_requests.append(command.future)  # resolved after its step (_answer_steps)
                    self._publish()
                    return
                result = False
            elif name == "set_speed":
                value = command.args[0] if command.args else None
                self._max_steps_per_second = float(value) if value else None
                result = None
            elif name == "add_observer":
                self._observers.append(command.args[0])
                result = None
            elif name == "remove_observer":
                if command.args[0] in self._observers:
                    self._observers.remove(command.args[0])
                result = None
            else:
                result = getattr(self.engine, name)(*command.args, **command.kwargs)
        except Exception as exc:  # the client decides what to show; the thread goes on
            command.future.set_exception(exc)
        else:
            command.future.set_result(result)
        self._publish()

    def _publish(self) -> None:
        """Publish a snapshot if the engine changed since the last one, and hand it to the observers."""
        for message in self.engine.take_background_errors():
            self._failures.put(EngineFailure(self.latest.step_id, message, ""))
        if self.engine.version == self._published_version:
            return
        snapshot = self.engine.snapshot()
        self._published_version = snapshot.version
        self.latest = snapshot
        self._notify(snapshot, self.engine.take_events())

    def _notify(self, snapshot: PoolSnapshot, events: list[BlockEvent]) -> None:
        # one unit for every observer, numbered once for all (the window's frames and its History's are these numbers)
        update = PoolUpdate(snapshot, tuple(events), self.engine.change_record(snapshot), seq=self.published)
        self.published += 1
        for observer in list(self._observers):
            try:
                observer(update)
            except Exception as exc:  # a broken recorder or socket must not stop the engine
                self._observers.remove(observer)
                self._fail(f"{getattr(observer, '__qualname__', type(observer).__name__)} stopped receiving "
                           f"updates: {type(exc).__name__}: {exc}")

    def _drive(self) -> None:
        """Let the driver add what is due; a driver that fails is detached (said once), the engine goes on."""
        try:
            self.driver.feed()
        except Exception as exc:
            self.driver = None
            self._fail(f"the traffic source stopped: {type(exc).__name__}: {exc}")
        self._publish()

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: say so, and let every future resolve
            self._fail(f"the engine thread stopped: {type(exc).__name__}: {exc}", fatal=True)
        finally:
            self._stop.set()
            self._fail_pending()

    def _loop(self) -> None:
        last_step = 0.0
        while not self._stop.is_set():
            if self.driver is not None and not self._paused:
                self._drive()
            # Drain every queued command first so the user's actions take effect before the next step.
            has_work = self.engine.has_work()
            while self._step_requests and not has_work:  # the work went (ended) before the step: nothing to do
                self._step_requests.popleft().set_result(False)
            want_step = (not self._paused or bool(self._step_requests)) and has_work
            try:
                command = self._commands.get(timeout=0.0 if want_step else 0.05)
            except queue.Empty:
                command = None
            if command is not None:
                self._run_command(command)
                continue
            if not want_step or self._stop.is_set():
                continue
            if self._max_steps_per_second:  # a single step too: the limit is what the user set
                wait = last_step + 1.0 / self._max_steps_per_second - time.perf_counter()
                if wait > 0:
                    try:  # sleep, but wake for a command
                        command = self._commands.get(timeout=min(wait, 0.05))
                        self._run_command(command)
                    except queue.Empty:
                        pass
                    continue
            last_step = time.perf_counter()
            failure = None
            try:
                self.engine.step()
            except Exception as exc:  # the step rolled back; decode stops until resumed
                self._paused = True
                self._fail(f"{type(exc).__name__}: {exc}")
                failure = exc
            self._steps.tick()
            self._publish()
            self._answer_steps(failure)
            self.heap.maybe_trim()  # a long run's fragmented heap goes back to the system (engine/heap.py)
