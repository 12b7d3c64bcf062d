"""A chat model in the window: "Add conversation" sends system / user turns in the model's chat template (the shared
system prompt as the system turn), and "Reply" a user turn, as the demos do."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine import Engine, EngineConfig, EngineRunner
from explorer.feeds.demo import SYSTEM_PROMPT
from explorer.window.main_window import MainWindow
from helpers import write_tiny_checkpoint
from test_gui_support import wait_for_snapshot

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_chat_checkpoint(path):
    """The tiny random model with a word-level tokenizer and a ChatML template (as SmolLM2's)."""
    path = write_tiny_checkpoint(path, vocab_size=97)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = (SYSTEM_PROMPT + " user assistant system what is a block table hello again").split()
    tok.train_from_iterator([" ".join(words)] * 3, trainers.WordLevelTrainer(
        vocab_size=97, special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return path


@pytest.fixture
def chat_window(qtbot, tmp_path):
    cfg = EngineConfig(model=str(write_tiny_chat_checkpoint(tmp_path / "chat")), num_blocks=64, block_size=4)
    engine = Engine(cfg)
    assert engine.chat_template is not None
    window = MainWindow(EngineRunner(engine, max_steps_per_second=None).start(), cfg)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
    yield window, engine
    window.close()


def test_add_and_reply_are_chat_turns(qtbot, chat_window):
    window, engine = chat_window
    dialog = window.open_add_dialog()
    dialog.prompt.setPlainText("what is a block table")
    dialog.use_system.setChecked(True)
    dialog.max_new_tokens.setText("3")
    dialog.try_accept()
    qtbot.waitUntil(lambda: dialog.answer is not None, timeout=5000)
    cid = dialog.answer
    expected = engine.chat_prompt_ids([{"role": "system", "content": SYSTEM_PROMPT.strip()},
                                       {"role": "user", "content": "what is a block table"}])
    snap = wait_for_snapshot(qtbot, window, lambda s: s.conversation(cid) is not None
                             and s.conversation(cid).status == "finished")
    assert list(snap.conversation(cid).prompt_token_ids) == expected
    # the reply is a user turn: the assistant's turn is closed, the user's follows, then the assistant's header
    reply = window.commands.open_reply_dialog(cid)
    reply.message.setPlainText("hello again")
    reply.max_new_tokens.setText("2")
    reply.try_accept()
    qtbot.waitUntil(lambda: not reply.isVisible() or bool(reply.error_text("message")), timeout=5000)
    assert reply.error_text("message") == ""
    snap = wait_for_snapshot(qtbot, window, lambda s: s.conversation(cid).status == "finished"
                             and s.conversation(cid).num_tokens > len(expected) + 3)
    turn = engine.chat_prompt_ids([{"role": "user", "content": "hello again"}])  # <|im_start|> user ... assistant
    info = snap.conversation(cid)
    ids = list(info.prompt_token_ids) + list(info.output_token_ids)
    assert any(ids[i:i + len(turn)] == turn for i in range(len(expected), len(ids)))
