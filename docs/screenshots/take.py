"""Take the README's screenshots from the real app: the real window, engine, demos and history, no mock-ups.

    Xvfb :98 -screen 0 1920x1080x24 &  DISPLAY=:98 openbox &
    DISPLAY=:98 python docs/screenshots/take.py [OUT_DIR] [--only main,tiers,...] [--traces DIR]

Every README picture but the two of a vLLM server (docs/screenshots/vllm_shots.sh) comes from here: main,
window_1024x640, scrubbed, contiguous, why, tiers, window_demo, capacity, lesson_before, lesson_after (about 6
minutes on 2 cores; main and window_1024x640 need SmolLM2, ``python main.py --fetch-model smollm2``, and
capacity Mooncake's trace in ``--traces``, ../shared/traces by default).

Each shot runs ``main.py`` itself with the shot's command line, in a process of its own with a fresh layout (no saved
dock sizes: ``XDG_CONFIG_HOME`` in a temporary folder), so the window is the one a user gets from that command: the
same model loading, demo, served traffic and first selection. Once the window shows, the shot does what a user would
(wait for a step, pause, click an event in the log, turn on the side-by-side view, open a tier slot, ask Pool > Check
a prompt...) through the window's own calls, and saves either the window (``window.grab()``, as ``--screenshot``
and File > Export > Window as PNG) or, for the pictures of a whole 1920x1080 screen, the screen itself with the
window manager's frame and any dialog the shot opened: those need a real X display of that size (Xvfb + openbox).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
OUT_DEFAULT = Path(__file__).resolve().parent
SHOT_TIMEOUT_S = 900  # a shot that has not saved by then failed (the serve demo's evictions are timed traffic)


@dataclass(frozen=True)
class Shot:
    args: tuple[str, ...]  # main.py's command line
    script: Callable  # script(window, out): a generator that does what a user would, saves the picture(s)
    files: tuple[str, ...]


# ---- helpers run inside a shot's process ------------------------------------------------------------------------
# A shot is a generator: each ``yield`` hands control back to the app's own event loop (a timer resumes the shot),
# never a nested loop: deferred deletes run only in the loop they were posted from, and a shot that waited in nested
# loops left QMainWindow's discarded dock tab bars drawn over the status bar.
def wait(seconds: float):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        yield


def wait_until(predicate, timeout: float = 120.0):
    end = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > end:
            raise TimeoutError("the window did not get there in time")
        yield


def drawn(window):
    yield from wait_until(lambda: window.snapshot is not None and window.grid.frames_drawn > 0)


def run_to_step(window, step: int, pause: bool = True):
    yield from wait_until(lambda: window.source.live.step_id >= step, timeout=600)
    if pause:
        window.source.submit("pause")
        yield from wait(0.5)


def save_window(window, path: Path):
    yield from wait(1.0)  # panels refresh a few times a second and plots twice: let every one catch up
    write(window.grab(), path)


def save_screen(window, path: Path):
    """The whole screen, as a user sees it: the window manager's frame, and any dialog over the window. Once the
    status bar's note that --geometry was fitted to the screen has gone (the shots ask for the whole screen)."""
    from PySide6 import QtGui
    end = time.perf_counter() + 30
    while window.statusBar().currentMessage() and time.perf_counter() < end:
        yield
    yield from wait(1.0)
    write(QtGui.QGuiApplication.primaryScreen().grabWindow(0), path)


def write(picture, path: Path) -> None:
    if not picture.save(str(path)):
        raise OSError(f"could not save {path}")
    print(f"saved {path} ({picture.width()}x{picture.height()}, {path.stat().st_size // 1024} KiB)", flush=True)


# ---- the shots --------------------------------------------------------------------------------------------------
def shot_main(window, out: Path) -> None:
    """SmolLM2's busy demo at step 225, live: the window's first selection (a block conversation 1 shares, and
    that conversation) kept; the table lists the running conversations first."""
    yield from drawn(window)
    yield from run_to_step(window, 225, pause=False)
    yield from save_screen(window, out / "main.png")


def shot_window_1024x640(window, out: Path) -> None:
    """The same demo in a 1024x640 window: docks tab, the status bar's fields elide."""
    yield from drawn(window)
    yield from run_to_step(window, 225, pause=False)
    yield from save_window(window, out / "window_1024x640.png")


def shot_scrubbed(window, out: Path) -> None:
    """The busy demo, scrubbed back to the step where the fork first copied a shared block on write, by a click
    on that line of the event log (every view shows that step; the engine went on)."""
    from kvstream.events import EventKind
    yield from drawn(window)
    yield from run_to_step(window, 140)
    (seq, _event), *_ = window.source.history.events(kinds=(EventKind.COPIED_ON_WRITE,))
    window.docks["events"].raise_()
    log = window.event_log
    row = next(r for r in range(log.model.rowCount()) if log.model.entry(r)[0] == seq
               and log.model.entry(r)[1].kind == EventKind.COPIED_ON_WRITE)
    index = log.model.index(row, 1)
    log.view.scrollTo(index)
    log.view.setCurrentIndex(index)
    log._activated(index)  # what a click on the line does
    yield from wait_until(lambda: window.source.viewing == seq)
    yield from save_window(window, out / "scrubbed.png")


def shot_contiguous(window, out: Path) -> None:
    """The crowd demo with the contiguous max-length allocator beside the paged grid, early on (many waiting)."""
    yield from drawn(window)
    window.set_contiguous(True)
    yield from run_to_step(window, 40)
    yield from save_window(window, out / "contiguous.png")


def shot_why(window, out: Path) -> None:
    """Why did my prompt miss: the serve demo in a pool of 40 blocks, run until a running conversation's prompt
    found some of its blocks evicted (and the timeline has regretted evictions); that conversation selected with its
    missed blocks marked, and Pool > Check a prompt... asked about a new question after the system prompt the pool
    holds most of. The dialog is its own window, moved over the inspector (empty with no block selected)."""
    from explorer.feeds.traffic import SYSTEM_PROMPTS
    yield from drawn(window)
    window.traffic.set_rate(3.0)

    def evicted_running():
        for c in window.snapshot.conversations:
            if c.status == "running" and any(o.outcome == "evicted" for o in c.prompt_block_outcomes) \
                    and any(o.hit for o in c.prompt_block_outcomes):
                return c.conversation_id
        return None

    yield from wait_until(lambda: window.pane.timeline.regrets and evicted_running() is not None, timeout=600)
    cid = evicted_running()
    window.traffic.set_rate(0.0)  # the arrivals slider at 0 (stopping the traffic would forget which were its own)
    window.source.submit("pause")
    yield from wait(0.5)
    window.select_block(None)
    window.conversations.select_conversation(cid)
    window.conversations.detail.mark_misses.setChecked(True)
    dialog = window.open_check_prompt()
    best = (-1, "")
    for system in SYSTEM_PROMPTS:  # a new question after the system prompt the pool holds most of
        dialog.prompt.setPlainText(system + " How does a prefix cache decide what to keep?")
        dialog.checks = None
        dialog.check()
        yield from wait_until(lambda: dialog.checks is not None)
        best = max(best, (sum(c.cached_tokens for c in dialog.checks), system))
    dialog.prompt.setPlainText(best[1] + " How does a prefix cache decide what to keep?")
    dialog.checks = None
    dialog.check()
    yield from wait_until(lambda: dialog.checks is not None)
    dialog.resize(760, 460)
    room = window.screen().availableGeometry()
    dialog.move(room.right() - dialog.frameGeometry().width() - 8, room.top() + 60)
    dialog.raise_()
    yield from save_screen(window, out / "why.png")
    dialog.close()


def shot_tiers(window, out: Path) -> None:
    """The tiers demo once the returning conversations, whose prefix came back from the host tier, have finished;
    the host tier's first slot whose tokens the window saw stored opened in the Inspector (what a click does).
    On the built-in model: the demo sizes its prompts in characters, and SmolLM2's tokens never fill its pool."""
    yield from drawn(window)

    def returned():  # the returning conversations took their prefix from the host tier, and finished
        back = [c for c in window.snapshot.conversations if dict(c.prompt_token_sources).get("host", 0)]
        return len(back) >= 2 and not any(c.is_live for c in back)

    yield from wait_until(returned, timeout=240)
    window.source.submit("pause")
    yield from wait(1.0)
    grids = window.pane.tier_grids
    host = window.snapshot.tiers["host"]
    slot = next(s for s in range(host.num_blocks) if host.state[s] != 0 and grids.tokens("host", s))
    grids.inspect("host", slot)  # what a click on the slot does
    yield from save_screen(window, out / "tiers.png")


def shot_window_demo(window, out: Path) -> None:
    """The window demo coloured by KV cache group (one pool, two groups), the legend in front to name the colours."""
    yield from drawn(window)
    box = window.pane.color_by
    box.setCurrentIndex(box.findData("group"))
    window.docks["legend"].raise_()
    yield from run_to_step(window, 200)
    yield from save_window(window, out / "window_demo.png")


def shot_capacity(window, out: Path) -> None:
    """The Capacity dock once its sweep of Mooncake's conversation trace has answered (as --screenshot waits)."""
    from explorer.window import traces
    yield from drawn(window)
    done = []
    traces.when_swept(window.capacity, lambda: done.append(True))
    yield from wait_until(lambda: done, timeout=600)
    yield from save_screen(window, out / "capacity.png")


def shot_lesson(window, out: Path) -> None:
    """The lesson at its fifth position (a second block, elsewhere), then after Change layout."""
    yield from wait_until(lambda: window.lesson_window is not None and window.lesson_window.isVisible())
    lesson = window.lesson_window
    lesson.resize(1280, 780)
    for _ in range(5):
        lesson.step()
    yield from save_window(lesson, out / "lesson_before.png")
    lesson.change_layout()
    yield from save_window(lesson, out / "lesson_after.png")


TRACE = "mooncake_conversation.jsonl"
SHOTS = {
    "main": Shot(("--model", "smollm2", "--demo", "busy", "--geometry", "1920x1080"), shot_main, ("main.png",)),
    "window_1024x640": Shot(("--model", "smollm2", "--demo", "busy", "--geometry", "1024x640"),
                            shot_window_1024x640, ("window_1024x640.png",)),
    "scrubbed": Shot(("--model", "builtin", "--demo", "busy", "--geometry", "1600x1000"), shot_scrubbed,
                     ("scrubbed.png",)),
    "contiguous": Shot(("--model", "builtin", "--demo", "crowd", "--num-blocks", "1024", "--geometry", "1600x1000"),
                       shot_contiguous, ("contiguous.png",)),
    "why": Shot(("--model", "builtin", "--demo", "serve", "--num-blocks", "40", "--geometry", "1920x1080"),
                shot_why, ("why.png",)),
    "tiers": Shot(("--model", "builtin", "--demo", "tiers", "--geometry", "1920x1080"), shot_tiers, ("tiers.png",)),
    "window_demo": Shot(("--demo", "window", "--geometry", "1024x640"), shot_window_demo, ("window_demo.png",)),
    "capacity": Shot(("--model", "none", "--trace", "{traces}/" + TRACE, "--num-blocks", "14058", "--trace-speed",
                      "20", "--trace-scale", "0.05", "--geometry", "1920x1080"), shot_capacity, ("capacity.png",)),
    "lesson": Shot(("--demo", "lesson"), shot_lesson, ("lesson_before.png", "lesson_after.png")),
}


def command(name: str, traces: str) -> list[str]:
    return ["main.py", *(a.replace("{traces}", traces) for a in SHOTS[name].args)]


def run_shot(name: str, out: Path, traces: str) -> int:
    """In this process: main.main() with the shot's command line; the shot's script runs once the window shows."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="take-shot-")  # a first launch's layout
    from PySide6 import QtCore
    import main
    from explorer.window.main_window import MainWindow
    failed = []
    shown = MainWindow.show

    def show(window):
        shown(window)
        if getattr(MainWindow, "_shot_started", False):
            return
        MainWindow._shot_started = True

        steps = SHOTS[name].script(window, out)
        timer = QtCore.QTimer(window)
        timer.setInterval(50)

        def resume():
            try:
                next(steps)
                return
            except StopIteration:
                pass
            except Exception:  # the shot failed: say why, and end the app all the same
                traceback.print_exc()
                failed.append(name)
            timer.stop()
            window.close()
        timer.timeout.connect(resume)
        timer.start()
        QtCore.QTimer.singleShot(SHOT_TIMEOUT_S * 1000, lambda: (failed.append(name), window.close()))

    MainWindow.show = show
    code = main.main(command(name, traces)[1:])
    return 1 if failed or code else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(OUT_DEFAULT))
    parser.add_argument("--only", default=",".join(SHOTS))
    parser.add_argument("--traces", default=str(ROOT.parent / "shared" / "traces"))
    parser.add_argument("--shot", help=argparse.SUPPRESS)  # one shot, in this process (the driver runs each so)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.shot:
        return run_shot(args.shot, out, args.traces)
    names = args.only.split(",")
    unknown = [n for n in names if n not in SHOTS]
    if unknown:
        parser.error(f"unknown shot {unknown[0]!r}; the shots are {', '.join(SHOTS)}")
    failed = []
    for name in names:
        print(f"{name}: python {' '.join(command(name, args.traces))}", flush=True)
        started = time.time()
        done = subprocess.run([sys.executable, __file__, str(out), "--shot", name, "--traces", args.traces])
        written = all((out / f).exists() and (out / f).stat().st_mtime >= started for f in SHOTS[name].files)
        if done.returncode or not written:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
