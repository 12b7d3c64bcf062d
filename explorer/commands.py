"""What the user asks of the engine (add, parallel samples, fork, reply, end, relocate), sent through the source.

Every command goes to :meth:`PoolSource.submit`, so it reaches whatever feed is current and is refused with a
reason by a read-only one; answers come back on the GUI thread through the source's FutureWatcher. Dialogs are
sized from the newest live frame, never from a history frame the user may be looking at.
"""
from __future__ import annotations

import random

from PySide6 import QtCore

from engine import Engine

from .dialogs import AddConversationDialog, ReplyDialog


def engine_has_add_samples() -> bool:
    """Whether the engine makes n parallel samples as one atomic command (else: add, then fork while paused)."""
    return hasattr(Engine, "add_samples")


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
        return self.source.feed.submit("tokenize", text, continuation)

    # ---- conversations ----------------------------------------------------------------------------------------
    def open_add_dialog(self) -> AddConversationDialog | None:
        if self._refuse("add a conversation"):
            return None
        dialog = AddConversationDialog(self._tokenize, self.source.futures.watch, self.source.live, self.window)
        dialog.accepted.connect(lambda: self.submit_add(dialog.request))
        self.add_dialog = dialog
        dialog.open()
        return dialog

    def submit_add(self, request) -> None:
        """One conversation, or ``request.samples`` parallel samples of one prompt as one engine command."""
        source, select = self.source, self.window.select_conversation_when_present
        common = dict(prompt=request.prompt, max_new_tokens=request.max_new_tokens, temperature=request.temperature)
        if request.samples <= 1:
            source.submit("add_conversation", **common, on_result=select)
        elif engine_has_add_samples():
            source.submit("add_samples", n=request.samples, **common, on_result=lambda ids: select(ids[0]))
        else:
            self._add_then_fork_paused(request.samples, common)

    def _add_then_fork_paused(self, samples: int, common: dict) -> None:
        """Fallback for engines without add_samples: pause first so no step runs between the add and its forks
        (a step in between can finish the first sample, and a finished conversation cannot be forked)."""
        source = self.source
        was_paused = source.feed.paused
        source.submit("pause")

        def added(cid: int) -> None:
            self.window.select_conversation_when_present(cid)
            for _ in range(samples - 1):
                source.submit("fork_conversation", cid)
            if not was_paused:
                source.submit("resume")

        def failed(exc: BaseException) -> None:
            if not was_paused:
                source.submit("resume")
            self.window.show_error("Command refused", str(exc))

        source.submit("add_conversation", **common, on_result=added, on_error=failed)

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
                             self.source.futures.watch, snap, self.window)
        dialog.accepted.connect(lambda: self.source.submit(
            "continue_conversation", dialog.request.conversation_id, prompt=dialog.request.message,
            max_new_tokens=dialog.request.max_new_tokens))
        self.reply_dialog = dialog
        dialog.open()
        return dialog

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
