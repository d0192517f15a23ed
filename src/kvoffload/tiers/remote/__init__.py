"""What every remote key-value tier shares (Redis/Valkey in tiers/redis,
Mooncake in tiers/mooncake): the settings (config.py), the value format
and key space (value.py), shared state and counters (state.py), network
errors and back-off (network.py), coalesced existence lookups (lookup.py),
the offloading manager (manager.py), the IO worker base and its job
(worker.py, job.py), and local server process helpers (process.py)."""

from kvoffload.tiers.remote.config import RemoteConfig

__all__ = ["RemoteConfig"]
