"""KV events for routers: BlockStored / BlockRemoved per tier, published over
ZMQ as msgpack batches in the wire format of vLLM's KV event publisher
(vllm/distributed/kv_events.py), so KV-aware routers that already subscribe
to vLLM (llm-d, Dynamo, SGLang's router) read ours.

Wire format (one ZMQ multipart message per batch):
    [topic, 8-byte big-endian sequence number, msgpack(batch)]
    batch = [ts, [event, ...], data_parallel_rank]
An event is encoded in one of vLLM's two encodings:
    "map"   (vLLM since its 2026 change, 0.32 and 0.33 included): a tagged map,
            {"type": "BlockStored", "block_hashes": [...], ...}, fields left
            out where they hold their default (msgspec's omit_defaults)
    "array" (earlier vLLM): positional, ["BlockStored", block_hashes, ...],
            every field in order (msgspec keeps defaults in arrays)
"auto" (the default) picks the installed vLLM's encoding, "map" without vLLM.
Fields, in vLLM's order:
    BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                 medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                 kv_cache_spec_sliding_window, locality, ownership, session_id
                 (vLLM 0.33 adds lookahead_token_ids: never sent, it defaults to None)
    BlockRemoved: block_hashes, medium, group_idx, locality, ownership
    AllBlocksCleared: (none)
medium is "CPU" or "STORAGE", locality "LOCAL" or "REMOTE" (a remote tier),
ownership the secondary tier's name. Block hashes are ints (the low 64 bits,
big-endian) as vLLM sends by default, or bytes with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM's switch) or int_hashes=False.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.abstractions import Locality, OffloadingEvent
from kvoffload.config import ConfigError
from kvoffload.keys import OffloadKey, get_offload_group_idx

FORMATS = ("auto", "map", "array")
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
           "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
_STORED_REQUIRED = 7  # up to lora_name: no default in vLLM's struct, always sent
_REMOVED = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_REMOVED_REQUIRED = 2
FIELDS = {"BlockStored": _STORED, "BlockRemoved": _REMOVED, "AllBlocksCleared": ()}


@dataclass(frozen=True)
class BlockDescription:
    """Self-describing payload of a stored block (opt-in)."""

    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


# key -> its description, or None when unknown
Describer = Callable[[OffloadKey], BlockDescription | None]


def vllm_event_format() -> str | None:
    """The encoding of the installed vLLM's events, None without vLLM. Read
    from its KVCacheEvent's definition (array_like or not), from the loaded
    module if vLLM is imported, else from its source (importing vLLM takes
    seconds; a replay need not pay them)."""
    mod = sys.modules.get("vllm.distributed.kv_events")
    if mod is not None:
        return "array" if mod.KVCacheEvent.__struct_config__.array_like else "map"
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_events.py"
    try:
        src = path.read_text()
    except OSError:
        return None
    m = re.search(r"class KVCacheEvent\((.*?)\):", src, re.S)
    if m is None:
        return None
    return "array" if re.search(r"array_like\s*=\s*True", m.group(1)) else "map"


def resolve_format(event_format: str) -> str:
    if event_format not in FORMATS:
        raise ConfigError(f"event format must be one of {', '.join(FORMATS)}, got {event_format!r}")
    if event_format == "auto":
        return vllm_event_format() or "map"
    return event_format


def default_int_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", "false", "False")


def _wire(tag: str, names: tuple[str, ...], values: list, required: int, array: bool) -> Any:
    """One event in either encoding as msgspec writes vLLM's structs: a map
    leaves defaults (None) out, an array keeps every position."""
    if array:
        return [tag, *values]
    out = {"type": tag}
    for i, (name, v) in enumerate(zip(names, values)):
        if v is not None or i < required:
            out[name] = v
    return out


class EventEncoder:
    """Turns OffloadingEvents into vLLM-format events (see the module doc).

    Deduplicates: a key already announced as stored in a tier is not
    announced again until it is removed from that tier (several chunks or
    several requests can store overlapping keys). Not for remote tiers,
    whose removals are never seen (encode).
    """

    def __init__(self, block_size: int = 0, describe: Describer | None = None,
                 event_format: str = "auto", int_hashes: bool | None = None):
        self.block_size = block_size
        self.describe = describe  # None: plain (not self-describing) payloads
        self.format = resolve_format(event_format)
        self._array = self.format == "array"
        self.int_hashes = default_int_hashes() if int_hashes is None else int_hashes
        # tier -> keys announced stored there (bytes: no GC-tracked object per block)
        self._announced: dict[str, set[OffloadKey]] = {}

    def block_hash(self, h: bytes | None) -> bytes | int | None:
        if h is None or not self.int_hashes:
            return h
        return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF

    def hashes(self, keys: list[OffloadKey]) -> list:
        """The keys' block hashes as sent: the last 8 bytes of each hash are its low 64 bits."""
        if self.int_hashes:
            fb = int.from_bytes
            return [fb(k[-12:-4], "big") for k in keys]
        return [k[:-4] for k in keys]

    def _stored(self, hashes: list, parent, tokens: list[int], block_size: int, group: int,
                medium: str, locality: str | None, ownership: str | None) -> Any:
        return _wire("BlockStored", _STORED, [
            hashes, self.block_hash(parent), tokens, block_size, None, medium, None, None, group,
            None, None, locality, ownership, None], _STORED_REQUIRED, self._array)

    def encode(self, events: Iterable[OffloadingEvent]) -> list:
        out: list = []
        for ev in events:
            if ev.metadata_only:
                continue  # a failed store's cleanup: never announced, nothing for a router
            medium = ev.medium.value
            locality = ev.locality.value if ev.locality is not None else None
            # Dedupe per (tier, key): the same hash in two KV groups, or in
            # two tiers, is two separate facts for a router.
            tier = ev.ownership or medium + (locality or "")
            # A remote store's server evicts unseen: no removal comes for most of
            # its keys, so a dedupe set would grow by every key ever stored and
            # never announce one stored again after the server dropped it. Its
            # manager stores only keys not known present: few repeats.
            remote = ev.locality is Locality.REMOTE
            if ev.removed:
                if remote:
                    keys = list(dict.fromkeys(ev.keys))
                else:
                    held = self._announced.get(tier, set())
                    keys = [k for k in ev.keys if k in held]
                    n = len(held)
                    held.difference_update(keys)
                    if n - len(held) != len(keys):  # a key twice in one event: once on the wire
                        keys = list(dict.fromkeys(keys))
                for group, ks in _by_group(keys).items():
                    out.append(_wire("BlockRemoved", _REMOVED, [
                        self.hashes(ks), medium, group,
                        locality, ev.ownership], _REMOVED_REQUIRED, self._array))
                continue
            if remote:
                keys = list(dict.fromkeys(ev.keys))
            else:
                held = self._announced.setdefault(tier, set())
                keys = [k for k in ev.keys if k not in held]
                n = len(held)
                held.update(keys)
                if len(held) - n != len(keys):
                    keys = list(dict.fromkeys(keys))
            if self.describe is None:
                for group, ks in _by_group(keys).items():
                    out.append(self._stored(self.hashes(ks), None, [], self.block_size, group, medium,
                                            locality, ev.ownership))
                continue
            for k in keys:  # self-describing: one event per block, with its parent and tokens
                d = self.describe(k)
                h = self.hashes([k])
                group = get_offload_group_idx(k)
                if d is None:
                    out.append(self._stored(h, None, [], self.block_size, group, medium, locality, ev.ownership))
                else:
                    out.append(self._stored(h, d.parent_block_hash, list(d.token_ids), d.block_size, group,
                                            medium, locality, ev.ownership))
        return out

    def clear(self) -> list:
        self._announced.clear()
        return [["AllBlocksCleared"] if self._array else {"type": "AllBlocksCleared"}]


def _by_group(keys: list[OffloadKey]) -> dict[int, list[OffloadKey]]:
    """Keys by KV group (vLLM sends one group per event), in first-seen order."""
    if not keys:
        return {}
    tails = {k[-4:] for k in keys}
    if len(tails) == 1:  # one group: the usual case
        return {int.from_bytes(tails.pop(), "big"): keys}
    groups: dict[int, list[OffloadKey]] = {}
    for k in keys:
        groups.setdefault(get_offload_group_idx(k), []).append(k)
    return groups


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket (bind side)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5557", topic: str = "kv-events",
                 data_parallel_rank: int | None = None, encoder: EventEncoder | None = None,
                 event_format: str = "auto"):
        encoder = encoder or EventEncoder(event_format=event_format)  # a bad format: refused before binding
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ImportError("KV event publishing needs pyzmq and msgpack: pip install kvoffload[metrics]") from e
        self._msgpack = msgpack
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(f"cannot bind KV event endpoint {endpoint!r}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.dp_rank = data_parallel_rank
        self.encoder = encoder
        self.seq = 0
        self.published_events = 0

    def publish(self, events: Iterable[OffloadingEvent]) -> int:
        """Encode and send one batch; returns the number of wire events."""
        wire = self.encoder.encode(events)
        if wire:
            self._send(wire)
        return len(wire)

    def publish_cleared(self) -> None:
        self._send(self.encoder.clear())

    def _send(self, wire: list) -> None:
        payload = self._msgpack.packb([time.time(), wire, self.dp_rank], use_bin_type=True)
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), copy=False)
        self.seq += 1
        self.published_events += len(wire)

    def close(self) -> None:
        self._sock.close()


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """Decode one msgpack batch in either encoding, as routers do: each event
    as a map {"type": ..., field: value} (fields left out: None)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False)
    ts, events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) > 2 else None
    return ts, [normalize_event(e) for e in events], dp_rank


def normalize_event(event: Any) -> dict:
    """One wire event (tagged map or positional array) as a map."""
    if isinstance(event, dict):
        tag = event["type"]
        return {"type": tag, **{f: event.get(f) for f in FIELDS[tag]}}
    tag, values = event[0], list(event[1:])
    names = FIELDS[tag]
    values += [None] * (len(names) - len(values))
    return {"type": tag, **dict(zip(names, values))}
