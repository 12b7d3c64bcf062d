"""What the user asks of the engine (add, parallel samples, fork, reply, end, relocate), sent through the source.

Every command goes to :meth:`PoolSource.submit`, so it reaches whatever feed is current and is refused with a
reason by a read-only one; answers come back on the GUI thread through the source's FutureWatcher. Dialogs are
sized from the newest live frame, never from a history frame the user may be looking at.
"""
from __future__ import annotations

import random
from concurrent.futures import Future

from PySide6 import QtCore

from .dialogs import AddConversationDialog, ReplyDialog


def _quiet(_exc: BaseException) -> None:
    """An error the dialog that sent the command shows at its field (no second message box)."""


def add_command(request) -> tuple[str, dict]:
    """The runner command for an :class:`~explorer.window.dialogs.AddRequest`: one conversation, or ``samples`` parallel
    samples of one prompt as one atomic ``add_samples`` (forks sent one by one raced the engine's steps: a step in
    between could finish the first sample, and a finished conversation cannot be forked)."""
    kwargs = dict(max_new_tokens=request.max_new_tokens, temperature=request.temperature)
    if request.prompt_token_ids is not None:
        kwargs["prompt_token_ids"] = list(request.prompt_token_ids)  # ids verbatim; no text, no tokenizer
    else:
        kwargs["prompt"] = request.prompt
    if request.samples <= 1:
        return "add_conversation", kwargs
    return "add_samples", dict(kwargs, n=request.samples)


def reply_command(request) -> tuple[tuple, dict]:
    """(args, kwargs) of ``continue_conversation`` for a :class:`~explorer.window.dialogs.ReplyRequest`."""
    kwargs = dict(max_new_tokens=request.max_new_tokens)
    if request.prompt_token_ids is not None:
        kwargs["prompt_token_ids"] = list(request.prompt_token_ids)
    else:
        kwargs["prompt"] = request.message
    return (request.conversation_id,), kwargs


class Commands(QtCore.QObject):
    """Turns the window's actions into commands on its current source."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.add_dialog: AddConversationDialog | None = None
        self.reply_dialog: ReplyDialog | None = None

    @property
    def source(self):
        return self.window.source

    def _refuse(self, what: str) -> bool:
        """Say why a command cannot run now; True when it was refused."""
        reason = self.source.command_blocked_reason
        if reason:
            self.window.statusBar().showMessage(f"Cannot {what}: {reason}.", 5000)
        return bool(reason)

    def _tokenize(self, text: str, continuation: bool = False):
        """The feed's tokenizer (the local engine's, called directly: it is safe from any thread), as a Future."""
        return self.source.feed.tokenize(text, continuation)

    # ---- conversations ----------------------------------------------------------------------------------------
    def open_add_dialog(self) -> AddConversationDialog | None:
        """The add dialog sends its request itself (``submit``) and stays open on a refusal, which it shows at
        the prompt field; once the engine took it, the new conversation (the first sample) is selected."""
        if self._refuse("add a conversation"):
            return None
        feed = self.source.feed
        dialog = AddConversationDialog(self._tokenize, self.source.futures.watch, self.source.live, self.window,
                                       submit=self.send_add,
                                       chat=feed.chat_prompt_ids if getattr(feed, "chats", False) else None)
        dialog.accepted.connect(lambda: self._select_answer(dialog.answer))
        self._ids_only(dialog)
        self.add_dialog = dialog
        dialog.open()
        return dialog

    def send_add(self, request) -> Future:
        """Send an add request; the Future holds the new id (or the ids of the samples). Errors are left to the
        caller (the dialog shows them at its field)."""
        name, kwargs = add_command(request)
        return self.source.submit(name, **kwargs, on_error=_quiet)

    def _select_answer(self, answer) -> None:
        if answer is None:
            return
        cid = answer[0] if isinstance(answer, tuple) else answer
        self.window.select_conversation_when_present(int(cid))

    def fork(self, cid: int) -> None:
        if not self._refuse("fork"):
            self.source.submit("fork_conversation", cid, on_result=self.window.select_conversation_when_present)

    def end(self, cid: int) -> None:
        if not self._refuse("end a conversation"):
            self.source.submit("end_conversation", cid)

    def open_reply_dialog(self, cid: int) -> ReplyDialog | None:
        if self._refuse("reply"):
            return None
        snap = self.source.live
        info = snap.conversation(cid) if snap is not None else None
        if info is None:
            return None
        if info.status != "finished":
            self.window.show_error("Cannot reply", f"Conversation {cid} is {info.status}; only a finished "
                                   "conversation can get a follow-up message.")
            return None
        dialog = ReplyDialog(cid, info.num_tokens, lambda text: self._tokenize(text, continuation=True),
                             self.source.futures.watch, snap, self.window, submit=self.send_reply)
        self._ids_only(dialog)
        self.reply_dialog = dialog
        dialog.open()
        return dialog

    def _ids_only(self, dialog) -> None:
        """A model without a tokenizer takes token ids only: the dialog opens in that mode and says why."""
        if not self.source.feed.takes_text:
            dialog.set_ids_mode(True)
            dialog.mode.setEnabled(False)
            dialog.mode.setToolTip("This model has no tokenizer (no tokenizer.json): prompts are token ids.")

    def send_reply(self, request) -> Future:
        """Send a reply request (text or token ids); errors are left to the dialog."""
        args, kwargs = reply_command(request)
        return self.source.submit("continue_conversation", *args, **kwargs, on_error=_quiet)

    def close_dialogs(self) -> None:
        """Dialogs sized for, and waiting on, a feed that is gone."""
        for dialog in (self.add_dialog, self.reply_dialog):
            if dialog is not None and dialog.isVisible():
                dialog.reject()

    # ---- the pool ------------------------------------------------------------------------------------------------
    def relocate(self, compact: bool) -> None:
        """Move blocks between two decode steps and show the before/after attention difference."""
        if self._refuse("relocate blocks"):
            return
        panel = self.window.relocation
        panel.set_busy(True)

        def failed(exc: BaseException) -> None:
            panel.show_failure(str(exc))
            self.window.show_error("Relocation refused", str(exc))

        self.source.submit("relocate_and_verify", seed=random.randrange(1 << 30), compact=compact,
                           on_result=lambda report: panel.show_report(report, compact), on_error=failed)
