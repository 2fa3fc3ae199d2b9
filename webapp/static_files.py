"""Static files: WhiteNoise, its files streamed the way Django's ASGI handler wants them.

WhiteNoise answers with a ``FileResponse`` over the open file, a synchronous iterator. Served
by ASGI (uvicorn), Django iterates it in a thread and warns "StreamingHttpResponse must consume
synchronous iterators in order to serve them asynchronously" at the first one a process
serves. Here the file is read chunk by chunk in a thread by an async iterator instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from django.core.handlers.asgi import ASGIRequest
from whitenoise.middleware import WhiteNoiseMiddleware

CHUNK = 1 << 16


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise's middleware (and its settings); under ASGI its files stream asynchronously."""

    @staticmethod
    def serve(static_file, request):
        response = WhiteNoiseMiddleware.serve(static_file, request)
        if isinstance(request, ASGIRequest):
            response.streaming_content = _read_in_thread(response.file_to_stream)
        return response


async def _read_in_thread(file) -> AsyncIterator[bytes]:
    """``file``'s bytes, a chunk at a time; nothing for None (a HEAD, a 304). The response
    closes the file."""
    while file is not None and (chunk := await asyncio.to_thread(file.read, CHUNK)):
        yield chunk
