"""The main window and what assembles it: actions, menus, files, dialogs, layout, status bar, the app."""
