"""The gateway's HTTP/1.1 client (rl_core.inference.http1) against real sockets.

A small asyncio server stands in for an inference server so that each test can choose
how responses are framed and when connections close.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rl_core.inference.http1 import Http1Pool, HTTPConnectionError
from rl_core.inference.launch import free_port


class Server:
    """Answers every POST with ``respond(body) -> raw response bytes``; counts connections."""

    def __init__(self, respond):
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = self.respond(body)
                if answer is None:  # drop the connection without answering
                    writer.close()
                    return
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self):
        self.port = free_port()
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        for writer in self.writers:
            writer.close()
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def sized(payload: dict, status: str = "200 OK", extra: str = "") -> bytes:
    body = json.dumps(payload).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def chunked(payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    parts = [body[:5], body[5:]]
    chunks = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def run(coro):
    return asyncio.run(coro)


def test_posts_json_and_reuses_one_kept_alive_connection():
    async def main():
        async with Server(lambda body: sized({"echo": json.loads(body)})) as server:
            pool = Http1Pool(server.url + "/base")
            for i in range(5):
                status, body = await pool.post_json("/generate", json.dumps({"i": i}).encode())
                assert status == 200 and json.loads(body) == {"echo": {"i": i}}
            await pool.close()
            return server

    server = run(main())
    assert server.connections == 1
    first = server.requests[0].decode()
    assert first.startswith("POST /base/generate HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}\r\n" in first


def test_reads_chunked_bodies_and_error_statuses():
    async def main():
        replies = iter([chunked({"ok": True}), sized({"error": "bad"}, status="400 Bad Request")])
        async with Server(lambda body: next(replies)) as server:
            pool = Http1Pool(server.url)
            assert await pool.post_json("/g", b"{}") == (200, b'{"ok": true}')
            status, body = await pool.post_json("/g", b"{}")
            await pool.close()
            return status, body

    assert run(main()) == (400, b'{"error": "bad"}')


def test_connection_close_is_honoured():
    async def main():
        async with Server(lambda body: sized({}, extra="Connection: close\r\n")) as server:
            pool = Http1Pool(server.url)
            for _ in range(3):
                assert (await pool.post_json("/g", b"{}"))[0] == 200
            await pool.close()
            return server.connections

    assert run(main()) == 3


def test_a_request_on_a_connection_the_server_dropped_is_sent_again_once():
    async def main():
        answers = iter([sized({"n": 1}), None, sized({"n": 2})])
        async with Server(lambda body: next(answers)) as server:
            pool = Http1Pool(server.url)
            assert json.loads((await pool.post_json("/g", b"{}"))[1]) == {"n": 1}
            # The server drops the kept-alive connection when the next request arrives:
            # nothing came back, so the pool retries on a new connection.
            assert json.loads((await pool.post_json("/g", b"{}"))[1]) == {"n": 2}
            await pool.close()
            return server.connections

    assert run(main()) == 2


def test_a_fresh_connection_that_breaks_is_an_error_not_a_retry():
    async def main():
        async with Server(lambda body: None) as server:
            pool = Http1Pool(server.url)
            with pytest.raises(HTTPConnectionError):
                await pool.post_json("/g", b"{}")
            return server.connections

    assert run(main()) == 1


def test_unreachable_server_is_a_connection_error():
    async def main():
        pool = Http1Pool(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(HTTPConnectionError, match="cannot connect"):
            await pool.post_json("/g", b"{}")

    run(main())


def test_concurrent_requests_use_separate_connections_then_share_them():
    async def main():
        async with Server(lambda body: sized({"b": json.loads(body)})) as server:
            pool = Http1Pool(server.url)
            results = await asyncio.gather(
                *(pool.post_json("/g", json.dumps(i).encode()) for i in range(8))
            )
            assert [json.loads(b)["b"] for _, b in results] == list(range(8))
            opened = server.connections
            await asyncio.gather(*(pool.post_json("/g", b"1") for _ in range(8)))
            await pool.close()
            return opened, server.connections

    opened, total = run(main())
    assert opened == 8 and total == 8


def test_rejects_non_http_urls():
    with pytest.raises(ValueError):
        Http1Pool("ftp://example.org")


def test_a_streamed_body_that_arrives_at_once_is_one_piece_and_its_connection_is_reused():
    async def main():
        async with Server(lambda body: chunked({"streamed": True})) as server:
            pool = Http1Pool(server.url)
            for _ in range(3):
                stream = pool.post_stream("/g", b"{}")
                assert await anext(stream) == 200
                pieces = [piece async for piece in stream]
                # The server wrote both chunks at once: the reader gets them joined.
                assert pieces == [json.dumps({"streamed": True}).encode()]
            await pool.close()
            return server.connections

    assert run(main()) == 1


def test_a_streamed_body_arrives_piece_by_piece_and_what_piles_up_is_joined():
    async def main():
        reader_took_first = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
            await reader_took_first.wait()
            for piece in (b"b", b"c", b"d"):  # three writes while the reader is not looking
                writer.write(b"1\r\n" + piece + b"\r\n")
                await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"1\r\ne\r\n0\r\n\r\n")
            await writer.drain()
            writer.close()

        port = free_port()
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        pool = Http1Pool(f"http://127.0.0.1:{port}")
        stream = pool.post_stream("/g", b"{}")
        assert await anext(stream) == 200
        pieces = [await anext(stream)]
        reader_took_first.set()
        await asyncio.sleep(0.03)  # the reader is busy while b, c and d arrive
        pieces += [piece async for piece in stream]
        await pool.close()
        server.close()
        return pieces

    assert run(main()) == [b"a", b"bcd", b"e"]


def test_a_stream_closed_early_closes_its_connection():
    async def main():
        async with Server(lambda body: chunked({"streamed": True})) as server:
            pool = Http1Pool(server.url)
            stream = pool.post_stream("/g", b"{}")
            assert await anext(stream) == 200
            await stream.aclose()  # the client went away mid-answer: never reuse that connection
            assert (await pool.post_json("/g", b"{}"))[0] == 200
            await pool.close()
            return server.connections

    assert run(main()) == 2
