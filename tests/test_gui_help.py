"""The Help window explains the grid's marks, lists the window's real shortcuts and opens the lesson."""
from PySide6 import QtCore

from explorer.window.help import MOUSE, HelpDialog

def test_help_lists_marks_and_the_windows_own_shortcuts_and_opens_the_lesson(qtbot, make_window):
    window = make_window(paused=True)
    dialog = HelpDialog(window)
    qtbot.addWidget(dialog)
    dialog.show()
    keys = dict(dialog.shortcuts)
    assert keys["Ctrl+N"] == "Add" and keys["Ctrl+L"] == "Lesson" and keys["Space"] == "Pause or run the engine"
    assert all(words[:1].isalnum() for words in keys.values()), keys  # no toolbar glyph ("▌▌ Pause")
    texts = " ".join(dialog.texts())
    for words in ("shared: ref count > 1", "partial tail", "external fragmentation", "Fill level", "zoom"):
        assert words in texts
    requested = []
    dialog.lessonRequested.connect(lambda: requested.append(True))
    qtbot.mouseClick(dialog.lesson_button, QtCore.Qt.MouseButton.LeftButton)
    assert requested and window.lesson_window is not None and window.lesson_window.isVisible()


def test_help_without_a_window_still_explains_the_mouse(qtbot):
    dialog = HelpDialog()
    qtbot.addWidget(dialog)
    dialog.resize(320, 280)  # small screens: the tabs scroll, labels wrap
    dialog.show()
    assert dialog.shortcuts == list(MOUSE)
    assert dialog.minimumSizeHint().width() <= 400
