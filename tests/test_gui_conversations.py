"""The conversations table and detail: why a conversation stopped, and turns shown as turns."""
import numpy as np
import pytest

from kvstream.views import ConversationInfo, FinishReason, PoolSnapshot, Status
from explorer.widgets.conversations import (REPLY_MARK, USER_MARK, ConversationDetail, ConversationsPanel, status_text,
                                    turn_segments)


def text_ids(text):
    return tuple(text.encode())


def detokenize(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def conv(cid, prompt="Hello there.", output="", status=Status.RUNNING, reason=None, turns=None, max_new=32,
         prompt_text=None, output_text=None, prompt_ids=None, output_ids=None):
    prompt_ids = text_ids(prompt) if prompt_ids is None else prompt_ids
    output_ids = text_ids(output) if output_ids is None else output_ids
    return ConversationInfo(
        conversation_id=cid, status=status, prompt_token_ids=prompt_ids, output_token_ids=output_ids,
        output_text=output if output_text is None else output_text,
        prompt_text=prompt if prompt_text is None else prompt_text, block_table=(), num_computed_tokens=0,
        num_cached_tokens=0, max_new_tokens=max_new, temperature=0.0, parent_id=None, num_preemptions=0,
        arrival_step=cid, finish_reason=reason, turns=((0, len(prompt_ids)),) if turns is None else turns)


def view(conversations):
    n = 8
    return PoolSnapshot(step_id=1, block_size=4, num_blocks=n, ref_count=np.zeros(n, np.int32),
                        num_filled=np.zeros(n, np.int32), state=np.zeros(n, np.int8), owner=np.full(n, -1, np.int32),
                        last_access=np.zeros(n, np.int64), block_tables={}, conversations=tuple(conversations))


@pytest.fixture
def panel(qtbot):
    widget = ConversationsPanel()
    qtbot.addWidget(widget)
    widget.resize(900, 300)
    widget.show()
    return widget


def test_table_and_detail_say_why_a_conversation_stopped(panel):
    convs = [conv(0, status=Status.FINISHED, reason=FinishReason.LENGTH), conv(1, status=Status.FINISHED,
                                                                               reason=FinishReason.EOS),
             conv(2, status=Status.ENDED, reason=FinishReason.ENDED),
             conv(3, status=Status.FINISHED, reason=FinishReason.CONTEXT), conv(4)]
    panel.refresh(view(convs))
    model = panel.model
    column = model.COLUMNS.index("stopped by")
    assert [model.data(model.index(r, column)) for r in range(5)] == [
        "max new tokens", "end-of-sequence", "ended by user", "context limit", ""]
    assert [model.data(model.index(r, 1)) for r in range(5)] == ["finished"] * 2 + ["ended", "finished", "running"]
    assert [status_text(c) for c in convs] == ["finished (max new tokens)", "finished (end-of-sequence)",
                                               "ended by user", "finished (context limit)", "running"]
    panel.set_served({2})  # the served traffic's conversation: its client left, the user did nothing
    panel.refresh(view(convs))
    assert model.data(model.index(2, column)) == "the client left"
    assert status_text(convs[2], {2}) == "ended (the client left)"
    panel.select_conversation(0)
    assert "finished (max new tokens)" in panel.detail.title.text()
    assert status_text(conv(5, status=Status.FINISHED)) == "finished"  # a source that does not say why


def two_turns(reply="Sure, blocks."):
    first, answer, follow = "Hello there.", "decoded strin", "Please say more"
    prompt = first + answer + follow
    return conv(7, prompt=prompt, output=reply, turns=((0, len(first)), (len(first + answer), len(prompt))))


def test_a_follow_up_is_not_glued_to_the_reply_before_it(qtbot):
    detail = ConversationDetail()
    qtbot.addWidget(detail)
    detail.set_detokenizer(detokenize)
    info = two_turns()
    detail.show_conversation(info, view([info]))
    text = detail.plain_text()
    assert "strinPlease" not in text
    assert text == "\n".join(["Hello there.", REPLY_MARK, "decoded strin", USER_MARK, "Please say more", REPLY_MARK,
                              "Sure, blocks."])
    assert "turn 2" in detail.title.text()
    longer = two_turns("Sure, blocks. More")  # streaming: only the last reply grows
    detail.show_conversation(longer, view([longer]))
    assert detail.plain_text().endswith(REPLY_MARK + "\nSure, blocks. More")
    assert turn_segments(info, detokenize) == [("user", "Hello there."), ("reply", "decoded strin"),
                                               ("user", "Please say more"), ("reply", "Sure, blocks.")]


def test_turns_watched_live_are_split_without_a_detokenizer(qtbot):
    detail = ConversationDetail()
    qtbot.addWidget(detail)
    first = conv(7, prompt="Hello there.", output="decoded strin", status=Status.FINISHED, reason=FinishReason.LENGTH)
    detail.show_conversation(first, view([first]))
    assert detail.plain_text() == f"Hello there.\n{REPLY_MARK}\ndecoded strin"
    second = two_turns()
    detail.show_conversation(second, view([second]))
    assert USER_MARK + "\nPlease say more\n" + REPLY_MARK in detail.plain_text()
    other = ConversationDetail()  # never saw the first turn: the history is one piece, the reply still apart
    qtbot.addWidget(other)
    other.show_conversation(second, view([second]))
    assert other.plain_text() == f"Hello there.decoded strinPlease say more\n{REPLY_MARK}\nSure, blocks."


def test_token_ids_when_the_source_has_no_text(qtbot):
    detail = ConversationDetail()
    qtbot.addWidget(detail)
    info = conv(3, prompt_ids=(12, 7, 99), output_ids=(5, 6), prompt_text="", output_text="")
    detail.show_conversation(info, view([info]))
    assert detail.plain_text() == f"12 7 99\n{REPLY_MARK}\n5 6"


def test_a_real_reply_shows_as_a_new_turn_and_says_why_it_stopped(qtbot):
    from engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=4))
    cid = engine.add_conversation("Hello", max_new_tokens=6, ignore_eos=True)
    engine.run_until_idle()
    first = engine.conversation(cid)
    engine.continue_conversation(cid, prompt=" more please", max_new_tokens=5)
    engine.run_until_idle()
    info = engine.conversation(cid)
    assert len(info.turns) == 2 and info.finish_reason == FinishReason.LENGTH
    panel = ConversationsPanel()
    qtbot.addWidget(panel)
    panel.set_detokenizer(engine.detokenize)
    panel.refresh(engine.snapshot())
    panel.select_conversation(cid)
    model = panel.model
    assert model.data(model.index(0, model.COLUMNS.index("stopped by"))) == "max new tokens"
    text = panel.detail.plain_text()
    assert text == "\n".join(["Hello", REPLY_MARK, first.output_text, USER_MARK, " more please", REPLY_MARK,
                              info.output_text])


def test_long_ids_are_not_cut_beside_the_colour_swatch(qtbot):
    """Found in the X window (crowd demo): ids from 10 on read '…' in the id column."""
    panel = ConversationsPanel()
    qtbot.addWidget(panel)
    panel.resize(900, 300)
    panel.show()
    panel.refresh(view([conv(i) for i in (7, 42, 127, 12345)]))
    for row in range(4):
        index = panel.model.index(row, 0)
        needed = panel.view.sizeHintForIndex(index).width()  # swatch, margins and the whole id
        assert panel.view.horizontalHeader().sectionSize(0) >= needed, (panel.model.data(index), needed)


def test_rows_are_made_again_only_when_what_they_show_changed(panel):
    """The engine hands out the same info while a conversation is unchanged; a stream rebuilds equal ones. Only
    a changed conversation, or a changed pool under a conversation holding blocks, makes its row again."""
    import dataclasses
    finished = [conv(c, status=Status.FINISHED, reason=FinishReason.LENGTH, output="done") for c in range(50)]
    first = view(finished + [conv(50, output="a")])
    first = dataclasses.replace(first, block_tables={50: (3,)}, ref_count=np.eye(8, dtype=np.int32)[3],
                                num_filled=np.eye(8, dtype=np.int32)[3])
    model = panel.model
    panel.refresh(first)
    assert model.rows_made == 51
    rebuilt = [dataclasses.replace(c) for c in first.conversations]  # what a stream decoder hands out
    panel.refresh(dataclasses.replace(first, conversations=tuple(rebuilt), version=first.version + 1))
    assert model.rows_made == 51
    grown = dataclasses.replace(first, version=first.version + 2, conversations=tuple(rebuilt[:50]) + (
        conv(50, output="ab"),), num_filled=2 * np.eye(8, dtype=np.int32)[3])
    panel.refresh(grown)
    assert model.rows_made == 52  # only the conversation that decoded a token
    shared = dataclasses.replace(grown, version=first.version + 3, ref_count=2 * np.eye(8, dtype=np.int32)[3])
    panel.refresh(shared)
    assert model.rows_made == 53  # its block got shared: only the row that holds blocks is made again
    row = model.row_of(50)
    assert model.data(model.index(row, 3)) == "2" and model.data(model.index(row, 5)) == "1"
    assert model.data(model.index(row, 6)) == "2/4"


def test_an_old_conversation_leaving_the_window_keeps_selection_and_scroll(panel, qtbot):
    """The engine lists the newest 256 finished conversations: when the oldest leaves that window (and a new one
    arrives) the table removes its row and adds the new one instead of resetting, so the selection and the
    scroll position stay where the user has them."""
    done = dict(status=Status.FINISHED, reason=FinishReason.LENGTH)
    convs = [conv(cid, **done) for cid in range(300)]
    panel.refresh(view(convs))
    qtbot.waitUntil(lambda: panel.model.rowCount() == 300, timeout=2000)
    panel.select_conversation(250)
    bar = panel.view.verticalScrollBar()
    panel.view.scrollTo(panel.proxy.mapFromSource(panel.model.index(panel.model.row_of(250), 0)))
    scrolled = bar.value()
    assert scrolled > 0 and panel.selected_conversation() == 250
    resets, selected = [], []
    panel.model.modelReset.connect(lambda: resets.append(1))
    panel.selectionChanged.connect(selected.append)
    panel.refresh(view(convs[1:] + [conv(300)]))  # conversation 0 leaves the window, 300 arrives
    assert panel.model.rowCount() == 300 and panel.model.conversation_id(0) == 1
    assert panel.model.conversation_id(299) == 300
    assert not resets and panel.selected_conversation() == 250 and set(selected) <= {250}  # still 250
    assert abs(bar.value() - scrolled) <= 1  # one row at most: newest first, 300 came in above it
    panel.refresh(view([c for c in convs[1:] if c.conversation_id != 250] + [conv(300)]))
    assert panel.selected_conversation() is None and selected[-1:] == [None]  # its conversation left: said so


def test_shortcuts_follow_the_buttons_rules(qtbot, make_window):  # noqa: F811
    """Found in the X window: Ctrl+F on a finished conversation said "Command refused" while Fork was greyed, and
    End was enabled for a finished conversation (which holds no blocks)."""
    from PySide6 import QtCore
    from test_gui_support import wait_for_snapshot

    def setup(engine):
        engine.add_conversation("Done soon.", max_new_tokens=1)
        engine.add_conversation("Still going on here.", max_new_tokens=200, ignore_eos=True)
        engine.step()
    window = make_window(setup=setup, paused=True)
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 2)
    done, live = sorted(c.conversation_id for c in snap.conversations)
    assert str(snap.conversation(done).status) == "finished"
    actions, buttons = window.window_actions, window.conversations.buttons
    for cid, usable in ((done, {"fork": False, "reply": True, "end": False}),
                        (live, {"fork": True, "reply": False, "end": True})):
        window.conversations.select_conversation(cid)
        qtbot.waitUntil(lambda: window.selected_conversation() == cid, timeout=2000)
        for key, on in usable.items():
            assert buttons[key].isEnabled() == on, (cid, key)
            assert getattr(actions, key).isEnabled() == on, (cid, key)
    window.conversations.select_conversation(done)
    qtbot.waitUntil(lambda: not actions.fork.isEnabled(), timeout=2000)
    qtbot.keyClick(window, "F", QtCore.Qt.KeyboardModifier.ControlModifier)
    qtbot.wait(200)
    assert window.errors == []



def test_the_newest_conversations_come_first(panel):
    """Issue 49: in id order the live rows of the busy and serve demos scrolled out of sight; the table shows the
    newest first (ids compared as numbers), and a new conversation arrives at the top, the selection kept."""
    done = dict(status=Status.FINISHED, reason=FinishReason.LENGTH)
    panel.refresh(view([conv(i, **done) for i in (2, 9, 10)] + [conv(11)]))
    shown = panel.view.model()  # what the view lists, in its order
    assert [shown.index(r, 0).data() for r in range(shown.rowCount())] == ["11", "10", "9", "2"]
    panel.select_conversation(9)
    panel.refresh(view([conv(i, **done) for i in (2, 9, 10)] + [conv(11), conv(12)]))
    assert shown.index(0, 0).data() == "12" and panel.selected_conversation() == 9
    assert panel.view.selectionModel().selectedRows()[0].row() == 3


def test_a_long_title_never_runs_under_the_block_table(qtbot):
    """Issue 49: at 800x600 the detail's title (status, token counts, prompt sources) was squeezed below its wrapped
    height and its last line ran under the block table; the text below gives up the height instead."""
    import dataclasses
    panel = ConversationsPanel()
    qtbot.addWidget(panel)
    panel.resize(800, 160)  # the conversations dock of an 800x600 window
    panel.show()
    qtbot.waitExposed(panel)
    info = dataclasses.replace(conv(2, status=Status.FINISHED, reason=FinishReason.LENGTH, output="done " * 40),
                               prompt_token_sources={"device": 0, "host": 0, "disk": 0, "computed": 39})
    panel.refresh(view([info]))
    panel.select_conversation(2)
    title, table = panel.detail.title, panel.detail.table_area
    qtbot.waitUntil(lambda: "computed 39" in title.text() and title.width() > 100, timeout=3000)
    qtbot.waitUntil(lambda: title.height() >= title.heightForWidth(title.width())
                    and title.geometry().bottom() < table.geometry().top(), timeout=3000)
