"""The torch engine's HTTP server: SGLang's native endpoints over a ``TorchEngine``.

Each route is a small handler: parse the body (``protocol``), hand the work to the
engine's scheduler thread (``TorchEngine.submit`` / ``call``), answer in SGLang's
shape. Errors are answered as SGLang's error JSON (``_errors_as_json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rl_core.inference.torch_engine import weight_update
from rl_core.inference.torch_engine.engine import EngineStopped, TorchEngine
from rl_core.inference.torch_engine.protocol import (
    BadRequest,
    GenerateRequest,
    check_pause_request,
    parse_abort_request,
    parse_generate_request,
    parse_load_lora_request,
    parse_slow_down_request,
    parse_unload_lora_request,
    parse_update_weights_request,
)
from rl_core.inference.torch_engine.weight_load import NotStageable, read_staged

logger = logging.getLogger("rl_core.inference.torch_engine")

ENGINE_VERSION = "steep-torch-engine/0.1"
ENGINE = web.AppKey("engine", TorchEngine)


def _error(status: int, message: str) -> web.Response:
    # SGLang's ErrorResponse shape (http_server.py validation handler).
    phrase = {
        400: "Bad Request",
        404: "Not Found",
        405: "Method Not Allowed",
        503: "Service Unavailable",
    }
    body = {
        "object": "error",
        "message": message,
        "type": phrase.get(status, "Internal Server Error"),
        "param": None,
        "code": status,
    }
    return web.json_response(body, status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except EngineStopped as exc:
        return _error(503, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"Internal error: {exc}")


async def _json_body(request: web.Request, *, default: Any = None) -> Any:
    raw = await request.read()
    if not raw.strip():
        if default is not None:
            return default
        raise BadRequest("The request body must be JSON.")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None


def _ok(message: str) -> web.Response:
    return web.json_response({"message": message, "status": "ok"})


# --------------------------------------------------------------------------- generation


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].is_alive() else 503)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = parse_generate_request(
        await _json_body(request), tokenizer=engine.tokenizer, vocab_size=engine.vocab_size
    )
    if len(req.input_ids) >= engine.context_length:
        raise BadRequest(
            f"The input ({len(req.input_ids)} tokens) is longer than the model's context length ({engine.context_length} tokens)."
        )
    if (
        req.lora_path is not None
        and engine.adapters is not None
        and engine.adapters.was_evicted(req.lora_path)  # no thread hop for a loaded adapter
    ):
        try:  # evicted while its run was quiet: read it again, beside the scheduler
            await asyncio.to_thread(engine.adapters.reload, req.lora_path)
        except (ValueError, OSError) as exc:
            raise BadRequest(
                f"LoRA adapter {req.lora_path!r} was evicted and cannot be reloaded: {exc}"
            ) from None
    updates = _updates_of(req)
    engine.submit(req)
    try:
        if req.stream:
            return await _stream(request, updates)
        while True:
            payload, final = await updates.get()
            if final:
                return web.json_response(payload)
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away: stop spending compute on its request.
        if req.finish is None:
            with contextlib.suppress(EngineStopped):
                engine.call(lambda: engine.abort(req=req)).add_done_callback(
                    lambda f: f.cancelled() or f.exception()
                )
        raise


def _updates_of(req: GenerateRequest) -> asyncio.Queue[tuple[dict[str, Any], bool]]:
    """A queue on this event loop that receives the scheduler thread's ``(payload, final)``."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()

    def sink(payload: dict[str, Any], final: bool) -> None:
        try:
            loop.call_soon_threadsafe(updates.put_nowait, (payload, final))
        except RuntimeError:  # the loop is closed: the server is going away
            pass

    req.sink = sink
    return updates


async def _stream(
    request: web.Request, updates: asyncio.Queue[tuple[dict[str, Any], bool]]
) -> web.StreamResponse:
    """Server-sent events: each update as ``data: {json}``, then ``data: [DONE]``."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    while True:
        payload, final = await updates.get()
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        if final:
            break
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# --------------------------------------------------------------------------- control


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    check_pause_request(await _json_body(request, default={}))
    await engine.call(engine.pause)
    return _ok("Generation paused successfully.")


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    await engine.call(engine.resume)
    return _ok("Generation continued successfully.")


async def abort_request(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    rid, abort_all = parse_abort_request(await _json_body(request, default={}))
    await engine.call(lambda: engine.abort(rid, abort_all=abort_all))
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = parse_update_weights_request(await _json_body(request))
    staged, new_model = None, None
    try:
        # Read while still serving; only the swap (between two steps) holds generation.
        staged = await asyncio.to_thread(read_staged, body.model_path, engine.model)
    except NotStageable as why:  # not safetensors by the served names: build a model
        logger.info("update_weights_from_disk via from_pretrained: %s", why)
        try:
            new_model = await asyncio.to_thread(engine.load_weights, body.model_path)
        except Exception as exc:
            return _disk_failure(body.model_path, exc)
    except Exception as exc:
        return _disk_failure(body.model_path, exc)
    if body.abort_all_requests:
        await engine.call(lambda: engine.abort(abort_all=True))
    # Swapped between two decode steps: running requests go on under the new weights.
    if staged is not None:
        swap = await engine.call(
            lambda: engine.install_weights(staged, body.weight_version, body.model_path)
        )
    else:
        swap = await engine.call(
            lambda: engine.swap_model(new_model, body.model_path, body.weight_version)
        )
    message = "Succeeded to update model weights."
    if body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    body_out = {"success": True, "message": message, "num_paused_requests": 0}
    return web.json_response({**body_out, "swap_seconds": swap})


def _disk_failure(path: str, exc: Exception) -> web.Response:
    message = f"Failed to update weights from {path}: {exc}"
    logger.warning(message)
    return web.json_response(
        {"success": False, "message": message, "num_paused_requests": 0}, status=400
    )


async def slow_down(request: web.Request) -> web.Response:
    request.app[ENGINE].forward_sleep_time = parse_slow_down_request(await _json_body(request))
    return web.json_response({})


async def flush_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache; refused while requests run or wait, as SGLang refuses."""
    engine = request.app[ENGINE]
    state = engine.snapshot()
    if state["num_running_reqs"] or state["num_waiting_reqs"]:
        return web.Response(
            status=400, text="Cache not flushed: there are running or waiting requests.\n"
        )
    await engine.call(engine.flush_prefix_cache)
    return web.Response(status=200, text="Cache flushed.\n")


# --------------------------------------------------------------------------- LoRA adapters


def _lora_answer(engine: TorchEngine, error: str | None) -> web.Response:
    # SGLang's LoRAUpdateOutput: 200 on success, 400 with success false otherwise.
    body = {
        "success": error is None,
        "error_message": error or "",
        "loaded_adapters": engine.adapters.loaded() if engine.adapters is not None else {},
    }
    return web.json_response(body, status=200 if error is None else 400)


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name, path, pinned = parse_load_lora_request(await _json_body(request))
    if engine.adapters is None:
        return _lora_answer(engine, "LoRA is not enabled: start the server with --enable-lora.")
    try:  # reading the weights runs beside the scheduler: serving never pauses
        await asyncio.to_thread(engine.adapters.load, name, path, pinned=pinned)
    except (ValueError, OSError) as exc:
        return _lora_answer(engine, f"Failed to load LoRA adapter {name!r}: {exc}")
    return _lora_answer(engine, None)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Refuse new requests under the name at once; answer once its running requests finished."""
    engine = request.app[ENGINE]
    name = parse_unload_lora_request(await _json_body(request))
    if engine.adapters is None:
        return _lora_answer(engine, "LoRA is not enabled: start the server with --enable-lora.")
    try:
        adapter = engine.adapters.unregister(name)
    except ValueError as exc:
        return _lora_answer(engine, str(exc))
    while (
        adapter is not None and not adapter.idle.is_set()
    ):  # its requests finish (or are aborted) on their own
        await asyncio.to_thread(adapter.idle.wait, 1.0)
    # The name may come back with other weights: its cached KV goes with it.
    await engine.call(lambda: engine.flush_prefix_cache(name, everything=False))
    return _lora_answer(engine, None)


async def set_fair_share_weights(request: web.Request) -> web.Response:
    """Steep's extension (SGLang has no such route): ``{"weights": {run: weight}}``, each
    run's (adapter name without ``-v<N>``) weight in the batch's fair share (``fair.py``)."""
    engine = request.app[ENGINE]
    body = await _json_body(request)
    weights = body.get("weights") if isinstance(body, dict) else None
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in weights.items()
    ):
        raise BadRequest('set_fair_share_weights needs {"weights": {"<run>": <number>, ...}}.')
    try:
        engine.set_fair_share_weights({k: float(v) for k, v in weights.items()})
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return _ok("Fair share weights set.")


# --------------------------------------------------------------------------- information


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    config = engine.model.config
    info = {
        "model_path": engine.model_path,
        "tokenizer_path": engine.server_args.get("tokenizer_path", engine.model_path),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }
    return web.json_response(info)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE].weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    info = {
        **engine.server_args,
        "model_path": engine.model_path,
        "weight_version": engine.weight_version,
        "max_running_requests": engine.max_running_requests,
        "context_length": engine.context_length,
        "internal_states": [engine.snapshot()],
        "version": ENGINE_VERSION,
    }
    return web.json_response(info)


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    card = {
        "id": engine.served_model_name,
        "object": "model",
        "owned_by": "steep",
        "root": engine.served_model_name,
        "max_model_len": engine.context_length,
    }
    return web.json_response({"object": "list", "data": [card]})


ROUTES = [
    web.get("/health", health),
    web.get("/health_generate", health),
    web.post("/generate", generate),
    web.put("/generate", generate),
    web.post("/pause_generation", pause_generation),
    web.post("/continue_generation", continue_generation),
    web.post("/abort_request", abort_request),
    web.post("/update_weights_from_disk", update_weights_from_disk),
    *weight_update.ROUTES,
    web.post("/slow_down", slow_down),
    web.post("/load_lora_adapter", load_lora_adapter),
    web.post("/unload_lora_adapter", unload_lora_adapter),
    web.post("/set_fair_share_weights", set_fair_share_weights),
    web.get("/flush_cache", flush_cache),
    web.post("/flush_cache", flush_cache),
    web.get("/get_model_info", get_model_info),
    web.get("/model_info", get_model_info),
    web.get("/get_weight_version", get_weight_version),
    web.get("/weight_version", get_weight_version),
    web.get("/get_server_info", get_server_info),
    web.get("/server_info", get_server_info),
    web.get("/v1/models", list_models),
]


def build_app(engine: TorchEngine) -> web.Application:
    """The aiohttp application serving SGLang's native endpoints for ``engine``."""
    app = web.Application(middlewares=[_errors_as_json], client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine
    app.add_routes(ROUTES)

    async def on_shutdown(app: web.Application) -> None:
        await asyncio.to_thread(engine.stop)

    app.on_shutdown.append(on_shutdown)
    return app
