"""The local engine's tokenizer, as the window uses it: text to token ids, ids to text, one token's text.

``Engine.tokenize``, ``detokenize``, ``token_text`` and ``takes_text`` read only the engine's tokenizer, which never
changes after the engine loads, so any thread may call them (the engine says so). The window calls them directly,
on the GUI thread, instead of queueing them behind a decode step on the engine thread: a dialog counts a prompt's
tokens at once, and the conversation detail turns earlier turns back into text without waiting. This object is
the one place the explorer reaches the engine's tokenizer; a refusal (bad text, an id outside the vocabulary) comes
back as the engine's own error, never as a crash of the GUI thread.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence


class EngineText:
    """Tokenizer calls of one engine, safe from the GUI thread (see the module docstring)."""

    def __init__(self, engine):
        self._engine = engine  # only its tokenizer methods are called
        self.takes_text = bool(engine.takes_text)  # False: a checkpoint without tokenizer.json takes token ids only
        self.chats = getattr(engine, "chat_template", None) is not None  # prompts are chat turns (a chat model)

    def tokenize(self, text: str, continuation: bool = False) -> Future:
        """A finished Future of the token ids of ``text`` as a prompt takes them (a reply, ``continuation``, gets no
        BOS), or of the engine's refusal. A Future, as any other answer of the engine, so a dialog handles both
        kinds the same way."""
        future: Future = Future()
        try:
            future.set_result(self._engine.tokenize(text, continuation))
        except (ValueError, TypeError) as exc:  # EngineError: no tokenizer, not text, empty
            future.set_exception(exc)
        return future

    def chat_prompt_ids(self, messages) -> Future:
        """A finished Future of the token ids of ``messages`` (system / user turns) in the model's chat template,
        ending where the assistant answers, or of the engine's refusal (the template reads only the tokenizer)."""
        future: Future = Future()
        try:
            future.set_result(self._engine.chat_prompt_ids(messages))
        except (ValueError, TypeError) as exc:
            future.set_exception(exc)
        return future

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; ids the tokenizer refuses read as the ids themselves."""
        try:
            return self._engine.detokenize(list(token_ids))
        except (ValueError, TypeError, IndexError):
            return " ".join(str(t) for t in token_ids)

    def token_text(self, token_id: int) -> str | None:
        """Printable text of one token, or None when the tokenizer has none for it."""
        try:
            return self._engine.token_text(token_id)
        except (ValueError, TypeError, IndexError, KeyError):
            return None
