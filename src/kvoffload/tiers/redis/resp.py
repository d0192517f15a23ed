"""Pipelined GET/SET framed by hand on a socket that redis-py connected.

Why not redis-py's own commands: they copy each value at least twice
(into a packed command on send; into a parser buffer and then a bytes
object on receive). Here a SET sends the host-pool chunk's memoryview
straight to the socket (sendmsg scatter-gather), and a GET reads the value
straight into the preallocated pool slot: header, payload and trailing CRLF
in one recvmsg_into(MSG_WAITALL) call (one wake-up per value, not one per
socket-buffer's worth); only the few bytes the reply-line buffer read ahead
(at most _READAHEAD) are copied once.

The socket comes from redis-py (it did the TCP/unix/TLS connect, AUTH and
SELECT): redis-py 8 has no public accessor for a connection's socket (only
the private `_sock` / `_get_socket()`), so `_socket_of` reads `_sock` in one
place and fails with a clear message if a redis-py release renames it. The
connection is made for us (make_connection), never returned to redis-py's
pool, so nothing else reads from or changes that socket.

Plain (non-TLS) sockets are switched to blocking mode with the same timeout
as kernel SO_RCVTIMEO / SO_SNDTIMEO: every wait stays bounded by
remote.socket_timeout_s, without Python's poll() before each recv, and
MSG_WAITALL can fill a whole value in one call. The bound is per call:
a timed-out call returns what it got and the loop calls again, so a
stalled transfer gives up after 2-3 timeouts (documented in docs/REMOTE.md).
A link that keeps trickling bytes never lets a call time out, so each
GET/SET round also has a deadline (remote.min_transfer_mib_s): the loops
check it between calls and raise TimeoutError once it has passed.

Callers must treat any exception as "connection state unknown" and close.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

from kvoffload.tiers.remote.value import (  # noqa: F401 - the statuses are part of this module's API
    BAD_MAC,
    CORRUPT,
    ERROR,
    HEADER_BYTES,
    MISSING,
    OK,
    WRONG_KEY,
    WRONG_TYPE,
    ValueCodec,
)
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
# Bytes the reply-line buffer asks for per recv: enough for a batch of "+OK"
# lines and a "$<len>" line, small so that little of a value lands here
# (copied once more) instead of straight in its slot.
_READAHEAD = 1024


def _socket_of(conn) -> socket.socket:
    """The connected socket of a redis-py Connection (see the module doc)."""
    sock = getattr(conn, "_sock", None)
    if not isinstance(sock, socket.socket):
        import redis

        raise RuntimeError(f"remote tier: redis-py {redis.__version__} keeps its socket elsewhere "
                           f"(Connection._sock is {type(sock).__name__}); resp.py needs updating")
    return sock


def _kernel_timeouts(sock: socket.socket, timeout_s: float | None) -> None:
    """Blocking mode with the timeout enforced by the kernel (see the module doc)."""
    if timeout_s is not None:
        tv = struct.pack("@ll", int(timeout_s), int(timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.settimeout(None)


class RawConnection:
    def __init__(self, conn, codec: ValueCodec | None = None, min_rate: float = 0.0, slack_s: float = 0.0):
        """min_rate (bytes/s, 0: no deadline) and slack_s set each round's
        deadline: slack_s + its bytes / min_rate from its start."""
        self.codec = codec or ValueCodec()
        self._min_rate = min_rate
        self._slack_s = slack_s
        self._deadline = float("inf")
        conn.connect()  # redis-py: TCP/unix/TLS, AUTH/ACL, SELECT
        self.conn = conn
        self.sock: socket.socket = _socket_of(conn)
        # SSL sockets have no sendmsg/recvmsg_into and take no recv flags: one buffer at a time.
        self._scatter = not isinstance(self.sock, ssl.SSLSocket)
        if self._scatter:
            # a timed-out recv now raises BlockingIOError (an OSError): a network error like before
            _kernel_timeouts(self.sock, self.sock.gettimeout())
        self._buf = bytearray(1 << 16)
        self._mv = memoryview(self._buf)
        self._r = 0  # read position in _buf
        self._w = 0  # end of valid bytes in _buf
        self._hdr = bytearray(HEADER_BYTES)
        self._crlf = bytearray(2)
        self.last_error: bytes | None = None  # last error reply, e.g. b"MOVED 12 host:port"

    def close(self) -> None:
        try:
            self.conn.disconnect()
        except Exception:  # noqa: BLE001 - closing a broken socket may fail; nothing to do
            pass

    # -- the round's deadline ---------------------------------------------
    def _start_round(self, nbytes: int) -> None:
        if self._min_rate:
            self._deadline = time.monotonic() + self._slack_s + nbytes / self._min_rate

    def _on_time(self) -> None:
        """Raise once the round's deadline has passed (called between socket
        calls: each call is bounded by the socket timeout, so a round ends at
        most one timeout after its deadline)."""
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"transfer slower than {self._min_rate / (1 << 20):g} MiB/s "
                               f"(remote.min_transfer_mib_s): the link is stalled or trickling")

    # -- sending --------------------------------------------------------
    def _send(self, pieces: list) -> None:
        if not self._scatter:
            for p in pieces:
                self._on_time()
                self.sock.sendall(p)
            return
        views = [memoryview(p).cast("B") for p in pieces]
        i = 0
        while i < len(views):
            self._on_time()
            sent = self.sock.sendmsg(views[i : i + _IOV_MAX])
            # skip whole buffers sent, then trim a partly sent one
            while i < len(views) and sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            if sent:
                views[i] = views[i][sent:]

    # -- receiving ------------------------------------------------------
    def _fill(self) -> None:
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w == len(self._buf):
            if self._r == 0:  # a line longer than the buffer: grow it
                self._mv.release()  # a bytearray with a live view cannot grow
                self._buf.extend(bytes(len(self._buf)))
                self._mv = memoryview(self._buf)
            else:
                n = self._w - self._r
                self._buf[:n] = self._buf[self._r : self._w]
                self._r, self._w = 0, n
        self._on_time()
        got = self.sock.recv_into(self._mv[self._w : self._w + _READAHEAD])
        if got == 0:
            raise ConnectionError("server closed the connection")
        self._w += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._r, self._w)
            if i >= 0:
                line = bytes(self._mv[self._r : i])
                self._r = i + 2
                return line
            self._fill()

    def _read_into(self, *dsts: memoryview) -> None:
        """Fill each buffer in turn: first from what the line buffer holds,
        then from the socket, all the rest in one recvmsg_into if it can."""
        rest = []
        for dst in dsts:
            take = min(self._w - self._r, len(dst))
            if take:
                dst[:take] = self._mv[self._r : self._r + take]
                self._r += take
            if take < len(dst):
                rest.append(dst[take:])
        if self._scatter:
            while rest:
                self._on_time()
                got = self.sock.recvmsg_into(rest, 0, socket.MSG_WAITALL)[0]
                if got == 0:
                    raise ConnectionError("server closed the connection mid-value")
                while rest and got >= len(rest[0]):  # drop filled buffers, trim a partly filled one
                    got -= len(rest.pop(0))
                if got:
                    rest[0] = rest[0][got:]
            return
        for dst in rest:
            take = 0
            while take < len(dst):
                self._on_time()
                got = self.sock.recv_into(dst[take:])
                if got == 0:
                    raise ConnectionError("server closed the connection mid-value")
                take += got

    def _skip(self, n: int) -> None:
        """Discard n bytes (a value not ours): buffered ones, then whole-buffer reads."""
        take = min(self._w - self._r, n)
        self._r += take
        n -= take
        while n:
            self._on_time()
            got = self.sock.recv_into(self._mv[: min(n, len(self._buf))])
            if got == 0:
                raise ConnectionError("server closed the connection mid-value")
            n -= got
        if self._r == self._w:
            self._r = self._w = 0

    # -- commands -------------------------------------------------------
    def set_many(self, keys: list[bytes], payloads: list[memoryview], ttl_s: int | None = None) -> list[bool]:
        """SET every key to header+payload in one pipelined round; True where
        the server answered OK (False: e.g. OOM under maxmemory noeviction)."""
        tail = b"\r\n" if ttl_s is None else b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)
        argc = b"*3" if ttl_s is None else b"*5"
        self._start_round(sum(map(len, payloads)))
        pieces: list = []
        pending = b""
        header = self.codec.header
        for k, p in zip(keys, payloads):
            pieces.append(pending + b"%s\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                argc, len(k), k, HEADER_BYTES + len(p), header(k, p)))
            pieces.append(p)
            pending = tail
        pieces.append(pending)
        self._send(pieces)
        ok = []
        for _ in keys:
            line = self._line()
            if line[:1] == b"-":
                self.last_error = line[1:]
            ok.append(line == b"+OK")
        return ok

    def get_many_into(self, keys: list[bytes], dsts: list[memoryview], batch_bytes: int) -> list[int]:
        """GET each key into its destination buffer, verifying the header,
        checksum, key binding and MAC. Returns a status per key: OK, MISSING,
        CORRUPT, WRONG_KEY, BAD_MAC, WRONG_TYPE or ERROR.
        GETs go out in windows of half of batch_bytes, one window ahead of
        the replies being read: the server works while we read and check,
        and at most about batch_bytes of replies are outstanding (the same
        depth as a store round's)."""
        window_bytes = max(1, batch_bytes // 2)
        self._start_round(sum(map(len, dsts)))
        windows = []
        start, size = 0, 0
        for i, d in enumerate(dsts):
            size += len(d)
            if size >= window_bytes:
                windows.append((start, i + 1))
                start, size = i + 1, 0
        if start < len(keys):
            windows.append((start, len(keys)))
        status = [ERROR] * len(keys)
        if not windows:
            return status
        self._send_gets(keys, *windows[0])
        for w, (a, b) in enumerate(windows):
            if w + 1 < len(windows):
                self._send_gets(keys, *windows[w + 1])
            for i in range(a, b):
                status[i] = self._read_value(keys[i], dsts[i])
        return status

    def _send_gets(self, keys: list[bytes], a: int, b: int) -> None:
        self._send([b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys[a:b])])

    def _read_value(self, key: bytes, dst: memoryview) -> int:
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return MISSING
            if n != HEADER_BYTES + len(dst):  # truncated or foreign value
                self._skip(n + 2)
                return CORRUPT
            # straight into the pool slot, checked in place (a bad value leaves
            # garbage there, as a failed load may: the slot is not served)
            self._read_into(memoryview(self._hdr), dst, memoryview(self._crlf))
            if self._crlf != b"\r\n":
                raise ConnectionError("GET reply: bulk string not followed by CRLF")
            if not self.codec.shape_ok(self._hdr, len(dst)):
                return CORRUPT
            return self.codec.verify(key, self._hdr, dst)
        if kind == b"_":  # RESP3 null
            return MISSING
        if kind == b"-":
            self.last_error = line[1:]
            # a list/hash/... under our key: not ours, and it would fail on every request
            return WRONG_TYPE if line.startswith(b"-WRONGTYPE") else ERROR
        raise ConnectionError(f"unexpected reply to GET: {line[:80]!r}")
