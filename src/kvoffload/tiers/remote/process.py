"""Helpers for the local server processes that tests, benchmarks and the
local-server helpers of every remote tier start: a free loopback port, and
pausing / resuming a process (SIGSTOP that has taken effect, SIGCONT)."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(highest: int = 65535) -> int:
    """A port free on loopback now. Cluster nodes also use port+10000, so
    they ask for one <= 55535: both ports are then drawn below Linux's
    ephemeral range (32768+), where outgoing connections cannot take the
    bus port between this check and the server's bind."""
    if highest == 65535:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    top = min(highest, 22767)
    for _ in range(1000):
        port = random.randint(12000, top)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError(f"no free loopback port pair <= {top}")


def pause(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGSTOP, then wait until every thread of the process has stopped.
    kill() returns before the stop takes effect: on a loaded machine a thread
    of the server could still answer a request sent right after it (a
    Mooncake fault test once saw a HIT from a master it had just paused)."""
    proc.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{proc.pid}/task")
    if not tasks.is_dir():  # (no procfs: nothing to wait on)
        return
    deadline = time.monotonic() + timeout_s
    while not all(_stopped(t) for t in tasks.iterdir()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {proc.pid} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.001)


def _stopped(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:  # the thread ended
        return True
    return stat[stat.rindex(")") + 2] in "tT"  # the state follows the command name's ")"


def resume(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
