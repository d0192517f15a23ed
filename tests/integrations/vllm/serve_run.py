"""A real `vllm serve` (through `kvoffload vllm serve`) in its own process
group, and what a test asks of it over HTTP: completions and /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[3] / "src")
START_S = 300  # start-up is 30-45 s here; a loaded 2-core machine is slower


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, kv_config: dict | None, log: Path, gpu_blocks: int, max_len: int,
                 env: dict | None = None, extra_args: list[str] | None = None):
        self.port = free_port()
        self.model = str(model)
        args = [sys.executable, "-m", "kvoffload.cli", "vllm", "serve", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--block-size", "32", "--enforce-eager",
                "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", str(max_len),
                "--max-num-seqs", "4", "--enable-prefix-caching", *(extra_args or [])]
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        full_env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
                    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", _all_cpus()),
                    **(env or {})}
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(args, env=full_env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise

    def _wait_up(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) during start-up:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not up after {START_S} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url(path), data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else {}

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy output token ids and their logprobs."""
        out = self.post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
        choice = out["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def reset_prefix_cache(self) -> None:
        """vLLM's own (GPU) prefix cache only; the offload tiers keep theirs."""
        self.post("/reset_prefix_cache")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics samples: (name, sorted label pairs) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self, graceful: bool = False) -> None:
        """SIGTERM to the whole group (API server, engine core, workers), or
        with graceful to the API server alone (as docker, Kubernetes and most
        service managers stop it: vLLM stops its own processes), then SIGKILL."""
        if self.proc.poll() is None:
            try:
                if graceful:
                    self.proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=120 if graceful else 60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        try:  # stragglers of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log_file.close()


def _all_cpus() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def tier_value(samples: dict, name: str, tier: str) -> float:
    """Our series' value for one tier (0 when absent)."""
    return sum(v for (n, labels), v in samples.items() if n == name and ("tier", tier) in labels)
