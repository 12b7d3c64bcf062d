"""Read-only feeds of the project's pool stream: a recording on disk (``--open``) and another process's stream
(``--attach``: a ``--publish`` of this app, or a vLLM server with the plugin).

Both are a kvstream History the timeline scrubs, and views rebuilt from it array for array; each poll hands out the
newest view with the events of the frames the History gained up to it (:meth:`Feed.poll`); neither takes commands
nor has K/V values, and each says why in words the window shows on its disabled controls. Qt-free, so headless
runs (``--open FILE --headless --json``) use the same feeds as the window.
"""
from __future__ import annotations

import gc
import os
import time
from concurrent.futures import Future

from kvstream.tokens import ByteTokens, piece_text

from .feed import Capabilities, Feed, Problem, done_future

RECORDING_READ_ONLY = "a recording replays what was recorded; it takes no commands"
ATTACH_READ_ONLY = "an attached pool belongs to another process; commands are not sent over the wire"
BUILTIN_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "resources", "builtin")  # the built-in model's directory (no tokenizer.json in it)


def _tokenizer_text(tokenizer):
    """token id -> printable text with a ``tokenizers`` tokenizer, or the engine's built-in byte tokenizer (None
    without one)."""
    if tokenizer is None:
        return None
    return lambda token_id: piece_text(tokenizer, token_id)


class NamedTokenText:
    """Token text for a stream that names its own tokenizer (the header's ``tokenizer``, PoolSnapshot.tokenizer):
    the name is read from each newest view, and the tokenizer it names is loaded once, where this machine has it
    ("builtin"; a known model already fetched; a checkpoint directory with tokenizer.json). Without one, ids
    stay ids: the project's own engine watched through ``--attach`` showed ``<81>`` where its byte tokenizer is
    known to every copy of this program."""

    def __init__(self, given=None):
        self._given = _tokenizer_text(given)  # token id -> text of a tokenizer given on the command line (--tokenizer),
        # which wins over the one the stream names; None: none given
        self.name = ""  # the tokenizer name of the stream, as last seen
        self.tokenizer = None  # the tokenizer that name stands for here, or None
        self._text = None  # token id -> text for that name, or None
        self._tried: set[str] = set()  # names already resolved (or found missing): never tried again per frame

    def of(self, token_id: int, snapshot) -> str | None:
        """``token_id``'s text: by the tokenizer given, else by the one ``snapshot`` (the stream's newest) names."""
        if self._given is not None:
            return self._given(token_id)
        self.follow(snapshot)
        return self(token_id)

    def follow(self, snapshot) -> None:
        name = str(getattr(snapshot, "tokenizer", "") or "") if snapshot is not None else ""
        if name == self.name and (name in self._tried or not name):
            return
        self.name = name
        self._text = self.tokenizer = None
        if name:
            self._tried.add(name)
            self.tokenizer = named_tokenizer(name)
            self._text = _tokenizer_text(self.tokenizer)

    def __call__(self, token_id: int) -> str | None:
        return self._text(token_id) if self._text is not None else None


def named_tokenizer(name: str):
    """The tokenizer a stream's ``tokenizer`` name stands for on this machine, or None (not here, or unreadable):
    "builtin" (the byte tokenizer), a checkpoint directory holding tokenizer.json, or a known model ("smollm2")
    that has been fetched here (its converted directory holds the tokenizer; nothing is downloaded for this). A
    .gguf path is only named: converting it is minutes of work, not a viewer's to start."""
    try:
        if is_builtin_tokenizer(name) or os.path.isdir(name):
            return load_tokenizer(name)
        if name.lower().endswith(".gguf"):
            return None
        from engine import fetch_model, fetched_model
        if fetched_model(name):  # a known model, converted on this machine: fetch_model only finds its directory
            return load_tokenizer(fetch_model(name, progress=lambda _message: None))
    except Exception:  # noqa: BLE001  (a name that leads nowhere readable: ids stay ids)
        return None
    return None


class _PromptChecks:
    """Prompt checks of a pool-stream feed: against its newest frame, with the content its History's events
    stored (explorer.feeds.prompt_book)."""

    _book = None
    _tokenizer = None  # --tokenizer's, where given

    def check_prompt(self, token_ids) -> Future:
        from .prompt_book import PromptBook
        snapshot = self.latest()
        if snapshot is None:
            return done_future(error=ValueError("the source has not delivered a pool yet"))
        if self._book is None:
            self._book = PromptBook()
        try:
            return done_future([self._book.check(token_ids, snapshot, self.history)])
        except ValueError as exc:
            return done_future(error=exc)

    def prompt_tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        self._text.follow(self.latest())
        return self._text.tokenizer


class RecordingFeed(_PromptChecks, Feed):
    """A recording opened from disk: every frame kept (payloads read on demand), the newest frame as "live"."""

    kind = "recording"
    capabilities = Capabilities.watched(RECORDING_READ_ONLY, "a recording keeps no K/V values", live=False)

    def __init__(self, history, path: str, tokenizer=None):
        self._history = history  # the read-only History open_recording built
        self.path = path  # the file
        self._text = NamedTokenText(tokenizer)  # --tokenizer's, else the one the recording names
        self._tokenizer = tokenizer  # --tokenizer's, for prompt checks (None: the one the stream names)
        self._latest = history.latest()
        info = getattr(history, "recording", None)
        self._problems = [Problem("Recording cut off", info.note)] if info is not None and info.truncated else []
        self.complete = True  # everything there is has been read (headless stops at once)
        self._closed = False
        self._frozen = False  # started() froze the heap: close() gives it back

    @classmethod
    def open(cls, path: str, tokenizer=None) -> "RecordingFeed":
        """Open ``path``; a ValueError (RecordingError) with a message for the user if it is not a recording."""
        from kvstream.recording import open_recording
        return cls(open_recording(path), os.fspath(path), tokenizer)

    def started(self) -> None:
        """A read-only recording's frames and events live until it is closed: move them out of the collector's
        generations, so that a full collection during scrubbing no longer walks them (docs/poolstream.md). Only
        once the feed before it is closed and let go of: a freeze then would keep that feed's cycles (an old
        Engine, its KV tensor) resident until this recording closes."""
        if not self._closed and not self._frozen:
            gc.collect()
            gc.freeze()
            self._frozen = True

    @property
    def title(self) -> str:
        h = self._history
        first, last = h.step_of(h.first_seq), h.step_of(h.last_seq)
        return f"recording: {os.path.basename(self.path)} ({len(h):,} frames, steps {first:,}-{last:,})"

    @property
    def history(self):
        return self._history

    def latest(self):
        return self._latest

    def take_problems(self) -> list[Problem]:
        out, self._problems = self._problems, []
        return out

    def token_text(self, token_id: int) -> str | None:
        return self._text.of(token_id, self._latest)

    def status_text(self) -> str:
        return "■ recording (read-only)"

    def close(self) -> None:
        """Give the frozen objects back to the collector, so a closed recording's cycles can be freed."""
        if not self._closed:
            self._closed = True
            if self._frozen:
                gc.unfreeze()


class AttachFeed(_PromptChecks, Feed):
    """Another process's pool stream, read by a kvstream PoolStreamSubscriber thread into a History."""

    kind = "stream"
    capabilities = Capabilities.watched(ATTACH_READ_ONLY, "K/V values stay in the process that owns the pool")

    def __init__(self, subscriber, tokenizer=None):
        self.subscriber = subscriber  # owns the socket and the thread
        self.endpoint = subscriber.endpoint
        self._text = NamedTokenText(tokenizer)  # --tokenizer's, else the one the stream names
        self._tokenizer = tokenizer  # --tokenizer's, for prompt checks (None: the one the stream names)
        self._latest = None
        self._latest_seq: int | None = None
        self._last_state = ""
        self._problems: list[Problem] = []
        self._reported_malformed = 0  # malformed count already reported as a problem
        self._reported_at = -1e9  # monotonic time of that report

    @classmethod
    def connect(cls, endpoint: str, tokenizer=None, history_bytes: int | None = None) -> "AttachFeed":
        from kvstream.history import History
        from kvstream.poolstream.subscriber import PoolStreamSubscriber
        history = History() if history_bytes is None else History(budget_bytes=history_bytes)
        return cls(PoolStreamSubscriber(endpoint, history), tokenizer)

    @property
    def title(self) -> str:
        return f"attached: {self.endpoint}"

    @property
    def history(self):
        return self.subscriber.history

    def latest(self):
        status = self.subscriber.status
        if status.last_seq is not None and status.last_seq != self._latest_seq:
            snapshot = self.subscriber.latest()  # rebuilt only when a new frame came in
            if snapshot is not None:
                self._latest, self._latest_seq = snapshot, status.last_seq
        return self._latest

    def frame_seq(self, view):
        """The frame the subscriber rebuilt ``view`` from: its events are those up to it (the History may hold a
        newer frame already, whose events go out with its view at a later poll)."""
        return self._latest_seq

    def take_problems(self) -> list[Problem]:
        status = self.subscriber.status
        if status.state != self._last_state:
            if status.state == "silent" and self._last_state == "live":
                self._problems.append(Problem("Attached pool silent", f"{self.endpoint}: {status.text}. The view "
                                              "keeps the last state; it resumes by itself when frames come again."))
            self._last_state = status.state
        if status.malformed > self._reported_malformed and time.monotonic() - self._reported_at >= 10.0:
            # said at most every 10 s: the status line keeps the count
            self._reported_at = time.monotonic()
            self._problems.append(Problem("Attached pool: messages refused",
                                          f"{self.endpoint}: {status.malformed - self._reported_malformed} "
                                          f"message(s) refused; the last because {status.last_error}. The view "
                                          "never shows a refused frame; it goes on with the next good one."))
            self._reported_malformed = status.malformed
        out, self._problems = self._problems, []
        return out

    def token_text(self, token_id: int) -> str | None:
        return self._text.of(token_id, self._latest)

    def status_text(self) -> str:
        return f"↔ {self.subscriber.status.text}"

    def summary(self, final: bool = False) -> dict:
        data = super().summary(final)
        status = self.subscriber.status
        data["endpoint"] = self.endpoint
        data["stream"] = status.state
        data["malformed"] = status.malformed  # messages refused (malformed, impossible pools, frames from the future)
        data["lost"] = status.lost  # frames of the stream never applied
        data["last_error"] = status.last_error
        return data

    def close(self) -> None:
        self.subscriber.close()


def load_tokenizer(directory):
    """The ``tokenizers`` tokenizer of ``directory``/tokenizer.json (``--tokenizer DIR``; a tokenizer.json itself
    works too); a ValueError that says which file could not be read, and why, instead of the library's traceback.

    The built-in model's byte tokenizer has no tokenizer.json: ``--tokenizer builtin`` and ``--tokenizer
    resources/builtin`` (its directory) name it."""
    path = os.fspath(directory)
    if is_builtin_tokenizer(path):
        return ByteTokens()
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"cannot read tokenizer {file}: no tokenizer.json in {path} (--tokenizer wants a "
                         "directory holding one)")
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"cannot read tokenizer {file}: not a tokenizer file the tokenizers library can read "
                         f"({exc})") from None


def is_builtin_tokenizer(path: str) -> bool:
    """Whether ``--tokenizer PATH`` names the built-in byte tokenizer: "builtin", or the built-in model's directory."""
    if path == "builtin":
        return True
    try:
        return os.path.isdir(path) and os.path.samefile(path, BUILTIN_MODEL_DIR)
    except OSError:
        return False


def open_feeds(watch) -> list[Feed]:
    """The feeds of a :class:`~explorer.feeds.sources.WatchSpec` (``--open`` / ``--attach`` /
    ``--attach-kv-events``); ValueError/OSError with a clear message."""
    tokenizer = load_tokenizer(watch.tokenizer) if watch.tokenizer else None
    feeds: list[Feed] = []
    try:
        if watch.open:
            feeds.append(RecordingFeed.open(watch.open, tokenizer))
        for endpoint in watch.attach:
            feeds.append(AttachFeed.connect(endpoint, tokenizer))
        if watch.attach_kv_events:
            from .kv_event_feed import KVEventFeed
            feeds.append(KVEventFeed.connect(watch.attach_kv_events, tokenizer,
                                             metrics_url=watch.attach_metrics))
    except Exception:
        for feed in feeds:
            feed.close()
        raise
    return feeds
