"""Start a throwaway Mooncake Store on loopback: for tests, benchmarks and
trying the tier on one machine. `mooncake_master` (with its HTTP metadata
server) keeps the metadata; the data lives in memory that clients lend
(segment_bytes), here optionally one `mooncake_client` store node so the
data outlives the engines.

The binaries come with `pip install 'kvoffload[mooncake]'` (next to the
Python running this, or on PATH; $KVOFFLOAD_MOONCAKE_MASTER overrides).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvoffload.tiers.remote.process import free_port, pause, resume

_log = logging.getLogger(__name__)


def find_binary(name: str = "mooncake_master") -> str | None:
    env = os.environ.get("KVOFFLOAD_MOONCAKE_MASTER") if name == "mooncake_master" else None
    if env:
        return env if Path(env).exists() else shutil.which(env)
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _accepts(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class LocalMooncake:
    """A mooncake_master we own (restartable on the same ports, to simulate
    an outage) and, with store_bytes, a store node lending that memory."""

    def __init__(self, store_bytes: int = 0, lease_ms: int | None = None):
        self.master_bin = find_binary("mooncake_master")
        if self.master_bin is None:
            raise FileNotFoundError("no mooncake_master binary: pip install 'kvoffload[mooncake]' "
                                    "(scripts/setup.sh does) or set KVOFFLOAD_MOONCAKE_MASTER")
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.store_bytes = store_bytes
        # objects read or written this recently cannot be evicted or removed (None: Mooncake's 10 s); a read
        # slower than the lease fails (lease_expired_before_data_transfer_completed), so keep it long
        self.lease_ms = lease_ms
        self.dir = tempfile.mkdtemp(prefix="kvoffload-mooncake-")
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def url(self) -> str:
        return f"mooncake://{self.master_address}?metadata_server={self.metadata_server}"

    def tier_config(self, **kw) -> dict:
        return {"master_address": self.master_address, "metadata_server": self.metadata_server, **kw}

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, log), "ab") as f:
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)

    def _wait(self, proc: subprocess.Popen, ports: list[int], log: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(_accepts(p) for p in ports):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(self.dir, log).read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"{log[:-4]} did not start:\n{tail}")
            time.sleep(0.05)

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> LocalMooncake:
        """Master, then the store node. A node sometimes fails to register
        with a master that already accepts connections ("RPC call failed:
        End of file", seen once in a CI run): then both start again, on the
        same master ports."""
        for attempt in range(1, attempts):
            try:
                return self._start(timeout_s)
            except RuntimeError as e:
                _log.warning("mooncake start failed (attempt %d of %d), retrying: %s",
                             attempt, attempts, str(e).splitlines()[0])
                os.makedirs(self.dir, exist_ok=True)  # (close() removed it)
                time.sleep(1.0)
        return self._start(timeout_s)  # the last attempt: its error is the caller's

    def _start(self, timeout_s: float) -> LocalMooncake:
        self.start_master(timeout_s)
        if self.store_bytes and self.node is None:
            node_bin = find_binary("mooncake_client")
            if node_bin is None:
                raise FileNotFoundError("no mooncake_client binary (it comes with the mooncake package)")
            self.node_port = free_port()
            self.node = self._spawn([node_bin, f"-master_server_address={self.master_address}",
                                     f"-metadata_server={self.metadata_server}", "-host=127.0.0.1",
                                     f"-global_segment_size={self.store_bytes}", f"-port={self.node_port}"],
                                    "node.log")
            self._wait(self.node, [self.node_port], "node.log", timeout_s)  # listens after mounting
        return self

    def start_master(self, timeout_s: float = 30.0) -> None:
        self.master = self._spawn(
            [self.master_bin, f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
             "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
             f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
             "-enable_metric_reporting=false",
             *([f"-default_kv_lease_ttl={self.lease_ms}"] if self.lease_ms else [])], "master.log")
        self._wait(self.master, [self.rpc_port, self.http_port], "master.log", timeout_s)

    @staticmethod
    def _end(proc: subprocess.Popen | None, sig: int) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def kill_master(self) -> None:
        """SIGKILL: the outage case (its metadata is lost with it)."""
        self._end(self.master, signal.SIGKILL)
        self.master = None

    def pause_master(self) -> None:
        """SIGSTOP the master, returning once it has stopped."""
        pause(self.master)

    def resume_master(self) -> None:
        resume(self.master)

    def close(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGCONT)
        self._end(self.node, signal.SIGTERM)
        self._end(self.master, signal.SIGTERM)
        self.node = self.master = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
