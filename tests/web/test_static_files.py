"""Static files (WhiteNoise) stream as Django's ASGI handler wants them: through an async
iterator, without the "StreamingHttpResponse must consume synchronous iterators" warning that
a synchronous file iterator gets under uvicorn."""

from __future__ import annotations

import warnings

import pytest
from django.conf import settings

CSS = (settings.BASE_DIR / "static" / "steep.css").read_bytes()


async def _body(response) -> bytes:
    return b"".join([chunk async for chunk in response.streaming_content])


@pytest.mark.asyncio
async def test_a_static_file_served_by_asgi_streams_asynchronously(async_client):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Django's warning for a synchronous iterator
        response = await async_client.get("/static/steep.css")
        assert response.status_code == 200 and response.is_async
        assert await _body(response) == CSS


@pytest.mark.asyncio
async def test_a_range_and_a_head_of_a_static_file_stream_asynchronously_too(async_client):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranged = await async_client.get("/static/steep.css", headers={"Range": "bytes=0-9"})
        assert ranged.status_code == 206 and await _body(ranged) == CSS[:10]
        # (The test client drops a HEAD's body itself, as uvicorn does.)
        assert (await async_client.head("/static/steep.css")).status_code == 200


def test_a_static_file_served_by_wsgi_is_the_whole_file(client):
    response = client.get("/static/steep.css")
    assert response.status_code == 200 and not response.is_async
    assert b"".join(response.streaming_content) == CSS
