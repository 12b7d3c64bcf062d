"""Layout: usable at 1024 x 640, --geometry, proportions kept through resizes, layout kept across launches."""
import pytest
from PySide6 import QtCore, QtGui, QtWidgets

from engine import Engine, EngineRunner
from explorer.cli import UsageError, parse_args, parse_geometry
from explorer.window.layout import LAYOUT_VERSION
from explorer.window.main_window import MainWindow
from test_gui_support import make_config


@pytest.fixture
def window_at(qtbot):
    """window_at(width, height, settings=None) -> a shown MainWindow on a paused real engine with two
    conversations."""
    made = []

    def make(width, height, settings=None, setup=None):
        cfg = make_config(num_blocks=64, block_size=4)
        engine = Engine(cfg)
        for prompt in ("Layout check, first.", "Layout check, second one."):
            engine.add_conversation(prompt, max_new_tokens=20)
        engine.step()
        if setup is not None:
            setup(engine)
        runner = EngineRunner(engine, start_paused=True).start()
        window = MainWindow(runner, cfg, settings=settings, size=(width, height))
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        qtbot.waitUntil(lambda: window.snapshot is not None and window.grid.frames_drawn > 0, timeout=3000)
        qtbot.wait(150)  # a few frames: panels refreshed, docks laid out
        made.append(window)
        return window

    yield make
    for window in made:
        window.close()


def temp_settings(path):
    return QtCore.QSettings(str(path), QtCore.QSettings.Format.IniFormat)


def rect_in_window(window, widget):
    top_left = widget.mapTo(window, QtCore.QPoint(0, 0))
    return QtCore.QRect(top_left, widget.size())


def test_usable_at_1024_by_640(window_at):
    window = window_at(1024, 640)
    assert (window.width(), window.height()) == (1024, 640)  # the window did not insist on being bigger
    hint = window.minimumSizeHint()
    assert hint.width() <= 1024 and hint.height() <= 640
    assert window.layout_kind == "small"
    bounds = window.rect()
    for widget in window.findChildren(QtWidgets.QWidget):
        if not widget.isVisible() or widget.isWindow():
            continue
        assert widget.width() <= window.width(), f"{widget!r} is wider than the window"
        region = widget.visibleRegion()
        if not region.isEmpty():  # what is drawn of it lies inside the window
            assert bounds.contains(region.boundingRect().translated(widget.mapTo(window, QtCore.QPoint(0, 0)))), \
                widget
    for key in ("inspector", "conversations"):  # the essentials are in front, not hidden behind a tab
        dock = window.docks[key]
        assert dock.isVisible() and not dock.visibleRegion().isEmpty(), key
    assert all(window.docks[k].isVisible() for k in window.docks)  # the rest are tabs, one click away
    assert window.grid.width() >= 500 and window.grid.height() >= 250  # the grid keeps the most room
    snap = window.snapshot  # the whole pool is in view, not cropped
    view = window.grid.box.viewRect()
    geo = window.grid.geometry_
    assert view.left() <= 0 and view.top() <= 0 and view.right() >= geo.cols and view.bottom() >= geo.rows
    assert snap.num_blocks == 64


def test_no_visible_text_overlaps_at_1024_by_640(window_at):
    window = window_at(1024, 640)
    for key in window.docks:  # bring each tab to the front in turn
        window.docks[key].raise_()
        QtWidgets.QApplication.processEvents()
        labels = [w for w in window.docks[key].findChildren(QtWidgets.QLabel)
                  if w.isVisible() and w.text() and not w.visibleRegion().isEmpty()]
        rects = [(label, rect_in_window(window, label)) for label in labels]
        for i, (a, ra) in enumerate(rects):
            for b, rb in rects[i + 1:]:
                assert not ra.intersects(rb), f"{key}: {a.text()!r} overlaps {b.text()!r}"


def test_geometry_option_and_wide_layout(window_at):
    assert parse_geometry("1366x768") == (1366, 768)
    for bad in ("1366", "wide", "10x10", "1366x768x2", ""):
        with pytest.raises(ValueError, match="geometry"):
            parse_geometry(bad)
    with pytest.raises(UsageError, match="--geometry sizes the window"):
        parse_args(["--headless", "--geometry", "1024x640"])
    assert parse_args(["--geometry", "1920x1080"]).size == (1920, 1080)
    wide = window_at(1920, 1080)
    assert (wide.width(), wide.height()) == (1920, 1080) and wide.layout_kind == "wide"
    assert not wide.docks["legend"].visibleRegion().isEmpty()  # side by side, not tabbed, on a big screen
    assert not wide.docks["metrics"].visibleRegion().isEmpty()


def test_docks_keep_their_share_through_a_resize(window_at, qtbot):
    window = window_at(1920, 1080)
    share = window.docks["inspector"].width() / window.width()
    window.resize(1024, 640)
    qtbot.waitUntil(lambda: window.width() == 1024, timeout=2000)
    QtWidgets.QApplication.processEvents()
    window.resize(1920, 1080)
    qtbot.waitUntil(lambda: window.width() == 1920, timeout=2000)
    QtWidgets.QApplication.processEvents()
    assert abs(window.docks["inspector"].width() / window.width() - share) < 0.04


def test_layout_is_kept_from_one_launch_to_the_next(window_at, tmp_path, qtbot):
    settings_path = tmp_path / "layout.ini"
    first = window_at(1366, 768, settings=temp_settings(settings_path))
    first.docks["metrics"].hide()  # the user closes one dock and floats another
    first.docks["legend"].setFloating(True)
    first.close()
    saved = temp_settings(settings_path)
    assert saved.contains("layout/state") and saved.contains("layout/geometry")
    second = window_at(1366, 768, settings=temp_settings(settings_path))
    assert second.layout_restored
    assert not second.docks["metrics"].isVisible()
    assert second.docks["legend"].isFloating()
    fresh = window_at(1366, 768, settings=temp_settings(tmp_path / "other.ini"))  # nothing saved there
    assert not fresh.layout_restored and fresh.docks["metrics"].isVisible()
    assert LAYOUT_VERSION >= 1


def cut_labels(window):
    """Visible one-line plain-text labels whose text is wider than the label (drawn cut off)."""
    from explorer.window.status_bar import ElidedLabel
    cut = []
    for key in window.docks:
        window.docks[key].raise_()
        QtWidgets.QApplication.processEvents()
        for label in window.docks[key].findChildren(QtWidgets.QLabel):
            text = label.text()
            if not label.isVisible() or label.visibleRegion().isEmpty() or not text or isinstance(label, ElidedLabel):
                continue
            if label.wordWrap():  # wrapped: all its lines must get their height
                needed = label.heightForWidth(label.width())
                if needed > label.height() + 1:
                    cut.append((key, text[:40], f"{label.height()} of {needed} px high"))
            elif QtGui.Qt.mightBeRichText(text):
                continue
            elif label.fontMetrics().horizontalAdvance(text) > label.contentsRect().width() + 1:
                cut.append((key, text, label.contentsRect().width()))
    return cut


@pytest.mark.parametrize("size", [(1024, 640), (1366, 768), (1600, 1000)])
def test_no_label_is_cut_off(window_at, size):
    """Found in the X window at 1600 x 1000: 'Paged total (used bloc', 'Contiguous reservatio' in the memory
    readout; at 1024 x 640 the last line of a conversation's block table hidden under its text."""
    def long_ones(engine):
        engine.add_conversation("A long one to fill its block table. " * 4, max_new_tokens=20)
        engine.step()

    window = window_at(*size, setup=long_ones)
    window.conversations.select_conversation(2)
    QtWidgets.QApplication.processEvents()
    assert cut_labels(window) == []


@pytest.mark.parametrize("size", [(1024, 640), (1600, 1000)])
def test_dock_tabs_show_their_whole_titles(window_at, size):
    """Found in the X window: tabbed docks read 'Block i…', 'Le…', 'Relocation and …' at 1024 x 640 and in the
    wide layout's legend column."""
    window = window_at(*size)
    elided = []
    for bar in window.findChildren(QtWidgets.QTabBar):
        if not bar.isVisible():
            continue
        for i in range(bar.count()):
            if bar.tabRect(i).width() < bar.tabSizeHint(i).width():
                elided.append((bar.tabText(i), bar.tabRect(i).width(), bar.tabSizeHint(i).width()))
    assert elided == []


@pytest.mark.parametrize("size", [(1024, 640), (1366, 768), (1920, 1080)])
def test_metric_plots_stay_inside_their_dock_and_readable(window_at, size):
    """Found in the X window at 1366 x 768: the fourth plot ran past the window's edge and the short rows'
    tick labels overlapped."""
    from explorer.widgets.metrics import MIN_PLOT_HEIGHT, MIN_PLOT_WIDTH
    window = window_at(*size)
    window.docks["metrics"].raise_()
    QtWidgets.QApplication.processEvents()
    metrics = window.metrics
    viewport = metrics.scroll.viewport()
    assert metrics.plots.width() <= viewport.width()  # no plot column beyond the dock's edge
    for plot, _ in metrics.plot_items:
        rect = plot.sceneBoundingRect()
        assert rect.width() >= MIN_PLOT_WIDTH * 0.8 and rect.height() >= MIN_PLOT_HEIGHT * 0.8, (plot, rect)


@pytest.mark.parametrize("size", [(1024, 640), (1366, 768), (1600, 1000)])
def test_first_launch_lays_the_docks_out_as_reset_layout_does(window_at, qtbot, size):
    """Found in a real X window: a 1600x1000 first launch gave the conversations dock about four rows, while
    View > Reset layout gave it its share."""
    window = window_at(*size)
    qtbot.wait(100)
    docks = [window.docks[k] for k in window.right_docks + window.bottom_docks]
    first = [(d.isVisible(), d.width(), d.height()) for d in docks]
    window.reset_layout()
    qtbot.wait(150)
    again = [(d.isVisible(), d.width(), d.height()) for d in docks]
    for (v1, w1, h1), (v2, w2, h2), dock in zip(first, again, docks):
        assert v1 == v2 and abs(w1 - w2) <= 4 and abs(h1 - h2) <= 4, (dock.objectName(), (w1, h1), (w2, h2))
