"""A minimal HTTP/1.1 client for JSON POSTs to one inference server, with kept-alive connections.

The gateway calls ``POST /generate`` once per completion, and on a small machine a
general-purpose client's per-request work (httpx, aiohttp) was a large share of the
gateway's CPU and of its added latency (docs/benchmarks/gateway.md). This client does only what
that call needs: one origin, ``POST`` with a ``Content-Length`` body, responses with
``Content-Length`` or chunked bodies (parsed by ``httptools``, the parser uvicorn uses),
keep-alive with a pool of idle connections, and HTTPS through ``ssl``. ``post_stream``
yields a response body piece by piece as it arrives (a streamed ``/generate``'s SSE): each
piece is everything that arrived since the reader last looked, so a reader that falls behind
(a busy gateway) takes several of the server's writes in one piece instead of one at a time.

There is no read timeout: a generation may legitimately wait through a pause and a
weight update. A request written to a kept-alive connection that the server closed at
that moment (nothing received back) is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

__all__ = ["HTTPConnectionError", "Http1Pool"]


class HTTPConnectionError(ConnectionError):
    """The server could not be reached, or the connection broke before a complete response."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.received = False  # any byte of the current response
        self.closed = False
        self.keep_alive = True
        self.idle_since = 0.0
        # While streaming: the status, then body pieces, then None (or an exception), in order.
        self.pieces: _Pieces | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HTTPConnectionError(f"malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail(HTTPConnectionError(f"connection closed by the server ({exc or 'EOF'})"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.pieces is not None:
            self.pieces.put(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.pieces is not None:
            self.pieces.put_body(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.pieces is not None:
            self.pieces.put(None)
            return
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def _fail(self, exc: Exception) -> None:
        if self.pieces is not None:
            self.pieces.put(exc)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, request: bytes) -> asyncio.Future:
        self.pieces = None
        self.body = []
        self.received = False
        self.parser = httptools.HttpResponseParser(self)
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None, "send() before the connection was made"
        self.transport.write(request)
        return self.waiter

    def stream(self, request: bytes) -> _Pieces:
        self.pieces = _Pieces()
        self.received = False
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None, "stream() before the connection was made"
        self.transport.write(request)
        return self.pieces

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pieces:
    """A streamed response as it arrives: the status, body bytes, then None or an exception.

    Body bytes that arrive while the reader is busy are joined, so ``get`` answers everything
    that is there in one piece; the status, the end and a failure keep their place in order.
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        self._wake()

    def put_body(self, body: bytes) -> None:
        if self._items and isinstance(self._items[-1], bytearray):
            self._items[-1] += body
        else:
            self._items.append(bytearray(body))
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        return bytes(item) if isinstance(item, bytearray) else item


class Http1Pool:
    """JSON POSTs to ``base_url`` over kept-alive HTTP/1.1 connections. Use within one event loop."""

    def __init__(self, base_url: str, *, connect_timeout: float = 10.0, idle_timeout: float = 4.0):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.rsplit("@", 1)[-1]
        self.connect_timeout = connect_timeout
        # Below the servers' own keep-alive timeout (uvicorn: 5 s), so they rarely close first.
        self.idle_timeout = idle_timeout
        self._idle: deque[_Connection] = deque()

    def _request(self, path: str, body: bytes) -> bytes:
        return (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body

    async def post_stream(self, path: str, body: bytes):
        """``POST {base_url}{path}`` with a JSON ``body``: yields the status, then the body's
        pieces as they arrive. Closing the generator early closes the connection (so the
        server learns its client went away)."""
        request = self._request(path, body)
        for attempt in (1, 2):
            connection, reused = await self._acquire()
            pieces = connection.stream(request)
            try:
                first = await pieces.get()
            except BaseException:  # cancelled before the answer began: the connection is spent
                connection.close()
                raise
            if isinstance(first, Exception):
                connection.close()
                if reused and attempt == 1 and not connection.received:
                    continue  # the server closed this idle connection as we reused it
                raise first
            finished = False
            try:
                yield first
                while True:
                    piece = await pieces.get()
                    if piece is None:
                        finished = True
                        break
                    if isinstance(piece, Exception):
                        raise piece
                    yield piece
            finally:
                connection.pieces = None
                if finished:
                    self._release(connection)
                else:
                    connection.close()
            return

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of ``POST {base_url}{path}`` with a JSON ``body``."""
        request = self._request(path, body)
        for attempt in (1, 2):
            connection, reused = await self._acquire()
            try:
                status, payload = await connection.send(request)
            except HTTPConnectionError:
                connection.close()
                if reused and attempt == 1 and not connection.received:
                    continue  # the server closed this idle connection as we reused it
                raise
            except BaseException:  # cancelled mid-request: the connection's state is unknown
                connection.close()
                raise
            self._release(connection)
            return status, payload
        raise AssertionError("unreachable")

    async def _acquire(self) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < self.idle_timeout:
                return connection, True
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise HTTPConnectionError(
                f"cannot connect to {self.host}:{self.port}: {exc!r}"
            ) from exc
        return connection, False

    def _release(self, connection: _Connection) -> None:
        if connection.closed or not connection.keep_alive:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.append(connection)

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
