"""Dialogs that collect a request (add a conversation, reply, restart the engine) and refuse bad input at the field.

Nothing that changes the engine is sent until every field is valid, and every invalid field says so at once (one
press of OK shows all the errors). Each field's error line has its room reserved, so an error never pushes the
fields below it. Prompt length is checked with the engine's own tokenizer (:class:`explorer.feeds.engine_text.EngineText`,
safe to call from the GUI thread); its answer is a Future like every engine answer and comes back through the
window's FutureWatcher. The fit rule is the engine's own
(:func:`kvstream.rules.fit_error`), and a refusal says how many new tokens would fit.

A prompt can be text or token ids ("12 7 99" or "12, 7, 99"): a checkpoint without a tokenizer takes only ids.
The explorer does not know the model's vocabulary, so ids are checked by the engine itself: given a ``submit``
callable, the dialog sends the request, stays open while the engine answers, and shows a refusal (an id outside
the vocabulary, say) at the prompt field.
"""
from __future__ import annotations

import math
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable

from PySide6 import QtCore, QtGui, QtWidgets

from engine import EngineConfig, EngineError
from kvstream.rules import fit_error
from kvstream.views import KV_DTYPE_BYTES, PoolSnapshot

from ..model.words import count
from . import file_dialogs
from ..feeds.demo import SYSTEM_PROMPT  # the add dialog's "shared system prompt" is the demos' one

TEXT_MODE, IDS_MODE = "text", "token ids"  # what the prompt field holds


class FieldError(QtWidgets.QLabel):
    """The red message under a field. Its height is reserved (``lines`` lines) whether or not there is an error,
    so showing a short one never moves the fields below; a longer message makes the label (and the dialog) taller,
    so the whole message can always be read (cut after two lines, "block size 4096 with 1,048,576 blocks" lost
    its advice), and the label keeps that height once the message goes: the fields and OK move at most once, not
    each time an error comes and goes. The tooltip repeats it."""

    def __init__(self, lines: int = 2, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setStyleSheet("color: #e0443e;")
        self.setWordWrap(True)
        self.setAlignment(QtCore.Qt.AlignmentFlag.AlignLeft | QtCore.Qt.AlignmentFlag.AlignTop)
        self._reserved = lines * self.fontMetrics().lineSpacing() + 2
        self.setFixedHeight(self._reserved)
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Fixed)
        self.message = ""  # the full message ("" while the field is valid)

    def show_error(self, text: str) -> None:
        self.message = text
        self.setText(text)
        self.setToolTip(text)
        self._fit()

    def needed_height(self) -> int:
        """Pixels the whole message needs at the label's width."""
        return self.heightForWidth(max(self.width(), 80)) if self.message else 0

    def _fit(self) -> None:
        height = self._reserved = max(self._reserved, self.needed_height())
        if height != self.height() or height != self.minimumHeight():
            self.setFixedHeight(height)
            dialog = self.window()
            if dialog is not self and dialog.isVisible():
                dialog.adjustSize()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self._fit()  # a narrower label needs more lines


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


def parse_token_ids(text: str) -> tuple[tuple[int, ...] | None, str]:
    """(ids, "") or (None, message) for token ids separated by spaces and/or commas ("12 7 99", "12, 7, 99")."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts:
        return None, "No token ids: type them separated by spaces or commas, e.g. 12 7 99."
    bad = [p for p in parts if not re.fullmatch(r"\+?\d+", p)]
    if bad:
        return None, (f"{bad[0]!r} is not a token id: ids are whole numbers from 0, separated by spaces or "
                      "commas (e.g. 12, 7, 99).")
    return tuple(int(p) for p in parts), ""


def most_new_tokens(num_tokens: int, *, block_size: int, num_blocks: int, max_model_len: int = 0) -> int:
    """The largest max_new_tokens a conversation of ``num_tokens`` prompt tokens may ask for (0: none fit)."""
    best = num_blocks * block_size - num_tokens + 1  # blocks_needed(n, m) <= num_blocks <=> n + m - 1 <= slots
    if max_model_len:
        best = min(best, max_model_len - num_tokens)
    return max(best, 0)


class _FormDialog(QtWidgets.QDialog):
    """A form whose rows each carry a FieldError line underneath (room reserved)."""

    def __init__(self, title: str, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.form = QtWidgets.QFormLayout()
        self.form.setFieldGrowthPolicy(QtWidgets.QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.errors: dict[str, FieldError] = {}
        self.buttons = QtWidgets.QDialogButtonBox(
            QtWidgets.QDialogButtonBox.StandardButton.Ok | QtWidgets.QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.try_accept)
        self.buttons.rejected.connect(self.reject)
        self.busy = QtWidgets.QLabel()
        self.busy.setWordWrap(True)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addLayout(self.form)
        layout.addWidget(self.busy)
        layout.addWidget(self.buttons)

    def add_row(self, key: str, label: str, widget: QtWidgets.QWidget, error_lines: int = 2) -> QtWidgets.QWidget:
        box = QtWidgets.QWidget()
        column = QtWidgets.QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(1)
        column.addWidget(widget)
        error = FieldError(error_lines)
        column.addWidget(error)
        self.errors[key] = error
        self.form.addRow(label, box)
        return widget

    def error_text(self, key: str) -> str:
        return self.errors[key].message

    def clear_errors(self) -> None:
        for error in self.errors.values():
            error.show_error("")

    def has_errors(self) -> bool:
        return any(error.message for error in self.errors.values())

    def ok_button(self) -> QtWidgets.QPushButton:
        return self.buttons.button(QtWidgets.QDialogButtonBox.StandardButton.Ok)

    def set_busy(self, text: str) -> None:
        """While the engine answers, keep the dialog open with OK disabled ("" when done)."""
        self.busy.setText(text)
        self.ok_button().setEnabled(not text)

    def try_accept(self) -> None:
        """OK was pressed: subclasses validate their fields first and accept only if every field is valid."""
        self.accept()


class _MessageDialog(_FormDialog):
    """A message (text or token ids) plus max new tokens, refused at its field when it cannot fit.

    ``submit``, when given, sends the finished request and returns the Future of the engine's answer; the dialog
    accepts only when that succeeds (``self.answer`` holds the result) and shows a refusal at the message field.
    Without it the dialog accepts once every field is valid, and the caller sends ``self.request``."""

    def __init__(self, title: str, tokenize: Callable[[str], Future], watch: Callable, snapshot: PoolSnapshot,
                 parent: QtWidgets.QWidget | None = None, submit: Callable[[object], Future] | None = None):
        super().__init__(title, parent)
        self._tokenize = tokenize  # text -> Future of token ids (the feed's tokenizer)
        self._watch = watch  # FutureWatcher.watch of the window: calls back on the GUI thread
        self._submit = submit  # request -> Future of the engine's answer (None: the caller sends it)
        self.num_blocks, self.block_size = snapshot.num_blocks, snapshot.block_size
        self.max_model_len = snapshot.max_model_len  # the model's positions; 0: no limit known
        self.request = None  # set when the dialog is accepted
        self.counted_ids: tuple[int, ...] | None = None  # the ids the length check counted (text it tokenized)
        self.answer = None  # the engine's answer to ``submit`` (a conversation id), when the dialog sent it
        self._pending: Future | None = None  # the length check or the submission in flight
        self.mode = QtWidgets.QComboBox()
        self.mode.addItems([TEXT_MODE, IDS_MODE])
        self.mode.setToolTip("Token ids: for a checkpoint without a tokenizer, or to send exact tokens. Separate "
                             "them with spaces or commas.")
        self.mode.currentTextChanged.connect(self._on_mode)

    def add_message_rows(self, key: str, label: str, placeholder: str) -> QtWidgets.QPlainTextEdit:
        self.mode_label = f"{label.rstrip(':')} as"  # "Prompt as", "Message as"
        self.add_row("mode", self.mode_label + ":", self.mode, error_lines=0)
        editor = self.add_row(key, label, QtWidgets.QPlainTextEdit(), error_lines=3)
        editor.setPlaceholderText(placeholder)
        editor.setMinimumSize(260, 70)
        editor.setTabChangesFocus(True)  # Tab goes on to the next field, as in every other field of the form
        send = QtGui.QShortcut(QtGui.QKeySequence("Ctrl+Return"), self)  # Return itself starts a new line
        send.activated.connect(self.try_accept)
        self._placeholder = placeholder
        self._message_editor = editor
        # an error about the message ("The prompt is empty") is stale once the user types: it clears itself
        editor.textChanged.connect(lambda: self.errors[key].message and self.errors[key].show_error(""))
        return editor

    def message_editor(self) -> QtWidgets.QPlainTextEdit:
        """The message field :meth:`add_message_rows` made."""
        return self._message_editor

    def showEvent(self, event) -> None:
        """Typing goes into the message at once (the focus was on the mode box, and the space in "Record me"
        then pressed OK)."""
        super().showEvent(event)
        self.message_editor().setFocus(QtCore.Qt.FocusReason.ActiveWindowFocusReason)

    def ids_mode(self) -> bool:
        return self.mode.currentText() == IDS_MODE

    def set_ids_mode(self, on: bool) -> None:
        self.mode.setCurrentText(IDS_MODE if on else TEXT_MODE)

    def _on_mode(self, _text: str) -> None:
        self.message_editor().setPlaceholderText("Token ids, e.g. 12 7 99 or 12, 7, 99" if self.ids_mode()
                                                 else self._placeholder)

    def add_max_new_tokens_row(self) -> QtWidgets.QLineEdit:
        return self.add_row("max_new_tokens", "Max new tokens:", QtWidgets.QLineEdit("32"))

    def parse_max_new_tokens(self) -> int | None:
        most = self.num_blocks * self.block_size
        value, err = parse_number(self.max_new_tokens.text(), "Max new tokens", int, 1,
                                  min(most, self.max_model_len) if self.max_model_len else most)
        self.errors["max_new_tokens"].show_error(err)
        return value

    def fit_message(self, num_tokens: int, max_new: int) -> str:
        """Why ``num_tokens`` prompt tokens + ``max_new`` new ones cannot run, with what would fit ("" if they fit)."""
        reason = fit_error(num_tokens, max_new, block_size=self.block_size, num_blocks=self.num_blocks,
                           max_model_len=self.max_model_len)
        if reason is None:
            return ""
        most = most_new_tokens(num_tokens, block_size=self.block_size, num_blocks=self.num_blocks,
                               max_model_len=self.max_model_len)
        hint = (f" With this prompt at most {count(most, 'new token')} fit." if most > 0 else
                " The prompt alone is too long.")
        return f"Too long: {reason}.{hint}"

    def check_and_send(self, key: str, text: str, ids: tuple[int, ...] | None, history_tokens: int,
                       max_new: int | None, make_request: Callable[[int], object],
                       tokenized: Future | None = None) -> None:
        """Count the message's tokens (``ids``, or ``text`` through the engine's tokenizer, without blocking), show
        at field ``key`` why it cannot fit, and accept (or send) ``make_request(max_new)`` when every field is
        valid. ``max_new`` None: that field is invalid; the length is still checked, against one new token."""

        def counted(num_tokens: int) -> None:
            self.errors[key].show_error(self.fit_message(num_tokens + history_tokens, max_new or 1))
            if not self.has_errors():
                self._finish(key, make_request(max_new))

        if ids is not None:
            counted(len(ids))
            return
        future = self._pending = tokenized if tokenized is not None else self._tokenize(text)
        self.set_busy("Checking the length…")

        def answered(_=None) -> None:
            if self._pending is not future:  # cancelled meanwhile
                return
            self._pending = None
            self.set_busy("")
            try:
                self.counted_ids = tuple(future.result())  # what the request sends when the text became chat turns
                num_tokens = len(self.counted_ids)
            except Exception as exc:  # the tokenizer refused the text (a checkpoint without one, say)
                hint = f" Switch '{self.mode_label}' to token ids." if "token ids" in str(exc) else ""
                self.errors[key].show_error(f"{exc}.{hint}" if hint else str(exc))
                return
            counted(num_tokens)

        self._watch(future, answered, answered)

    def _finish(self, key: str, request) -> None:
        """Every field is valid: accept, or send the request first and accept when the engine agrees."""
        if self._submit is None:
            self.request = request
            self.accept()
            return
        future = self._pending = self._submit(request)
        self.set_busy("Sending to the engine…")

        def done(answer) -> None:
            if self._pending is future:
                self._pending = None
                self.set_busy("")
                self.request, self.answer = request, answer
                self.accept()

        def refused(exc: BaseException) -> None:
            if self._pending is future:
                self._pending = None
                self.set_busy("")
                field, text = refusal_field(str(exc), self.errors, key), str(exc)
                # under its own field the engine's words say it all ("Temperature 1e-30 is too small…"), in the
                # two lines kept for it; under the message, what refused it is said too
                self.errors[field].show_error(f"The engine refused it: {text}" if field == key
                                              else text[:1].upper() + text[1:])

        self._watch(future, done, refused)

    def reject(self) -> None:
        """Cancel also forgets a check in flight, so its answer can no longer accept the dialog."""
        self._pending = None
        self.set_busy("")
        super().reject()


@dataclass(frozen=True)
class AddRequest:
    """What the add dialog asks for; ``samples`` > 1 means n parallel samples of one prompt."""

    prompt: str  # the full prompt text, system prompt included when chosen ("" when given as token ids)
    max_new_tokens: int
    temperature: float
    samples: int  # conversations to start from this prompt (Engine.add_samples n)
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt as token ids instead of text (then prompt is "")
    messages: tuple = ()  # a chat model's system / user turns that prompt_token_ids were rendered from


class AddConversationDialog(_MessageDialog):
    """Prompt (text or token ids), generation settings, shared system prompt option and parallel samples."""

    def __init__(self, tokenize: Callable[[str], Future], watch: Callable, snapshot: PoolSnapshot,
                 parent: QtWidgets.QWidget | None = None, submit: Callable[[AddRequest], Future] | None = None,
                 chat: Callable[[list], Future] | None = None):
        super().__init__("Add conversation", tokenize, watch, snapshot, parent, submit)
        self._chat = chat  # messages -> Future of ids in the model's chat template (a chat model), or None
        self.prompt = self.add_message_rows("prompt", "Prompt:", "Type the user's message")
        self.prompt.setMinimumSize(300, 70)
        self.max_new_tokens = self.add_max_new_tokens_row()
        self.temperature = self.add_row("temperature", "Temperature:", QtWidgets.QLineEdit("0.8"))
        self.use_system = self.add_row("system", "", QtWidgets.QCheckBox("Start from the shared system prompt"),
                                       error_lines=0)
        self.use_system.setToolTip("The demos' system prompt goes first; its full blocks are shared with every "
                                   "conversation that starts with it (prefix caching)")
        self.samples = self.add_row("samples", "Parallel samples:", QtWidgets.QLineEdit("1"))
        self.samples.setToolTip("n > 1 starts n conversations from this prompt at once; they share its blocks")
        for key in ("max_new_tokens", "temperature", "samples"):  # an error is stale once its field is changed
            getattr(self, key).textChanged.connect(
                lambda _text, key=key: self.errors[key].message and self.errors[key].show_error(""))

    def _on_mode(self, text: str) -> None:
        super()._on_mode(text)
        self.use_system.setEnabled(not self.ids_mode())  # the system prompt is text
        if self.ids_mode():
            self.use_system.setChecked(False)

    def full_prompt(self) -> str:
        text = self.prompt.toPlainText()
        return SYSTEM_PROMPT + text if self.use_system.isChecked() else text

    def try_accept(self) -> None:
        self.clear_errors()
        max_new = self.parse_max_new_tokens()
        temperature, err = parse_number(self.temperature.text(), "Temperature", float, 0.0, 10.0)
        self.errors["temperature"].show_error(err)
        samples, err = parse_number(self.samples.text(), "Parallel samples", int, 1, 64)
        self.errors["samples"].show_error(err)
        ids = None
        if self.ids_mode():
            ids, err = parse_token_ids(self.prompt.toPlainText())
            if err:
                self.errors["prompt"].show_error(err)
                return
        elif not self.prompt.toPlainText().strip():
            self.errors["prompt"].show_error("The prompt is empty: type a message.")
            return
        if ids is None and self._chat is not None:
            # a chat model: the shared system prompt is the system turn, the text the user's; ids as the template says
            messages = (([{"role": "system", "content": SYSTEM_PROMPT.strip()}] if self.use_system.isChecked()
                         else []) + [{"role": "user", "content": self.prompt.toPlainText()}])
            self.check_and_send("prompt", "", None, 0, max_new,
                                lambda new: AddRequest("", new, float(temperature), samples, self.counted_ids,
                                                       tuple(messages)),
                                tokenized=self._chat(messages))
            return
        prompt = "" if ids is not None else self.full_prompt()
        self.check_and_send("prompt", prompt, ids, 0, max_new,
                            lambda new: AddRequest(prompt, new, float(temperature), samples, ids))


@dataclass(frozen=True)
class ReplyRequest:
    """A follow-up message to a finished conversation."""

    conversation_id: int
    message: str  # the message text ("" when given as token ids)
    max_new_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None  # the message as token ids instead of text


class ReplyDialog(_MessageDialog):
    """A follow-up message to a finished conversation; its whole history becomes the new prompt."""

    def __init__(self, conversation_id: int, history_tokens: int, tokenize: Callable[[str], Future],
                 watch: Callable, snapshot: PoolSnapshot, parent: QtWidgets.QWidget | None = None,
                 submit: Callable[[ReplyRequest], Future] | None = None):
        super().__init__(f"Reply to conversation {conversation_id}", tokenize, watch, snapshot, parent, submit)
        self.conversation_id, self.history_tokens = conversation_id, history_tokens
        self.message = self.add_message_rows("message", "Message:", "Type the follow-up message")
        self.max_new_tokens = self.add_max_new_tokens_row()

    def try_accept(self) -> None:
        self.clear_errors()
        max_new = self.parse_max_new_tokens()
        text = self.message.toPlainText()
        ids = None
        if self.ids_mode():
            ids, err = parse_token_ids(text)
            if err:
                self.errors["message"].show_error(err)
                return
            text = ""
        elif not text.strip():
            self.errors["message"].show_error("The message is empty: type a reply.")
            return
        self.check_and_send("message", text, ids, self.history_tokens, max_new,
                            lambda new: ReplyRequest(self.conversation_id, text, new, ids))


class RestartDialog(_FormDialog):
    """A new engine configuration: block size, pool size, model (built-in or a checkpoint folder), device.

    ``num_conversations``: how many the current engine holds; restarting discards them, so OK asks first.
    ``submit``, when given, starts the restart (``submit(config)``) and the dialog stays open, its values kept,
    until the caller reports back: :meth:`restart_failed` shows the reason at the field it concerns and lets the
    user correct it; :meth:`restart_succeeded` closes the dialog. Without ``submit`` OK just accepts."""

    def __init__(self, current: EngineConfig, parent: QtWidgets.QWidget | None = None, *,
                 num_conversations: int = 0, submit: Callable[[EngineConfig], None] | None = None,
                 engine_running: bool = True, snapshot: PoolSnapshot | None = None):
        super().__init__("Restart engine", parent)
        self.block_size = self.add_row("block_size", "Block size (slots):",
                                       QtWidgets.QLineEdit(str(current.block_size)))
        self.num_blocks = self.add_row("num_blocks", "Pool size (blocks):",
                                       QtWidgets.QLineEdit(str(current.num_blocks)))
        self.kv_cache_dtype = self.add_row("kv_cache_dtype", "KV cache dtype:", QtWidgets.QComboBox())
        self.kv_cache_dtype.addItems(list(KV_CACHE_DTYPE_CHOICES))
        self.kv_cache_dtype.setCurrentText(current.kv_cache_dtype)
        self.kv_cache_dtype.setToolTip("auto: the model's dtype (--dtype); fp8 (e4m3) and fp8_e5m2 store a byte a "
                                       "value, as vLLM's --kv-cache-dtype")
        # what a pool of this size takes, and how many blocks the same memory holds in each dtype (the running
        # model's shape: a value's bytes times the values of a block, from the snapshot)
        self.memory = QtWidgets.QLabel()
        self.memory.setWordWrap(True)
        self.layout().insertWidget(self.layout().count() - 1, self.memory)
        self._values_per_slot = values_per_slot(snapshot)
        self._model_dtype = current.dtype
        for signal in (self.block_size.textChanged, self.num_blocks.textChanged,
                       self.kv_cache_dtype.currentTextChanged):
            signal.connect(self._show_memory)
        self._show_memory()
        model_box = QtWidgets.QWidget()
        grid = QtWidgets.QGridLayout(model_box)
        grid.setContentsMargins(0, 0, 0, 0)
        self.builtin = QtWidgets.QRadioButton("built-in")
        self.checkpoint = QtWidgets.QRadioButton("other:")
        self.path = QtWidgets.QLineEdit("" if current.model == "builtin" else current.model)
        self.path.setPlaceholderText("smollm2, a .gguf file, or a folder with config.json and *.safetensors")
        self.path.setMinimumWidth(self.path.fontMetrics().horizontalAdvance(self.path.placeholderText()) + 24)
        self.browse = QtWidgets.QPushButton("Browse…")
        self.browse.clicked.connect(self._browse)
        (self.builtin if current.model == "builtin" else self.checkpoint).setChecked(True)
        grid.addWidget(self.builtin, 0, 0)
        grid.addWidget(self.checkpoint, 0, 1)
        grid.addWidget(self.path, 1, 0, 1, 2)
        grid.addWidget(self.browse, 1, 2)
        self.add_row("model", "Model:", model_box, error_lines=2)
        self.device = self.add_row("device", "Device:", QtWidgets.QComboBox())
        self.device.addItems(["cpu", "cuda", "auto"])
        self.device.setCurrentText(current.device)
        self.current = current
        self.num_conversations = num_conversations  # conversations a restart would discard
        self._submit = submit
        self.config: EngineConfig | None = None
        self.confirm: QtWidgets.QMessageBox | None = None  # the "N conversations will be discarded" question
        self.loading = False  # a restart started from this dialog has not answered yet
        self.engine_running = engine_running  # a local engine runs now (not a recording or an attached stream)
        # an error is stale once its field is changed: it clears then, not only when OK is pressed again
        for key, changed in (("block_size", self.block_size.textChanged), ("num_blocks", self.num_blocks.textChanged),
                             ("model", self.path.textChanged), ("model", self.builtin.toggled),
                             ("device", self.device.currentTextChanged)):
            changed.connect(lambda *_, key=key: self.errors[key].message and self.errors[key].show_error(""))

    def _browse(self) -> None:
        folder = file_dialogs.existing_directory(self, "Checkpoint directory", self.path.text())
        if folder:
            self.path.setText(folder)
            self.checkpoint.setChecked(True)

    def try_accept(self) -> None:
        if self.loading:
            return
        self.clear_errors()
        block_size, err = parse_number(self.block_size.text(), "Block size", int, 1, 4096)
        self.errors["block_size"].show_error(err)
        num_blocks, err2 = parse_number(self.num_blocks.text(), "Pool size", int, 2, 1 << 20)
        self.errors["num_blocks"].show_error(err2)
        model, err3 = "builtin", ""
        if self.checkpoint.isChecked():
            model, err3 = check_model_spec(self.path.text())
        self.errors["model"].show_error(err3)
        if err or err2 or err3:
            return
        try:
            config = replace(self.current, block_size=block_size, num_blocks=num_blocks, model=model,
                             device=self.device.currentText(), kv_cache_dtype=self.kv_cache_dtype.currentText())
        except (EngineError, ValueError) as exc:  # the config's own checks
            self.errors["model"].show_error(str(exc))
            return
        if self.num_conversations > 0:
            self._ask_then_restart(config)
        else:
            self._restart(config)

    def _ask_then_restart(self, config: EngineConfig) -> None:
        """'N conversations will be discarded': restart only if the user says so (non-blocking question)."""
        n = self.num_conversations
        box = QtWidgets.QMessageBox(
            QtWidgets.QMessageBox.Icon.Question, "Restart engine",
            f"{n} conversation{'s' if n != 1 else ''} will be discarded: a new engine starts with an empty pool.",
            QtWidgets.QMessageBox.StandardButton.Cancel, self)
        restart = box.addButton("Restart", QtWidgets.QMessageBox.ButtonRole.AcceptRole)
        box.setDefaultButton(QtWidgets.QMessageBox.StandardButton.Cancel)
        box.buttonClicked.connect(lambda button: self._restart(config) if button is restart else None)
        self.confirm = box
        box.open()

    def _restart(self, config: EngineConfig) -> None:
        self.config = config
        if self._submit is None:
            self.accept()
            return
        self.loading = True
        self.set_busy(f"Loading {config.model}…")
        self._submit(config)

    def restart_failed(self, message: str) -> None:
        """The restart this dialog started failed: keep the values, say why at the field it is about."""
        self.loading = False
        self.set_busy("")
        self.config = None
        kept = " (the previous engine keeps running)" if self.engine_running else " (what is on view stays)"
        self.errors[failure_field(message)].show_error(f"{message}{kept}")
        if not self.isVisible():
            self.open()

    def restart_succeeded(self) -> None:
        self.loading = False
        self.set_busy("")
        self.accept()

    def _show_memory(self, *_) -> None:
        self.memory.setText(pool_memory_text(self._values_per_slot, self.block_size.text(), self.num_blocks.text(),
                                             self.kv_cache_dtype.currentText(), self._model_dtype))


# the engine's parameter names in its refusals -> the field; a refusal naming none (a prompt that does not fit, a
# token outside the vocabulary) is about the message
REFUSAL_FIELDS = (("temperature", "temperature"), ("max_new_tokens", "max_new_tokens"), ("n must", "samples"))


def refusal_field(message: str, fields, default: str) -> str:
    """The field an engine's refusal is about (the engine names its parameter: "temperature 1e-30 is too small"),
    among ``fields``; ``default`` (the message's field) when it names none of them."""
    text = message.lower()
    for word, field in REFUSAL_FIELDS:
        if word in text and field in fields:
            return field
    return default


KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # EngineConfig.kv_cache_dtype


def values_per_slot(snapshot: PoolSnapshot | None) -> int | None:
    """K and V values of one token slot across the layers of the model a snapshot shows (its bytes per token over
    the bytes of a value of its pool's dtype); None where the snapshot does not say both."""
    if snapshot is None or snapshot.memory is None or snapshot.kv_cache_dtype not in KV_DTYPE_BYTES:
        return None
    return snapshot.memory.bytes_per_token // KV_DTYPE_BYTES[snapshot.kv_cache_dtype]


def pool_memory_text(values: int | None, block_size: str, num_blocks: str, kv_cache_dtype: str,
                     model_dtype: str) -> str:
    """'1,024 blocks of 16 slots in fp8_e4m3: 90.0 MiB. The same memory holds 256 blocks in float32, 512 in bfloat16,
    1,024 in fp8.' ('' without the model's size or with a field that is not a number yet)."""
    try:
        slots, blocks = int(block_size), int(num_blocks)
    except ValueError:
        return ""
    if values is None or slots < 1 or blocks < 1:
        return ""
    name = model_dtype if kv_cache_dtype == "auto" else ("fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype)
    per_value = KV_DTYPE_BYTES.get(name, 4)
    total = blocks * slots * values * per_value
    amount = f"{total / (1 << 30):.2f} GiB" if total >= 1 << 30 else f"{total / (1 << 20):.1f} MiB"
    others = ", ".join(f"{total // (slots * values * size):,} in {label}"
                       for label, size in (("float32", 4), ("bfloat16", 2), ("fp8", 1)))
    return (f"{blocks:,} blocks of {slots} slots in {name}: {amount} of K/V for this model. The same memory holds "
            f"{others}.")


NAMED_MODELS = ("builtin", "smollm2")  # the model names EngineConfig(model=...) knows (README, --model, --fetch-model)


def check_model_spec(text: str) -> tuple[str, str]:
    """(the model spec, why it cannot be one or ''): a known name ("builtin", "smollm2"), a ``.gguf`` file, or a
    checkpoint directory, as ``--model`` takes them. A named model that has not been fetched says the command to run
    here, before a restart is tried."""
    model = text.strip()
    if not model:
        return model, "Type a model name (smollm2), a .gguf file or a checkpoint directory (or pick built-in)."
    if model in NAMED_MODELS:
        if model != "builtin":
            from engine import fetched_model
            if fetched_model(model) is None:
                return model, (f"{model} has not been fetched yet: run `python main.py --fetch-model {model}` once "
                               "(about 93 MB), then restart.")
        return model, ""
    if model.lower().endswith(".gguf"):
        return model, "" if os.path.isfile(model) else f"No such GGUF file: {model}"
    if os.path.isfile(model):
        return model, (f"{model} is a file; choose a .gguf file or the checkpoint's directory (the folder holding "
                       "config.json and the *.safetensors files).")
    if not os.path.isdir(model):
        return model, f"No such directory: {model} (model names: {', '.join(NAMED_MODELS)})"
    return model, ""


def failure_field(message: str) -> str:
    """Which restart field an engine's failure message is about (the model unless it names another)."""
    text = message.lower()
    if "kv_cache_dtype" in text:
        return "kv_cache_dtype"
    if "block_size" in text or "block size" in text:
        return "block_size"
    if "num_blocks" in text or "pool" in text or "memory" in text:
        return "num_blocks"
    if "device" in text or "cuda" in text:
        return "device"
    return "model"
