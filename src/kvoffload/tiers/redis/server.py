"""Start a throwaway Redis/Valkey server on loopback: for tests, benchmarks
and trying the remote tier on one machine. Production servers are run by
their operators (see docs/REMOTE.md for the settings we recommend).

The binary is $KVOFFLOAD_REDIS_SERVER, else redis-server or valkey-server
on PATH (Debian: `apt-get install redis-server`; scripts/setup.sh does it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from kvoffload.tiers.remote.process import free_port, pause, resume


def find_server_binary() -> str | None:
    env = os.environ.get("KVOFFLOAD_REDIS_SERVER")
    if env:
        return env if Path(env).exists() else shutil.which(env)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def find_benchmark_binary() -> str | None:
    return shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")


class LocalServer:
    """One redis-server process we own (never daemonized, so its pid is ours
    to kill). Restartable on the same port to simulate an outage."""

    def __init__(self, port: int | None = None, password: str | None = None,
                 maxmemory: str = "512mb", unix_socket: bool = False, extra_args: tuple[str, ...] = ()):
        self.binary = find_server_binary()
        if self.binary is None:
            raise FileNotFoundError(
                "no redis-server or valkey-server binary found: install Debian's redis-server "
                "(scripts/setup.sh does) or set KVOFFLOAD_REDIS_SERVER")
        cluster = "--cluster-enabled" in extra_args
        self._highest = 55535 if cluster else 65535
        self._auto_port = port is None  # until the first start: a restart keeps its port
        self.port = port or free_port(self._highest)
        self.password = password
        self.maxmemory = maxmemory
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="kvoffload-redis-")
        self.unix_path = os.path.join(self.dir, "redis.sock") if unix_socket else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.unix_path, "started without unix_socket=True"
        auth = f"?password={self.password}" if self.password else ""
        return f"unix://{self.unix_path}{auth}"

    def args(self) -> list[str]:
        a = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir,
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
             "--protected-mode", "no", "--logfile", os.path.join(self.dir, "server.log")]
        if self.password:
            a += ["--requirepass", self.password]
        if self.unix_path:
            a += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        return a + list(self.extra_args)

    def start(self, timeout_s: float = 10.0) -> LocalServer:
        for _ in range(4):
            try:
                self._start(timeout_s)
                self._auto_port = False
                return self
            except RuntimeError as e:
                # A port we picked was taken between the check and the bind: pick again.
                if not (self._auto_port and "Address already in use" in str(e)):
                    raise
                self.port = free_port(self._highest)
        self._start(timeout_s)
        self._auto_port = False
        return self

    def _start(self, timeout_s: float) -> LocalServer:
        Path(self.dir, "server.log").unlink(missing_ok=True)  # its tail is this attempt's story
        self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.2, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                client.close()
                return self
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = Path(self.dir, "server.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}") from None
                time.sleep(0.02)

    def pause(self) -> None:
        """SIGSTOP (a hung server: it accepts nothing and answers nothing),
        returning once it has stopped."""
        pause(self.proc)

    def resume(self) -> None:
        resume(self.proc)

    def kill(self) -> None:
        """SIGKILL: the outage case (no goodbye to clients)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
