"""Pool views turned into RGBA arrays for the grids (numpy only: no Qt; the widgets hand the arrays to pyqtgraph)."""
