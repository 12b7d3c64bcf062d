"""The metrics dock's words about a watched vLLM server (``--attach-metrics``): its own prefix-cache hit rate and KV
usage, what its KV events say beside them, where the two disagree, and how the reading of its /metrics goes.

The figures and the words are made without Qt (:mod:`kvstream.metrics.compare`, on the reader's thread); this
widget only shows the newest, when the reader has read again, at the dock's redraw pace.
"""
from __future__ import annotations

import html
import re

from PySide6 import QtCore, QtWidgets

DISAGREE_COLOUR = "#e0443e"
ERROR_COLOUR = "#f0a030"


class ServerMetricsView(QtWidgets.QFrame):
    """Hidden until given a :class:`~kvstream.metrics.ServerWatch`; one paragraph per engine of the server."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.watch = None
        self._shown: int | None = None  # the reader's version on view
        self.body = QtWidgets.QLabel()
        self.body.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.body.setWordWrap(True)
        self.body.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.addWidget(self.body)
        self.setVisible(False)

    def set_watch(self, watch) -> None:
        self.watch = watch
        self._shown = None
        self.setVisible(watch is not None)
        self.refresh()

    def refresh(self) -> None:
        watch = self.watch
        if watch is None or watch.reader.version == self._shown:
            return
        self._shown = watch.reader.version
        self.body.setText(self.text_of(watch))

    def plain_text(self) -> str:
        """What the view says, without markup (tests, copy)."""
        return _plain(self.body.text())

    @staticmethod
    def text_of(watch) -> str:
        status = watch.status()
        parts = [f"<b>vLLM server {html.escape(watch.url)}</b>"]
        for comparison in watch.comparisons():
            lines = comparison.lines()
            title = f"engine {html.escape(comparison.engine)}" + (
                f" · KV events {html.escape(comparison.instance)}" if comparison.instance else "")
            words = [html.escape(line) if not line.startswith("disagree:") else
                     f"<span style='color:{DISAGREE_COLOUR}; font-weight:bold'>{html.escape(line)}</span>"
                     for line in lines]
            parts.append(f"<i>{title}</i><br>" + "<br>".join(words))
        if status.state != "ok":
            parts.append(f"<span style='color:{ERROR_COLOUR}'>{html.escape(status.text)}</span>")
        return "<br>".join(parts)


def _plain(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text.replace("<br>", "\n")))
