"""Worker of the Redis/Valkey tier: each IO thread has its own connection
(one per cluster node in cluster mode) and frames GET/SET itself (resp.py).
Queues, parts and completions are the shared base's (tiers/remote/worker.py).

A part never waits longer than the socket timeouts: on a network error it
fails, the connection is closed, and the shared back-off keeps everyone off
the network until it is time to try reconnecting.
"""

from __future__ import annotations

import logging
import threading

import redis

from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.redis import resp
from kvoffload.tiers.redis.resp import RawConnection
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.network import NETWORK_ERRORS
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import RemoteLoadStoreSpec, ValueCodec
from kvoffload.tiers.remote.worker import RemoteTierWorker

# Values that must go: a later store rewrites the key (SET replaces any type).
_DELETE = {resp.CORRUPT: "checksum_failures", resp.WRONG_KEY: "wrong_key_values",
           resp.BAD_MAC: "mac_failures", resp.WRONG_TYPE: "wrong_type_keys"}

log = logging.getLogger(__name__)


class RedisTierWorker(RemoteTierWorker):
    def __init__(self, pool: HostPool, client, cfg: RemoteConfig, state: SharedState,
                 codec: ValueCodec | None = None):
        self._cluster = cfg.cluster
        self._topology_lock = threading.Lock()
        super().__init__(pool, client, cfg, state, codec)

    def _transfer(self, conns: dict, is_store: bool, slots: list[int], spec: RemoteLoadStoreSpec) -> bool:
        c = self._state.counters
        backoff = self._state.backoff
        if not slots:
            return True
        if not backoff.available():
            c.add("store_failures" if is_store else "load_failures", len(slots))
            return False
        views = [self.pool.chunk_memoryview(s)[: self.payload_bytes] for s in slots]
        try:
            groups = self._groups(spec.redis_keys)
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:  # no topology
            log.debug("remote: cannot route keys: %s", e)
            backoff.failed()
            c.add("store_failures" if is_store else "load_failures", len(slots))
            return False
        ok = True
        for name, node, idx in groups:
            keys = [spec.redis_keys[i] for i in idx]
            dsts = [views[i] for i in idx]
            try:
                rc = conns.get(name) or conns.setdefault(name, self._connect(node))
                if is_store:
                    good = self._store(rc, keys, dsts)
                else:
                    good = self._load(rc, keys, dsts, [spec.keys[i] for i in idx])
                backoff.succeeded()
            except (*NETWORK_ERRORS, redis.RedisError) as e:  # incl. auth revoked at run time
                log.debug("remote %s to %s failed: %s", "store" if is_store else "load", name, e)
                bad = conns.pop(name, None)
                if bad is not None:
                    bad.close()
                backoff.failed()
                c.add("store_failures" if is_store else "load_failures", len(idx))
                return False
            if not good and self._cluster and rc.last_error and rc.last_error.startswith((b"MOVED", b"ASK")):
                rc.last_error = None
                self._refresh_topology()
            ok = ok and good
        return ok

    def _store(self, rc: RawConnection, keys: list[bytes], views: list[memoryview]) -> bool:
        per_round = max(1, self._cfg.batch_bytes // max(1, self.payload_bytes))
        n_ok = 0
        for i in range(0, len(keys), per_round):
            n_ok += sum(rc.set_many(keys[i : i + per_round], views[i : i + per_round], self._cfg.ttl_s))
        c = self._state.counters
        c.add("stored_bytes", n_ok * self.payload_bytes)
        if n_ok < len(keys):  # e.g. OOM with maxmemory-policy noeviction
            c.add("store_failures", len(keys) - n_ok)
        return n_ok == len(keys)

    def _load(self, rc: RawConnection, keys: list[bytes], views: list[memoryview], offload_keys: list[bytes]) -> bool:
        status = rc.get_many_into(keys, views, self._cfg.batch_bytes)
        c = self._state.counters
        n_ok = status.count(resp.OK)
        c.add("loaded_blocks", n_ok)
        c.add("loaded_bytes", n_ok * self.payload_bytes)
        if n_ok == len(keys):
            return True
        corrupt = [keys[i] for i, s in enumerate(status) if s in _DELETE]
        for i, s in enumerate(status):
            if s != resp.OK:
                self._state.gone_keys.append(offload_keys[i])
            if s in _DELETE:
                c.add(_DELETE[s])
        c.add("load_misses", status.count(resp.MISSING))
        c.add("load_failures", len(keys) - n_ok)
        if corrupt:  # delete so it is not found (and failed) again; the next store rewrites it
            try:
                self._client.delete(*corrupt) if not self._cluster else [self._client.delete(k) for k in corrupt]
            except (redis.RedisError, OSError):
                pass
        return False

    # -- connections ----------------------------------------------------
    def _groups(self, redis_keys: list[bytes]):
        """(connection name, cluster node or None, indices) per server to talk to."""
        if not self._cluster:
            return [("standalone", None, range(len(redis_keys)))]
        groups: dict[str, tuple] = {}
        for i, k in enumerate(redis_keys):
            node = self._client.get_node_from_key(k)
            groups.setdefault(node.name, (node.name, node, []))[2].append(i)
        return list(groups.values())

    def _connect(self, node) -> RawConnection:
        pool = self._client.connection_pool if node is None else self._client.get_redis_connection(node).connection_pool
        return RawConnection(pool.make_connection(), self._codec, self._cfg.min_transfer_mib_s * (1 << 20),
                             self._cfg.socket_timeout_s)

    def _refresh_topology(self) -> None:
        with self._topology_lock:
            try:
                self._client.nodes_manager.initialize()
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                log.warning("remote: cluster topology refresh failed: %s", e)
