from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from webapp.agents.selectors import agent_get, agent_list
from webapp.agents.services import AgentInvalid, agent_bind_run, agent_create, agent_delete
from webapp.api.views import ProjectAPIView
from webapp.runs.selectors import run_get


class AgentOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    run = serializers.UUIDField(source="run_id", allow_null=True)
    role = serializers.CharField(help_text="Its role in a multi-agent run; empty: none bound.")
    base_url = serializers.CharField()
    created_at = serializers.DateTimeField()


class AgentCreateInput(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    run = serializers.CharField(
        required=False, allow_null=True, help_text="Run id whose policy serves this agent."
    )
    role = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=32,
        help_text="A multi-agent run: the role this agent plays (one of the run's roles); its "
        'requests may also name one with model "policy/<role>".',
    )


class AgentUpdateInput(serializers.Serializer):
    run = serializers.CharField(
        required=False, allow_null=True, help_text="Run id to bind to (null: unbind)."
    )
    role = serializers.CharField(
        required=False, allow_blank=True, max_length=32, help_text="One of the run's roles."
    )


def _project_run(project, run_id):
    """The project's run ``run_id`` (None for none); a 400 naming ``run`` when it has none."""
    if not run_id:
        return None
    try:
        return run_get(project=project, run_id=run_id)
    except Http404:
        raise serializers.ValidationError({"run": ["Run not found in this project."]}) from None


class AgentListApi(ProjectAPIView):
    @extend_schema(responses=AgentOutput(many=True), summary="List agents")
    def get(self, request):
        return self.paginate(
            agent_list(project=self.project, run_id=request.query_params.get("run")), AgentOutput
        )

    @extend_schema(
        request=AgentCreateInput,
        responses={201: AgentOutput},
        summary="Create an agent and get its base_url",
    )
    def post(self, request):
        data = AgentCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        run = _project_run(self.project, data.validated_data.get("run"))
        try:
            agent = agent_create(
                project=self.project,
                name=data.validated_data["name"],
                run=run,
                role=data.validated_data.get("role", ""),
            )
        except AgentInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(AgentOutput(agent).data, status=status.HTTP_201_CREATED)


class AgentDetailApi(ProjectAPIView):
    @extend_schema(responses=AgentOutput, summary="An agent")
    def get(self, request, agent_id):
        return Response(AgentOutput(agent_get(project=self.project, agent_id=agent_id)).data)

    @extend_schema(
        request=AgentUpdateInput, responses=AgentOutput, summary="Rebind an agent's run or role"
    )
    def patch(self, request, agent_id):
        agent = agent_get(project=self.project, agent_id=agent_id)
        data = AgentUpdateInput(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        run = _project_run(self.project, values["run"]) if "run" in values else agent.run
        try:
            agent = agent_bind_run(agent=agent, run=run, role=values.get("role"))
        except AgentInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(AgentOutput(agent).data)

    @extend_schema(responses={204: None}, summary="Delete an agent")
    def delete(self, request, agent_id):
        agent_delete(agent=agent_get(project=self.project, agent_id=agent_id))
        return Response(status=status.HTTP_204_NO_CONTENT)
