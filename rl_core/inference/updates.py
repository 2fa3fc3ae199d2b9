"""The weight-update calls of ``InferenceClient``: SGLang's full-weight updates (from disk,
or by broadcast from the trainer's process group) and its LoRA adapter registry.

Field names were checked against SGLang's ``io_struct.py`` (``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``DestroyWeightsUpdateGroupReqInput``, ``LoadLoRAAdapterReqInput``,
``UnloadLoRAAdapterReqInput``). Like the client, this module never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from rl_core.inference.protocol import InferenceError


class UpdateCalls:
    """Mixed into ``InferenceClient``, whose ``_request`` and ``_control_timeout`` these use."""

    _control_timeout: httpx.Timeout

    async def _request(
        self, method: str, path: str, *, json_body: Any = None, timeout: Any = None
    ) -> httpx.Response:
        raise NotImplementedError

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: int | str | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        flush_cache: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Load new weights from ``model_path`` (a directory on the server's machine).

        Returns ``{"success": True, "message": ...}``; raises ``InferenceError`` when the
        server reports failure. ``weight_version`` becomes ``meta_info.weight_version``
        of everything generated afterwards.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        if flush_cache is not None:
            body["flush_cache"] = flush_cache
        return await self._weights_call("/update_weights_from_disk", body, timeout)

    async def _weights_call(
        self, path: str, body: dict[str, Any], timeout: float | None
    ) -> dict[str, Any]:
        """POST a weight-update call; its ``{"success", "message", ...}``; InferenceError unless success."""
        limit = self._control_timeout if timeout is None else httpx.Timeout(timeout)
        response = await self._request("POST", path, json_body=body, timeout=limit)
        data = response.json()
        if not data.get("success", False):
            raise InferenceError(
                f"{path.lstrip('/')} failed: {data.get('message')}",
                status=response.status_code,
                body=data,
            )
        return data

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, pinned: bool = False
    ) -> dict[str, Any]:
        """Load the peft adapter at ``lora_path`` (a directory on the server's machine) as
        ``lora_name``; serving goes on meanwhile. Returns SGLang's ``{"success",
        "error_message", "loaded_adapters"}``; raises ``InferenceError`` on failure."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self._lora_update("/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload ``lora_name``: new requests naming it are refused at once; the answer comes
        once the requests running under it have finished (they are not aborted)."""
        return await self._lora_update("/unload_lora_adapter", {"lora_name": lora_name})

    async def _lora_update(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._request("POST", path, json_body=body, timeout=self._control_timeout)
        data = response.json()
        if not data.get("success", False):  # SGLang answers failures with 400 (raised above)
            raise InferenceError(
                f"{path} failed: {data.get('error_message')}",
                status=response.status_code,
                body=data,
            )
        return data

    # SGLang's distributed weight update (io_struct.py InitWeightsUpdateGroupReqInput,
    # UpdateWeightsFromDistributedReqInput, DestroyWeightsUpdateGroupReqInput): the
    # trainer is rank 0 of a group at master_address:master_port and broadcasts each
    # tensor, in the order of ``names``, while update_weights_from_distributed is pending.

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's weight-update group as rank ``rank_offset`` (+ its TP rank).

        ``timeout_s`` (torch engine only, not SGLang's protocol): the group's operation timeout.
        """
        body = group_fields(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s
        )
        return await self._weights_call("/init_weights_update_group", body, None)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Receive ``names`` (dtype names like ``"bfloat16"``) by broadcast from rank 0."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._weights_call("/update_weights_from_distributed", body, timeout)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        """Leave the weight-update group ``group_name``."""
        return await self._weights_call(
            "/destroy_weights_update_group", {"group_name": group_name}, None
        )


def group_fields(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float | None,
) -> dict[str, Any]:
    """SGLang's ``/init_weights_update_group`` body (also what vLLM's ``steep`` engine takes)."""
    body: dict[str, Any] = {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body
