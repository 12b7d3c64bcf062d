"""The app as a user starts it (``main.py --demo serve`` by default), left running: memory and frame rate over time.

A demo that never runs dry must not grow without bound: the History has a byte budget, the finished-conversation
window a fixed size, the traffic a bounded queue. This runs the real window (on whatever display Qt is given: a real
X server shows what a user sees; offscreen measures the same work without painting to a screen) through main.py's own
entry point and prints, at the minutes asked for, the process's resident memory (VmRSS, and its high-water mark
VmHWM), the window's GUI frames/s and grid redraws/s (the status bar's own counters), the engine step, the number
of conversations served so far and the bytes the timeline's History holds (it grows to its budget, then trims).

    python bench/soak.py [--minutes 60] [--marks 1 10 60] [--every 60] [-- main.py arguments (default --demo serve)]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def memory_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB, from /proc (0, 0 where there is no /proc)."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--marks", type=float, nargs="*", default=[1, 10, 60],
                        help="minutes at which to print a marked line (besides every --every seconds)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between lines")
    parser.add_argument("--history-mib", type=int, default=None,
                        help="the timeline History's budget once the window is up (default: the app's own), to reach "
                             "its trimming sooner")
    parser.add_argument("app_args", nargs="*", help="main.py arguments after --")
    args = parser.parse_args(argv)
    app_args = args.app_args or ["--demo", "serve"]

    from PySide6 import QtCore, QtWidgets

    import main as app_main
    from explorer.window.app import application
    from explorer.window.main_window import MainWindow

    application()  # the app's own QApplication (run_gui takes the same instance)
    start = time.monotonic()
    marks = sorted(m * 60.0 for m in args.marks)
    print(f"soak: main.py {' '.join(app_args)} for {args.minutes:g} min, pid {os.getpid()}, "
          f"QT_QPA_PLATFORM={os.environ.get('QT_QPA_PLATFORM', '(display)')}", flush=True)
    print("  minute   RSS MiB   peak MiB   GUI fps   redraws/s      step   conversations   history MiB", flush=True)

    def window() -> MainWindow | None:
        for w in QtWidgets.QApplication.topLevelWidgets():
            if isinstance(w, MainWindow):
                return w
        return None

    def sample(mark: bool = False) -> None:
        w = window()
        elapsed = time.monotonic() - start
        rss, hwm = memory_kib()
        fps = redraws = float("nan")
        step, convs, kept = "-", "-", float("nan")
        if w is not None:
            now = time.monotonic()
            fps = w.gui_fps(now)
            redraws = w.status.redraws.per_second(now)
            snap = getattr(getattr(w, "source", None), "live", None)  # the newest frame the window was given
            history = getattr(getattr(w, "source", None), "history", None)
            if history is not None and args.history_mib and history.budget_bytes != args.history_mib << 20:
                history.budget_bytes = args.history_mib << 20
            if history is not None:
                kept = history.nbytes / 2 ** 20  # the timeline's frames, held up to its budget
            if snap is not None:
                step = f"{snap.step_id:,}"
                convs = f"{max((c.conversation_id for c in snap.conversations), default=-1) + 1:,}"
        print(f"{'*' if mark else ' '} {elapsed / 60:6.1f}  {rss / 1024:8.0f}  {hwm / 1024:9.0f}  {fps:8.1f}  "
              f"{redraws:10.1f}  {step:>8}  {convs:>14}  {kept:12.0f}", flush=True)
        if elapsed >= args.minutes * 60.0 and w is not None:
            w.close()

    ticker = QtCore.QTimer()
    ticker.timeout.connect(sample)
    ticker.start(int(args.every * 1000))
    mark_timers = []
    for m in marks:
        t = QtCore.QTimer()
        t.setSingleShot(True)
        t.timeout.connect(lambda: sample(mark=True))
        t.start(int(m * 1000))
        mark_timers.append(t)
    return app_main.main(app_args)


if __name__ == "__main__":
    sys.exit(main())
