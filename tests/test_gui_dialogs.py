"""Dialogs refuse bad input at the field and send nothing; engine restarts keep the old engine on failure."""
from PySide6 import QtCore, QtWidgets

from explorer.window.dialogs import AddConversationDialog, ReplyDialog, RestartDialog, parse_number, parse_token_ids
from explorer.window import files
from test_gui_support import open_add_dialog, wait_for_snapshot


def spy_on_submit(window):
    """Record the names of commands the window sends from now on."""
    sent = []
    submit = window.runner.submit

    def recording(name, *args, **kwargs):
        sent.append(name)
        return submit(name, *args, **kwargs)

    window.runner.submit = recording
    return sent


def test_parse_number():
    assert parse_number("12", "N") == (12, "")
    assert parse_number(" 0.5 ", "T", float) == (0.5, "")
    assert "whole number" in parse_number("abc", "N")[1]
    assert "at least 1" in parse_number("0", "N", int, 1)[1]
    assert "finite" in parse_number("nan", "T", float)[1]


def test_add_dialog_refuses_bad_input_and_sends_nothing(qtbot, make_window):
    window = make_window(paused=True)
    sent = spy_on_submit(window)
    dialog = window.open_add_dialog()
    dialog.try_accept()  # empty prompt
    assert "empty" in dialog.error_text("prompt")
    dialog.prompt.setPlainText("A fine prompt")
    dialog.max_new_tokens.setText("lots")
    dialog.temperature.setText("warm")
    dialog.samples.setText("2.5")
    dialog.try_accept()
    assert "whole number" in dialog.error_text("max_new_tokens")
    assert "number" in dialog.error_text("temperature")
    assert "whole number" in dialog.error_text("samples")
    qtbot.waitUntil(lambda: dialog.busy.text() == "", timeout=3000)  # the prompt's length was checked too
    assert dialog.error_text("prompt") == ""
    assert dialog.errors["max_new_tokens"].isVisible()
    assert dialog.isVisible() and sent == []  # the tokenizer is called directly; nothing reached the engine thread

    dialog.max_new_tokens.setText("8")
    dialog.temperature.setText("0")
    dialog.samples.setText("1")
    dialog.prompt.setPlainText("x" * 300)  # 64 blocks x 4 slots = 256 slots: can never fit
    dialog.try_accept()
    qtbot.waitUntil(lambda: "needs 77 blocks" in dialog.error_text("prompt"), timeout=3000)
    assert dialog.error_text("prompt").startswith("Too long: this conversation needs 77 blocks (301 prompt tokens")
    assert "The prompt alone is too long" in dialog.error_text("prompt")
    assert dialog.isVisible()
    assert sent == []  # the length check is the tokenizer's alone: nothing reached the engine thread
    qtbot.wait(100)
    assert window.snapshot.conversations == ()


def test_add_dialog_refuses_more_than_the_model_handles(qtbot, make_window):
    """With a pool bigger than the built-in model's 1024 positions, the model's limit is said at the field."""
    window = make_window(paused=True, num_blocks=320, block_size=4)  # 1280 slots
    assert window.snapshot.max_model_len == 1024
    sent = spy_on_submit(window)
    dialog = window.open_add_dialog()
    dialog.prompt.setPlainText("x" * 1000)
    dialog.max_new_tokens.setText("100")
    dialog.try_accept()
    qtbot.waitUntil(lambda: "model handles at most 1024" in dialog.error_text("prompt"), timeout=3000)
    assert "at most 23 new tokens fit" in dialog.error_text("prompt") and dialog.isVisible()  # 1001 + 23 = 1024
    dialog.max_new_tokens.setText("1100")
    dialog.try_accept()
    assert "at most 1024" in dialog.error_text("max_new_tokens")
    assert "add_conversation" not in sent


def test_add_dialog_with_samples_forks(qtbot, make_window):
    window = make_window(speed=20)
    dialog = open_add_dialog(window, "Three samples please", max_new_tokens=30, samples=3)
    dialog.try_accept()
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 3)
    parent = snap.conversations[0].conversation_id
    assert [c.parent_id for c in snap.conversations[1:]] == [parent, parent]


def test_reply_dialog_refuses_empty_message(qtbot, make_window):
    def setup(engine):
        engine.add_conversation("Done soon.", max_new_tokens=2)
        engine.run_until_idle()

    window = make_window(setup=setup, paused=True)
    sent = spy_on_submit(window)
    dialog = window.open_reply_dialog(window.snapshot.conversations[0].conversation_id)
    dialog.try_accept()
    assert "empty" in dialog.error_text("message")
    dialog.message.setPlainText("more")
    dialog.max_new_tokens.setText("-3")
    dialog.try_accept()
    assert "at least 1" in dialog.error_text("max_new_tokens")
    qtbot.waitUntil(lambda: dialog.busy.text() == "", timeout=3000)
    assert "continue_conversation" not in sent and dialog.isVisible()


def test_restart_dialog_validation(qtbot, make_window, tmp_path):
    window = make_window(paused=True)
    dialog = window.open_restart_dialog()
    dialog.block_size.setText("sixteen")
    dialog.num_blocks.setText("1")
    dialog.checkpoint.setChecked(True)
    dialog.path.setText(str(tmp_path / "missing"))
    dialog.try_accept()
    assert "whole number" in dialog.error_text("block_size")
    assert "at least 2" in dialog.error_text("num_blocks")
    assert "No such directory" in dialog.error_text("model")
    assert dialog.config is None and dialog.isVisible()


def test_restart_with_bad_checkpoint_keeps_old_engine(qtbot, make_window, tmp_path):
    window = make_window(speed=50)
    old = window.runner
    window.restart_engine(window.config.__class__(model=str(tmp_path), block_size=4, num_blocks=64))
    qtbot.waitUntil(lambda: len(window.errors) > 0, timeout=10000)
    title, text = window.errors[-1]
    assert title == "Engine restart failed" and "previous engine keeps running" in text
    assert window.runner is old and old.alive


def test_restart_swaps_in_new_engine(qtbot, make_window):
    window = make_window(paused=True)
    old = window.runner
    window.relocation.set_busy(True)  # as if a relocation were in flight on the old engine
    dialog = window.open_restart_dialog()
    dialog.block_size.setText("8")
    dialog.num_blocks.setText("32")
    dialog.builtin.setChecked(True)
    dialog.try_accept()
    assert dialog.loading and dialog.isVisible()  # open, values kept, until the new engine is up
    add = open_add_dialog(window, "sized for the old pool")
    qtbot.waitUntil(lambda: window.runner is not old, timeout=10000)
    assert dialog.result() == QtWidgets.QDialog.DialogCode.Accepted and not dialog.isVisible()
    assert not old.alive and window.runner.alive and window.runner.paused  # the user had paused it
    assert not add.isVisible() and window.relocation.scramble.isEnabled()  # nothing waits on the old engine
    snap = wait_for_snapshot(qtbot, window, lambda s: s.num_blocks == 32)
    assert snap.block_size == 8
    qtbot.waitUntil(lambda: window.grid.geometry_ is not None and window.grid.geometry_.num_blocks == 32, timeout=2000)
    assert "32 blocks" in window.windowTitle()


def test_restart_with_checkpoint_directory_shows_progress(qtbot, make_window, tmp_path):
    from helpers import write_tiny_checkpoint
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    window = make_window(paused=True)
    old = window.runner
    dialog = window.open_restart_dialog()
    dialog.checkpoint.setChecked(True)
    dialog.path.setText(str(checkpoint))
    dialog.try_accept()
    assert dialog.config.model == str(checkpoint)
    progress = window.restart_progress
    assert progress.isVisible()  # progress while the worker thread loads
    qtbot.waitUntil(lambda: window.runner is not old, timeout=15000)
    assert not progress.isVisible() and window.restart_progress is None and not old.alive
    snap = wait_for_snapshot(qtbot, window, lambda s: s.model_name == str(checkpoint))
    assert snap.num_blocks == window.config.num_blocks and window.errors == []


def test_lesson_menu_opens_the_lesson_window(qtbot, make_window):
    window = make_window(paused=True)
    window.window_actions.lesson.trigger()
    assert isinstance(window.lesson_window, QtWidgets.QMainWindow) and window.lesson_window.isVisible()
    assert window.errors == []


def test_cancel_while_checking_sends_nothing(qtbot, make_window):
    window = make_window(paused=True)
    sent = spy_on_submit(window)
    dialog = open_add_dialog(window, "Cancel me before the length check answers")
    dialog.try_accept()  # the tokenizer is asked; the answer is taken on a timer
    dialog.reject()
    qtbot.wait(300)
    assert sent == [] and dialog.request is None
    assert dialog.result() == QtWidgets.QDialog.DialogCode.Rejected
    assert window.snapshot.conversations == ()


def test_checkpoint_without_tokenizer_explains_at_the_prompt(qtbot, make_window, tmp_path):
    from helpers import write_tiny_checkpoint
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")  # no tokenizer.json: text prompts are refused
    window = make_window(paused=True)
    old = window.runner
    window.restart_engine(window.config.__class__(model=str(checkpoint), block_size=4, num_blocks=64))
    qtbot.waitUntil(lambda: window.runner is not old, timeout=15000)
    assert window.runner.paused  # a restart keeps the engine paused when it was
    sent = spy_on_submit(window)
    dialog = window.open_add_dialog()
    assert dialog.ids_mode() and not dialog.mode.isEnabled()  # no tokenizer: the dialog opens taking ids
    assert "no tokenizer" in dialog.mode.toolTip()
    dialog.reject()
    dialog = AddConversationDialog(window.commands._tokenize, window.source.futures.watch, window.snapshot, window)
    dialog.open()
    dialog.prompt.setPlainText("Hello")  # text anyway (a dialog not told): the engine's tokenizer says why not
    dialog.try_accept()
    qtbot.waitUntil(lambda: "tokenizer" in dialog.error_text("prompt"), timeout=3000)
    assert "Switch 'Prompt as' to token ids" in dialog.error_text("prompt") and dialog.isVisible()
    assert sent == [] and window.errors == []  # the engine's own tokenizer refused it, on the GUI thread
    qtbot.wait(100)
    assert window.snapshot.conversations == ()
    # the way out: the same dialog takes token ids, and the engine checks them against its vocabulary (97)
    submit_dialog = AddConversationDialog(window.commands._tokenize, window.source.futures.watch, window.snapshot,
                                          window, submit=submit_through(window))
    submit_dialog.set_ids_mode(True)
    submit_dialog.prompt.setPlainText("5, 120 7")
    submit_dialog.try_accept()
    qtbot.waitUntil(lambda: "outside the vocabulary" in submit_dialog.error_text("prompt"), timeout=3000)
    assert "token id 120" in submit_dialog.error_text("prompt") and submit_dialog.result() == 0
    submit_dialog.prompt.setPlainText("5, 12 7")
    submit_dialog.try_accept()
    qtbot.waitUntil(lambda: submit_dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=3000)
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 1)
    assert snap.conversations[0].prompt_token_ids == (5, 12, 7) == submit_dialog.request.prompt_token_ids
    assert submit_dialog.answer == snap.conversations[0].conversation_id


def test_closing_while_a_restart_loads_starts_no_engine(qtbot, make_window):
    window = make_window(paused=True)
    old = window.runner
    window.restart_engine(window.config.__class__(model="builtin", block_size=8, num_blocks=32))
    window.close()
    assert not old.alive
    qtbot.waitUntil(lambda: window._loader is None, timeout=10000)  # the load finished (or failed) after closing
    assert window.runner is old and window.restart_progress is None


# ---- issue 13 -------------------------------------------------------------------------------------------------
def submit_through(window):
    """What the window would pass as ``submit``: send an AddRequest to the engine, return the Future."""
    def submit(request):
        if request.prompt_token_ids is not None:
            return window.runner.submit("add_conversation", prompt_token_ids=list(request.prompt_token_ids),
                                        max_new_tokens=request.max_new_tokens, temperature=request.temperature)
        return window.runner.submit("add_conversation", prompt=request.prompt, max_new_tokens=request.max_new_tokens,
                                    temperature=request.temperature)
    return submit


def test_parse_token_ids():
    assert parse_token_ids("12 7 99") == ((12, 7, 99), "")
    assert parse_token_ids(" 12, 7,99 \n 3") == ((12, 7, 99, 3), "")
    assert "not a token id" in parse_token_ids("12 seven")[1] and parse_token_ids("-1")[0] is None
    assert "No token ids" in parse_token_ids(" , ")[1]


def test_add_dialog_shows_every_error_at_once(qtbot, make_window):
    window = make_window(paused=True)  # 64 blocks of 4
    dialog = window.open_add_dialog()
    dialog.prompt.setPlainText("x" * 300)  # too long for the pool, found by the engine's tokenizer
    dialog.temperature.setText("warm")
    dialog.samples.setText("0")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.error_text("prompt") != "", timeout=3000)
    assert "Too long" in dialog.error_text("prompt")
    assert "number" in dialog.error_text("temperature") and "at least 1" in dialog.error_text("samples")
    assert dialog.isVisible() and dialog.request is None


def field_positions(dialog):
    return [dialog.form.itemAt(i).widget().geometry().top() for i in range(dialog.form.count())
            if dialog.form.itemAt(i).widget() is not None]


def test_error_lines_do_not_move_the_fields(qtbot, make_window):
    window = make_window(paused=True)
    dialog = window.open_add_dialog()
    qtbot.waitExposed(dialog)
    before, size = field_positions(dialog), dialog.size()
    dialog.max_new_tokens.setText("lots")
    dialog.temperature.setText("warm")
    dialog.samples.setText("2.5")
    dialog.try_accept()
    qtbot.wait(50)
    assert dialog.error_text("samples") and field_positions(dialog) == before and dialog.size() == size


def test_token_ids_in_the_add_and_reply_dialogs(qtbot, make_window):
    window = make_window(paused=True)
    sent = spy_on_submit(window)
    dialog = window.open_add_dialog()
    dialog.set_ids_mode(True)
    assert not dialog.use_system.isEnabled()  # the system prompt is text
    dialog.prompt.setPlainText("12 seven")
    dialog.try_accept()
    assert "not a token id" in dialog.error_text("prompt") and sent == [] and dialog.isVisible()
    dialog.prompt.setPlainText("12, 7 99")
    dialog.try_accept()  # ids are counted here and sent as ids (they went out as prompt="" and were refused)
    qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=3000)
    assert "tokenize" not in sent and sent == ["add_conversation"] and window.errors == []
    assert dialog.request.prompt_token_ids == (12, 7, 99) and dialog.request.prompt == ""
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 1)
    assert snap.conversations[0].prompt_token_ids == (12, 7, 99)
    assert dialog.answer == snap.conversations[0].conversation_id
    qtbot.waitUntil(lambda: window.conversations.selected_conversation() == dialog.answer, timeout=3000)
    snap = window.snapshot
    reply = ReplyDialog(3, 250, window.commands._tokenize, window.source.futures.watch, snap, window)
    reply.set_ids_mode(True)
    reply.message.setPlainText(" ".join(["5"] * 6))
    reply.max_new_tokens.setText("8")
    reply.try_accept()  # 250 history + 6 + 8 new: 66 blocks of 4 > 64
    assert "Too long" in reply.error_text("message") and "at most 1 new token fit" in reply.error_text("message")
    reply.max_new_tokens.setText("1")
    reply.try_accept()
    assert reply.request.prompt_token_ids == (5,) * 6 and reply.request.message == ""


def test_add_dialog_with_submit_stays_open_on_a_refusal(qtbot, make_window):
    window = make_window(paused=True)  # the built-in model: 258 token ids
    dialog = AddConversationDialog(window.commands._tokenize, window.source.futures.watch, window.snapshot, window,
                                   submit=submit_through(window))
    dialog.open()
    dialog.set_ids_mode(True)
    dialog.prompt.setPlainText("72 105 999")
    dialog.try_accept()
    qtbot.waitUntil(lambda: "outside the vocabulary" in dialog.error_text("prompt"), timeout=3000)
    assert dialog.isVisible() and window.snapshot.conversations == () and window.errors == []


def restart_dialog_with_loader(window, **kwargs):
    """A restart dialog whose submit starts a real engine load, reporting back as the window would."""
    from explorer.window.loader import EngineLoader
    loader = EngineLoader(window)
    dialog = RestartDialog(window.config, window, submit=loader.start, **kwargs)
    loader.failed.connect(lambda message, _details: dialog.restart_failed(message))
    loader.loaded.connect(lambda engine: dialog.restart_succeeded())
    return dialog


def test_failed_restart_keeps_the_values_and_says_why_at_the_field(qtbot, make_window, tmp_path):
    window = make_window(paused=True)
    dialog = restart_dialog_with_loader(window)
    dialog.open()
    (tmp_path / "empty").mkdir()
    dialog.block_size.setText("8")
    dialog.num_blocks.setText("48")
    dialog.checkpoint.setChecked(True)
    dialog.path.setText(str(tmp_path / "empty"))  # a directory, but no checkpoint in it
    dialog.try_accept()
    assert dialog.loading and not dialog.ok_button().isEnabled()
    qtbot.waitUntil(lambda: dialog.error_text("model") != "", timeout=10000)
    assert "previous engine keeps running" in dialog.error_text("model") and dialog.isVisible()
    assert (dialog.block_size.text(), dialog.num_blocks.text(), dialog.path.text()) == ("8", "48",
                                                                                       str(tmp_path / "empty"))
    assert dialog.ok_button().isEnabled() and dialog.config is None
    dialog.builtin.setChecked(True)  # corrected: the built-in model
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=10000)
    assert dialog.config.block_size == 8 and dialog.config.num_blocks == 48


def test_restart_asks_before_discarding_conversations(qtbot, make_window, tmp_path):
    window = make_window(paused=True)
    dialog = RestartDialog(window.config, window, num_conversations=3)
    dialog.open()
    dialog.try_accept()
    box = dialog.confirm
    assert box is not None and box.isVisible() and "3 conversations will be discarded" in box.text()
    qtbot.mouseClick(box.button(QtWidgets.QMessageBox.StandardButton.Cancel), QtCore.Qt.MouseButton.LeftButton)
    assert dialog.isVisible() and dialog.config is None  # nothing restarted
    dialog.try_accept()
    restart = next(b for b in dialog.confirm.buttons() if b.text() == "Restart")
    qtbot.mouseClick(restart, QtCore.Qt.MouseButton.LeftButton)
    assert dialog.result() == QtWidgets.QDialog.DialogCode.Accepted and dialog.config is not None
    quiet = RestartDialog(window.config, window)  # an empty engine: nothing to lose, no question
    quiet.open()
    quiet.try_accept()
    assert quiet.confirm is None and quiet.result() == QtWidgets.QDialog.DialogCode.Accepted


def test_restart_with_a_file_for_a_model_says_it_is_a_file(qtbot, make_window, tmp_path):
    window = make_window(paused=True)
    dialog = RestartDialog(window.config, window)
    (tmp_path / "model.safetensors").write_bytes(b"")
    dialog.checkpoint.setChecked(True)
    dialog.path.setText(str(tmp_path / "model.safetensors"))
    dialog.try_accept()
    assert "is a file; choose a .gguf file or the checkpoint's directory" in dialog.error_text("model")


def test_typing_goes_into_the_prompt_and_tab_moves_on(qtbot, make_window):
    """Found in the X window: the add dialog opened with the focus on 'Prompt as', and the space in the typed
    'Record me please.' pressed OK ('The prompt is empty')."""
    window = make_window(paused=True)
    window.activateWindow()
    for open_dialog, editor in ((window.open_add_dialog, "prompt"),):
        dialog = open_dialog()
        qtbot.waitExposed(dialog)
        qtbot.waitUntil(lambda: QtWidgets.QApplication.focusWidget() is getattr(dialog, editor), timeout=2000)
        qtbot.keyClicks(QtWidgets.QApplication.focusWidget(), "Record me please.")
        assert getattr(dialog, editor).toPlainText() == "Record me please." and dialog.isVisible()
        assert dialog.error_text(editor) == ""
        qtbot.keyClick(QtWidgets.QApplication.focusWidget(), QtCore.Qt.Key.Key_Tab)
        assert QtWidgets.QApplication.focusWidget() is dialog.max_new_tokens
        qtbot.keyClick(dialog.max_new_tokens, QtCore.Qt.Key.Key_Return, QtCore.Qt.KeyboardModifier.ControlModifier)
        qtbot.waitUntil(lambda: dialog.result() == QtWidgets.QDialog.DialogCode.Accepted, timeout=3000)
        assert wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 1).conversations[0].prompt_text \
            == "Record me please."


def test_restart_dialog_takes_model_names_and_gguf_files(qtbot, make_window, tmp_path, monkeypatch):
    """Found with smollm2: the dialog said "No such directory: smollm2" (and "is a file" for a .gguf), and it
    pre-fills "smollm2" while smollm2 runs, so OK failed without a change."""
    import dataclasses

    import engine
    window = make_window(paused=True)

    def accepted(model, cfg=window.config):
        dialog = RestartDialog(cfg, window)
        dialog.checkpoint.setChecked(True)
        if model is not None:
            dialog.path.setText(model)
        dialog.try_accept()
        return dialog

    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    for model in ("builtin", str(gguf)):
        dialog = accepted(model)
        assert dialog.error_text("model") == "" and dialog.config.model == model
    dialog = accepted(str(tmp_path / "missing.gguf"))
    assert "No such GGUF file" in dialog.error_text("model") and dialog.config is None
    # smollm2 not fetched (the tests' own cache is empty): the one command to run, at the field
    dialog = accepted("smollm2")
    assert "python main.py --fetch-model smollm2" in dialog.error_text("model") and dialog.config is None
    # fetched, and running: the dialog opens on it and OK restarts with it
    monkeypatch.setattr(engine, "fetched_model", lambda name: "SmolLM2-135M-Instruct")
    dialog = accepted(None, dataclasses.replace(window.config, model="smollm2"))
    assert dialog.path.text() == "smollm2" and dialog.checkpoint.isChecked()
    assert dialog.error_text("model") == "" and dialog.config.model == "smollm2"


def test_tests_never_see_a_fetched_model():
    """A developer's fetched smollm2 must not change what the GUI tests run: the session has its own cache."""
    import os

    from engine.native import cache_dir
    from explorer.feeds.demo import pick_model
    assert os.environ.get("PAGED_KV_EXPLORER_CACHE") and "paged-kv-tests-" in str(cache_dir())
    assert pick_model(None, "busy")[0] == "builtin"


def test_long_validation_messages_are_never_cut(qtbot, make_window):
    """Found in the X window: 'block size 4096 with 1,048,576 blocks' and a long prompt with Max new tokens 1024
    were cut after two lines; the whole message must be readable (the label grows, and the dialog with it)."""
    window = make_window(paused=True)
    restart = window.open_restart_dialog()
    qtbot.waitExposed(restart)
    restart.block_size.setText("4096")
    restart.num_blocks.setText("1048576")
    restart.try_accept()
    add = open_add_dialog(window, "a long prompt " * 40, max_new_tokens=1024)
    qtbot.waitExposed(add)
    add.try_accept()
    qtbot.waitUntil(lambda: bool(add.error_text("prompt")), timeout=3000)
    long = "Too long: " + "this sentence explains what went wrong and what to do about it; " * 6
    restart.errors["model"].show_error(long)
    for dialog in (restart, add):
        for key, label in dialog.errors.items():
            if label.message:
                qtbot.waitUntil(lambda: label.height() >= label.heightForWidth(label.width()), timeout=2000)
                bottom = label.mapTo(dialog, label.rect().bottomLeft()).y()
                assert bottom <= dialog.height(), key  # inside the dialog, not under its edge
    assert restart.errors["model"].height() > 3 * restart.errors["model"].fontMetrics().lineSpacing()


def test_the_empty_prompt_error_clears_while_typing(qtbot, make_window):
    window = make_window(paused=True)
    dialog = open_add_dialog(window, "")
    dialog.try_accept()
    assert "empty" in dialog.error_text("prompt")
    qtbot.keyClicks(dialog.prompt, "h")
    assert dialog.error_text("prompt") == ""


def test_demos_are_disabled_for_a_model_without_a_tokenizer(qtbot, make_window, tmp_path):
    """Found in the X window: picking a demo with a tokenizer-less model raised "Engine restart failed" speaking of
    prompt_token_ids. The demos write text: they are disabled, and say why."""
    from helpers import write_tiny_checkpoint
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    window = make_window(paused=True)
    demos = window.window_actions.demos
    assert all(action.isEnabled() for action in demos.values())
    old = window.runner
    window.restart_engine(window.config.__class__(model=str(checkpoint), block_size=4, num_blocks=64))
    qtbot.waitUntil(lambda: window.runner is not old, timeout=15000)
    for name in ("busy", "crowd", "serve"):
        assert not demos[name].isEnabled() and "no tokenizer" in demos[name].toolTip(), name
    assert demos["lesson"].isEnabled()  # the lesson has no engine
    old = window.runner
    window.restart_engine(window.config.__class__(model="builtin", block_size=4, num_blocks=64))
    qtbot.waitUntil(lambda: window.runner is not old, timeout=15000)
    assert demos["busy"].isEnabled() and "no tokenizer" not in demos["busy"].toolTip()


def test_counts_are_singular_for_one_and_use_one_number_format(qtbot, make_window):
    """"1 new tokens", "1 tokens"; "step 2,100" beside "step 2100": one way to say a count everywhere."""
    from explorer.model.words import count
    assert count(1, "new token") == "1 new token" and count(2100, "token") == "2,100 tokens"
    window = make_window(paused=True, num_blocks=4, block_size=4)  # 16 slots
    dialog = AddConversationDialog(window.commands._tokenize, window.source.futures.watch, window.snapshot, window)
    message = dialog.fit_message(16, 8)  # 16 prompt tokens: one new token fits (the last needs no slot)
    assert "at most 1 new token fit" in message


def widget_tops(dialog):
    """Where every field and the OK button are, in the dialog, once its layouts have done what they were asked
    (what the event loop would do next: the comparison never depends on how busy the machine is)."""
    QtWidgets.QApplication.sendPostedEvents(None, QtCore.QEvent.Type.LayoutRequest)
    for widget in [dialog, *dialog.findChildren(QtWidgets.QWidget)]:
        if widget.layout() is not None:
            widget.layout().activate()
    return field_positions(dialog) + [dialog.ok_button().mapTo(dialog, QtCore.QPoint(0, 0)).y()]


def settled_tops(qtbot, dialog):
    """widget_tops once the dialog has stopped moving: the same positions and size on three reads in a row, the
    event loop running between them (a dialog that adjusts its size does so after the event that asked)."""
    seen = []

    def still() -> bool:
        seen.append((widget_tops(dialog), dialog.size().toTuple()))
        return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
    qtbot.waitUntil(still, timeout=5000)
    return seen[-1][0]


def test_an_engine_refusal_lands_under_its_field_and_nothing_moves(qtbot, make_window):
    """Issue 49: a temperature of 1e-30 passes the dialog's own check and the engine refuses it; the refusal
    appeared under the prompt, and the fields and OK jumped as errors came and went."""
    window = make_window(paused=True)
    dialog = open_add_dialog(window, "Hello there")
    qtbot.waitExposed(dialog)
    before = settled_tops(qtbot, dialog)
    dialog.temperature.setText("1e-30")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.error_text("temperature") != "", timeout=5000)
    assert dialog.error_text("temperature").startswith("Temperature 1e-30 is too small to sample from")
    assert dialog.error_text("prompt") == ""
    qtbot.waitUntil(lambda: dialog.ok_button().isEnabled(), timeout=2000)
    assert settled_tops(qtbot, dialog) == before  # the refusal fits its room: nothing moved
    dialog.temperature.setText("0.8")  # corrected: the error goes at once, and nothing moves back
    assert dialog.error_text("temperature") == "" and settled_tops(qtbot, dialog) == before
    dialog.samples.setText("many")
    dialog.try_accept()
    assert dialog.error_text("samples") and settled_tops(qtbot, dialog) == before
    dialog.set_busy("Sending to the engine…")  # the line under the form keeps its room, said or not
    assert settled_tops(qtbot, dialog) == before
    dialog.set_busy("")
    error = dialog.errors["samples"]  # a message longer than its room grows it once, and it stays grown
    error.show_error("this sentence explains what went wrong and what to do about it; " * 5)
    qtbot.waitUntil(lambda: widget_tops(dialog) != before, timeout=2000)  # room made for it, once
    grown = settled_tops(qtbot, dialog)
    error.show_error("")
    assert settled_tops(qtbot, dialog) == grown


def test_a_restart_error_clears_when_its_field_is_corrected(qtbot, make_window):
    window = make_window(paused=True)
    dialog = window.open_restart_dialog()
    assert dialog.engine_running  # over the local engine: a failure says it keeps running
    dialog.block_size.setText("0")
    dialog.num_blocks.setText("1")
    dialog.try_accept()
    assert dialog.error_text("block_size") and dialog.error_text("num_blocks")
    dialog.block_size.setText("8")
    assert dialog.error_text("block_size") == "" and dialog.error_text("num_blocks")
    dialog.num_blocks.setText("64")
    assert dialog.error_text("num_blocks") == ""
    dialog.restart_failed("No such directory: /nowhere")
    assert dialog.error_text("model").endswith("(the previous engine keeps running)")
    dialog.checkpoint.setChecked(True)  # another model: the failure was about the one before
    assert dialog.error_text("model") == ""
    dialog.reject()


def test_a_restart_over_a_recording_does_not_speak_of_a_previous_engine(qtbot, make_window, tmp_path):
    window = make_window(setup=lambda e: e.add_conversation("Record me", max_new_tokens=200), speed=40, history=True)
    path = tmp_path / "run.kvpool"
    assert files.start_recording(window, str(path))
    recorder, joining = window.source.feed.recorders[-1]
    qtbot.waitUntil(lambda: joining.primed and recorder.frames_written >= 2, timeout=5000)
    files.stop_recording(window)
    qtbot.waitUntil(lambda: recorder.closed, timeout=5000)
    assert files.open_recording(window, str(path))
    qtbot.waitUntil(lambda: window.source.feed.kind == "recording", timeout=3000)
    dialog = window.open_restart_dialog()
    assert not dialog.engine_running
    dialog.restart_failed("No such directory: /nowhere")
    assert "engine keeps running" not in dialog.error_text("model")
    dialog.reject()
