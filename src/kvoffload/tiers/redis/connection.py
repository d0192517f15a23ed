"""Talking to the server: building a redis-py client from the config, and the
start-up check (the shared back-off is in tiers/remote/network.py).

redis-py does the control plane (handshake, AUTH/ACL, TLS, EXISTS
pipelines, cluster topology). The data plane (resp.py) borrows redis-py's
connected sockets and frames GET/SET itself so values go out of and into
the host pool without intermediate copies.
"""

from __future__ import annotations

import logging
import ssl

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvoffload.config import ConfigError
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.network import NETWORK_ERRORS

log = logging.getLogger(__name__)



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
            _check_ca_file(cfg.tls_ca_certs)
            kw["ssl_ca_certs"] = cfg.tls_ca_certs
    return kw


def _check_ca_file(path: str) -> None:
    """Load the CA bundle now: a missing or wrong file is a settings error,
    not an outage (redis-py would only fail each connect with errno 2)."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as e:  # an OSError too: caught first
        raise ConfigError(f"remote.tls_ca_certs {path!r}: not a PEM certificate bundle ({e.reason or e})") from None
    except OSError as e:
        raise ConfigError(f"remote.tls_ca_certs {path!r}: cannot read it "
                          f"({e.strerror or type(e).__name__})") from None


def _bad_certificate(e: BaseException, cfg: RemoteConfig) -> ConfigError | None:
    """A ConfigError if a certificate verification failure is behind a
    redis-py error: it would never verify later either, so it is a setting
    to fix, not an outage to wait out."""
    for _ in range(5):  # redis-py raises ConnectionError from the ssl error
        if e is None:
            return None
        if isinstance(e, ssl.SSLCertVerificationError):
            return ConfigError(
                f"remote tier: the TLS certificate of {cfg.redacted_url} does not verify "
                f"({e.verify_message or e.reason}); set remote.tls_ca_certs to the CA that signed it "
                f"(or remote.tls_verify: false to skip the check)")
        e = e.__cause__ or e.__context__
    return None


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
    try:
        redis.connection.parse_url(url)  # what from_url would raise on, e.g. ?db=x
    except ValueError as e:
        raise ConfigError(f"remote.url {cfg.redacted_url!r}: {e}") from None
    if cfg.cluster:
        from redis.cluster import RedisCluster

        kw.pop("retry")
        try:  # learns the topology now, so the cluster must answer at start-up
            return RedisCluster.from_url(url, **kw)
        except redis.AuthenticationError as e:
            raise ConfigError(f"remote tier: authentication to cluster {cfg.redacted_url} failed ({e}); "
                              f"check remote.password / remote.username") from None
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            bad_cert = _bad_certificate(e, cfg)
            if bad_cert is not None:
                raise bad_cert from None
            raise ConfigError(f"remote tier: cannot use {cfg.redacted_url} as a Redis Cluster "
                              f"(remote.cluster is true): {e}") from None
    return redis.Redis.from_url(url, **kw)


def check_server(client, cfg: RemoteConfig) -> bool:
    """PING once at start-up. A bad password or ACL, or a TLS certificate
    that does not verify, is a configuration error (raised now, clearly);
    an unreachable server is not: the tier starts and answers misses until
    the server comes back."""
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
        bad_cert = _bad_certificate(e, cfg)
        if bad_cert is not None:
            raise bad_cert from None
        log.warning("remote tier: %s unreachable at start-up (%s); serving misses until it is back",
                    cfg.redacted_url, e)
        return False
