"""A vLLM server started by a live test in a process of its own, and stopped whatever the test's outcome.

Each live test used to start its server with the same twenty lines (a new session so that the engine-core process
joins the server's group, a pipe for answers since vLLM logs to stdout, a watchdog that kills the group so a hung
server fails the test instead of hanging CI, a polite stop then a kill); they live here once."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path


class ServerProcess:
    """``argv`` run with ``env`` in ``cwd``, its output in ``log``. With ``pipe``, the write end of a pipe is passed
    to it and its number appended to ``argv``: the script's answers are read from :attr:`said`. After ``deadline``
    seconds the watchdog kills its process group."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, log: Path, deadline: float, pipe: bool = True):
        self.log = log
        read_fd = write_fd = None
        if pipe:
            read_fd, write_fd = os.pipe()
            argv = argv + [str(write_fd)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, text=True,
                                         pass_fds=(write_fd,) if pipe else (), start_new_session=True)
        self.said = None
        if pipe:
            os.close(write_fd)
            self.said = os.fdopen(read_fd)
        self.watchdog = threading.Timer(deadline, self.kill)
        self.watchdog.start()

    def kill(self) -> None:
        """The server and its engine-core process, which would outlive a killed parent."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, chars: int = 3000) -> str:
        """The end of the server's log, for an assertion's message."""
        return self.log.read_text()[-chars:]

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, line: str | None = None, sig: int = signal.SIGINT) -> None:
        """Ask it to end (``line`` on its stdin, else ``sig``), wait a minute, then kill the group."""
        if self.proc.poll() is None:
            if line is not None:
                self.send(line)
            else:
                self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.watchdog.cancel()
        if self.said is not None:
            self.said.close()
