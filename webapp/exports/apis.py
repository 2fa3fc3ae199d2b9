"""REST: a run's trajectories as JSON lines or Parquet, and a checkpoint as a zipped model folder."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import serializers

from webapp.api.errors import Conflict
from webapp.api.views import ProjectAPIView
from webapp.exports.trajectories import (
    CONTENT_TYPES,
    FORMATS,
    export_rows,
    jsonl_chunks,
    parquet_chunks,
)
from webapp.exports.zipstream import zip_folder
from webapp.gateway.apis import STATUS_HELP, STATUS_VALUES, AnyAccept, _status_param
from webapp.runs.models import Checkpoint
from webapp.runs.selectors import checkpoint_get, run_get


def streamed(request, chunks: Iterator[bytes], batch: int = 16) -> Iterator[bytes] | AsyncIterator:
    """Under ASGI Django would read a sync iterator whole before sending; pull it in batches,
    on one thread (a queryset's cursor lives on its connection)."""
    if not isinstance(request._request, ASGIRequest):
        return chunks
    next_batch = sync_to_async(lambda: list(itertools.islice(chunks, batch)), thread_sensitive=True)

    async def batches():
        while parts := await next_batch():
            yield b"".join(parts)

    return batches()


def _format_param(request) -> str:
    value = request.query_params.get("format") or "jsonl"
    if value not in FORMATS:
        raise serializers.ValidationError({"format": [f"Must be one of {', '.join(FORMATS)}."]})
    return value


class TrajectoryExportApi(ProjectAPIView):
    """A run's trajectories to take away, streamed as they are read."""

    content_negotiation_class = AnyAccept

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "format",
                str,
                enum=list(FORMATS),
                description="jsonl (default): one JSON object per line; parquet: one Parquet "
                "file (pyarrow), a row group per 200 trajectories.",
            ),
            OpenApiParameter("status", str, enum=STATUS_VALUES, description=STATUS_HELP),
        ],
        responses={
            (200, CONTENT_TYPES["jsonl"]): OpenApiResponse(
                response=OpenApiTypes.STR,
                description="One row per trajectory, the same columns in both formats: format, "
                "run_id, session_id, agent_id, task_id, group_id, status, trajectory, "
                "created_at, ended_at, messages [{role, content}], completion, input_ids, "
                "loss_mask, logprobs, versions, temperatures, turn_ends, rewards, reward, "
                "metadata (a JSON object as a string). Loads with datasets.load_dataset('json' "
                "| 'parquet', data_files=...); uploads back as a dataset (POST /api/v1/datasets/).",
            ),
            (200, CONTENT_TYPES["parquet"]): OpenApiResponse(response=OpenApiTypes.BINARY),
        },
        summary="Export a run's trajectories (JSON lines or Parquet), oldest session first",
        operation_id="runs_trajectories_export_file",
    )
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        fmt = _format_param(request)
        rows = export_rows(run=run, status=_status_param(request))
        chunks = jsonl_chunks(rows) if fmt == "jsonl" else parquet_chunks(rows)
        response = StreamingHttpResponse(streamed(request, chunks), content_type=CONTENT_TYPES[fmt])
        response["Content-Disposition"] = f'attachment; filename="run-{run.id}-trajectories.{fmt}"'
        return response


@extend_schema_view(get=extend_schema(operation_id="runs_trajectories_export_file_slash"))
class TrajectoryExportSlashApi(TrajectoryExportApi):
    """The same export under the slash form of the API's other routes."""


class CheckpointDownloadApi(ProjectAPIView):
    """A checkpoint's exported model folder as a zip, streamed."""

    content_negotiation_class = AnyAccept

    @extend_schema(
        responses={
            (200, "application/zip"): OpenApiResponse(
                response=OpenApiTypes.BINARY,
                description="A zip of the Hugging Face model folder (config.json, weights as "
                "safetensors, tokenizer), a LoRA adapter merged into its base weights; "
                "from_pretrained and SGLang load the unzipped folder.",
            ),
            409: OpenApiResponse(description="Not exported yet: POST .../export/ first."),
        },
        summary="Download a checkpoint as a zipped Hugging Face folder",
    )
    def get(self, request, run_id, checkpoint_id):
        run = run_get(project=self.project, run_id=run_id)
        checkpoint = checkpoint_get(run=run, checkpoint_id=checkpoint_id)
        folder = Path(checkpoint.export_path) if checkpoint.export_path else None
        if checkpoint.export_status != Checkpoint.ExportStatus.DONE or not (
            folder and folder.is_dir()
        ):
            state = {
                Checkpoint.ExportStatus.RUNNING: "its export is still running; try again when "
                "export_status is done",
                Checkpoint.ExportStatus.FAILED: f"its export failed ({checkpoint.export_error}); "
                "POST .../export/ to try again",
            }.get(checkpoint.export_status, "export it first with POST .../export/")
            raise Conflict(
                f"Checkpoint at step {checkpoint.step} has no model folder yet: {state}."
            )
        name = f"run-{run.id}-step{checkpoint.step}"
        response = StreamingHttpResponse(
            streamed(request, zip_folder(folder, name)), content_type="application/zip"
        )
        response["Content-Disposition"] = f'attachment; filename="{name}.zip"'
        return response
