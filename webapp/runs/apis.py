from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from rl_core.config import ConfigError, RunConfig
from webapp.api.errors import Conflict
from webapp.api.fields import RAW_FIELDS
from webapp.api.views import ProjectAPIView
from webapp.datasets.selectors import dataset_get
from webapp.rewards.secrets import redact_config
from webapp.runs.ledger import run_ledger
from webapp.runs.models import Checkpoint, Run
from webapp.runs.selectors import (
    checkpoint_for_step,
    checkpoint_get,
    checkpoint_list,
    known_models,
    metric_list,
    run_event_list,
    run_get,
    run_list,
)
from webapp.runs.services import (
    ExportRefused,
    IllegalTransition,
    RunInvalid,
    checkpoint_export_request,
    run_clone,
    run_create,
    run_delete,
    run_start,
    run_stop,
)

CONFIG_FIELDS = [f.name for f in RunConfig.field_specs()]


def _config_field(spec):
    kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
    raw = RAW_FIELDS[kind.replace(" | None", "").strip()]
    return raw(required=bool(spec.metadata.get("required")), help_text=spec.metadata["help"])


def _refuse_unknown_fields(serializer: serializers.Serializer) -> None:
    """A 400 naming each field of the body that ``serializer`` does not have (a typo in a
    setting's name must not be ignored silently)."""
    unknown = sorted(set(serializer.initial_data) - set(serializer.fields))
    if unknown:
        raise serializers.ValidationError({key: [f"Unknown field '{key}'."] for key in unknown})


# The OpenAPI schema names this enum by it (SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]).
RUN_STATUSES = Run.Status.values


class RunCreateInput(serializers.Serializer):
    """``name``, optional ``dataset`` id, and any ``RunConfig`` setting as a top-level field."""

    name = serializers.CharField(max_length=200)
    dataset = serializers.CharField(
        required=False, allow_null=True, help_text="Dataset id (required in dataset mode)."
    )

    def get_fields(self):
        fields = super().get_fields()
        fields.update({spec.name: _config_field(spec) for spec in RunConfig.field_specs()})
        fields["base_model"].help_text += (
            " GET /api/v1/models/ lists the models this instance offers (the demo model,"
            " the project's, the model directories under STEEP_MODEL_ROOTS); anything else"
            " is refused."
        )
        return fields

    def validate(self, attrs):
        _refuse_unknown_fields(self)
        settings = {name: attrs[name] for name in CONFIG_FIELDS if name in attrs}
        try:
            attrs["config"] = RunConfig.from_dict(settings)
        except ConfigError as exc:
            raise serializers.ValidationError(exc.errors) from None
        return attrs


class RedactedConfigField(serializers.DictField):
    def to_representation(self, value):
        return super().to_representation(redact_config(value))


class RunOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    mode = serializers.CharField()
    base_model = serializers.CharField()
    dataset = serializers.UUIDField(source="dataset_id", allow_null=True)
    status = serializers.ChoiceField(
        choices=RUN_STATUSES,
        help_text="draft → queued → starting → running → stopping → stopped | completed | "
        "failed. queued: waiting for a worker, or for the cluster's resources (queue_reason "
        "says which). interrupted: Steep was stopped cleanly while the run was active; it "
        "resumes from its last checkpoint when Steep starts again.",
    )
    queue_reason = serializers.CharField(
        help_text="Why a queued run waits instead of starting, e.g. 'waiting for 1 GPU for the "
        "trainer: 0 of 1 free; pool shared holds 1'; empty otherwise. It starts by itself when "
        "the cluster has room."
    )
    step = serializers.IntegerField()
    weight_version = serializers.IntegerField()
    error = serializers.CharField()
    config = RedactedConfigField(help_text="The run's settings; a judge's key is never shown.")
    created_at = serializers.DateTimeField()
    queued_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


class RunEventOutput(serializers.Serializer):
    created_at = serializers.DateTimeField()
    kind = serializers.CharField()
    message = serializers.CharField()


class RunDetailOutput(RunOutput):
    events = serializers.SerializerMethodField()

    def get_events(self, run) -> list[dict]:
        return RunEventOutput(run_event_list(run=run)[:50], many=True).data


class RunListApi(ProjectAPIView):
    @extend_schema(
        parameters=[
            OpenApiParameter(
                "status", str, enum=Run.Status.values, description="Only runs in this status."
            )
        ],
        responses=RunOutput(many=True),
        summary="List runs",
    )
    def get(self, request):
        status_filter = request.query_params.get("status")
        if status_filter and status_filter not in Run.Status.values:
            raise serializers.ValidationError(
                {"status": [f"Must be one of {', '.join(Run.Status.values)}."]}
            )
        return self.paginate(run_list(project=self.project, status=status_filter), RunOutput)

    @extend_schema(
        request=RunCreateInput,
        responses={201: RunDetailOutput},
        summary="Create a run (as a draft)",
    )
    def post(self, request):
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Expected a JSON object."]})
        data = RunCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        dataset_id = data.validated_data.get("dataset")
        dataset = None
        if dataset_id:
            try:
                dataset = dataset_get(project=self.project, dataset_id=dataset_id)
            except Http404:
                raise serializers.ValidationError(
                    {"dataset": ["Dataset not found in this project."]}
                ) from None
        try:
            run = run_create(
                project=self.project,
                name=data.validated_data["name"],
                config=data.validated_data["config"],
                dataset=dataset,
            )
        except RunInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(RunDetailOutput(run).data, status=status.HTTP_201_CREATED)


class RunDetailApi(ProjectAPIView):
    @extend_schema(responses=RunDetailOutput, summary="A run with its recent events")
    def get(self, request, run_id):
        return Response(RunDetailOutput(run_get(project=self.project, run_id=run_id)).data)

    @extend_schema(responses={204: None}, summary="Delete a run that is not active")
    def delete(self, request, run_id):
        try:
            run_delete(run=run_get(project=self.project, run_id=run_id))
        except IllegalTransition as exc:
            raise Conflict(f"{exc} Stop it first.") from None
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunStartApi(ProjectAPIView):
    @extend_schema(
        request=None, responses={202: RunDetailOutput}, summary="Start (or resume) a run"
    )
    def post(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        try:
            run = run_start(run=run)
        except IllegalTransition as exc:
            raise Conflict(str(exc)) from None
        return Response(RunDetailOutput(run).data, status=status.HTTP_202_ACCEPTED)


class RunStopApi(ProjectAPIView):
    @extend_schema(request=None, responses={202: RunDetailOutput}, summary="Stop a run")
    def post(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        try:
            run = run_stop(run=run)
        except IllegalTransition as exc:
            raise Conflict(str(exc)) from None
        return Response(RunDetailOutput(run).data, status=status.HTTP_202_ACCEPTED)


class RunCloneInput(serializers.Serializer):
    name = serializers.CharField(
        max_length=200, required=False, help_text="Default: the source's name + ' (again)'."
    )
    from_checkpoint = serializers.IntegerField(
        required=False,
        min_value=0,
        help_text="Start from the weights of the source's checkpoint saved at this step "
        "(see its checkpoints/); default: from where the source started.",
    )
    config = serializers.DictField(
        required=False,
        help_text='Settings that replace the source\'s, e.g. {"max_steps": 200}; '
        "validated like a new run's.",
    )

    def validate(self, attrs):
        _refuse_unknown_fields(self)
        return attrs


class RunCloneApi(ProjectAPIView):
    @extend_schema(
        request=RunCloneInput,
        responses={201: RunDetailOutput},
        summary="Run again: a new draft with this run's dataset and settings",
        description="Any run can be cloned, whatever its status; the source is left as it is. "
        "With from_checkpoint the new run starts from that checkpoint's weights "
        "(its init_checkpoint setting); start it with runs/{id}/start/.",
    )
    def post(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        data = RunCloneInput(data=request.data if request.data else {})
        data.is_valid(raise_exception=True)
        checkpoint = None
        step = data.validated_data.get("from_checkpoint")
        if step is not None:
            checkpoint = checkpoint_for_step(run=run, step=step)
            if checkpoint is None:
                steps = [c.step for c in checkpoint_list(run=run)]
                have = (
                    f"its checkpoints are at steps {', '.join(map(str, sorted(steps)))}"
                    if steps
                    else "it has none"
                )
                raise serializers.ValidationError(
                    {
                        "from_checkpoint": [
                            f"Run '{run.name}' has no checkpoint at step {step}; {have}."
                        ]
                    }
                )
        try:
            clone = run_clone(
                run=run,
                name=data.validated_data.get("name"),
                checkpoint=checkpoint,
                overrides=data.validated_data.get("config"),
            )
        except RunInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(RunDetailOutput(clone).data, status=status.HTTP_201_CREATED)


class MetricOutput(serializers.Serializer):
    step = serializers.IntegerField()
    name = serializers.CharField()
    value = serializers.FloatField()
    created_at = serializers.DateTimeField()


class RunMetricsApi(ProjectAPIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("name", str, description="Only this metric, e.g. rollout/reward."),
            OpenApiParameter("since_step", int, description="Only points after this step."),
        ],
        responses=MetricOutput(many=True),
        summary="A run's metric points, oldest first",
    )
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        since = request.query_params.get("since_step")
        if since is not None:
            try:
                since = int(since)
            except ValueError:
                raise serializers.ValidationError(
                    {"since_step": ["Must be a whole number."]}
                ) from None
        points = metric_list(
            run=run, name=request.query_params.get("name") or None, since_step=since
        )
        return self.paginate(points, MetricOutput)


class CheckpointOutput(serializers.Serializer):
    id = serializers.IntegerField()
    version = serializers.IntegerField()
    step = serializers.IntegerField()
    path = serializers.CharField()
    size_bytes = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    export_status = serializers.ChoiceField(
        choices=Checkpoint.ExportStatus.values,
        help_text="none → running → done | failed (POST .../export/ starts one).",
    )
    export_path = serializers.CharField(
        help_text="When done: the exported model folder (from_pretrained / SGLang --model-path)."
    )
    export_error = serializers.CharField(help_text="When failed: why.")
    export_started_at = serializers.DateTimeField(allow_null=True)
    export_finished_at = serializers.DateTimeField(allow_null=True)


class RunCheckpointsApi(ProjectAPIView):
    @extend_schema(
        responses=CheckpointOutput(many=True), summary="A run's checkpoints, newest first"
    )
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        return self.paginate(checkpoint_list(run=run), CheckpointOutput)


class RunCheckpointDetailApi(ProjectAPIView):
    @extend_schema(responses=CheckpointOutput, summary="A checkpoint, with its export's status")
    def get(self, request, run_id, checkpoint_id):
        run = run_get(project=self.project, run_id=run_id)
        return Response(CheckpointOutput(checkpoint_get(run=run, checkpoint_id=checkpoint_id)).data)


class RunCheckpointExportApi(ProjectAPIView):
    @extend_schema(
        request=None,
        responses={202: CheckpointOutput},
        summary="Export a checkpoint as a standalone model folder",
        description="A worker writes a Hugging Face folder (a LoRA adapter merged into its base "
        "weights; full weights cast to the base model's dtype), loadable by from_pretrained "
        "and SGLang. Poll the checkpoint until export_status is done (export_path) or failed "
        "(export_error). Idempotent: a done export is returned as it is; 409 while one runs.",
    )
    def post(self, request, run_id, checkpoint_id):
        run = run_get(project=self.project, run_id=run_id)
        checkpoint = checkpoint_get(run=run, checkpoint_id=checkpoint_id)
        try:
            checkpoint = checkpoint_export_request(checkpoint=checkpoint)
        except ExportRefused as exc:
            raise Conflict(str(exc)) from None
        return Response(CheckpointOutput(checkpoint).data, status=status.HTTP_202_ACCEPTED)


class KnownModelOutput(serializers.Serializer):
    name = serializers.CharField(help_text="The value to pass as a run's base_model.")
    source = serializers.ChoiceField(
        choices=["demo", "project", "models_dir"],
        help_text="demo: the demo model; project: a run of this project uses it; "
        "models_dir: a model directory under the operator's model roots (STEEP_MODEL_ROOTS, "
        "default DATA_DIR/models).",
    )


class KnownModelsApi(ProjectAPIView):
    pagination_class = None  # a short list, whole

    @extend_schema(
        responses=KnownModelOutput(many=True),
        summary="Models to train: candidates for a run's base_model",
    )
    def get(self, request):
        return Response(KnownModelOutput(known_models(project=self.project), many=True).data)


class LedgerStepOutput(serializers.Serializer):
    step = serializers.IntegerField(help_text="The step (it produced policy version `step`).")
    count = serializers.IntegerField(help_text="Trajectories (sessions) that step trained.")


class LedgerOutput(serializers.Serializer):
    run = serializers.UUIDField()
    version = serializers.IntegerField(help_text="The policy version the run serves now.")
    step = serializers.IntegerField(help_text="The last step of the surviving lineage.")
    accepted = serializers.IntegerField(
        help_text="Trajectories that went to training (sessions neither open nor unrewarded);"
        " equals trained + dropped + pending."
    )
    trained = serializers.IntegerField(
        help_text="Trained in the surviving lineage (what was trained after the checkpoint a"
        " resumed run restarted from is pending again)."
    )
    trained_by_step = LedgerStepOutput(many=True)
    trained_records = serializers.IntegerField(
        help_text="Training records (one per session and step); equals trained when balanced."
    )
    dropped = serializers.IntegerField(help_text="Accepted but not trained, for a reason.")
    dropped_by_reason = serializers.DictField(
        child=serializers.IntegerField(),
        help_text='Dropped trajectories by reason: "stale" (no token within max_staleness).',
    )
    pending = serializers.IntegerField(help_text="ready + claimed: still to be trained.")
    ready = serializers.IntegerField()
    claimed = serializers.IntegerField()
    open = serializers.IntegerField(help_text="Sessions still running (not in accepted).")
    unrewarded = serializers.IntegerField(
        help_text="Sessions ended without a reward: never trained (not in accepted)."
    )
    aborted = serializers.IntegerField(
        help_text="Sessions the client abandoned: expired without a reward (not in accepted)."
    )
    trained_twice = serializers.ListField(
        child=serializers.UUIDField(),
        help_text="Sessions trained more than once in the surviving lineage (should be none).",
    )
    balanced = serializers.BooleanField(
        help_text="accepted == trained + dropped + pending, nothing trained twice, and the"
        " training records agree with the sessions' states."
    )


class RunLedgerApi(ProjectAPIView):
    @extend_schema(
        responses=LedgerOutput,
        summary="Where every trajectory the run accepted went: trained (by step), dropped, pending",
    )
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        return Response(LedgerOutput(run_ledger(run)).data)
