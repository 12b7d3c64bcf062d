"""The window's file dialogs, which never read a file to pick its icon.

Qt's own file dialog (the one drawn where no platform dialog is offered: a bare X server, a container) lists a
folder through a QFileSystemModel whose gatherer asks its icon provider for each entry's icon and type. The stock
provider asks QMimeDatabase, which opens any file whose name does not say its type and reads its first bytes: as
root, the completer walking into /proc read /proc/kmsg, which blocks until the kernel logs something, and the
window hung for good. The provider here names icons and types from what the directory entry says (folder, file,
its suffix), never from its content. Every dialog the window opens for a path comes from this module.
"""
from __future__ import annotations

import os

from PySide6 import QtWidgets

_Kinds = QtWidgets.QFileIconProvider.IconType


class PlainIcons(QtWidgets.QFileIconProvider):
    """Icons and type names from the entry's kind and suffix alone (the gatherer calls it on its own thread: the
    icons are made once, here, on the GUI thread)."""

    def __init__(self):
        super().__init__()
        self._folder = super().icon(_Kinds.Folder)
        self._file = super().icon(_Kinds.File)
        self._drive = super().icon(_Kinds.Drive)

    def icon(self, what):  # noqa: D102 (Qt's overloads: an IconType, or a QFileInfo)
        if isinstance(what, _Kinds):
            return super().icon(what)
        if what.isRoot():
            return self._drive
        return self._folder if what.isDir() else self._file

    def type(self, info) -> str:  # noqa: D102
        if info.isDir():
            return "Folder"
        suffix = info.suffix()
        return f"{suffix.upper()} file" if suffix else "File"


_icons: PlainIcons | None = None


def plain_icons() -> PlainIcons:
    """The one provider every dialog shares (made after the QApplication, which its icons need)."""
    global _icons
    if _icons is None:
        _icons = PlainIcons()
    return _icons


def file_dialog(parent, title: str, path: str = "", pattern: str = "", *, save: bool = False,
                folder: bool = False) -> QtWidgets.QFileDialog:
    """A dialog for a file to save (``save``), a file to open, or a directory (``folder``), starting at ``path``
    (a directory, or a file name to propose)."""
    directory, name = (path, "") if not path or os.path.isdir(path) else os.path.split(path)
    dialog = QtWidgets.QFileDialog(parent, title, directory or os.getcwd(), pattern)
    dialog.setIconProvider(plain_icons())
    if folder:
        dialog.setFileMode(QtWidgets.QFileDialog.FileMode.Directory)
        dialog.setOption(QtWidgets.QFileDialog.Option.ShowDirsOnly, True)
    elif save:
        dialog.setAcceptMode(QtWidgets.QFileDialog.AcceptMode.AcceptSave)
        dialog.setFileMode(QtWidgets.QFileDialog.FileMode.AnyFile)
    else:
        dialog.setFileMode(QtWidgets.QFileDialog.FileMode.ExistingFile)
    if name:
        dialog.selectFile(name)
    return dialog


def _run(dialog: QtWidgets.QFileDialog) -> tuple[str, str]:
    try:
        if dialog.exec() != QtWidgets.QDialog.DialogCode.Accepted or not dialog.selectedFiles():
            return "", ""
        return dialog.selectedFiles()[0], dialog.selectedNameFilter()
    finally:
        dialog.deleteLater()


def save_file_name(parent, title: str, name: str, pattern: str) -> tuple[str, str]:
    """As QFileDialog.getSaveFileName: (path, filter chosen), ("", "") when cancelled."""
    return _run(file_dialog(parent, title, name, pattern, save=True))


def open_file_name(parent, title: str, folder: str, pattern: str) -> tuple[str, str]:
    """As QFileDialog.getOpenFileName."""
    return _run(file_dialog(parent, title, folder, pattern))


def existing_directory(parent, title: str, folder: str) -> str:
    """As QFileDialog.getExistingDirectory: the directory, "" when cancelled."""
    return _run(file_dialog(parent, title, folder, folder=True))[0]
