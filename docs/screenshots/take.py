"""Take the README's screenshots from the real app: the real window, engine, demos and history, no mock-ups.

    Xvfb :99 -screen 0 1920x1080x24 &  DISPLAY=:99 openbox &
    DISPLAY=:99 python docs/screenshots/take.py [OUT_DIR] [--size 1600x1000] [--only main,scrubbed,contiguous]

Each shot builds the main window as ``main.py --demo NAME`` does (the demo's conversations, the demo's speed, a
history for the timeline), lets the engine run to a given step, does what a user would do (select a shared block,
click an event in the log, turn on View > Contiguous allocator side by side), and saves ``window.grab()``, the same
picture ``--screenshot`` and File > Export > Window as PNG save. Runs under any Qt platform; with a real X display
(Xvfb) the fonts and styles are the ones a user sees.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as main.py: the engine and GUI threads share the cores

from PySide6 import QtCore, QtGui, QtWidgets  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from explorer.window.app import application, show_example_selection  # noqa: E402
from explorer.feeds.demo import DEMO_SPEED, DEMOS  # noqa: E402
from explorer.feeds.engine_feed import EngineFeed  # noqa: E402
from explorer.window.main_window import MainWindow  # noqa: E402
from kvstream.events import EventKind  # noqa: E402

SHOTS = ("main", "scrubbed", "contiguous", "why")


def spin(seconds: float) -> None:
    """Let the window run (frames, panels, answers) for ``seconds``, in a real event loop: a bare processEvents()
    loop never runs deferred deletes, and QMainWindow's discarded dock tab bars then stay on screen."""
    loop = QtCore.QEventLoop()
    QtCore.QTimer.singleShot(max(int(seconds * 1000), 1), loop.quit)
    loop.exec()


def spin_until(predicate, timeout: float = 60.0) -> None:
    end = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > end:
            raise TimeoutError("the window did not get there in time")
        spin(0.05)


def demo_window(demo: str, num_blocks: int, size: tuple[int, int], speed: float = DEMO_SPEED) -> MainWindow:
    cfg = EngineConfig(model="builtin", num_blocks=num_blocks, block_size=16)
    engine = Engine(cfg)
    seeded = DEMOS[demo](engine)
    feed = EngineFeed.start(engine, cfg, max_steps_per_second=speed)
    window = MainWindow(feed=feed, config=cfg, size=size)
    window.show_demo_notes(seeded)
    window.show()
    spin_until(lambda: window.snapshot is not None and window.grid.frames_drawn > 0)
    return window


def run_to_step(window: MainWindow, step: int) -> None:
    spin_until(lambda: window.source.live.step_id >= step)
    window.source.submit("pause")
    spin(0.5)


def save(window: MainWindow, path: Path) -> None:
    spin(0.8)  # panels refresh a few times a second and plots twice: let every one catch up
    if not window.grab().save(str(path)):
        raise OSError(f"could not save {path}")
    print(f"saved {path} ({path.stat().st_size // 1024} KiB)")


def shot_main(out: Path, size) -> None:
    """The busy demo a few seconds in: shared system-prompt blocks selected, a conversation streaming."""
    window = demo_window("busy", 128, size)
    show_example_selection(window)
    run_to_step(window, 70)
    save(window, out / "main.png")
    window.close()


def shot_scrubbed(out: Path, size) -> None:
    """The busy demo, scrubbed back to the step where the fork first copied a shared block on write, by a click
    on that line of the event log (every view shows that step; the engine went on)."""
    window = demo_window("busy", 128, size)
    run_to_step(window, 140)
    history = window.source.history
    (seq, event), *_ = history.events(kinds=(EventKind.COPIED_ON_WRITE,))
    window.docks["events"].raise_()
    log = window.event_log
    row = next(r for r in range(log.model.rowCount()) if log.model.entry(r)[0] == seq
               and log.model.entry(r)[1].kind == EventKind.COPIED_ON_WRITE)
    index = log.model.index(row, 1)
    log.view.scrollTo(index)
    log.view.setCurrentIndex(index)
    log._activated(index)  # what a click on the line does
    spin_until(lambda: window.source.viewing == seq)
    save(window, out / "scrubbed.png")
    window.close()


def shot_contiguous(out: Path, size) -> None:
    """The crowd demo with the contiguous max-length allocator beside the paged grid, early on (many waiting)."""
    window = demo_window("crowd", 1024, size)
    window.set_contiguous(True)
    run_to_step(window, 40)
    save(window, out / "contiguous.png")
    window.close()


def shot_why(out: Path, size) -> None:
    """Why did my prompt miss: the serve demo in a pool of 40 blocks, run until a running conversation's prompt
    found some of its blocks evicted (and the timeline has regretted evictions); that conversation selected with its
    missed blocks marked, and Pool > Check a prompt... asked about a new question on a shared system prompt. The
    dialog is its own window: it is drawn into the picture's upper right corner (over the inspector, empty with no
    block selected), as a window manager would show it over the main window."""
    from explorer.feeds.traffic import SYSTEM_PROMPTS
    window = demo_window("serve", 40, size)
    window.start_traffic("serve")
    window.traffic.set_rate(3.0)

    def evicted_running():
        snap = window.snapshot
        for c in snap.conversations:
            if c.status == "running" and any(o.outcome == "evicted" for o in c.prompt_block_outcomes) \
                    and any(o.hit for o in c.prompt_block_outcomes):
                return c.conversation_id
        return None

    spin_until(lambda: window.pane.timeline.regrets and evicted_running() is not None, timeout=600)
    cid = evicted_running()
    window.source.submit("pause")
    window.stop_traffic()
    spin(0.5)
    window.conversations.select_conversation(cid)
    window.conversations.detail.mark_misses.setChecked(True)
    dialog = window.open_check_prompt()
    dialog.prompt.setPlainText(SYSTEM_PROMPTS[0] + " How does a prefix cache decide what to keep?")
    dialog.check()
    spin_until(lambda: dialog.checks is not None)
    dialog.resize(760, 460)
    spin(0.8)
    picture = window.grab()
    painter = QtGui.QPainter(picture)
    where = QtCore.QPoint(picture.width() - dialog.width() - 16, 56)
    painter.fillRect(QtCore.QRect(where, dialog.size()).adjusted(-2, -2, 2, 2), QtGui.QColor(40, 40, 40))
    painter.drawPixmap(where, dialog.grab())
    painter.end()
    path = out / "why.png"
    if not picture.save(str(path)):
        raise OSError(f"could not save {path}")
    print(f"saved {path} ({path.stat().st_size // 1024} KiB)")
    dialog.close()
    window.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--size", default="1600x1000")
    parser.add_argument("--only", default=",".join(SHOTS))
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.lower().split("x"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    application()
    for name in args.only.split(","):
        if name not in SHOTS:
            parser.error(f"unknown shot {name!r}; the shots are {', '.join(SHOTS)}")
        globals()[f"shot_{name}"](out, size)
    QtCore.QCoreApplication.processEvents()
    return 0


if __name__ == "__main__":
    sys.exit(main())
