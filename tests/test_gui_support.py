"""Shared fixtures for the GUI tests: a main window around a real engine (small pool, built-in model)."""
import dataclasses
import time

import pytest

from engine import Engine, EngineConfig, EngineRunner
from explorer.feeds.engine_feed import EngineFeed
from explorer.window.main_window import MainWindow


def make_config(num_blocks=64, block_size=4):
    return EngineConfig(model="builtin", num_blocks=num_blocks, block_size=block_size)


@pytest.fixture
def make_window(qtbot):
    """make_window(setup=callable(engine), paused=False, speed=None, num_blocks=64, block_size=4, history=False,
    **fields) -> MainWindow. ``history``: the engine's frames also go to a History (the timeline and event log work);
    ``fields``: more EngineConfig fields (a host tier, say)."""
    windows = []

    def make(setup=None, paused=False, speed=None, num_blocks=64, block_size=4, history=False, size=None, **fields):
        cfg = dataclasses.replace(make_config(num_blocks, block_size), **fields)
        engine = Engine(cfg)
        if setup is not None:
            setup(engine)
        if history:
            feed = EngineFeed.start(engine, cfg, max_steps_per_second=speed, start_paused=paused)
            window = MainWindow(feed=feed, config=cfg, size=size)
        else:
            runner = EngineRunner(engine, max_steps_per_second=speed, start_paused=paused).start()
            window = MainWindow(runner, cfg, size=size)
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
        windows.append(window)
        return window

    yield make
    for window in windows:
        window.close()
        assert window.runner is None or not window.runner.alive


def wait_for_snapshot(qtbot, window, predicate, timeout=8000):
    """Wait until the snapshot the window last drew satisfies ``predicate``; return it."""
    qtbot.waitUntil(lambda: window.snapshot is not None and predicate(window.snapshot), timeout=timeout)
    return window.snapshot


def open_add_dialog(window, prompt, max_new_tokens=None, temperature=None, samples=None, system=False):
    """The window's add dialog with its fields filled in (fields left as None keep their defaults)."""
    dialog = window.open_add_dialog()
    dialog.prompt.setPlainText(prompt)
    dialog.use_system.setChecked(system)
    for field, value in ((dialog.max_new_tokens, max_new_tokens), (dialog.temperature, temperature),
                         (dialog.samples, samples)):
        if value is not None:
            field.setText(str(value))
    return dialog


def test_support_window_stops_its_engine_on_close(make_window):
    window = make_window()
    assert window.runner.alive
    start = time.perf_counter()
    window.close()
    assert time.perf_counter() - start < 1.0
    assert not window.runner.alive
