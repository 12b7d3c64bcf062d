"""Issue 13's defects 3 and 9 in a real window (pytest-qt, offscreen, real engine), read from what the window draws:
the grid's colour of a forked conversation's blocks once its parent ended, and the K/V heatmap's slot axis after a
restart with another block size."""
import numpy as np
from PySide6 import QtCore

from explorer.model import palette
from test_gui_support import open_add_dialog, wait_for_snapshot

PROMPT = "Forks share the parent's full blocks."  # 37 bytes: 9 full blocks of 4 and a tail of 1


def a_prefilled_conversation(engine):
    engine.add_conversation(PROMPT, max_new_tokens=60, temperature=0.0, ignore_eos=True)
    engine.step()  # prefill: its full prompt blocks are written and hashed


def drawn_after(qtbot, window, predicate, timeout=5000):
    """The snapshot the grid last drew once it satisfies ``predicate`` (the window refreshed and drew it)."""
    grid = window.grid
    qtbot.waitUntil(lambda: grid.snapshot is not None and predicate(grid.snapshot) and not grid._dirty
                    and grid.image is not None, timeout=timeout)
    return grid.snapshot


def test_a_fork_keeps_its_own_colour_on_the_blocks_it_shared_once_the_parent_ends(qtbot, make_window):
    """Defect 3: conversation 9 forked into 10, 9 ended; 10's first blocks kept 9's colour although 10 was their
    only owner. Here A is forked into B through the window, B decodes a step (copy-on-write of the shared tail),
    A is ended through the window; the grid then draws every block B shared with A in B's colour (the colour the
    conversation table shows for B), not A's."""
    window = make_window(setup=a_prefilled_conversation, paused=True)
    snap = window.snapshot
    (a, a_table), = snap.block_tables.items()
    assert len(a_table) >= 9
    window.fork_conversation(a)
    snap = wait_for_snapshot(qtbot, window, lambda s: len(s.block_tables) == 2)
    b = next(cid for cid in snap.block_tables if cid != a)
    assert snap.conversation(b).parent_id == a
    window.runner.step_once()  # B and A both decode: each writes its own tail (copy-on-write of the shared one)
    snap = wait_for_snapshot(qtbot, window, lambda s: s.step_id >= 2)
    shared = [blk for blk in snap.block_tables[b] if blk in snap.block_tables[a]]
    assert len(shared) >= 8 and all(int(snap.ref_count[blk]) == 2 for blk in shared)
    book = window.source.colours  # the colours of this source's conversations
    a_colour, b_colour = palette.conversation_colour(a, book), palette.conversation_colour(b, book)
    assert a_colour != b_colour  # live conversations get distinct colours
    qtbot.waitUntil(lambda: window.conversations.model.rowCount() == 2, timeout=3000)

    window.end_conversation(a)
    drawn = drawn_after(qtbot, window, lambda s: str(s.conversation(a).status) == "ended"
                        and a not in s.block_tables)
    assert drawn.block_tables[b][:len(shared)] == tuple(shared) and window.errors == []
    assert all(int(drawn.ref_count[blk]) == 1 for blk in shared)  # B is their only holder now
    drawn_colours = {blk: window.grid.cell_colour(blk) for blk in shared}  # read from the image the grid shows
    assert all(colour == b_colour for colour in drawn_colours.values()), (a_colour, b_colour, drawn_colours)
    assert all(int(drawn.owner[blk]) == b for blk in shared)  # what the grid coloured them by
    # and it is the colour the conversation table gives B's row
    model = window.conversations.model
    swatch = model.index(model.row_of(b), 0).data(QtCore.Qt.ItemDataRole.DecorationRole)
    assert (swatch.red(), swatch.green(), swatch.blue()) == b_colour


def tick_positions(axis):
    """Every tick (major and minor) the axis was given, as (position, label)."""
    levels = axis._tickLevels
    assert levels is not None, "the axis uses pyqtgraph's automatic (fractional) ticks"
    return [tick for level in levels for tick in level]


def test_heatmap_slot_axis_follows_a_restart_with_block_size_8(qtbot, make_window):
    """Defect 9: after a restart with block size 8 the K/V heatmap kept a 0-15 slot axis (and showed fractional
    ticks, with no colour scale). Restart through the window's dialog, decode, select a used block: its heatmap's
    slot axis is 0-7 in whole slots, and a colour bar spans the values drawn."""
    window = make_window(setup=a_prefilled_conversation, paused=True, num_blocks=64, block_size=16)
    (_, table), = window.snapshot.block_tables.items()
    window.select_block(table[0])
    inspector = window.inspector
    qtbot.waitUntil(lambda: inspector.info is not None and inspector.info.keys is not None, timeout=3000)
    assert {pos for pos, _ in tick_positions(inspector.plot.getAxis("left"))} == {i + 0.5 for i in range(16)}

    old = window.runner
    dialog = window.open_restart_dialog()
    dialog.block_size.setText("8")
    dialog.num_blocks.setText("32")
    dialog.try_accept()
    restart = next(button for button in dialog.confirm.buttons() if button.text() == "Restart")
    qtbot.mouseClick(restart, QtCore.Qt.MouseButton.LeftButton)  # "1 conversation will be discarded"
    qtbot.waitUntil(lambda: window.runner is not old and not dialog.isVisible(), timeout=15000)
    wait_for_snapshot(qtbot, window, lambda s: s.block_size == 8 and s.num_blocks == 32)

    add = open_add_dialog(window, "Eight slots a block now.", max_new_tokens=20)
    add.try_accept()
    wait_for_snapshot(qtbot, window, lambda s: len(s.conversations) == 1)
    window.runner.step_once()  # prefill: 24 bytes, three full blocks of 8
    snap = wait_for_snapshot(qtbot, window, lambda s: bool(s.block_tables) and s.step_id >= 1
                             and int(s.num_filled[next(iter(s.block_tables.values()))[0]]) == 8)
    (_, table), = snap.block_tables.items()
    block = table[0]  # a full block of the new size
    window.select_block(block)
    qtbot.waitUntil(lambda: inspector.info is not None and inspector.info.block_id == block
                    and inspector.info.keys is not None, timeout=3000)
    assert inspector.info.block_size == 8 and inspector.info.num_filled == 8
    qtbot.wait(50)  # a resize of the plot reticks too

    ticks = tick_positions(inspector.plot.getAxis("left"))
    assert {pos for pos, _ in ticks} == {i + 0.5 for i in range(8)}, ticks  # one per slot 0-7, none beyond
    labels = [label for _, label in ticks if label]
    assert labels and labels[0] == "0" and all(label.isdigit() and int(label) < 8 for label in labels)
    for pos, label in ticks:  # a label names the slot whose middle it marks
        assert not label or int(label) == pos - 0.5
    assert inspector.plot.getViewBox().viewRange()[1] == [0, 8]
    image = inspector.heat.image
    assert image is not None and image.shape[0] == 8
    keys = inspector.info.keys[inspector.layer.value(), :, inspector.head.value(), :]
    assert np.array_equal(image, np.asarray(keys, np.float32))
    colorbar = inspector.colorbar  # the colour scale: in the plot, over the heatmap's image, spanning its values
    assert colorbar.scene() is inspector.plot.scene() and colorbar.isVisible()
    assert tuple(colorbar.levels()) == (float(image.min()), float(image.max()))
    assert tuple(inspector.heat.getLevels()) == tuple(colorbar.levels())
    assert "8 of 8 slots" in inspector.heat_title.text() and window.errors == []


def _recording(path, frames=30, seed=0):
    from kvstream.poolstream import StreamEncoder
    from kvstream.recording import Recorder
    from tests.poolstream_helpers import workload
    encoder = StreamEncoder()
    with Recorder(path) as recorder:
        for snap, events in workload(seed=seed)[:frames]:
            recorder.write(encoder.encode(snap, events))
    return str(path)


def test_opening_a_recording_lets_the_old_engine_go_and_a_second_open_keeps_the_freeze(qtbot, make_window, tmp_path):
    """File > Open freezes the recording's heap (full collections skip it while scrubbing) only once the engine
    it replaces is closed and let go of: frozen, the old Engine's cycles (its KV tensor with them) stayed resident
    until the recording closed. A second File > Open closes the first recording (unfreezing what it froze) and
    freezes the new one's; the first recording is then freed."""
    import gc
    import weakref
    from explorer.window import files
    window = make_window(history=True)
    engine = weakref.ref(window.source.feed.runner.engine)
    first, second = _recording(tmp_path / "a.kvpool"), _recording(tmp_path / "b.kvpool", 20)
    gc.unfreeze()
    try:
        assert files.open_recording(window, first)
        qtbot.waitUntil(lambda: window.source.view is not None, timeout=5000)
        gc.collect()
        assert engine() is None, "the replaced engine is kept alive"
        assert gc.get_freeze_count() > 0
        old_history = weakref.ref(window.source.history)
        assert files.open_recording(window, second)
        qtbot.waitUntil(lambda: window.source.view is not None, timeout=5000)
        gc.collect()
        assert gc.get_freeze_count() > 0, "the second recording is not frozen"
        assert old_history() is None, "the first recording is kept alive"
    finally:
        window.source.feed.close()
        gc.unfreeze()


def test_each_source_colours_its_conversations_from_its_own_book(qtbot, tmp_path):
    """Conversation ids are per source: two panes whose ids overlap (two attached servers, or a recording beside
    another) each keep a colour book, so one pane's frames neither reassign the other's colours nor bump its
    book's version (which repaints every block of the other grid), and the side panels colour the active
    pane's conversations from that pane's book."""
    from explorer.feeds.stream_feed import RecordingFeed
    from explorer.window.main_window import MainWindow
    a = RecordingFeed.open(_recording(tmp_path / "a.kvpool", 60))
    b = RecordingFeed.open(_recording(tmp_path / "b.kvpool", 40, seed=1))
    window = MainWindow(feed=a, extra_feeds=[b])
    qtbot.addWidget(window)
    window.show()
    first, second = window.panes
    qtbot.waitUntil(lambda: first.source.view is not None and second.source.view is not None, timeout=5000)
    books = first.source.colours, second.source.colours
    assert books[0] is not books[1] and first.grid.colours is books[0] and second.grid.colours is books[1]
    view = first.source.view
    books[0].observe(view)
    ids = [c.conversation_id for c in view.conversations]
    before = [palette.conversation_colour(cid, books[0]) for cid in ids]
    version = books[0].version
    history = second.source.history
    for seq in range(history.first_seq, history.last_seq + 1):  # the other pane plays through its frames
        second.source.seek(seq)
        second.grid.set_snapshot(second.source.view)
        second.grid.render()
    assert books[0].version == version
    assert [palette.conversation_colour(cid, books[0]) for cid in ids] == before
    assert window.conversations.model.colours is books[0]
    window.activate_pane(second)
    assert window.conversations.model.colours is books[1]
    window.close()
