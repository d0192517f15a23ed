"""KV events for routers: BlockStored / BlockRemoved per tier, published over
ZMQ as msgpack batches in the wire format of vLLM's KV event publisher, so
KV-aware routers that already subscribe to vLLM (llm-d, Dynamo) read ours.

Wire format (one ZMQ multipart message per batch):
    [topic, 8-byte big-endian sequence number, msgpack(batch)]
    batch = [ts, [event, ...], data_parallel_rank]
    event = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
          | ["BlockRemoved", block_hashes, medium]
          | ["AllBlocksCleared"]
Medium strings are "CPU", "STORAGE", or "<MEDIUM>_REMOTE" for remote tiers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvoffload.abstractions import Locality, OffloadingEvent
from kvoffload.config import ConfigError
from kvoffload.keys import OffloadKey, get_offload_block_hash


@dataclass(frozen=True)
class BlockDescription:
    """Self-describing payload of a stored block (opt-in)."""

    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


# key -> its description, or None when unknown
Describer = Callable[[OffloadKey], BlockDescription | None]


def medium_label(event: OffloadingEvent) -> str:
    label = event.medium.value
    if event.locality is Locality.REMOTE:
        label += "_REMOTE"
    return label


class EventEncoder:
    """Turns OffloadingEvents into vLLM-format event lists.

    Deduplicates: a key already announced as stored in a tier is not
    announced again until it is removed from that tier (several chunks or
    several requests can store overlapping keys).
    """

    def __init__(self, block_size: int = 0, describe: Describer | None = None):
        self.block_size = block_size
        self.describe = describe  # None: plain (not self-describing) payloads
        self._announced: set[tuple[str, OffloadKey]] = set()

    def encode(self, events: Iterable[OffloadingEvent]) -> list[list]:
        out: list[list] = []
        for ev in events:
            medium = medium_label(ev)
            # Dedupe per (tier, key): the same hash in two KV groups, or in
            # two tiers, is two separate facts for a router.
            tier = ev.ownership or medium
            if ev.removed:
                keys = [k for k in ev.keys if (tier, k) in self._announced]
                self._announced.difference_update((tier, k) for k in keys)
                if keys:
                    out.append(["BlockRemoved", [get_offload_block_hash(k) for k in keys], medium])
                continue
            keys = [k for k in ev.keys if (tier, k) not in self._announced]
            self._announced.update((tier, k) for k in keys)
            if not keys:
                continue
            if self.describe is None:
                out.append(["BlockStored", [get_offload_block_hash(k) for k in keys], None, [],
                            self.block_size, None, medium])
                continue
            for k in keys:  # self-describing: one event per block, with its parent and tokens
                d = self.describe(k)
                if d is None:
                    out.append(["BlockStored", [get_offload_block_hash(k)], None, [],
                                self.block_size, None, medium])
                else:
                    out.append(["BlockStored", [get_offload_block_hash(k)], d.parent_block_hash,
                                list(d.token_ids), d.block_size, None, medium])
        return out

    def clear(self) -> list[list]:
        self._announced.clear()
        return [["AllBlocksCleared"]]


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket (bind side)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5557", topic: str = "kv-events",
                 data_parallel_rank: int | None = None, encoder: EventEncoder | None = None):
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
        self.encoder = encoder or EventEncoder()
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

    def _send(self, wire: list[list]) -> None:
        payload = self._msgpack.packb([time.time(), wire, self.dp_rank], use_bin_type=True)
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), copy=False)
        self.seq += 1
        self.published_events += len(wire)

    def close(self) -> None:
        self._sock.close()


def decode_batch(payload: bytes) -> tuple[float, list[list], int | None]:
    """Decode one msgpack batch (what a subscriber does)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False)
    ts, events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) > 2 else None
    return ts, events, dp_rank
