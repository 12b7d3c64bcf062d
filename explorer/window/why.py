"""Why did my prompt miss, in the window: the conversation detail's sentence and its marks in the grid, the
inspector's prompt lines, the timeline's regretted evictions, and "Would this prompt hit?" (Pool > Check a
prompt..., and ``--check-prompt FILE``).

One object, :class:`WhyViews`, wires them to the active source, so the main window only builds it and tells it
what changed (a source, the selection). The facts are the sources' (each admission's BlockOutcome per prompt
block, a feed's prompt check); the words are explorer.model.outcome_text's; the bookkeeping (step times, regrets)
explorer.model's, all Qt-free.
"""
from __future__ import annotations

import html
import time

from PySide6 import QtCore, QtGui, QtWidgets

from kvstream.prompt_check import prompt_ids_from_text

from ..model.outcome_text import check_block_words, check_sentence, missed_indices, regret_words
from ..model.regrets import RegretBook
from ..model.step_clock import StepClock

MISS_COLOUR = (255, 70, 50)  # the blocks a selected conversation's prompt missed (it computed them)
HIT_COLOUR = (255, 230, 60)  # the blocks a checked prompt would hit
TABLE_HIT = (30, 140, 60)  # a hit in the check's table (the grid's yellow does not read on a white table)
WATCH_MS = 250  # how often a --check-prompt file is looked at


class CheckPromptDialog(QtWidgets.QDialog):
    """Paste a prompt (text, tokenised as the source's server would; or a JSON list of token ids), press Check:
    which of its blocks the pool holds now, where, why the others would miss; the hits light up in the grid or the
    content view. Non-modal: the pool keeps moving, Check again asks again. With ``--check-prompt FILE`` it shows
    that file's answers as they come."""

    def __init__(self, why: "WhyViews", parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.why = why
        self.setWindowTitle("Check a prompt")
        self.setModal(False)
        self.intro = QtWidgets.QLabel()
        self.intro.setWordWrap(True)
        self.prompt = QtWidgets.QPlainTextEdit()
        self.prompt.setPlaceholderText("Paste a prompt's text, or a JSON list of token ids such as [1, 2, 3]")
        self.prompt.setMinimumHeight(60)
        self.prompt.setMaximumHeight(120)  # the answer and its table get the height
        self.light = QtWidgets.QCheckBox("Light up the blocks it would hit")
        self.light.setChecked(True)
        self.light.toggled.connect(lambda _on: self.why.light_up(self.checks if self.light.isChecked() else None))
        self.answer = QtWidgets.QLabel("")
        self.answer.setWordWrap(True)
        self.answer.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.table = QtWidgets.QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["block", "outcome", "why", "pool block"])
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setStretchLastSection(False)
        self.table.horizontalHeader().setSectionResizeMode(2, QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.check_button = QtWidgets.QPushButton("Check")
        self.check_button.setDefault(True)
        self.check_button.clicked.connect(self.check)
        close = QtWidgets.QPushButton("Close")
        close.clicked.connect(self.close)
        buttons = QtWidgets.QHBoxLayout()
        buttons.addWidget(self.light)
        buttons.addStretch(1)
        buttons.addWidget(self.check_button)
        buttons.addWidget(close)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(self.intro)
        layout.addWidget(self.prompt)
        layout.addLayout(buttons)
        layout.addWidget(self.answer)
        layout.addWidget(self.table, 1)
        self.checks: list | None = None  # the newest answer, one PromptCheck per pool of the source
        self.watching: str | None = None  # the --check-prompt file this dialog shows, or None
        self.resize(720, 480)
        self.source_changed()

    def source_changed(self) -> None:
        feed = self.why.window.source.feed
        tokenizer = "the model's tokenizer" if feed.capabilities.can_command else (
            "the source's tokenizer" if feed.prompt_tokenizer() is not None else "no tokenizer (give token ids, "
                                                                                  "or --tokenizer DIR)")
        where = "the grid" if feed.capabilities.has_physical_pool else "the content view"
        self.intro.setText(f"Would this prompt hit {html.escape(feed.title)} now? Text is tokenised with "
                           f"{tokenizer}. The blocks it would hit light up in {where}."
                           + (f"<br>Watching <b>{html.escape(self.watching)}</b>: its answers appear as it changes."
                              if self.watching else ""))
        self.show_checks(None)

    def watch(self, path: str) -> None:
        self.watching = path
        self.prompt.setReadOnly(True)
        self.check_button.setEnabled(False)
        self.check_button.setToolTip("The prompt comes from the file given with --check-prompt")
        self.source_changed()

    def check(self) -> None:
        """Ask the active source about the prompt typed (an answer comes back at a later frame)."""
        feed = self.why.window.source.feed
        text = self.prompt.toPlainText()
        try:
            ids = prompt_ids_from_text(text)
            if ids is None:
                if not text.strip():
                    raise ValueError("paste a prompt first")
                ids = feed.tokenize_prompt(text)
        except (ValueError, TypeError) as exc:
            self.show_error(str(exc))
            return
        self.answer.setText(f"Checking {len(ids):,} tokens…")
        self.why.window.source.futures.watch(feed.check_prompt(ids), self.show_checks,
                                             lambda exc: self.show_error(str(exc)))

    def show_error(self, message: str) -> None:
        self.checks = None
        self.answer.setText(f"<span style='color:#e0443e'>{html.escape(message)}</span>")
        self.table.setRowCount(0)
        self.why.light_up(None)

    def show_checks(self, checks) -> None:
        """An answer (a list of PromptCheck, one per pool), or None: nothing yet."""
        self.checks = list(checks) if checks else None
        if not checks:
            self.answer.setText("")
            self.table.setRowCount(0)
            self.why.light_up(None)
            return
        many = len(checks) > 1
        stamp = time.strftime("%H:%M:%S", time.localtime(checks[0].checked_at))
        lines = [(f"<b>{html.escape(c.source)}</b>: " if many else "") + html.escape(check_sentence(c, self.why.clock))
                 for c in checks]
        self.answer.setText(f"Checked at {stamp}: " + "<br>".join(lines))
        rows = [(c, b) for c in checks for b in c.blocks]
        self.table.setRowCount(len(rows))
        for r, (c, b) in enumerate(rows):
            block = "-" if b.held is None or b.held.block_id is None else str(b.held.block_id)
            cells = (f"{c.source} {b.index}" if many else str(b.index), b.outcome,
                     check_block_words(b, c, self.why.clock), block)
            for col, value in enumerate(cells):
                item = QtWidgets.QTableWidgetItem(value)
                if col == 1:
                    item.setForeground(QtGui.QColor(*(TABLE_HIT if b.hit else MISS_COLOUR)))
                self.table.setItem(r, col, item)
        self.table.resizeColumnToContents(0)
        self.table.resizeColumnToContents(1)
        self.why.light_up(self.checks if self.light.isChecked() else None)

    def closeEvent(self, event) -> None:
        self.why.light_up(None)
        super().closeEvent(event)


class WhyViews(QtCore.QObject):
    """Everything "why did it miss" in the window (see the module docstring)."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.clock = StepClock()  # when the active source's live steps went by (idle times in seconds)
        self.regrets = RegretBook()
        self.marked_regrets: set = set()  # (step, victim, index) already on the timeline
        self.dialog: CheckPromptDialog | None = None
        self.watch = None  # the --check-prompt file's PromptWatch, or None
        self._watch_version = -1
        self.show_misses = False
        detail = window.conversations.detail
        detail.clock = self.clock
        detail.missesToggled.connect(self._misses_toggled)
        window.inspector.step_clock = self.clock
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(WATCH_MS)
        self.timer.timeout.connect(self._tick)

    # ---- the active source -------------------------------------------------------------------------------------
    def _slots(self) -> dict:
        return dict(frameArrived=self._on_frame, viewChanged=self._on_view)

    def follow(self, source) -> None:
        source.connect(**self._slots())

    def unfollow(self, source) -> None:
        source.disconnect(**self._slots())

    def source_changed(self, feed) -> None:
        self.clock.clear()
        self.regrets.clear()
        self.marked_regrets.clear()
        self.window.grid.set_marks((), layer="check")
        self._mark_grid()
        if self.dialog is not None:
            self.dialog.source_changed()
        if self.watch is not None:
            self.watch_file(self.watch.path)  # the same file, asked of the new source

    def _on_frame(self, snapshot) -> None:
        """A live frame: its step went by now; its admissions may reveal regretted evictions."""
        if self.window.source.capabilities.is_live:
            self.clock.saw(snapshot.step_id)
        new = self.regrets.observe(snapshot)
        history = self.window.source.history
        if not new or history is None:
            return
        marks = []
        for r in new:
            key = (r.step, r.victim, r.index)
            seq = history.seq_of_step(r.step) if key not in self.marked_regrets else None
            if seq is not None:
                self.marked_regrets.add(key)
                marks.append((seq, f"step {r.step:,}: " + regret_words(r.victim, r.index, r.outcome, self.clock)))
        if marks:
            self.window.pane.timeline.add_regrets(marks)

    def _on_view(self, snapshot) -> None:
        if self.show_misses:
            self._mark_grid()

    # ---- the selected conversation's misses --------------------------------------------------------------------
    def conversation_selected(self, cid) -> None:
        self._mark_grid()

    def _misses_toggled(self, on: bool) -> None:
        self.show_misses = on
        self._mark_grid()

    def _mark_grid(self) -> None:
        grid, view = self.window.grid, self.window.source.view
        cid = self.window.conversations.selected_conversation()
        if not self.show_misses or view is None or cid is None:
            grid.set_marks(())
            return
        info = view.conversation(cid)
        table = view.block_tables.get(cid, ())
        missed = [table[i] for i in missed_indices(info.prompt_block_outcomes if info else ()) if i < len(table)]
        grid.set_marks(missed, MISS_COLOUR, f"Outlined: the blocks {info.name if info else ''} computed because its "
                       "prompt missed the prefix cache")

    # ---- would this prompt hit? --------------------------------------------------------------------------------
    def open_dialog(self) -> CheckPromptDialog:
        if self.dialog is None:
            self.dialog = CheckPromptDialog(self, self.window)
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog

    def light_up(self, checks) -> None:
        """Light up the blocks ``checks`` would hit (None: clear): device blocks in the grid, stored blocks in a
        KV-event source's content view."""
        pane = self.window.pane
        if pane.content_view is not None:
            pane.content_view.mark_prompt(checks)
        hits = [b.held.block_id for c in (checks or ()) for b in c.hit_blocks
                if b.held is not None and b.held.block_id is not None]
        self.window.grid.set_marks(hits, HIT_COLOUR, "Yellow: the blocks the checked prompt would hit", layer="check")

    def watch_file(self, path: str) -> None:
        """``--check-prompt FILE`` in the window: the dialog shows the file's answers as they come."""
        from ..feeds.prompt_watch import PromptWatch
        self.watch = PromptWatch(path, [self.window.source.feed])
        self._watch_version = -1
        self.open_dialog().watch(path)
        self.timer.start()

    def _tick(self) -> None:
        watch = self.watch
        if watch is None:
            return
        watch.tick()
        if watch.version == self._watch_version or self.dialog is None:
            return
        self._watch_version = watch.version
        state = watch.states[0]
        self.dialog.prompt.setPlainText(watch.text or "")
        if state.status == "checked":
            self.dialog.show_checks(state.checks)
        elif state.status in ("waiting", "error"):
            self.dialog.show_error(f"{watch.path}: {state.error}" if state.status == "waiting" else state.error)
