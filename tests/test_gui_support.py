"""What the GUI tests share besides the fixtures (tests/conftest.py's make_window: a main window around a real
engine, small pool, built-in model): waiting for a frame, filling the add dialog."""
import time

from tests.helpers import make_config  # noqa: F401  (the GUI tests take it from here too)


def seeded(prompts, steps=3, max_new_tokens=40, ignore_eos=False):
    """A make_window setup: the prompts added one step apart, then ``steps`` more steps."""
    def setup(engine):
        for prompt in prompts:
            engine.add_conversation(prompt, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
            engine.step()
        for _ in range(steps):
            engine.step()
    return setup


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
