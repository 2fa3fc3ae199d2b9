"""A zero-latency inference-engine stand-in for the gateway benchmark (``bench/gateway.py``).

It answers at once, with a fixed short output, on both protocols the benchmarked
proxies speak to an engine:

- SGLang's native ``POST /generate`` (what Steep's gateway calls): ``output_ids``,
  ``text`` and ``meta_info`` with ``id``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens``, ``output_token_logprobs`` (``[logprob, token_id, null]``
  triples) and ``weight_version`` — the fields ``rl_core.inference.protocol.parse_segment``
  parses;
- OpenAI's ``POST /v1/chat/completions`` (what LiteLLM and sglang-router forward);
- canned answers to Steep's RL protocol, ``POST /v1/rl/start_session`` (201
  ``{"session_id", "api_key"}``), ``/v1/rl/set_reward`` and ``/v1/rl/end_session`` (also
  without ``/v1``), so that the sessions workload's agent loop can run against the
  stand-in itself: the load generator's own ceiling (``bench/sessions_load.py``);
- the probes sglang-router makes before it routes to a worker: ``GET /health``,
  ``/health_generate``, ``/server_info``, ``/get_server_info``, ``/model_info``,
  ``/get_model_info`` and ``/v1/models``.

It is a raw asyncio protocol (uvloop when installed) with a minimal HTTP/1.1
parser: keep-alive, ``Content-Length`` and chunked bodies, pipelining. No
framework, so that the proxies in front of it, not the stand-in, are measured.
OpenAI chat streaming is not implemented and answers 400. With ``--token-delay-ms D``
``/generate`` takes ``D`` ms per output token (a decode step), and ``"stream": true`` on it
answers SGLang's cumulative SSE (``data: {...}`` per token, each carrying the whole output
so far, then ``data: [DONE]``), chunked: what the TTFT benchmark (``bench/ttft.py``) needs.
A delayed request is answered by a task, so it must not be pipelined behind another.

Usage: ``python bench/standin.py --port 31000 [--tokens 8] [--token-delay-ms 0]``. Stdlib only
(uvloop optional).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import time

# "It is 4." in a byte-level vocabulary (rl_core.tiny's ids are the bytes): 8 tokens.
OUTPUT_IDS = [73, 116, 32, 105, 115, 32, 52, 46]
OUTPUT_TEXT = "It is 4."
LOGPROB = -0.125
MODEL = "policy"

_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
}
_counter = itertools.count(1)

try:  # the stand-in's own CPU is taken from the cores the gateway under test shares
    import orjson

    _dumps = orjson.dumps
except ImportError:  # pragma: no cover - it runs with the standard library alone too

    def _dumps(value) -> bytes:
        return json.dumps(value).encode()


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        % (status, _REASONS.get(status, "OK").encode(), content_type, len(body))
        + body
    )


def _error(status: int, message: str) -> bytes:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return _response(status, json.dumps(body).encode())


def _output(n: int) -> tuple[list[int], str]:
    reps = n // len(OUTPUT_IDS) + 1
    ids = (OUTPUT_IDS * reps)[:n]
    return ids, bytes(ids).decode("latin-1")


def generate(body: dict, tokens: int) -> bytes:
    return _response(200, _dumps(_generated(body, tokens, _count(body, tokens))))


def _count(body: dict, tokens: int) -> int:
    max_new = (body.get("sampling_params") or {}).get("max_new_tokens")
    return tokens if max_new is None else max(0, min(int(max_new), tokens))


def _generated(body: dict, tokens: int, n: int, *, done: bool = True) -> dict:
    """The /generate answer after ``n`` tokens (``done``: with its finish_reason)."""
    max_new = (body.get("sampling_params") or {}).get("max_new_tokens")
    ids, text = _output(n)
    finish = (
        None
        if not done
        else {"type": "length", "length": n}
        if max_new is not None and n == int(max_new)
        else {"type": "stop", "matched": None}
    )
    meta = {
        "id": body.get("rid") or f"standin-{next(_counter)}",
        "finish_reason": finish,
        "prompt_tokens": len(body.get("input_ids") or ()),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": "0",
        "e2e_latency": 0.0,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[LOGPROB, t, None] for t in ids]
        meta["input_token_logprobs"] = []
    if body.get("top_logprobs_num"):
        meta["output_top_logprobs"] = [[[LOGPROB, t, None]] for t in ids]
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def generate_slowly(transport, body: dict, tokens: int, delay: float) -> None:
    """``/generate`` at ``delay`` seconds per token: one answer at the end, or SSE per token."""
    n = _count(body, tokens)
    if not body.get("stream"):
        await asyncio.sleep(delay * n)
        transport.write(_response(200, _dumps(_generated(body, tokens, n))))
        return
    transport.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    # Token k is due ``k * delay`` after the start, as from an engine's fixed decode step: a
    # sleep per token would add the event loop's wake-up lag to every token, and a streamed
    # answer would take longer than the same answer unstreamed.
    start = asyncio.get_running_loop().time()
    for k in range(1, n + 1):
        await asyncio.sleep(max(0.0, start + k * delay - asyncio.get_running_loop().time()))
        if transport.is_closing():
            return
        event = b"data: " + _dumps(_generated(body, tokens, k, done=k == n)) + b"\n\n"
        transport.write(b"%x\r\n%s\r\n" % (len(event), event))
    done = b"data: [DONE]\n\n"
    transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def start_session() -> bytes:
    n = next(_counter)
    answer = {"session_id": f"standin-session-{n}", "api_key": f"sk-sess-standin-{n}"}
    return _response(201, json.dumps(answer).encode())


def set_reward(body: dict) -> bytes:
    answer = {
        "interaction_id": "chatcmpl-standin",
        "session_id": "standin-session",
        "reward": body.get("reward"),
    }
    return _response(200, json.dumps(answer).encode())


_END_SESSION = _response(
    200,
    json.dumps(
        {"session_id": "standin-session", "interaction_count": 1, "trajectory": "ready"}
    ).encode(),
)


def chat_completion(body: dict, tokens: int) -> bytes:
    if body.get("stream"):
        return _error(400, "the benchmark stand-in does not stream")
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    n = tokens if max_new is None else max(0, min(int(max_new), tokens))
    _, text = _output(n)
    prompt_tokens = sum(len(str(m.get("content") or "")) for m in body.get("messages") or ())
    payload = {
        "id": f"chatcmpl-standin-{next(_counter)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or MODEL,
        "system_fingerprint": "standin",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length" if max_new is not None and n == int(max_new) else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        },
    }
    return _response(200, json.dumps(payload).encode())


_MODEL_INFO = json.dumps(
    {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "0",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }
).encode()
_SERVER_INFO = json.dumps(
    {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "served_model_name": MODEL,
        "host": "127.0.0.1",
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": "null",
        "max_total_num_tokens": 1 << 20,
        "max_running_requests": 4096,
        "version": "standin",
        "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
    }
).encode()
_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "standin", "root": MODEL}
        ],
    }
).encode()
_GET = {
    b"/health": _response(200, b""),
    b"/health_generate": _response(200, b""),
    b"/model_info": _response(200, _MODEL_INFO),
    b"/get_model_info": _response(200, _MODEL_INFO),
    b"/server_info": _response(200, _SERVER_INFO),
    b"/get_server_info": _response(200, _SERVER_INFO),
    b"/v1/models": _response(200, _MODELS),
    b"/get_load": _response(
        200, b'[{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]'
    ),
}


class Stats:
    requests = 0


class HTTPProtocol(asyncio.Protocol):
    __slots__ = ("transport", "buffer", "tokens", "delay")

    def __init__(self, tokens: int, delay: float = 0.0):
        self.tokens = tokens
        self.delay = delay
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        out = []
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buffer[:end]
            line_end = head.find(b"\r\n")
            request_line = head if line_end < 0 else head[:line_end]
            parts = request_line.split(b" ")
            if len(parts) != 3:
                self.transport.write(_error(400, "bad request line"))
                self.transport.close()
                return
            method, target, _ = parts
            lower = head.lower()
            length = 0
            start = end + 4
            pos = lower.find(b"\r\ncontent-length:")
            if pos >= 0:
                stop = lower.find(b"\r\n", pos + 2)
                length = int(lower[pos + 17 : stop if stop >= 0 else len(lower)].strip())
                if len(buffer) < start + length:
                    break
                body = buffer[start : start + length]
                buffer = buffer[start + length :]
            elif b"\r\ntransfer-encoding:" in lower and b"chunked" in lower:
                parsed = _dechunk(buffer, start)
                if parsed is None:
                    break
                body, consumed = parsed
                buffer = buffer[consumed:]
            else:
                body = b""
                buffer = buffer[start:]
            close = b"\r\nconnection: close" in lower
            if self.delay and method == b"POST" and target.split(b"?", 1)[0] == b"/generate":
                if out:
                    self.transport.write(b"".join(out))
                    out = []
                asyncio.ensure_future(
                    generate_slowly(self.transport, json.loads(body), self.tokens, self.delay)
                )
                Stats.requests += 1
                continue
            out.append(self.handle(method, target, body))
            Stats.requests += 1
            if close:
                self.transport.write(b"".join(out))
                self.transport.close()
                return
        self.buffer = buffer
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def handle(self, method: bytes, target: bytes, body: bytes) -> bytes:
        path = target.split(b"?", 1)[0]
        if method == b"POST":
            try:
                payload = json.loads(body) if body else {}
            except ValueError:
                return _error(400, "body is not JSON")
            if not isinstance(payload, dict):
                return _error(400, "body must be a JSON object")
            if path == b"/generate":
                return generate(payload, self.tokens)
            if path in (b"/v1/chat/completions", b"/chat/completions"):
                return chat_completion(payload, self.tokens)
            if path in (b"/v1/rl/start_session", b"/rl/start_session"):
                return start_session()
            if path in (b"/v1/rl/set_reward", b"/rl/set_reward"):
                return set_reward(payload)
            if path in (b"/v1/rl/end_session", b"/rl/end_session"):
                return _END_SESSION
            if path in (b"/flush_cache", b"/pause_generation", b"/continue_generation"):
                return _response(200, b"{}")
            return _error(404, f"no route POST {path.decode(errors='replace')}")
        if method == b"GET":
            canned = _GET.get(path)
            if canned is not None:
                return canned
            return _error(404, f"no route GET {path.decode(errors='replace')}")
        return _error(405, "GET or POST only")


def _dechunk(buffer: bytes, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``start``; None when incomplete."""
    pieces = []
    pos = start
    while True:
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(buffer[pos:line_end].split(b";", 1)[0], 16)
        pos = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n", pos)
            if trailer_end < 0:
                return None
            # skip trailers (rare): up to the empty line
            while trailer_end != pos:
                pos = trailer_end + 2
                trailer_end = buffer.find(b"\r\n", pos)
                if trailer_end < 0:
                    return None
            return b"".join(pieces), pos + 2
        if len(buffer) < pos + size + 2:
            return None
        pieces.append(buffer[pos : pos + size])
        pos += size + 2


async def serve(host: str, port: int, tokens: int, delay: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HTTPProtocol(tokens, delay), host, port, reuse_address=True, backlog=4096
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"standin listening on http://{host}:{port} (pid {os.getpid()})", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument(
        "--tokens", type=int, default=len(OUTPUT_IDS), help="output tokens per answer"
    )
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="/generate takes this long per output token (and can stream); default 0",
    )
    args = parser.parse_args(argv)
    served = serve(args.host, args.port, args.tokens, args.token_delay_ms / 1000)
    try:
        import uvloop
    except ImportError:
        asyncio.run(served)
    else:
        uvloop.run(served)


if __name__ == "__main__":
    main()
