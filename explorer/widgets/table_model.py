"""A read-only Qt table model over a list of tuples, shared by the conversations table and the inspector's slots.

Subclasses name their columns and decide how rows change (reset, or in-place updates); cells show ``str(value)``
unless :meth:`RowsModel.cell_data` is overridden for other roles.
"""
from __future__ import annotations

from PySide6 import QtCore

DISPLAY = QtCore.Qt.ItemDataRole.DisplayRole


class RowsModel(QtCore.QAbstractTableModel):
    """One tuple per row, one header per column; never edited through the view."""

    COLUMNS: tuple[str, ...] = ()

    def __init__(self, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self._rows: list[tuple] = []

    def rowCount(self, parent=QtCore.QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent=QtCore.QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section, orientation, role=DISPLAY):
        if role == DISPLAY and orientation == QtCore.Qt.Orientation.Horizontal:
            return self.COLUMNS[section]
        return None

    def data(self, index, role=DISPLAY):
        if not index.isValid():
            return None
        return self.cell_data(self._rows[index.row()], index.column(), role)

    def cell_data(self, row: tuple, column: int, role):
        """What a cell shows for ``role``; the text of the value by default."""
        return str(row[column]) if role == DISPLAY else None

    def set_rows(self, rows: list[tuple]) -> None:
        """Replace every row (a model reset), but only when they differ, so views keep their state otherwise."""
        if rows != self._rows:
            self.beginResetModel()
            self._rows = rows
            self.endResetModel()

    def rows(self) -> list[tuple]:
        return list(self._rows)
