"""The window's menus and toolbar: File, Engine, Conversation, Pool, View, Demos, Help, laid out from the window's
:class:`~explorer.window.actions.WindowActions` (this file only places them)."""
from __future__ import annotations

from PySide6 import QtWidgets


def build_menus(window, actions) -> None:
    """Create the menu bar and fill the engine toolbar from ``actions``."""
    bar = window.menuBar()
    controls = window.controls

    file_menu = bar.addMenu("&File")
    file_menu.addActions([actions.record, actions.stop_record, actions.open, actions.open_trace])
    export = file_menu.addMenu("Export")
    export.addActions([actions.export_window, actions.export_grid, actions.export_json])
    file_menu.addSeparator()
    file_menu.addAction(actions.quit)

    engine_menu = bar.addMenu("&Engine")
    engine_menu.addActions([actions.pause, actions.step])
    engine_menu.addSeparator()
    engine_menu.addAction(actions.restart)

    conv = bar.addMenu("&Conversation")
    conv.addActions([actions.add, actions.fork, actions.reply, actions.end])

    pool = bar.addMenu("&Pool")
    relocate = pool.addMenu("Relocate blocks")
    relocate.addActions([actions.scramble, actions.compact])
    pool.addAction(actions.check_prompt)

    view = window.view_menu = bar.addMenu("&View")
    view.addActions([actions.back_to_live, actions.contiguous])
    view.addSeparator()
    for key in window.docks:
        view.addAction(window.docks[key].toggleViewAction())
    view.addSeparator()
    view.addAction(actions.reset_layout)

    demos = bar.addMenu("&Demos")
    demos.addActions([actions.demos[name] for name in ("busy", "crowd", "serve", "tiers", "window", "traffic")])
    demos.addSeparator()
    demos.addAction(actions.lesson)

    help_menu = bar.addMenu("&Help")
    help_menu.addActions([actions.help, actions.shortcuts, actions.lesson])

    controls.addSeparator()
    controls.addAction(actions.add)
    controls.addSeparator()
    controls.addWidget(QtWidgets.QLabel(" Relocate: "))
    controls.addActions([actions.scramble, actions.compact])
    controls.addSeparator()
    controls.addAction(actions.lesson)
