"""Why did my prompt miss, in the window (issue 46): the conversation detail says it and marks the missed blocks in
the grid, the inspector says what each owner's admission did with a block, the timeline marks regretted evictions,
and Pool > Check a prompt... (and --check-prompt FILE) lights up the blocks a prompt would hit (pytest-qt,
offscreen, a real engine)."""
from __future__ import annotations

import json

from PySide6 import QtCore

from kvstream.kv_events import BlockStored, KVCacheIndex, make_batch
from explorer.widgets.content_view import ContentView
from explorer.widgets.timeline import Timeline

PREFIX = list(range(1, 13))  # three blocks of 4 with the built-in byte model


def cached_then_running(engine):
    """A finished conversation leaves PREFIX cached; a second one, running, hits its first two blocks, misses the
    third (another token there) and computes a partial tail."""
    engine.add_conversation(prompt_token_ids=PREFIX + [40], max_new_tokens=1)
    engine.run_until_idle()
    engine.add_conversation(prompt_token_ids=PREFIX[:8] + [99, 98, 97, 96, 95], max_new_tokens=200)
    engine.step()


def test_the_detail_says_why_and_marks_the_missed_blocks(qtbot, make_window):
    window = make_window(setup=cached_then_running, paused=True)
    window.conversations.select_conversation(1)
    detail = window.conversations.detail
    qtbot.waitUntil(lambda: detail.why.isVisible(), timeout=3000)
    assert detail.why.text() == ("Prompt cache: 2 of 4 prompt blocks hit on the device; block 2 was never in the "
                                 "pool before (cold); block 3 was not full (only full blocks are cached).")
    table = window.snapshot.block_tables[1]
    assert window.grid.marks() == ()
    detail.mark_misses.setChecked(True)
    assert window.grid.marks() == (table[2], table[3]) and window.grid.mark_layers['misses'][0].isVisible()
    window.conversations.select_conversation(0)  # finished: holds nothing to mark, and hit nothing to tell
    qtbot.waitUntil(lambda: window.grid.marks() == (), timeout=3000)
    assert "None of 4 prompt blocks hit" in detail.why.text()
    window.conversations.select_conversation(1)
    qtbot.waitUntil(lambda: window.grid.marks() == (table[2], table[3]), timeout=3000)
    detail.mark_misses.setChecked(False)
    assert window.grid.marks() == () and not window.grid.mark_layers['misses'][0].isVisible()


def test_the_inspector_says_what_each_owner_did_with_the_block(qtbot, make_window):
    window = make_window(setup=cached_then_running, paused=True)
    table = window.snapshot.block_tables[1]
    window.select_block(table[0])
    qtbot.waitUntil(lambda: window.inspector.prompt.isVisible(), timeout=3000)
    assert window.inspector.prompt.text() == "conversation 1, prompt block 0: a hit on the device"
    window.select_block(table[3])
    qtbot.waitUntil(lambda: "prompt block 3" in window.inspector.prompt.text(), timeout=3000)
    assert "not cached: the prompt's last block was not full" in window.inspector.prompt.text()
    free = next(b for b in range(window.snapshot.num_blocks) if window.snapshot.state[b] == 0)
    window.select_block(free)
    qtbot.waitUntil(lambda: not window.inspector.prompt.isVisible(), timeout=3000)


def test_regretted_evictions_are_marked_where_they_happened(qtbot, make_window):
    window = make_window(history=True, num_blocks=12, eviction_policy="fifo")
    source = window.source
    first = list(range(1, 14))
    for ids in (first, list(range(100, 140)), first):  # cached, evicted for the second, wanted back by the third
        cid = window.runner.submit("add_conversation", prompt_token_ids=ids, max_new_tokens=1).result(10)
        qtbot.waitUntil(lambda: window.snapshot.conversation(cid) is not None
                        and window.snapshot.conversation(cid).status == "finished", timeout=10000)
    timeline = window.pane.timeline
    qtbot.waitUntil(lambda: bool(timeline.regrets), timeout=10000)
    back = window.snapshot.conversations[-1]
    evicted = [o for o in back.prompt_block_outcomes if o.outcome == "evicted"]
    assert evicted and len(timeline.regrets) == len(evicted)
    history = source.history
    assert sorted(history.step_of(seq) for seq, _ in timeline.regrets) == sorted(o.evicted_step for o in evicted)
    seq, note = timeline.regrets[0]
    assert f"cost conversation {back.conversation_id} a hit on prompt block" in note and "by FIFO" in note
    x = timeline.track.x_of(seq)
    assert "regretted eviction: step" in timeline.tooltip_at(x)


def test_check_a_prompt_lights_up_what_it_would_hit(qtbot, make_window):
    window = make_window(setup=cached_then_running, paused=True)
    dialog = window.open_check_prompt()
    dialog.prompt.setPlainText(json.dumps(PREFIX + [7]))
    qtbot.mouseClick(dialog.check_button, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.checks is not None, timeout=5000)
    check = dialog.checks[0]
    assert check.cached_tokens == 12 and [b.outcome for b in check.blocks] == ["device"] * 3 + ["partial"]
    assert "12 of 13 prompt tokens would come from the cache" in dialog.answer.text()
    assert dialog.table.rowCount() == 4 and dialog.table.item(0, 1).text() == "device"
    assert window.grid.marks('check') == tuple(b.held.block_id for b in check.blocks[:3])
    dialog.light.setChecked(False)
    assert window.grid.marks('check') == ()
    dialog.light.setChecked(True)
    dialog.prompt.setPlainText("Pages")  # text: tokenised with the model's (byte) tokenizer
    qtbot.mouseClick(dialog.check_button, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.checks is not None and dialog.checks[0].num_tokens == 6, timeout=5000)
    assert window.grid.marks('check') == ()
    dialog.prompt.setPlainText("[1, 2,")
    qtbot.mouseClick(dialog.check_button, QtCore.Qt.MouseButton.LeftButton)
    assert "does not parse" in dialog.answer.text() and dialog.checks is None
    dialog.close()
    assert window.errors == []


def test_a_conversations_misses_and_a_checked_prompts_hits_show_together(qtbot, make_window):
    """Two layers: checking a prompt does not hide the selected conversation's missed blocks, and clearing one
    leaves the other as it was (a screenshot or a user can compare what missed with what would hit now)."""
    window = make_window(setup=cached_then_running, paused=True)
    window.conversations.select_conversation(1)
    window.conversations.detail.mark_misses.setChecked(True)
    table = window.snapshot.block_tables[1]
    qtbot.waitUntil(lambda: window.grid.marks() == (table[2], table[3]), timeout=3000)
    dialog = window.open_check_prompt()
    dialog.prompt.setPlainText(json.dumps(PREFIX + [7]))
    qtbot.mouseClick(dialog.check_button, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.checks is not None, timeout=5000)
    hits = tuple(b.held.block_id for b in dialog.checks[0].blocks[:3])
    layers = window.grid.mark_layers
    assert window.grid.marks("check") == hits and window.grid.marks() == (table[2], table[3])
    assert layers["check"][0].isVisible() and layers["misses"][0].isVisible()
    assert "computed because its prompt missed" in window.grid.hover_label.toolTip()
    assert "would hit" in window.grid.hover_label.toolTip()
    both = table[2]  # a block on both layers (a prompt would now hit what the conversation computed): both show
    window.grid.set_marks((both,), (255, 230, 60), "", layer="check")
    x, y = window.grid.geometry_.cell_origin(both)
    centre = QtCore.QPointF(x + 0.5, y + 0.5)
    rects = [next(p.boundingRect() for p in layers[k][0].path().toSubpathPolygons() if p.boundingRect().contains(centre))
             for k in ("misses", "check")]
    outer, inner = sorted(rects, key=lambda r: -r.width())
    assert outer.contains(inner) and inner.width() < outer.width()
    dialog.close()
    assert window.grid.marks("check") == () and not layers["check"][0].isVisible()
    assert window.grid.marks() == (table[2], table[3]) and layers["misses"][0].isVisible()


def test_the_check_prompt_file_in_the_window(qtbot, make_window, tmp_path):
    window = make_window(setup=cached_then_running, paused=True)
    path = tmp_path / "ask.json"
    window.why.watch_file(str(path))  # what --check-prompt FILE does in the window
    dialog = window.why.dialog
    qtbot.waitUntil(lambda: "no such file yet" in dialog.answer.text(), timeout=3000)
    assert not dialog.check_button.isEnabled()
    path.write_text(json.dumps(PREFIX[:8] + [5]))
    qtbot.waitUntil(lambda: dialog.checks is not None, timeout=5000)
    assert dialog.checks[0].cached_tokens == 8 and "8 of 9 prompt tokens" in dialog.answer.text()
    assert len(window.grid.marks('check')) == 2


def test_the_content_view_lights_up_a_kv_event_prompts_hits(qtbot):
    index = KVCacheIndex("vllm-0")
    toks = list(range(1, 13))
    index.apply_batch(make_batch([BlockStored((11, 12, 13), None, tuple(toks), 4, None, "GPU", None),
                                  BlockStored((21,), None, (9, 9, 9, 9), 4, None, "GPU", None)], 1.0), 1)
    view = ContentView([index])
    qtbot.addWidget(view)
    check = index.check_prompt(toks[:8] + [5])
    assert view.mark_prompt([check]) == 2
    pane = view.panes[0]
    assert pane.marked == {"11", "12"}
    index.apply_batch(make_batch([BlockStored((31,), 21, (8, 8, 8, 8), 4, None, "GPU", None)], 2.0), 2)
    pane.refresh()  # a rebuilt tree keeps the lit rows lit
    assert pane._paint_marks(pane.model.invisibleRootItem()) == 2
    assert view.mark_prompt(None) == 0


def test_regret_ticks_on_the_timeline(qtbot):
    timeline = Timeline()
    qtbot.addWidget(timeline)
    timeline.resize(600, 60)
    timeline.set_range(0, 100, lambda seq: seq * 2)
    timeline.add_regrets([(40, "cost conversation 7 a hit on prompt block 2 (evicted for conversation 5, by LRU)")])
    assert timeline.regrets_near(38, 42) and not timeline.regrets_near(0, 30)
    assert "regretted eviction: cost conversation 7" in timeline.tooltip_at(timeline.track.x_of(40))
    timeline.clear()
    assert timeline.regrets == []
