"""The grid's KV cache group filter: 'All groups' or one group, whose blocks stay bright while the others dim.

Shown only for a pool with more than one group (a plain model has one, and a filter would do nothing); the entries
name each group by kind and window (:func:`explorer.model.groups.group_name`).
"""
from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from kvstream.views import PoolSnapshot

from ..model.groups import group_name, groups_of


class GroupFilter(QtWidgets.QComboBox):
    """Emits the chosen group (None: all) when the user picks one."""

    groupChosen = QtCore.Signal(object)  # int group index, or None

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._groups: tuple = ()
        self.setToolTip("Show the blocks of one KV cache group; the others are dimmed")
        self.addItem("All groups", None)
        self.currentIndexChanged.connect(lambda _i: self.groupChosen.emit(self.currentData()))
        self.setVisible(False)

    def set_groups(self, snapshot: PoolSnapshot) -> None:
        """Follow the snapshot's groups (entries rebuilt only when they change; the choice kept where it can be)."""
        groups = groups_of(snapshot)
        if groups == self._groups:
            return
        self._groups = groups
        chosen = self.currentData()
        self.blockSignals(True)
        self.clear()
        self.addItem("All groups", None)
        for i, group in enumerate(groups):
            self.addItem(group_name(group, i), i)
        keep = self.findData(chosen) if chosen is not None and chosen < len(groups) else 0
        self.setCurrentIndex(max(keep, 0))
        self.blockSignals(False)
        self.setVisible(len(groups) > 1)
        if keep <= 0 and chosen is not None:
            self.groupChosen.emit(None)
