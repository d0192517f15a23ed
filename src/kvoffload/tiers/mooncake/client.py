"""Opening the Mooncake Store client, and what its return codes mean.

The client (mooncake.store.MooncakeDistributedStore, a C++ extension)
talks to the master for metadata and moves bytes with its transfer
engine. Its RPC and transfer timeouts are process-wide environment
variables read when a client is set up, so they are set from the config
just before. The client crashes the process (SIGSEGV) on any call after
close(), so the tier only ever holds it through ClosableStore.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from urllib.parse import urlsplit

from kvoffload.config import ConfigError
from kvoffload.tiers.mooncake.config import MooncakeConfig, split_host_port

log = logging.getLogger(__name__)

# Mooncake ErrorCode values we act on (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
INVALID_PARAMS = -600  # e.g. the stored value is longer than the buffers given
TRANSFER_FAIL = -800  # e.g. the stored value is shorter than the buffers given
RPC_FAIL, RPC_TIMEOUT = -900, -901


def network_failed(code: int) -> bool:
    """True for the codes that mean 'the master could not be asked' (-9xx)."""
    return -1000 < code <= RPC_FAIL


def _reachable(host: str, port: int, timeout_s: float) -> str | None:
    """None if a TCP connection opens, else why not (one line)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _etcd_endpoints(url: str) -> list[tuple[str, int]]:
    """(host, port) of each endpoint of etcd://H:P[;H:P...]; [] for a form not read here (the client checks it)."""
    out = []
    for ep in url[len("etcd://"):].replace(",", ";").split(";"):
        host, _, port = ep.strip().rstrip("/").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return []
        out.append((host.strip("[]"), int(port)))
    return out


def open_store(cfg: MooncakeConfig):
    """A set-up MooncakeDistributedStore, or ConfigError (one line) naming
    what could not be reached: unlike a Redis URL, the client cannot be
    built against a master that is not there (and would retry for
    minutes), so a bad address fails start-up clearly."""
    # The client logs every step of its set-up at INFO to stderr; keep warnings and errors
    # (a user's own MC_LOG_LEVEL wins). Read when the library loads or a client starts.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ConfigError(f"mooncake tier needs the Mooncake client: pip install 'kvoffload[mooncake]' ({e})") from None
    host, port = split_host_port(cfg.master_address, "mooncake.master_address")
    why = _reachable(host, port, cfg.connect_timeout_s)
    if why:
        raise ConfigError(f"mooncake tier: master {cfg.master_address} unreachable ({why}); "
                          f"check mooncake.master_address and that mooncake_master runs")
    if cfg.metadata_server.startswith(("http://", "https://")):
        u = urlsplit(cfg.metadata_server)
        why = _reachable(u.hostname or "", u.port or (443 if u.scheme == "https" else 80), cfg.connect_timeout_s)
        if why:
            raise ConfigError(f"mooncake tier: metadata server {cfg.metadata_server} unreachable ({why}); "
                              f"check mooncake.metadata_server (mooncake_master -enable_http_metadata_server)")
    if cfg.metadata_server.startswith("etcd://"):  # the client would retry a dead etcd for 30 s
        endpoints = _etcd_endpoints(cfg.metadata_server)
        whys = [_reachable(h, p, cfg.connect_timeout_s) for h, p in endpoints]
        if endpoints and all(whys):
            raise ConfigError(f"mooncake tier: metadata server {cfg.metadata_server} unreachable ({whys[0]}); "
                              f"check mooncake.metadata_server and that etcd runs")
    os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1, int(cfg.rpc_timeout_s * 1000)))
    os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(max(1, int(cfg.connect_timeout_s * 1000)))
    # a transfer to a store node that stopped answering fails after this long without progress
    transfer_s = str(math.ceil(cfg.transfer_timeout_s))
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = transfer_s
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "3")  # checked above; don't retry for minutes
    store = MooncakeDistributedStore()
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.segment_bytes, cfg.local_buffer_bytes,
                     cfg.protocol, cfg.device_names, cfg.master_address)
    if rc != 0:
        raise ConfigError(f"mooncake tier: client set-up against master {cfg.master_address} and metadata "
                          f"{cfg.metadata_server} failed (code {rc}); see the Mooncake log lines above")
    return ClosableStore(store)


class ClosableStore:
    """The client, safe to close while other threads use it: a call after
    close() raises RuntimeError (callers count it as a failure) instead of
    reaching the closed client, and close() waits for the calls in flight.
    One still inside the client after wait_s (a transfer stuck on a paused
    store node) keeps the client open for good: leaked, with one warning,
    never closed under a live call."""

    def __init__(self, store):
        self._store = store
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            with self._cond:
                if self._closed:
                    raise RuntimeError(f"mooncake client closed (call {name})")
                self._in_flight += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

        return call

    def close(self, wait_s: float = 1.0) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = self._cond.wait_for(lambda: self._in_flight == 0, timeout=wait_s)
            busy = self._in_flight
        if not idle:
            log.warning("mooncake tier: %d client call(s) still running at shutdown (a store node not "
                        "answering?); the client is left open, not closed under them", busy)
            return
        self._store.close()


def replicate_config(cfg: MooncakeConfig):
    from mooncake.store import ReplicateConfig

    rc = ReplicateConfig()
    rc.replica_num = cfg.replicas
    return rc
