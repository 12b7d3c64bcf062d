import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# As in main.py: engine and GUI threads share two cores; spinning OpenMP workers would starve them (set before torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engine's cache (built kernels, fetched models) of this test session only, unless the caller chose one: a model
# the developer fetched (--fetch-model smollm2) must not change what the demos and the windows under test run.
if not os.environ.get("PAGED_KV_EXPLORER_CACHE"):
    _cache = tempfile.mkdtemp(prefix="paged-kv-tests-")
    os.environ["PAGED_KV_EXPLORER_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


try:  # the GUI tests' helpers; the vLLM venv that runs tests/vllm_live has no pytest-qt, and needs none of them
    import pytest
    import pytestqt  # noqa: F401
except ImportError:  # pragma: no cover
    pass
else:
    @pytest.fixture
    def shown(qtbot):
        """``shown(widget, width, height)``: ``widget`` at that size, shown, exposed and closed after the test."""
        def show(widget, width, height):
            qtbot.addWidget(widget)
            widget.resize(width, height)
            widget.show()
            qtbot.waitExposed(widget)
            return widget
        return show

    @pytest.fixture
    def make_window(qtbot):
        """make_window(setup=callable(engine), paused=False, speed=None, num_blocks=64, block_size=4, history=False,
        **fields) -> MainWindow around a real engine (built-in model). ``history``: the engine's frames also go to a
        History (the timeline and event log work); ``fields``: more EngineConfig fields (a host tier, say). The
        windows are closed after the test, and their engine threads must have ended."""
        import dataclasses

        from engine import Engine, EngineRunner
        from explorer.feeds.engine_feed import EngineFeed
        from explorer.window.main_window import MainWindow
        from tests.helpers import make_config
        windows = []

        def make(setup=None, paused=False, speed=None, num_blocks=64, block_size=4, history=False, size=None,
                 **fields):
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
