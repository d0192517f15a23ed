"""One real `vllm serve` process for the serving benchmarks: started through
`kvoffload vllm serve` in its own process group (setsid), so stopping it
ends vLLM's engine core and workers too; health-checked over HTTP; its
/metrics scraped as parsed samples.

Every server gets the same core binding (VLLM_CPU_OMP_THREADS_BIND) and the
same process layout, with or without a --kv-transfer-config: vLLM-CPU
otherwise reserves a core for the connector and rebinds its threads, which
skews a with/without comparison on a small machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    """vLLM's CLI as users run it here: `kvoffload vllm ...` (vllm-cpu's own
    `vllm` entry point dies on its distribution name)."""
    return [sys.executable, "-m", "kvoffload.cli", "vllm"]


@dataclass
class ServerOptions:
    model: str
    block_size: int = 32
    gpu_blocks: int = 384
    max_model_len: int = 4096
    omp_bind: str = "0-1"
    kvcache_space_gib: int = 1
    uniproc: bool = False  # VLLM_ENABLE_V1_MULTIPROCESSING=0 for every server (else vLLM's default layout)
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 240.0


class ServeProcess:
    """`kvoffload vllm serve MODEL ...` on a free loopback port."""

    def __init__(self, name: str, opts: ServerOptions, kv_config: dict | None, log_dir: Path):
        self.name = name
        self.opts = opts
        self.kv_config = kv_config
        self.port = free_port()
        self.log_path = Path(log_dir) / f"server-{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        o = self.opts
        cmd = vllm_cli() + [
            "serve", o.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(o.block_size), "--enforce-eager", "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(o.gpu_blocks), "--max-model-len", str(o.max_model_len),
            "--seed", "0", *o.extra_args]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.opts.omp_bind
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.opts.kvcache_space_gib)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, for the output check
        if self.opts.uniproc:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    def start(self) -> "ServeProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), env=self.env(), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.opts.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode} during start-up; "
                                   f"last log lines:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"server {self.name} not healthy after {self.opts.start_timeout_s:.0f} s; "
                           f"last log lines:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL what is left after 30 s."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                _wait_group_gone(self.proc.pid, wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of the group is left (vLLM's engine core exits after the API server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(name, sorted labels): value}, without _created samples."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        labels = tuple(sorted((k, v) for k, v in _LABEL.findall(m.group(3) or "")
                              if k not in ("engine", "model_name")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out
