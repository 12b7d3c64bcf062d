"""``--check-prompt FILE``: a prompt in a file, checked against every watched pool, again whenever the file changes.

A script asks "would this prompt hit?" by writing the file (text, tokenised as the source's server would, or a JSON
list of token ids; best written whole: to a temporary name, then renamed) and reads the answer from the ``--json``
lines' ``prompt_check`` (or the window's prompt check). A file that does not exist yet is waited for, not an error;
one that cannot be read or tokenised is an error the answer says, and the watch goes on. The pool changes under a
prompt as traffic flows, so each answer is checked again about once a second (``checked_at`` says when).

Qt-free: the headless run and the window drive the same watch (:meth:`PromptWatch.tick`, never blocking: a check
is a Future, answered on the engine thread for the local engine).
"""
from __future__ import annotations

import os
import stat
import time
from concurrent.futures import Future
from dataclasses import dataclass

from kvstream.prompt_check import PromptCheck, prompt_ids_from_text

MAX_FILE_BYTES = 16 << 20  # a prompt file larger than this is refused (read whole, and tokenised)
RECHECK_S = 1.0  # how often an unchanged prompt is checked again (the pool moves on)


@dataclass(frozen=True)
class WatchState:
    """What the watch can say about one feed now."""

    status: str  # "waiting" (no file yet), "pending" (checked, no answer yet), "checked", "error"
    checks: tuple[PromptCheck, ...] = ()  # the newest answer, one per pool of the feed ("checked")
    error: str = ""  # what went wrong ("error"), or why it waits ("waiting")

    def as_json(self, path: str, pool: int = 0) -> dict:
        """The ``prompt_check`` object of a --json line for pool ``pool`` of the feed."""
        if self.status == "checked" and pool < len(self.checks):
            return {"file": path, "status": "checked", "error": None, **self.checks[pool].as_json()}
        return {"file": path, "status": self.status, "error": self.error or None, "checked_at": None,
                "num_tokens": None, "block_size": None, "cached_tokens": None, "blocks": None}


class PromptWatch:
    """Watches ``path`` and checks its prompt against each feed (see the module docstring)."""

    def __init__(self, path: str, feeds, recheck_s: float = RECHECK_S):
        self.path = os.fspath(path)
        self.feeds = list(feeds)
        self.recheck_s = recheck_s
        self._signature = None  # (mtime_ns, size, inode) of the file as last read
        self._text: str | None = None  # its content as last read
        self._file_error = ""  # why the file could not be read (empty: it was)
        self._ids: dict[int, list[int] | str] = {}  # feed index -> its token ids, or why it has none
        self._pending: dict[int, tuple[Future, float]] = {}  # feed index -> check in flight, when asked
        self._asked_at: dict[int, float] = {}  # feed index -> when the last check was asked
        self.states: dict[int, WatchState] = {i: WatchState("waiting", error="no such file yet")
                                              for i in range(len(self.feeds))}
        self.version = 0  # bumped whenever a state changes (the window redraws, headless text mode prints)

    @property
    def text(self) -> str | None:
        """The file's content as last read (None: not read, absent or unreadable)."""
        return self._text

    def state_of(self, feed) -> WatchState:
        return self.states[self.feeds.index(feed)]

    # ---- the file ------------------------------------------------------------------------------------------------
    def _read(self) -> bool:
        """Read the file if it changed; returns whether what the feeds should check changed."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._signature != "absent":
                self._signature, self._text, self._ids = "absent", None, {}
                self._file_error = ""
                return True
            return False
        except OSError as exc:
            return self._fail(f"cannot read {self.path}: {exc.strerror or exc}")
        if not stat.S_ISREG(st.st_mode):
            return self._fail(f"{self.path} is not a regular file (a FIFO or a device is not read)")
        if st.st_size > MAX_FILE_BYTES:
            return self._fail(f"{self.path} holds {st.st_size:,} bytes; a prompt file may hold "
                              f"{MAX_FILE_BYTES >> 20} MiB at most")
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
            text = data.decode("utf-8")
        except FileNotFoundError:  # gone between stat and open
            self._signature = None
            return False
        except (OSError, UnicodeDecodeError) as exc:
            return self._fail(f"cannot read {self.path}: {exc}")
        self._text, self._file_error, self._ids = text, "", {}
        return True

    def _fail(self, message: str) -> bool:
        changed = message != self._file_error
        self._signature, self._text, self._ids, self._file_error = None, None, {}, message
        return changed

    def _ids_for(self, i: int, feed) -> list[int] | str:
        """The file's prompt as ``feed``'s token ids (cached until the file changes), or why there are none."""
        if i not in self._ids:
            text = self._text or ""
            try:
                ids = prompt_ids_from_text(text)
                if ids is None:
                    if not text.strip():
                        raise ValueError("the prompt file is empty")
                    ids = feed.tokenize_prompt(text)
                self._ids[i] = list(ids)
            except (ValueError, TypeError) as exc:
                self._ids[i] = f"{self.path}: {exc}"
        return self._ids[i]

    # ---- checking ------------------------------------------------------------------------------------------------
    def tick(self, now: float | None = None, force: bool = False) -> bool:
        """Read the file if it changed, collect answers, ask again where due (``force``: now). Returns whether any
        state changed."""
        now = time.monotonic() if now is None else now
        changed = self._read()
        before = dict(self.states)
        for i, feed in enumerate(self.feeds):
            pending = self._pending.get(i)
            if pending is not None and pending[0].done():
                del self._pending[i]
                if not changed:  # an answer for a file that has changed since is dropped
                    self._answered(i, pending[0])
            if self._signature == "absent":
                self.states[i] = WatchState("waiting", error="no such file yet")
                continue
            if self._file_error:
                self.states[i] = WatchState("error", error=self._file_error)
                continue
            if self._text is None:
                continue
            ids = self._ids_for(i, feed)
            if isinstance(ids, str):
                self.states[i] = WatchState("error", error=ids)
                continue
            due = changed or force or now - self._asked_at.get(i, -1e18) >= self.recheck_s
            if due and i not in self._pending:
                self._pending[i] = (feed.check_prompt(ids), now)
                self._asked_at[i] = now
                if self.states[i].status != "checked" or changed:
                    self.states[i] = WatchState("pending")
        moved = self.states != before
        if moved:
            self.version += 1
        return moved

    def _answered(self, i: int, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self.states[i] = WatchState("error", error=f"{type(error).__name__}: {error}"
                                        if not isinstance(error, ValueError) else str(error))
        else:
            self.states[i] = WatchState("checked", tuple(future.result()))

    def settle(self, timeout: float = 10.0) -> None:
        """Ask once more and wait (up to ``timeout`` seconds) for the answers: the end of a headless run."""
        self.tick(force=True)
        deadline = time.monotonic() + timeout
        for future, _ in list(self._pending.values()):
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001  (a timeout: the state stays pending and says so)
                pass
        self.tick()

    def json_for(self, feed, pool: int = 0) -> dict:
        return self.state_of(feed).as_json(self.path, pool)
