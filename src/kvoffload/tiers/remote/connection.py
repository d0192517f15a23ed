"""Talking to the server: building a redis-py client from the config, the
start-up check, and the back-off shared by everything that touches the
network in one process.

redis-py does the control plane (handshake, AUTH/ACL, TLS, EXISTS
pipelines, cluster topology). The data plane (resp.py) borrows redis-py's
connected sockets and frames GET/SET itself so values go out of and into
the host pool without intermediate copies.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvoffload.config import ConfigError
from kvoffload.tiers.remote.config import RemoteConfig

log = logging.getLogger(__name__)

# Errors that mean "the server is unreachable or too slow": a miss, not a crash.
NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


def client_kwargs(cfg: RemoteConfig) -> dict:
    kw = dict(
        socket_connect_timeout=cfg.connect_timeout_s,
        socket_timeout=cfg.socket_timeout_s,
        # Fail fast: our own back-off decides when to try again.
        retry=Retry(NoBackoff(), 0),
    )
    if cfg.username is not None:
        kw["username"] = cfg.username
    password = cfg.load_password()
    if password is not None:
        kw["password"] = password
    if cfg.url.startswith(("rediss://", "valkeys://")):
        kw["ssl_cert_reqs"] = "required" if cfg.tls_verify else "none"
        if cfg.tls_ca_certs:
            kw["ssl_ca_certs"] = cfg.tls_ca_certs
    return kw


def _normal_url(url: str) -> str:
    # valkey-py spells its schemes valkey:// and valkeys://; redis-py speaks the same protocol.
    if url.startswith("valkey://"):
        return "redis://" + url[len("valkey://"):]
    if url.startswith("valkeys://"):
        return "rediss://" + url[len("valkeys://"):]
    return url


def build_client(cfg: RemoteConfig) -> redis.Redis | redis.cluster.RedisCluster:
    """A redis-py client (standalone or cluster). Connects lazily: nothing
    touches the network here except cluster topology discovery."""
    url = _normal_url(cfg.url)
    kw = client_kwargs(cfg)
    if cfg.cluster:
        from redis.cluster import RedisCluster

        kw.pop("retry")
        try:  # learns the topology now, so the cluster must answer at start-up
            return RedisCluster.from_url(url, **kw)
        except redis.AuthenticationError as e:
            raise ConfigError(f"remote tier: authentication to cluster {cfg.redacted_url} failed ({e}); "
                              f"check remote.password / remote.username") from None
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            raise ConfigError(f"remote tier: cannot use {cfg.redacted_url} as a Redis Cluster "
                              f"(remote.cluster is true): {e}") from None
    return redis.Redis.from_url(url, **kw)


def check_server(client, cfg: RemoteConfig) -> bool:
    """PING once at start-up. A bad password or ACL is a configuration
    error (raised now, clearly); an unreachable server is not: the tier
    starts and answers misses until the server comes back."""
    try:
        client.ping()
        return True
    except redis.AuthenticationError as e:
        who = f"user {cfg.username!r}" if cfg.username else "the default user"
        raise ConfigError(
            f"remote tier: authentication to {cfg.redacted_url} as {who} failed ({e}); "
            f"check remote.password / remote.username (or the url's credentials)"
        ) from None
    except redis.ResponseError as e:
        if "WRONGPASS" in str(e) or "NOAUTH" in str(e) or "NOPERM" in str(e):
            raise ConfigError(f"remote tier: server {cfg.redacted_url} refused the credentials: {e}") from None
        raise ConfigError(f"remote tier: server {cfg.redacted_url} answered PING with an error: {e}") from None
    except NETWORK_ERRORS as e:
        log.warning("remote tier: %s unreachable at start-up (%s); serving misses until it is back",
                    cfg.redacted_url, e)
        return False


class Backoff:
    """Exponential back-off after network failures, shared by the threads
    of one process. While backing off nobody touches the network, so a
    dead server costs nothing but misses."""

    def __init__(self, initial_s: float, max_s: float):
        self.initial_s = initial_s
        self.max_s = max_s
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0
        self.failures = 0  # consecutive
        self.total_failures = 0
        self.reconnects = 0  # recoveries after a failure

    def available(self) -> bool:
        """True if the network may be tried now."""
        return time.monotonic() >= self._retry_at

    @property
    def is_down(self) -> bool:
        return self.failures > 0

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
            self.total_failures += 1
            self._delay = self.initial_s if self._delay == 0 else min(self._delay * 2, self.max_s)
            self._retry_at = time.monotonic() + self._delay

    def succeeded(self) -> None:
        if self.failures == 0:
            return
        with self._lock:
            if self.failures:
                self.reconnects += 1
            self.failures = 0
            self._delay = 0.0
            self._retry_at = 0.0
