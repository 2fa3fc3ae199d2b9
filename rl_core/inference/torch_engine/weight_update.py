"""The torch engine's distributed weight update: SGLang's three endpoints, without a stall.

``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
``world_size``, ``group_name``, ``backend``) joins the trainer's group as rank
``rank_offset`` (one rank per server: no tensor parallelism here).
``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
``group_name``, ``flush_cache``, ``abort_all_requests``, ``weight_version``,
``load_format``) receives one broadcast from rank 0 per name, in order, into a staging
buffer on a side thread while the scheduler keeps generating; then the scheduler copies
the staged tensors into the model between two decode steps. Requests in flight keep
running on the new weights (their earlier tokens keep the old version: ``meta_info.
weight_versions``). ``POST /destroy_weights_update_group`` (``group_name``) leaves it.
All three answer ``{"success": bool, "message": str}`` (400 when not successful), as
SGLang's ``http_server.py`` does; the update also reports ``swap_seconds`` (a Steep
extension: how long generation stood still).

A broadcast that fails or outlives the group's timeout (``STEEP_WEIGHT_SYNC_TIMEOUT_S``
unless the init body says otherwise, see ``rl_core.weight_sync``) ends the update with
``success: false`` and drops the group, whose peers can no longer be trusted; the old
weights keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import torch
from aiohttp import web

from rl_core.inference.torch_engine.protocol import BadRequest, as_bool, as_int
from rl_core.inference.weight_group import (
    DEFAULT_GROUP_NAME,
    WeightGroup,
    WeightGroupError,
    parse_dtype,
)

logger = logging.getLogger("rl_core.inference.torch_engine")

DEFAULT_TIMEOUT_S = float(os.environ.get("STEEP_WEIGHT_SYNC_TIMEOUT_S", "120"))


class WeightReceiver:
    """The weight-update groups this server joined, by name; receives into staging buffers."""

    def __init__(self, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.device = device
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def init_group(self, body: dict[str, Any]) -> str:
        name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
        with self._lock:
            if name in self._groups:
                raise BadRequest(f"Weight update group {name!r} already exists.")
        backend = str(body.get("backend") or "nccl")
        if self.device.type == "cpu":
            backend = "gloo"  # SGLang's default is nccl; a CPU engine can only speak gloo
        group = WeightGroup(
            master_address=str(body["master_address"]),
            master_port=as_int("master_port", body["master_port"], minimum=1),
            rank=as_int("rank_offset", body["rank_offset"], minimum=1),
            world_size=as_int("world_size", body["world_size"], minimum=2),
            group_name=name,
            backend=backend,
            timeout_s=float(body.get("timeout_s") or self.timeout_s),
            device=self.device,
        )
        with self._lock:
            self._groups[name] = group
        return name

    def destroy(self, name: str) -> bool:
        with self._lock:
            group = self._groups.pop(name, None)
        if group is not None:
            group.close()
        return group is not None

    def receive(self, name: str, specs: list[tuple[str, torch.dtype, list[int]]]) -> dict:
        """Receive every tensor of ``specs`` from rank 0 (blocking); ``{name: tensor}``."""
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                raise BadRequest(f"No weight update group {name!r}; call init first.")
            if name in self._busy:
                raise BadRequest(f"An update through group {name!r} is already running.")
            self._busy.add(name)
        try:
            staged: dict[str, torch.Tensor] = {}
            for key, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                group.broadcast(tensor)
                staged[key] = tensor
            return staged
        except WeightGroupError:
            self.destroy(name)  # a broken group cannot be reused; the trainer re-inits
            raise
        finally:
            with self._lock:
                self._busy.discard(name)


def _specs(body: dict[str, Any], params: dict[str, torch.Tensor]) -> list:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise BadRequest("names, dtypes and shapes must be lists.")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest("names, dtypes and shapes must have the same length.")
    specs = []
    for key, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if key not in params:
            raise BadRequest(f"The served model has no tensor {key!r}.")
        try:
            parsed = parse_dtype(dtype)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if list(params[key].shape) != [int(s) for s in shape]:
            raise BadRequest(f"{key}: shape {shape} != the served {list(params[key].shape)}.")
        specs.append((key, parsed, [int(s) for s in shape]))
    return specs


def _answer(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


# --------------------------------------------------------------------------- routes


def _engine_and_receiver(request: web.Request) -> tuple[Any, WeightReceiver]:
    from rl_core.inference.torch_engine.server import ENGINE

    engine = request.app[ENGINE]
    if engine.receiver is None:
        engine.receiver = WeightReceiver(engine.device)
    return engine, engine.receiver


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


async def init_weights_update_group(request: web.Request) -> web.Response:
    _, receiver = _engine_and_receiver(request)
    body = await _json(request)
    missing = [
        k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body
    ]
    if missing:
        raise BadRequest(f"init_weights_update_group needs {', '.join(missing)}.")
    try:
        name = await asyncio.to_thread(receiver.init_group, body)
    except WeightGroupError as exc:
        logger.warning("%s", exc)
        return _answer(False, f"Failed to init group: {exc}")
    return _answer(True, f"Succeeded to initialize custom process group {name}.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    _, receiver = _engine_and_receiver(request)
    body = await _json(request)
    name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
    if not await asyncio.to_thread(receiver.destroy, name):
        return _answer(False, f"Weight update group {name!r} does not exist.")
    return _answer(True, f"Succeeded to destroy custom process group {name}.")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine, receiver = _engine_and_receiver(request)
    body = await _json(request)
    name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
    if body.get("load_format") not in (None, "auto"):
        raise BadRequest(
            f"load_format {body['load_format']!r} is not supported by the torch engine."
        )
    version = body.get("weight_version")
    specs = _specs(body, engine.model.state_dict())
    started = time.perf_counter()
    try:
        # The transfer runs beside generation: the scheduler never waits for the network.
        staged = await asyncio.to_thread(receiver.receive, name, specs)
    except WeightGroupError as exc:
        logger.warning("%s", exc)
        return _answer(False, f"Failed to update weights: {exc}")
    transfer = time.perf_counter() - started
    if as_bool("abort_all_requests", body.get("abort_all_requests", False)):
        await engine.call(lambda: engine.abort(abort_all=True))
    swap = await engine.call(
        lambda: engine.install_weights(staged, None if version is None else str(version))
    )
    message = "Succeeded to update parameter online."
    if version is not None:
        message += f" Weight version updated to {version}."
    return _answer(True, message, transfer_seconds=transfer, swap_seconds=swap)


ROUTES = [
    web.post("/init_weights_update_group", init_weights_update_group),
    web.post("/update_weights_from_distributed", update_weights_from_distributed),
    web.post("/destroy_weights_update_group", destroy_weights_update_group),
]
