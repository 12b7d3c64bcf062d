"""Dialogs that collect a request (add a conversation, reply, restart the engine) and refuse bad input at the field.

Nothing reaches the engine until every field is valid. Prompt length is checked with the engine's own tokenizer,
asked through the runner; the answer comes back through the window's FutureWatcher, so the GUI thread never blocks.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable

from PySide6 import QtWidgets

from engine.block_pool import blocks_needed
from engine.config import EngineConfig
from engine.snapshot import PoolSnapshot

from .demo import SYSTEM_PROMPT  # the add dialog's "shared system prompt" is the demos' one


class FieldError(QtWidgets.QLabel):
    """The red message under a field; hidden while the field is valid."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setStyleSheet("color: #e0443e;")
        self.setWordWrap(True)
        self.hide()

    def show_error(self, text: str) -> None:
        self.setText(text)
        self.setVisible(bool(text))


def parse_number(text: str, name: str, kind=int, low=None, high=None) -> tuple[object, str]:
    """(value, "") or (None, message) for a text field holding an int or float within [low, high]."""
    try:
        value = kind(text.strip())
    except ValueError:
        word = "a whole number" if kind is int else "a number"
        return None, f"{name} must be {word}, got {text.strip()!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return None, f"{name} must be a finite number"
    if low is not None and value < low:
        return None, f"{name} must be at least {low}"
    if high is not None and value > high:
        return None, f"{name} must be at most {high}"
    return value, ""


class _FormDialog(QtWidgets.QDialog):
    """A form whose rows each carry a FieldError label underneath."""

    def __init__(self, title: str, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.form = QtWidgets.QFormLayout()
        self.errors: dict[str, FieldError] = {}
        self.buttons = QtWidgets.QDialogButtonBox(
            QtWidgets.QDialogButtonBox.StandardButton.Ok | QtWidgets.QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.try_accept)
        self.buttons.rejected.connect(self.reject)
        self.busy = QtWidgets.QLabel()
        layout = QtWidgets.QVBoxLayout(self)
        layout.addLayout(self.form)
        layout.addWidget(self.busy)
        layout.addWidget(self.buttons)

    def add_row(self, key: str, label: str, widget: QtWidgets.QWidget) -> QtWidgets.QWidget:
        box = QtWidgets.QWidget()
        column = QtWidgets.QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(1)
        column.addWidget(widget)
        error = FieldError()
        column.addWidget(error)
        self.errors[key] = error
        self.form.addRow(label, box)
        return widget

    def error_text(self, key: str) -> str:
        error = self.errors[key]
        return error.text() if not error.isHidden() else ""

    def clear_errors(self) -> None:
        for error in self.errors.values():
            error.show_error("")

    def try_accept(self) -> None:
        """OK was pressed: subclasses validate their fields first and accept only if every field is valid."""
        self.accept()

class _MessageDialog(_FormDialog):
    """A text message plus max new tokens, refused at its field when the engine's tokenizer says it cannot fit."""

    def __init__(self, title: str, tokenize: Callable[[str], Future], watch: Callable, snapshot: PoolSnapshot,
                 parent: QtWidgets.QWidget | None = None):
        super().__init__(title, parent)
        self._tokenize = tokenize  # text -> Future of token ids, from the engine thread
        self._watch = watch  # FutureWatcher.watch of the window: calls back on the GUI thread
        self.num_blocks, self.block_size = snapshot.num_blocks, snapshot.block_size
        self.max_model_len = snapshot.max_model_len  # the model's positions; 0: no limit known
        self.request = None  # set when the dialog is accepted
        self._pending: Future | None = None  # the length check in flight

    def add_max_new_tokens_row(self) -> QtWidgets.QLineEdit:
        return self.add_row("max_new_tokens", "Max new tokens:", QtWidgets.QLineEdit("32"))

    def parse_max_new_tokens(self) -> int | None:
        most = self.num_blocks * self.block_size
        value, err = parse_number(self.max_new_tokens.text(), "Max new tokens", int, 1,
                                  min(most, self.max_model_len) if self.max_model_len else most)
        self.errors["max_new_tokens"].show_error(err)
        return value

    def accept_if_it_fits(self, key: str, text: str, history_tokens: int, max_new: int, request) -> None:
        """Tokenize ``text`` through the engine (without blocking); if history + text + max_new fit the model's
        positions and the pool, keep ``request`` and accept, else say why at field ``key`` (a tokenizer refusal is
        said there too, such as a checkpoint without a tokenizer)."""

        def check_length(future: Future) -> None:
            try:
                num_tokens = len(future.result()) + history_tokens
            except Exception as exc:  # the tokenizer refused the text
                self.errors[key].show_error(str(exc))
                return
            if self.max_model_len and num_tokens + max_new > self.max_model_len:
                self.errors[key].show_error(
                    f"Too long for the model: {num_tokens} prompt tokens + {max_new} new tokens, but it handles at "
                    f"most {self.max_model_len} tokens in one conversation.")
                return
            need = blocks_needed(num_tokens, max_new, self.block_size)
            if need > self.num_blocks:
                self.errors[key].show_error(
                    f"Too long for the pool: {num_tokens} prompt tokens + {max_new} new tokens need {need} blocks "
                    f"of {self.block_size} slots, but the pool has only {self.num_blocks} blocks.")
                return
            self.request = request
            self.accept()

        future = self._pending = self._tokenize(text)
        self._set_checking(True)

        def answered(_=None) -> None:
            if self._pending is future:  # not cancelled meanwhile
                self._pending = None
                self._set_checking(False)
                check_length(future)

        self._watch(future, answered, answered)

    def _set_checking(self, checking: bool) -> None:
        """While the engine answers, keep the dialog open with OK disabled."""
        self.busy.setText("Checking…" if checking else "")
        self.buttons.button(QtWidgets.QDialogButtonBox.StandardButton.Ok).setEnabled(not checking)

    def reject(self) -> None:
        """Cancel also forgets a check in flight, so its answer can no longer accept the dialog."""
        self._pending = None
        self._set_checking(False)
        super().reject()


@dataclass(frozen=True)
class AddRequest:
    """What the add dialog asks for; ``samples`` > 1 means one conversation plus forks."""

    prompt: str  # the full prompt text, system prompt included when chosen
    max_new_tokens: int
    temperature: float
    samples: int  # conversations to start: the first plus samples - 1 forks of it


class AddConversationDialog(_MessageDialog):
    """Prompt, generation settings, shared system prompt option and parallel samples."""

    def __init__(self, tokenize: Callable[[str], Future], watch: Callable, snapshot: PoolSnapshot,
                 parent: QtWidgets.QWidget | None = None):
        super().__init__("Add conversation", tokenize, watch, snapshot, parent)
        self.prompt = self.add_row("prompt", "Prompt:", QtWidgets.QPlainTextEdit())
        self.prompt.setPlaceholderText("Type the user's message")
        self.prompt.setMinimumSize(420, 90)
        self.max_new_tokens = self.add_max_new_tokens_row()
        self.temperature = self.add_row("temperature", "Temperature:", QtWidgets.QLineEdit("0.8"))
        self.use_system = self.add_row("system", "", QtWidgets.QCheckBox(
            "Start from the shared system prompt (its full blocks are shared through prefix caching)"))
        self.samples = self.add_row("samples", "Parallel samples:", QtWidgets.QLineEdit("1"))
        self.samples.setToolTip("n > 1 adds one conversation and forks it n - 1 times; the forks share its blocks")

    def full_prompt(self) -> str:
        text = self.prompt.toPlainText()
        return SYSTEM_PROMPT + text if self.use_system.isChecked() else text

    def try_accept(self) -> None:
        self.clear_errors()
        empty = not self.prompt.toPlainText().strip()
        self.errors["prompt"].show_error("The prompt is empty: type a message." if empty else "")
        max_new = self.parse_max_new_tokens()
        temperature, err = parse_number(self.temperature.text(), "Temperature", float, 0.0, 10.0)
        self.errors["temperature"].show_error(err)
        samples, err = parse_number(self.samples.text(), "Parallel samples", int, 1, 64)
        self.errors["samples"].show_error(err)
        if empty or None in (max_new, temperature, samples):
            return
        prompt = self.full_prompt()
        self.accept_if_it_fits("prompt", prompt, 0, max_new, AddRequest(prompt, max_new, float(temperature), samples))


@dataclass(frozen=True)
class ReplyRequest:
    """A follow-up message to a finished conversation."""

    conversation_id: int
    message: str
    max_new_tokens: int


class ReplyDialog(_MessageDialog):
    """A follow-up message to a finished conversation; its whole history becomes the new prompt."""

    def __init__(self, conversation_id: int, history_tokens: int, tokenize: Callable[[str], Future],
                 watch: Callable, snapshot: PoolSnapshot, parent: QtWidgets.QWidget | None = None):
        super().__init__(f"Reply to conversation {conversation_id}", tokenize, watch, snapshot, parent)
        self.conversation_id, self.history_tokens = conversation_id, history_tokens
        self.message = self.add_row("message", "Message:", QtWidgets.QPlainTextEdit())
        self.message.setMinimumSize(420, 70)
        self.max_new_tokens = self.add_max_new_tokens_row()

    def try_accept(self) -> None:
        self.clear_errors()
        text = self.message.toPlainText()
        empty = not text.strip()
        self.errors["message"].show_error("The message is empty: type a reply." if empty else "")
        max_new = self.parse_max_new_tokens()
        if empty or max_new is None:
            return
        self.accept_if_it_fits("message", text, self.history_tokens, max_new,
                               ReplyRequest(self.conversation_id, text, max_new))


class RestartDialog(_FormDialog):
    """A new engine configuration: block size, pool size, model (built-in or a checkpoint folder), device."""

    def __init__(self, current: EngineConfig, parent: QtWidgets.QWidget | None = None):
        super().__init__("Restart engine", parent)
        self.block_size = self.add_row("block_size", "Block size (slots):",
                                       QtWidgets.QLineEdit(str(current.block_size)))
        self.num_blocks = self.add_row("num_blocks", "Pool size (blocks):",
                                       QtWidgets.QLineEdit(str(current.num_blocks)))
        model_box = QtWidgets.QWidget()
        row = QtWidgets.QHBoxLayout(model_box)
        row.setContentsMargins(0, 0, 0, 0)
        self.builtin = QtWidgets.QRadioButton("built-in")
        self.checkpoint = QtWidgets.QRadioButton("checkpoint:")
        self.path = QtWidgets.QLineEdit("" if current.model == "builtin" else current.model)
        self.browse = QtWidgets.QPushButton("Browse…")
        self.browse.clicked.connect(self._browse)
        (self.builtin if current.model == "builtin" else self.checkpoint).setChecked(True)
        for widget in (self.builtin, self.checkpoint, self.path, self.browse):
            row.addWidget(widget)
        self.add_row("model", "Model:", model_box)
        self.device = self.add_row("device", "Device:", QtWidgets.QComboBox())
        self.device.addItems(["cpu", "cuda", "auto"])
        self.device.setCurrentText(current.device)
        self.current = current
        self.config: EngineConfig | None = None

    def _browse(self) -> None:
        folder = QtWidgets.QFileDialog.getExistingDirectory(self, "Checkpoint directory", self.path.text())
        if folder:
            self.path.setText(folder)
            self.checkpoint.setChecked(True)

    def try_accept(self) -> None:
        self.clear_errors()
        block_size, err = parse_number(self.block_size.text(), "Block size", int, 1, 4096)
        self.errors["block_size"].show_error(err)
        num_blocks, err2 = parse_number(self.num_blocks.text(), "Pool size", int, 2, 1 << 20)
        self.errors["num_blocks"].show_error(err2)
        model, err3 = "builtin", ""
        if self.checkpoint.isChecked():
            model = self.path.text().strip()
            if not model:
                err3 = "Choose a checkpoint directory (or pick built-in)."
            elif not os.path.isdir(model):
                err3 = f"No such directory: {model}"
        self.errors["model"].show_error(err3)
        if err or err2 or err3:
            return
        self.config = replace(self.current, block_size=block_size, num_blocks=num_blocks, model=model,
                              device=self.device.currentText())
        self.accept()
