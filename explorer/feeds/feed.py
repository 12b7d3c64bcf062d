"""Feeds: the concrete sources of pool views (local engine, pool stream, recording, KV events), without Qt.

A feed says what it can do (:class:`Capabilities`), hands out its newest immutable view (:meth:`Feed.latest`) and,
once per poll, its new frame with the events that led to it (:meth:`Feed.poll`, a
:class:`~explorer.feeds.frames.FeedFrame`), reports problems once, and takes commands when it can. The window drives
feeds through :class:`explorer.model.pool_source.PoolSource`; headless runs (``main.py --headless``) poll the very same
feeds, so a recording or an attached stream reads the same in both.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvstream.views import PoolSnapshot

from .frames import FeedFrame, HistoryReader
from .snapshot_block import block_info_from_snapshot


@dataclass(frozen=True)
class Capabilities:
    """What a source can do; panels enable or explain their controls from this alone."""

    can_command: bool  # takes commands that change the pool (add, fork, end, relocate, pause, step)
    has_kv_values: bool  # the inspector can show a block's K/V values
    has_history: bool  # keeps earlier frames that the timeline can scrub
    has_physical_pool: bool  # knows physical block ids, so the grid can be drawn (a KV-event stream does not)
    read_only_reason: str = ""  # why commands are unavailable, in words for a tooltip ("" when they are)
    kv_values_reason: str = ""  # why K/V values are unavailable ("" when they are available)
    is_live: bool = True  # new frames arrive while it runs (a recording's are all in its history from the start)
    can_record: bool = False  # File > Record can save its frames as they come (the local engine)

    @classmethod
    def watched(cls, why: str, no_kv_values: str, *, history: bool = True, pool: bool = True,
                live: bool = True) -> "Capabilities":
        """A source that is only watched (a recording, another process's pool, a KV-event stream): no commands,
        for the reason ``why``, and no K/V values, for ``no_kv_values``; whether it keeps ``history``, knows the
        physical ``pool``, and is ``live``."""
        return cls(False, False, history, pool, why, no_kv_values, live)


@dataclass(frozen=True)
class Problem:
    """Something a feed wants the user to see once (an engine failure, a lost connection, a corrupt record)."""

    title: str  # message box title
    text: str  # what happened and what still works
    details: str = ""  # traceback or raw message for a "details" section


class Feed:
    """One concrete source of pool views. Subclasses fill in what they support; the defaults describe a feed that
    can do nothing, so a new kind only overrides what it really has.

    Everything here is called on the GUI thread; a feed that reads from another thread hands over immutable views.
    """

    kind = "none"  # short name: "engine", "stream", "recording", "kv-events"
    capabilities = Capabilities(False, False, False, False, "nothing is connected", "nothing is connected")
    _polled_view: PoolSnapshot | None = None  # the view the last poll handed out (default poll)
    _frame_reader: HistoryReader | None = None  # what of the history the default poll has handed out

    @property
    def title(self) -> str:
        """A one-line header naming the source ("local engine: builtin, 64 blocks × 4 slots, cpu")."""
        return self.kind

    @property
    def history(self):
        """The kvstream History of its frames, or None."""
        return None

    def latest(self) -> PoolSnapshot | None:
        """The newest view (cheap: a reference, never a copy)."""
        return None

    def poll(self) -> FeedFrame | None:
        """The newest frame since the last poll with the events of every frame up to it, as one unit (None: nothing
        new). The window shows the snapshot with those events together, so the grid, the event log, the timeline's
        marks and the inspector's relocation-following agree. Default: the newest view (:meth:`latest`) with the
        events its history (the feed's own store of received frames) gained up to that view's frame."""
        view = self.latest()
        if view is None:
            return None
        if self._frame_reader is None:
            self._frame_reader = HistoryReader()
        first = self._polled_view is None
        seq = self.frame_seq(view)
        pairs, restarted = self._frame_reader.read(self.history, seq)
        if view is self._polled_view and not pairs and not restarted:
            return None
        self._polled_view = view
        return FeedFrame(view, seq, pairs, restarted or first)

    def frame_seq(self, view: PoolSnapshot) -> int | None:
        """The frame of the history that ``view`` is (None: no history): its events are those up to that frame."""
        history = self.history
        return history.last_seq if history is not None and len(history) else None

    def take_problems(self) -> list[Problem]:
        """Problems since the last call, each reported once."""
        return []

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Future:
        """Run a command; the future holds its result or the error that refused it."""
        raise PermissionError(self.capabilities.read_only_reason or f"a {self.kind} source takes no commands")

    def inspect_live(self, block_id: int) -> Future:
        """Full details of a block of the newest view (K/V included where the source has them)."""
        future: Future = Future()
        snapshot = self.latest()
        if snapshot is None:
            future.set_exception(LookupError("the source has not delivered a pool yet"))
        else:
            future.set_result(block_info_from_snapshot(snapshot, block_id, self.history, None, self.token_text))
        return future

    def tokenize(self, text: str, continuation: bool = False) -> Future:
        """Token ids of ``text`` as a prompt of this source takes them (a finished Future, or its refusal)."""
        future: Future = Future()
        future.set_exception(PermissionError(self.capabilities.read_only_reason
                                             or f"a {self.kind} source takes no prompts"))
        return future

    def token_text(self, token_id: int) -> str | None:
        """Printable text of one token, or None when the source has no tokenizer."""
        return None

    chats = False  # the model has a chat template, so a prompt is a user turn (after an optional system turn)
    takes_text = True  # prompts may be text (False: the model has no tokenizer, so only token ids)
    detokenizer = None  # ``token_ids -> text`` with the source's own tokenizer (the text of a conversation's earlier
    # turns), or None when the source has none

    # ---- would this prompt hit? ----------------------------------------------------------------------------------
    def check_prompt(self, token_ids) -> Future:
        """Which of a prompt's blocks the pool holds now, where, and why the others would miss: a Future of one
        :class:`kvstream.prompt_check.PromptCheck` per pool the feed shows (a KV-event feed: one per instance, in
        :meth:`summaries` order), or of the refusal (a ValueError saying why)."""
        future: Future = Future()
        future.set_exception(ValueError(f"a {self.kind} source cannot check prompts"))
        return future

    def prompt_tokenizer(self):
        """The tokenizer that turns a checked prompt's text into the token ids this source's server would see (a
        ``tokenizers.Tokenizer`` or the built-in byte tokenizer), or None: ids only."""
        return None

    def tokenize_prompt(self, text: str) -> list[int]:
        """``text`` as token ids, for a prompt check; ValueError saying what to give instead when the source has
        no tokenizer."""
        tokenizer = self.prompt_tokenizer()
        if tokenizer is None:
            raise ValueError(f"no tokenizer for this {self.kind} source: give --tokenizer DIR, or the prompt as a "
                             "JSON list of token ids")
        return encode_text(tokenizer, text)

    def chat_prompt_ids(self, messages) -> Future:
        """Token ids of ``messages`` (system / user turns) in the model's chat template (a finished Future)."""
        return self.tokenize("")

    @property
    def paused(self) -> bool:
        return False

    @property
    def speed(self) -> float | None:
        return None

    def status_text(self) -> str:
        """A short state for the status bar ("live", "replaying 40%", "disconnected")."""
        return "live"

    def stream_counts(self) -> dict[str, int] | None:
        """For a source that delivers no pool views (KV events), what it has received, for the status bar:
        ``instances``, ``batches``, ``cached`` (blocks held now), ``stored`` and ``removed`` (totals); None for a
        source whose views say it themselves."""
        return None

    def summary(self, final: bool = False) -> dict:
        """DESIGN.md's ``--json`` object for this feed's newest (or final) view (null where it cannot know)."""
        from kvstream.summary import json_summary
        view = self.final_view() if final else self.latest()
        return json_summary(view) if view is not None else json_summary(None, source=self.kind)

    def summaries(self, final: bool = False) -> list[dict]:
        """One ``--json`` object per pool the feed shows (a KV-event feed follows several instances)."""
        return [self.summary(final)]

    def final_view(self) -> PoolSnapshot | None:
        """The view to report at the end of a headless run (after :meth:`close` too)."""
        return self.latest()

    def started(self) -> None:
        """The feed is now the one watched, and the one watched before it is closed and let go of (the window's
        source calls this after swapping feeds, headless runs at their start). Default: nothing to do."""

    def close(self) -> None:
        """Stop whatever threads or sockets the feed owns (idempotent)."""


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a server tokenises a prompt (special tokens added, as vLLM's completions do), with
    a ``tokenizers.Tokenizer`` or the built-in byte tokenizer; ValueError for an empty result."""
    try:
        encoded = tokenizer.encode(text)
    except Exception as exc:  # tokenizers raises bare Exceptions
        raise ValueError(f"the tokenizer could not read the prompt: {exc}") from None
    ids = list(getattr(encoded, "ids", encoded))
    if not ids:
        raise ValueError("the prompt is empty")
    return [int(i) for i in ids]


def done_future(value=None, error: BaseException | None = None) -> Future:
    """A finished Future holding ``value`` (or ``error``)."""
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future
