"""REST views over what the gateway recorded: sessions, their turns, and a run's trajectories."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.response import Response

from webapp.api.views import ProjectAPIView
from webapp.gateway.models import Session
from webapp.gateway.selectors import (
    session_get,
    session_interactions,
    session_list,
    trajectories_export,
)
from webapp.runs.selectors import run_get

STATUS_VALUES = [*Session.Status.values, *Session.Trajectory.values]
STATUS_HELP = (
    "A session status (open, ended, expired) or a trajectory state "
    "(pending, ready, claimed, trained, dropped, unrewarded)."
)


def _status_param(request) -> str | None:
    value = request.query_params.get("status") or None
    if value is not None and value not in STATUS_VALUES:
        raise serializers.ValidationError(
            {"status": [f"Must be one of {', '.join(STATUS_VALUES)}."]}
        )
    return value


def _id_param(request, name: str) -> str | None:
    value = request.query_params.get(name) or None
    if value is not None:
        try:
            uuid.UUID(value)
        except ValueError:
            raise serializers.ValidationError({name: ["Must be an id (a UUID)."]}) from None
    return value


class SessionOutput(serializers.Serializer):
    id = serializers.UUIDField()
    agent = serializers.UUIDField(source="agent_id", allow_null=True)
    run = serializers.UUIDField(source="run_id", allow_null=True)
    task_id = serializers.CharField()
    metadata = serializers.DictField()
    status = serializers.CharField(help_text="open, ended or expired.")
    trajectory = serializers.CharField(
        help_text="pending, ready, claimed, trained, dropped or unrewarded."
    )
    one_turn = serializers.BooleanField(help_text="A completion made with a project key.")
    interaction_count = serializers.IntegerField()
    reward = serializers.FloatField(
        source="reward_total", allow_null=True, help_text="Sum of the turns' rewards."
    )
    admitted_version = serializers.IntegerField()
    trained_version = serializers.IntegerField(allow_null=True)
    hint = serializers.CharField(
        allow_blank=True,
        help_text="A correction in words (set_reward's hint, a feedback comment, a judge's "
        "critique) a self-distilling run's teacher reads in context.",
    )
    created_at = serializers.DateTimeField()
    last_activity_at = serializers.DateTimeField()
    ended_at = serializers.DateTimeField(allow_null=True)


class ChoiceOutput(serializers.Serializer):
    output_ids = serializers.ListField(child=serializers.IntegerField())
    logprobs = serializers.ListField(child=serializers.FloatField())
    versions = serializers.ListField(
        child=serializers.IntegerField(), help_text="Policy version of each output token."
    )
    finish_reason = serializers.CharField(allow_null=True)
    text = serializers.CharField(allow_blank=True)
    aborted = serializers.BooleanField(
        default=False, help_text="The client went away mid-stream: kept, never trained."
    )


class InteractionOutput(serializers.Serializer):
    id = serializers.CharField(help_text="The completion's id (chatcmpl-...).")
    turn = serializers.IntegerField()
    role = serializers.CharField(
        allow_blank=True, help_text="A multi-agent run's role that answered; empty otherwise."
    )
    messages = serializers.ListField(
        child=serializers.DictField(), help_text="The messages as the agent sent them."
    )
    tools = serializers.ListField(child=serializers.DictField(), allow_null=True)
    sampling = serializers.DictField()
    input_ids = serializers.ListField(
        child=serializers.IntegerField(), help_text="The whole prompt as token ids."
    )
    choices = ChoiceOutput(source="outputs", many=True)
    chosen = serializers.IntegerField(help_text="The choice the conversation continued with.")
    response = serializers.DictField(help_text="The ChatCompletion the agent received.")
    reward = serializers.FloatField(allow_null=True)
    rewarded_at = serializers.DateTimeField(allow_null=True)
    prefix_reused = serializers.BooleanField(
        help_text="The prompt extended the previous turn's exact tokens."
    )
    latency_ms = serializers.FloatField()
    aborted = serializers.BooleanField(
        help_text="The client went away mid-stream: the turn is kept and never trained."
    )
    created_at = serializers.DateTimeField()


class SessionDetailOutput(SessionOutput):
    hint_signal = serializers.DictField(
        allow_null=True,
        help_text="What the hint did: {hint, trajectories: [{tokens, signal}]}, the teacher's "
        "minus the student's logprob of each trained token.",
    )
    interactions = InteractionOutput(source="turns", many=True)


class SessionListApi(ProjectAPIView):
    """Sessions (episodes) of the project; filter by agent, run, status or trajectory state."""

    @extend_schema(
        parameters=[
            OpenApiParameter("agent", str, description="Only this agent's sessions."),
            OpenApiParameter("run", str, description="Only this run's sessions."),
            OpenApiParameter("status", str, enum=STATUS_VALUES, description=STATUS_HELP),
            OpenApiParameter("role", str, description="Only sessions with a turn of this role."),
        ],
        responses=SessionOutput(many=True),
        summary="List sessions, newest first",
    )
    def get(self, request):
        sessions = session_list(
            project=self.project,
            agent_id=_id_param(request, "agent"),
            run_id=_id_param(request, "run"),
            status=_status_param(request),
            role=request.query_params.get("role") or None,
        )
        return self.paginate(sessions, SessionOutput)


class SessionDetailApi(ProjectAPIView):
    """One session: each turn's messages, prompt token ids, and per choice the output ids,
    logprobs and the policy version of every token."""

    @extend_schema(responses=SessionDetailOutput, summary="A session with every turn, token-exact")
    def get(self, request, session_id):
        session = session_get(project=self.project, session_id=session_id)
        session.turns = session_interactions(session=session)
        return Response(SessionDetailOutput(session).data)


class AnyAccept(BaseContentNegotiation):
    """The export answers JSON lines whatever ``Accept`` says, and its errors in JSON."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class RunTrajectoriesExportApi(ProjectAPIView):
    """Every trajectory of the run, for offline training or analysis, streamed as it is read."""

    content_negotiation_class = AnyAccept

    @extend_schema(
        parameters=[OpenApiParameter("status", str, enum=STATUS_VALUES, description=STATUS_HELP)],
        responses={
            (200, "application/x-ndjson"): OpenApiResponse(
                response=OpenApiTypes.STR,
                description=(
                    "One JSON object per line: a trajectory (input_ids, loss_mask, logprobs, "
                    "versions, rewards, group_id, session_id, turn_ends, metadata) plus "
                    "agent_id, task_id, status and trajectory. Drop those four keys to load "
                    "a line with rl_core.types.Trajectory.from_dict."
                ),
            )
        },
        summary="Stream a run's trajectories as JSON lines, oldest session first",
        operation_id="runs_trajectories_export",
    )
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        rows = trajectories_export(run=run, status=_status_param(request))
        lines = (json.dumps(row) + "\n" for row in rows)
        response = StreamingHttpResponse(
            _served(request, lines), content_type="application/x-ndjson"
        )
        response["Content-Disposition"] = f'attachment; filename="run-{run.id}-trajectories.jsonl"'
        return response


def _served(request, lines: Iterator[str]) -> Iterator[str] | AsyncIterator[str]:
    """Under ASGI Django would read a sync iterator whole before sending; pull it in batches."""
    if not isinstance(request._request, ASGIRequest):
        return lines
    # One thread for every batch: the queryset's cursor lives on its connection.
    next_batch = sync_to_async(lambda: list(itertools.islice(lines, 200)), thread_sensitive=True)

    async def batches():
        while batch := await next_batch():
            yield "".join(batch)

    return batches()
