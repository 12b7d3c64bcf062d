"""Defects found watching a real vLLM server with the window, each reproduced here first (pytest-qt, offscreen):
a hover line that widened the window (and the widened layout was saved), an inspector note that contradicted its
fields, a grid header and a status bar that counted different frames, and a KV-event source shown among empty docks.

Sources are hand-built kvstream views served by a small read-only feed (what an attached pool stream delivers,
frame by frame), and a real KV-event stream over ipc; none needs vLLM.
"""
import dataclasses
import shutil
import tempfile

import numpy as np
import pytest
from PySide6 import QtCore, QtWidgets

from explorer.feeds.feed import Capabilities, Feed
from explorer.window.main_window import MainWindow
from kvstream.views import BlockState, ConversationInfo, PoolSnapshot, Status
from tests.helpers import used_blocks


class ViewsFeed(Feed):
    """A read-only pool source that delivers the views a test hands it, newest last (as an attached stream does:
    no commands, no K/V values, inspect answers rebuilt from the view)."""

    kind = "stream"
    capabilities = Capabilities(can_command=False, has_kv_values=False, has_history=False, has_physical_pool=True,
                                read_only_reason="an attached pool belongs to another process; commands are not "
                                                 "sent over the wire",
                                kv_values_reason="K/V values stay in the process that owns the pool")

    def __init__(self, snapshot=None):
        self.current = snapshot  # the view latest() hands out

    @property
    def title(self) -> str:
        return "attached: test views"

    def latest(self):
        return self.current


def conversation(cid, num_tokens):
    return ConversationInfo(conversation_id=cid, status=Status.RUNNING, prompt_token_ids=tuple(range(num_tokens)),
                            output_token_ids=(), output_text="", prompt_text="", block_table=(),
                            num_computed_tokens=num_tokens, num_cached_tokens=0, max_new_tokens=16,
                            temperature=0.0, parent_id=None, num_preemptions=0, arrival_step=0)


def pool(tables, num_blocks=512, block_size=16, cached=(), step=1, version=None, memory=None):
    """A pool view: every table's blocks used and full (ref count = references), ``cached`` blocks cached."""
    state, ref = used_blocks(tables, num_blocks)
    for b in cached:
        state[b] = BlockState.CACHED
    filled = np.where(state > 0, block_size, 0).astype(np.int32)
    convs = tuple(conversation(cid, block_size * len(t)) for cid, t in sorted(tables.items()))
    return PoolSnapshot(step_id=step, block_size=block_size, num_blocks=num_blocks, ref_count=ref, num_filled=filled,
                        state=state, owner=np.full(num_blocks, -1, np.int32),
                        last_access=np.zeros(num_blocks, np.int64), block_tables=tables, conversations=convs,
                        version=step if version is None else version, source="vllm", memory=memory)


def shared_prefix(owners, first=1300, extra_cached=()):
    """``owners`` conversations from ``first`` on, all sharing block 0 as logical block 0, each with its own tail."""
    tables = {first + i: (0, 10 + i) for i in range(owners)}
    return pool(tables, cached=extra_cached)


@pytest.fixture
def watch_window(qtbot):
    """watch_window(feed, size=(1600, 1000), settings=None) -> a shown MainWindow on ``feed``."""
    made = []

    def make(feed, size=(1600, 1000), settings=None):
        window = MainWindow(feed=feed, settings=settings, size=size)
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        QtWidgets.QApplication.processEvents()
        made.append(window)
        return window

    yield make
    for window in made:
        window.close()


def settle(qtbot, ms=120):
    qtbot.wait(ms)
    flush()


def flush():
    """Let posted layout requests run (a label's new size reaches the window over a few rounds of events)."""
    for _ in range(6):
        QtCore.QCoreApplication.sendPostedEvents()
        QtWidgets.QApplication.processEvents()


# ---- 1. the hover line widened the window --------------------------------------------------------------------------
def test_hover_over_a_block_shared_by_16_keeps_the_window_and_its_line_short(qtbot, watch_window):
    """Found watching vLLM: the hover line listed all 16 owners of a shared block on one line and the window grew
    to 3470 px, the grid moving under the mouse."""
    window = watch_window(ViewsFeed(shared_prefix(16, first=3)))
    qtbot.waitUntil(lambda: window.grid.frames_drawn > 0, timeout=3000)
    settle(qtbot)
    width = window.width()
    grid = window.grid
    grid._on_mouse_moved(grid.view.mapToScene(grid.cell_center(0)))
    settle(qtbot)
    line = grid.hover_label.text()
    assert line.startswith("block 0: used, ref count 16")
    assert "owners conv 3 (logical 0), conv 4 (logical 0) and 14 more" in line and "conv 18" not in line
    assert window.width() == width == 1600 and window.minimumSizeHint().width() <= 1600
    tip = grid.tooltip_at(grid.cell_center(0))  # the tooltip lists more of them, one a line, still bounded
    assert "conv 3 (logical 0)" in tip and "and 8 more" in tip and len(tip.splitlines()) <= 16


CAPTIONS = ("Colour by:",)  # labels whose text is a fixed caption, never set again as the app runs


def one_line_labels(window):
    return [label for label in window.findChildren(QtWidgets.QLabel)
            if label.isVisible() and not label.wordWrap() and label.window() is window
            and label.text() not in CAPTIONS]


@pytest.mark.parametrize("size", [(1024, 640), (1600, 1000)])
def test_no_label_grows_the_window_whatever_its_text(qtbot, watch_window, size):
    """Every one-line label of the window (hover line, pool header, banner, status bar, panels) gets a text far
    wider than the screen: the window keeps its size and could still be made as small as before."""
    feed = ViewsFeed(shared_prefix(4))
    window = watch_window(feed, size=size)
    qtbot.waitUntil(lambda: window.grid.frames_drawn > 0, timeout=3000)
    window.timer.stop()  # the frame timer would set the labels' own texts again
    settle(qtbot)
    labels = one_line_labels(window)
    assert window.grid.hover_label in labels and window.pane.pool_label in labels
    assert all(label in labels for label in window.status.labels.values() if label.isVisible())
    long = "a sentence far wider than any screen, " * 120
    growers = []
    for label in labels:
        before = label.text()
        label.setText(long)
        flush()
        if window.width() != size[0] or window.minimumSizeHint().width() > size[0]:
            growers.append((before, window.width(), window.minimumSizeHint().width()))
        label.setText(before)
        flush()
        window.resize(*size)
        flush()
    assert growers == [], "\n".join(map(str, growers))
    window.pane.header.setText("<b>attached: " + "x" * 3000 + "</b>")  # a rich-text header, one long word
    flush()
    assert window.width() == size[0] and window.minimumSizeHint().width() <= size[0]


def test_read_only_banner_is_whole_at_1600(qtbot, watch_window):
    """At 1600 px the attached pool's banner was cut: '... commands are not sent over the wir'."""
    window = watch_window(ViewsFeed(shared_prefix(2)))
    settle(qtbot)
    header = window.pane.header
    assert "not sent over the wire" in header.text() and header.wordWrap()
    assert header.heightForWidth(header.width()) <= header.height() + 1  # every wrapped line gets its height
    assert header.width() <= window.width()


def test_a_saved_layout_wider_than_the_screen_is_not_restored(qtbot, watch_window, tmp_path):
    """The widened window was saved, and the next launch opened with the Legend and Inspector squeezed to 130 and
    60 px. A window larger than the desktop is not saved (the good layout before it stays), and a saved one (as
    older versions wrote it) is not restored: the docks get the first-launch arrangement."""
    from test_gui_window_layout import temp_settings
    path = tmp_path / "layout.ini"
    good = watch_window(ViewsFeed(shared_prefix(2)), size=(1366, 768), settings=temp_settings(path))
    good.docks["metrics"].hide()  # something of the user's to keep
    good.close()
    desktop = QtGui_desktop()
    blown = watch_window(ViewsFeed(shared_prefix(2)), size=(1366, 768), settings=temp_settings(path))
    assert blown.layout_restored and not blown.docks["metrics"].isVisible()
    blown.resize(desktop.width() + 2000, 1000)
    settle(qtbot)
    assert blown.width() > desktop.width()
    state, geometry = blown.saveState(2), blown.saveGeometry()
    blown.close()  # refused: the good layout stays
    saved = temp_settings(path)
    assert saved.value("layout/geometry") != geometry
    again = watch_window(ViewsFeed(shared_prefix(2)), size=(1366, 768), settings=temp_settings(path))
    assert again.layout_restored and not again.docks["metrics"].isVisible()
    again.close()
    saved.setValue("layout/state", state)  # what an older version saved from the widened window
    saved.setValue("layout/geometry", geometry)
    saved.sync()
    fresh = watch_window(ViewsFeed(shared_prefix(2)), settings=temp_settings(path), size=None)
    assert not fresh.layout_restored
    assert fresh.width() <= max(desktop.width(), 1024)
    reference = watch_window(ViewsFeed(shared_prefix(2)), size=None)  # nothing saved: the first-launch arrangement
    settle(qtbot, 450)  # both fitted to the screen, frame included (300 ms after they are shown)
    assert fresh.size() == reference.size()
    for key in ("inspector", "legend", "conversations"):
        assert fresh.docks[key].size() == reference.docks[key].size(), key
    assert fresh.docks["inspector"].width() >= 300


def QtGui_desktop():
    from PySide6 import QtGui
    return QtGui.QGuiApplication.primaryScreen().availableVirtualGeometry().size()


# ---- 2. the inspector contradicted itself ----------------------------------------------------------------------------
def note_and_fields(window):
    inspector = window.inspector
    return inspector.note.text(), inspector.fields["ref count"].text(), inspector.fields["owners"].text()


def test_inspector_note_agrees_with_its_fields_as_owners_change(qtbot, watch_window):
    """Found watching vLLM: the note said 'in use by conversations 1315, 1316, ... and 11 more, shared by 17
    references' while the fields below said 'ref count: 12' and listed other owners."""
    feed = ViewsFeed(shared_prefix(17, first=1315))
    window = watch_window(feed)
    qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
    window.select_block(0)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    note, ref, owners = note_and_fields(window)
    assert ref == "17" and "shared by 17 references" in note and "1315" in note
    for step, (count, first) in enumerate([(12, 1400), (3, 1400), (1, 1402)], start=2):
        frame = shared_prefix(count, first=first)
        feed.current = dataclasses.replace(frame, step_id=step, version=step)
        qtbot.waitUntil(lambda: window.inspector.fields["ref count"].text() == str(count), timeout=3000)
        for _ in range(12):  # every moment, not only once the inspector asked again: the note says the same
            note, ref, owners = note_and_fields(window)
            assert ref == str(count) and str(first) in note and str(first) in owners, (note, ref, owners)
            now = note.split("(before")[0]  # "has been reused: ... (before: 1315, ...)" names the old owners last
            assert ("shared by" in now) == (count > 1) and "1315" not in now
            if count > 1:
                assert f"shared by {count} references" in note
            qtbot.wait(25)
    frame = pool({1402: (10,)}, cached=(0,))  # its last owner moved on: cached now
    feed.current = dataclasses.replace(frame, step_id=9, version=9)
    qtbot.waitUntil(lambda: window.inspector.fields["state"].text() == "cached", timeout=3000)
    note, ref, owners = note_and_fields(window)
    assert "cached" in note and "in use" not in note and ref == "0" and owners == "none"


def test_inspector_note_follows_the_frame_even_without_answers(qtbot):
    """A source whose detail answers do not come (or come late): the note is written from the frame on view
    with the fields, never left over from an older answer."""
    from test_gui_inspector import info
    from explorer.widgets.inspector import Inspector
    inspector = Inspector()
    qtbot.addWidget(inspector)
    first = shared_prefix(17, first=1315)
    inspector.select(0, first)
    inspector.show_block(info(0, owners=[(1315 + i, 0) for i in range(17)], filled=16, block_size=16))
    assert "shared by 17 references" in inspector.note.text()
    later = shared_prefix(12, first=1500)
    inspector.show_summary(later)  # no answer follows
    note = inspector.note.text()
    assert inspector.fields["ref count"].text() == "12"
    assert "shared by 12 references" in note and "1500" in note and "1315" not in note.split("(before")[0]
    inspector.show_summary(pool({1600: (3,)}))  # block 0 released by all
    assert inspector.note.text().startswith("Block 0 has been freed")
    assert "1500" in inspector.note.text() and inspector.fields["owners"].text() == "none"


def labelled(frame):
    """``frame`` as a vLLM source sends it: every conversation carries its request id as its label."""
    convs = tuple(dataclasses.replace(c, label=f"cmpl-{c.conversation_id}-0") for c in frame.conversations)
    return dataclasses.replace(frame, conversations=convs)


def test_inspector_names_a_vllm_sources_owners_by_request_id(qtbot, watch_window):
    """README: the inspector of a vLLM pool shows owners as request ids; it said "conv 1219 (logical block 0)",
    the explorer's own numbers. And its K/V values stay on the server: the inspector says so."""
    feed = ViewsFeed(labelled(shared_prefix(3, first=1219)))
    window = watch_window(feed, size=(1024, 640))
    qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
    window.select_block(0)
    qtbot.waitUntil(lambda: window.inspector.info is not None, timeout=3000)
    note, ref, owners = note_and_fields(window)
    assert owners.startswith("request cmpl-1219-0 (logical block 0), request cmpl-1220-0 (logical block 0)"), owners
    assert "conv " not in owners and "1219 (" not in owners.replace("cmpl-1219", "")
    assert "in use by requests cmpl-1219-0, cmpl-1220-0, cmpl-1221-0, shared by 3 references" in note, note
    kv = window.inspector.kv_note
    assert kv.isVisible() and "K/V values stay in the process that owns the pool" in kv.text(), kv.text()
    feed.current = dataclasses.replace(labelled(shared_prefix(2, first=1400)), step_id=2, version=2)
    qtbot.waitUntil(lambda: window.inspector.fields["ref count"].text() == "2", timeout=3000)
    note, _, owners = note_and_fields(window)
    assert "now belongs to requests cmpl-1400-0, cmpl-1401-0" in note, note
    assert "(before: cmpl-1219-0, cmpl-1220-0, cmpl-1221-0)" in note, note  # the old owners by name, gone or not
    frame = labelled(pool({1401: (11,)}, cached=(0,)))
    frame = dataclasses.replace(frame, step_id=3, version=3, owner=np.where(np.arange(512) == 0, 1401, -1)
                                .astype(np.int32))
    feed.current = frame
    qtbot.waitUntil(lambda: window.inspector.fields["state"].text() == "cached", timeout=3000)
    note, _, owners = note_and_fields(window)
    assert "last filled by request cmpl-1401-0" in note and owners == "none", note


def test_the_local_engines_owners_keep_their_numbers():
    """Without labels (the project's engine) owners stay conversation numbers."""
    from explorer.widgets.inspector import _conversations, _owners_text, change_note, conversation_names
    from test_gui_inspector import info
    frame = shared_prefix(2, first=7)
    names = conversation_names(frame, (7, 8))
    assert names == {} and _owners_text(((7, 0), (8, 0)), names=names) == "conv 7 (logical block 0), conv 8 " \
                                                                             "(logical block 0)"
    assert change_note(None, info(0, owners=((7, 0),)), names=names) == "Block 0 is in use by conversation 7."
    assert _conversations([3, 4], names={4: "cmpl-x"}) == "conversation 3, request cmpl-x"  # a mix: each its own


# ---- 3. header and status bar counted different frames -------------------------------------------------------------
def pool_words(window):
    return window.pane.pool_label.text(), window.status.labels["pool"].text()


@pytest.mark.parametrize("with_memory", [False, True])
def test_grid_header_and_status_bar_count_the_same_frame(qtbot, watch_window, with_memory):
    """Found watching vLLM: the header said '36 used, 476 cached' while the status bar said 'pool 54/512 used ·
    458 cached'. Both count the frame on view, from its per-block states, whether or not it has memory figures."""
    from kvstream.views import MemoryStats

    def frame(used, cached, step):
        tables = {i: (i,) for i in range(used)}
        snap = pool(tables, cached=range(used, used + cached), step=step)
        if with_memory:
            memory = MemoryStats(bytes_per_block=64, bytes_per_token=4, num_used_blocks=used,
                                 num_cached_blocks=cached, num_free_blocks=512 - used - cached,
                                 num_filled_slots=16 * used, num_allocated_slots=16 * used, num_tail_empty_slots=0,
                                 num_logical_slots=16 * used, num_slots_saved_by_sharing=0,
                                 num_contiguous_slots=32 * used, block_table_bytes=4 * used)
            snap = dataclasses.replace(snap, memory=memory)
        return snap

    feed = ViewsFeed(frame(36, 476, 1))
    window = watch_window(feed)
    window.timer.stop()  # frames are delivered one tick at a time below
    window._tick()
    for used, cached, step in ((36, 476, 1), (54, 458, 2), (55, 457, 3), (20, 100, 4)):
        feed.current = frame(used, cached, step)
        window._tick()  # one frame of the window's timer
        header, status = pool_words(window)
        assert f"{used} used, {cached} cached, {512 - used - cached} free of 512 blocks" in header, header
        assert status.startswith(f"pool {used}/512 used") and f"{cached} cached" in status, status
        assert f"{16 * used}/{16 * used} slots filled" in status


# ---- 4. a KV-event source among empty docks ------------------------------------------------------------------------
@pytest.fixture
def kv_stream():
    """A real KV-event publisher on ipc with a few stored blocks, and its endpoint."""
    from kvstream.kv_events import BlockStored, KVEventPublisher
    sockdir = tempfile.mkdtemp(prefix="kvw", dir="/tmp")
    pub = KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r")
    pub.publish([BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4,
                             lora_id=None, medium="GPU", lora_name=None)])
    yield pub
    pub.close()
    shutil.rmtree(sockdir, ignore_errors=True)


POOL_DOCKS = ("inspector", "legend", "memory", "conversations", "metrics", "block-history", "events")


def test_a_kv_event_source_gets_the_room_and_a_status_line(qtbot, watch_window, kv_stream, tmp_path):
    """Found with --attach-kv-events: empty Legend, Inspector, Conversations and Metrics docks, 'waiting for the
    first frame...' and 'engine 0.0 steps/s' in the status bar, a blank band above the content view, which got
    790 x 370 of a 1600 x 1000 window."""
    from explorer.feeds.kv_event_feed import KVEventFeed
    from kvstream.kv_events import KVEventEndpoint
    from test_gui_window_layout import temp_settings
    feed = KVEventFeed.connect([KVEventEndpoint(kv_stream.endpoint, kv_stream.replay_endpoint, name="vllm-0")])
    path = tmp_path / "layout.ini"
    window = watch_window(feed, settings=temp_settings(path))
    pane = window.pane
    # connected and read (live, or silent once its one batch is older than the silence threshold: the window may
    # take that long to open on a loaded machine)
    connected = ("vllm-0: live", "vllm-0: silent")
    qtbot.waitUntil(lambda: pane.content_view is not None and window.status.labels["live"].text().startswith(connected),
                    timeout=30000)
    settle(qtbot, 600)  # the status line is refreshed twice a second
    hidden = [key for key in POOL_DOCKS if window.docks[key].isVisible()]
    assert hidden == []  # none shows an empty panel
    assert not window.docks["capacity"].isVisible()  # no trace: its empty plot took a third of the window's height
    assert window.centralWidget().height() >= 0.85 * window.height()  # the tree and its plot get the height
    labels = {k: v.text() for k, v in window.status.labels.items() if v.isVisible()}
    assert labels["live"].startswith(connected)
    assert "waiting" not in " ".join(labels.values()) and "steps/s" not in " ".join(labels.values())
    assert "2 blocks cached" in labels["pool"] and "1 batch" in labels["pool"], labels
    bar = window.status.labels
    assert bar["live"].width() > bar["pool"].width() > bar["gui"].width()  # the status line gets the most room
    content = pane.content_view
    central = window.centralWidget()
    assert content.width() >= 0.95 * central.width() and content.height() >= 0.8 * central.height()
    top = content.mapTo(central, QtCore.QPoint(0, 0)).y()
    assert top <= pane.header.height() + 16  # nothing but the banner above it
    window.set_feed(ViewsFeed(shared_prefix(3)))  # a source with a physical pool: the docks come back
    settle(qtbot)
    assert all(window.docks[key].isVisible() for key in POOL_DOCKS)
    assert pane.content_view is None and pane.grid.isVisible()
    assert all(label.isVisible() for label in bar.values()) and bar["live"].width() < bar["pool"].width()
    window.set_feed(KVEventFeed.connect([KVEventEndpoint(kv_stream.endpoint, name="vllm-0")]))
    settle(qtbot)
    assert not window.docks["inspector"].isVisible()
    window.close()  # the docks hidden for this source are saved as shown: the next launch has its panels
    nxt = watch_window(ViewsFeed(shared_prefix(3)), settings=temp_settings(path))
    assert nxt.layout_restored and all(nxt.docks[key].isVisible() for key in POOL_DOCKS)


def test_the_whole_window_fits_its_screen_title_bar_included(qtbot, watch_window):
    """Found in the Xvfb window: sized to the screen's 1000 px, the window manager's title bar pushed the status
    bar below the screen's edge. Once framed, the window shrinks to keep its frame on screen (not below the
    smallest supported size; --geometry is taken as given where the command line did not ask for a fit: tests,
    --screenshot)."""
    window = watch_window(ViewsFeed(shared_prefix(2)), size=None)
    room = window.screen().availableGeometry()
    qtbot.waitUntil(lambda: window.frameGeometry().height() <= room.height(), timeout=3000)
    assert window.frameGeometry().top() >= room.top() and window.frameGeometry().bottom() <= room.bottom()
    assert window.width() >= 1024 and window.height() >= 640
    asked = watch_window(ViewsFeed(shared_prefix(2)), size=(1024, room.height()))
    settle(qtbot, 450)
    assert asked.size() == QtCore.QSize(1024, room.height())


def test_a_geometry_larger_than_the_screen_is_clamped_and_said(qtbot, capsys):
    """Issue 49: --geometry 1920x1080 on a 1920x1080 screen pushed the status bar below the screen's edge. The
    command line's window (fit_size) is clamped to the screen's free area, frame included, and says so."""
    room = QtWidgets.QApplication.primaryScreen().availableGeometry()
    asked = (room.width() + 400, room.height() + 300)
    window = MainWindow(feed=ViewsFeed(shared_prefix(2)), size=asked, fit_size=True)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.frameGeometry().height() <= room.height(), timeout=3000)
    assert window.frameGeometry().bottom() <= room.bottom()  # the status bar on screen
    assert window.width() == max(room.width() - (window.frameGeometry().width() - window.width()), 1024)
    said = f"--geometry {asked[0]}x{asked[1]} does not fit the screen's free area ({room.width()}x{room.height()}"
    assert said in capsys.readouterr().err and window.geometry_note.startswith(said)
    assert f"the window is {window.width()}x{window.height()}" in window.geometry_note
    window.close()
    small = MainWindow(feed=ViewsFeed(shared_prefix(2)), size=(800, 600), fit_size=True)  # fits: kept as asked
    qtbot.addWidget(small)
    small.show()
    qtbot.waitExposed(small)
    settle(qtbot, 450)  # the fit runs once, FRAME_FIT_MS after the first show
    assert (small.width(), small.height()) == (800, 600) and small.geometry_note == ""
    small.close()


def test_on_a_screen_as_small_as_the_smallest_supported_the_frame_still_fits():
    """Found in the Xvfb window on a 1024 x 640 screen: the window kept its 640 px and openbox's title bar pushed
    the status bar (where pacing and errors are reported) below the screen's edge. Where the screen is no taller
    than that, the window gives up the height the frame needs, down to what its contents need; on taller screens
    the smallest supported height stays the floor."""
    from explorer.window.main_window import framed_length
    assert framed_length(640, room=640, frame=26, smallest=640, needed=411) == 614  # the frame fits now
    assert framed_length(640, room=500, frame=26, smallest=640, needed=411) == 474
    assert framed_length(640, room=400, frame=26, smallest=640, needed=411) == 411  # never below the contents
    assert framed_length(1000, room=1000, frame=26, smallest=640, needed=411) == 974  # as before
    assert framed_length(700, room=1000, frame=26, smallest=640, needed=411) == 700  # fits: untouched
    assert framed_length(600, room=1000, frame=26, smallest=640, needed=411) == 640  # the supported floor


def test_an_attached_pool_gone_silent_opens_no_dialog(qtbot, make_window):
    """Found in the X window: "Attached pool silent" was a message box that stayed open after the stream resumed;
    the pane's header says the stream's state (and clears itself), the status bar says it once."""
    from explorer.feeds.feed import Problem
    window = make_window(paused=True)
    window.source.problem.emit(Problem("Attached pool silent", "tcp://127.0.0.1:5599: silent for 3 s. The view "
                                       "keeps the last state; it resumes by itself when frames come again."))
    assert window.errors == [] and not any(box.isVisible() for box in window.message_boxes)
    assert "Attached pool silent" in window.status.currentMessage()
    window.source.problem.emit(Problem("Engine error", "a real failure"))
    assert window.errors[-1][0] == "Engine error"

