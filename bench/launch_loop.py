"""Launch the window again and again, each time on a fresh X server, and count how many launches crash.

Why: a SIGSEGV at launch was reported on fresh displays (2-3 of about 20 launches, inside pyqtgraph's
``AxisItem._updateLabel`` during the window's first resize), and a later round of 132 launches did not see it again.
A crash that shows in one launch of ten cannot be caught by a test that launches once; this loop is what a session
runs before a release. Each launch gets its own ``Xvfb`` (a fresh display, as the report had: nothing cached from
the launch before), Python's faulthandler is on (a crash prints every thread's stack to stderr), and the stderr of
each failed launch is kept.

    python bench/launch_loop.py [--launches 20] [--quit-after 6] [--demo busy] [--geometry 1920x1080]
                                [--model builtin] [--load 0] [--wm] [--keep DIR]

``--load N`` runs N busy processes beside the launches (the report saw crashes under load too); ``--wm`` starts
openbox on each display (a window manager resizes the window once more, as a desktop does). Needs ``Xvfb``
(``apt-get install -y xvfb``; ``openbox`` for ``--wm``) and the xcb libraries the README names. Prints one line per
launch and a summary; exits 1 when any launch crashed or hung, so a release script can stop on it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_display() -> int:
    """A display number no X server (nor a stale lock) holds."""
    for number in range(50, 500):
        if not os.path.exists(f"/tmp/.X11-unix/X{number}") and not os.path.exists(f"/tmp/.X{number}-lock"):
            return number
    raise RuntimeError("no free X display number between 50 and 499")


def start_display(size: str, wm: bool) -> tuple[int, list[subprocess.Popen]]:
    """A fresh Xvfb (and openbox on it, with ``wm``), ready for clients: (display number, their processes)."""
    number = free_display()
    xvfb = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", f"{size}x24", "-nolisten", "tcp", "-noreset"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socket = Path(f"/tmp/.X11-unix/X{number}")
    deadline = time.monotonic() + 15
    while not socket.exists():  # Xvfb offers no signal of readiness but its socket
        if xvfb.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Xvfb :{number} did not start (exit status {xvfb.poll()})")
        time.sleep(0.05)
    processes = [xvfb]
    if wm:
        processes.insert(0, subprocess.Popen(["openbox"], env=dict(os.environ, DISPLAY=f":{number}"),
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return number, processes


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def launch(args, number: int) -> tuple[str, float, str]:
    """One run of the window until --quit-after: (outcome, seconds, its stderr)."""
    env = dict(os.environ, DISPLAY=f":{number}", PYTHONFAULTHANDLER="1")
    env.pop("QT_QPA_PLATFORM", None)  # the real xcb plugin, as a user's desktop runs it
    env.pop("WAYLAND_DISPLAY", None)
    command = [sys.executable, "-X", "faulthandler", str(ROOT / "main.py"), "--model", args.model, "--demo",
               args.demo, "--quit-after", str(args.quit_after), "--geometry", args.geometry]
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.quit_after + args.grace)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return "hung", time.monotonic() - start, err
    seconds = time.monotonic() - start
    if done.returncode < 0:
        return f"crashed ({signal.Signals(-done.returncode).name})", seconds, done.stderr
    if "Fatal Python error" in done.stderr:
        return "crashed (fatal error)", seconds, done.stderr
    if done.returncode:
        return f"failed (exit {done.returncode})", seconds, done.stderr
    return "clean", seconds, done.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--quit-after", type=float, default=6.0, help="seconds each window stays open")
    ap.add_argument("--grace", type=float, default=120.0, help="seconds past --quit-after before a launch hung")
    ap.add_argument("--demo", default="busy")
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--geometry", default="1920x1080")
    ap.add_argument("--load", type=int, default=0, help="busy processes running beside the launches")
    ap.add_argument("--wm", action="store_true", help="openbox on each display")
    ap.add_argument("--keep", default=None, help="folder for the stderr of each launch that was not clean")
    args = ap.parse_args()
    for tool in ("Xvfb",) + (("openbox",) if args.wm else ()):
        if shutil.which(tool) is None:
            print(f"error: {tool} is not installed (apt-get install -y xvfb openbox)", file=sys.stderr)
            return 2
    keep = Path(args.keep or tempfile.mkdtemp(prefix="launch-loop-"))
    keep.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    outcomes: dict[str, int] = {}
    try:
        for i in range(args.launches):
            number, processes = start_display(args.geometry, args.wm)
            try:
                outcome, seconds, err = launch(args, number)
            finally:
                stop(processes)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            note = ""
            if outcome != "clean":
                path = keep / f"launch-{i + 1:03d}.stderr"
                path.write_text(err)
                note = f"  (stderr: {path})"
            print(f"launch {i + 1:3d}/{args.launches} on :{number}: {outcome}, {seconds:.1f} s{note}", flush=True)
    finally:
        stop(burners)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items(), key=lambda kv: -kv[1]))
    print(f"{args.launches} launches ({args.demo} demo, {args.geometry}, load {args.load}"
          f"{', openbox' if args.wm else ''}): {summary}")
    return 0 if outcomes.get("clean", 0) == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())
