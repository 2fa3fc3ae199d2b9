"""REST: evaluate a run's base model or checkpoints, follow the progress, browse the results."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from webapp.api.errors import Conflict
from webapp.api.views import ProjectAPIView
from webapp.datasets.selectors import dataset_get
from webapp.evals.models import Eval
from webapp.evals.selectors import eval_examples, eval_get, eval_list
from webapp.evals.services import EvalRefused, eval_request
from webapp.runs.models import Checkpoint
from webapp.runs.selectors import run_get

ORDERS = ("index", "worst", "best")
MAX_K = 64


class EvalCreateInput(serializers.Serializer):
    base_model = serializers.BooleanField(
        default=False, help_text="Evaluate the run's base model (the step-0 baseline)."
    )
    checkpoints = serializers.ListField(
        child=serializers.IntegerField(min_value=1),
        default=list,
        max_length=50,
        help_text="Ids of the run's checkpoints to evaluate (see its checkpoints/); one eval each.",
    )
    dataset = serializers.UUIDField(
        required=False, help_text="A dataset of the project; default: the run's."
    )
    split = serializers.ChoiceField(
        choices=Eval.Split.values,
        required=False,
        help_text="held_out: the rows the run's eval_fraction keeps out of training (the "
        "default when it has some); all: every row of the dataset.",
    )
    k = serializers.IntegerField(
        min_value=1,
        max_value=MAX_K,
        required=False,
        help_text="Answers per example; default eval_k.",
    )
    max_examples = serializers.IntegerField(
        min_value=0, required=False, help_text="Score at most this many rows (0 or absent: all)."
    )

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({key: [f"Unknown field '{key}'."] for key in unknown})
        return attrs


class EvalOutput(serializers.Serializer):
    id = serializers.UUIDField()
    run = serializers.UUIDField(source="run_id")
    model = serializers.CharField(source="model_label", help_text="'base model' or 'step N'.")
    checkpoint = serializers.IntegerField(source="checkpoint_id", allow_null=True)
    step = serializers.IntegerField(
        help_text="The checkpoint's training step; 0 for the base model."
    )
    dataset = serializers.UUIDField(source="dataset_id")
    split = serializers.ChoiceField(choices=Eval.Split.values)
    scheduled = serializers.BooleanField(help_text="Started by the run's eval_every.")
    k = serializers.IntegerField()
    pass_threshold = serializers.FloatField(help_text="A sample passes when its reward is ≥ this.")
    temperature = serializers.FloatField(help_text="Sampling temperature (the run's); 0: greedy.")
    top_p = serializers.FloatField(help_text="Nucleus sampling mass (the run's); 1: none.")
    status = serializers.CharField(help_text="queued → running → done | failed.")
    progress_done = serializers.IntegerField(help_text="Examples scored so far.")
    progress_total = serializers.IntegerField(help_text="Examples to score (known once running).")
    error = serializers.CharField(help_text="When failed: why.")
    examples = serializers.IntegerField()
    mean_reward = serializers.FloatField(allow_null=True, help_text="Mean over examples.")
    mean_reward_ci = serializers.SerializerMethodField(
        help_text="95% percentile-bootstrap interval over examples [low, high]."
    )
    pass_at_k = serializers.FloatField(allow_null=True, help_text="Unbiased pass@k (Chen et al.).")
    pass_at_k_ci = serializers.SerializerMethodField(
        help_text="95% percentile-bootstrap interval over examples [low, high]."
    )
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)

    def get_mean_reward_ci(self, evaluation) -> list[float] | None:
        if evaluation.mean_reward_low is None:
            return None
        return [evaluation.mean_reward_low, evaluation.mean_reward_high]

    def get_pass_at_k_ci(self, evaluation) -> list[float] | None:
        if evaluation.pass_at_k_low is None:
            return None
        return [evaluation.pass_at_k_low, evaluation.pass_at_k_high]


class EvalExampleOutput(serializers.Serializer):
    index = serializers.IntegerField()
    messages = serializers.ListField(child=serializers.DictField(), help_text="The prompt.")
    answer = serializers.JSONField(allow_null=True, help_text="The row's reference answer.")
    completions = serializers.ListField(child=serializers.CharField(allow_blank=True))
    rewards = serializers.ListField(child=serializers.FloatField())
    errors = serializers.ListField(
        child=serializers.CharField(allow_null=True),
        help_text="A reward function's error per sample.",
    )
    mean_reward = serializers.FloatField()
    pass_at_k = serializers.FloatField()


class EvalListApi(ProjectAPIView):
    @extend_schema(responses=EvalOutput(many=True), summary="A run's evals, newest first")
    def get(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        return self.paginate(eval_list(run=run), EvalOutput)

    @extend_schema(
        request=EvalCreateInput,
        responses={201: EvalOutput(many=True)},
        summary="Evaluate the base model and/or checkpoints with the run's reward",
        description="One eval per model, run by a worker in a low-priority process of its own "
        "(training is never paused). Poll an eval until status is done: mean reward and "
        "pass@k with 95% bootstrap intervals; per-example results at examples/.",
    )
    def post(self, request, run_id):
        run = run_get(project=self.project, run_id=run_id)
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"non_field_errors": ["Expected a JSON object."]})
        data = EvalCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        checkpoints = []
        for checkpoint_id in values["checkpoints"]:
            checkpoint = Checkpoint.objects.filter(run=run, pk=checkpoint_id).first()
            if checkpoint is None:
                raise serializers.ValidationError(
                    {"checkpoints": [f"Checkpoint {checkpoint_id} not found in this run."]}
                )
            checkpoints.append(checkpoint)
        dataset = None
        if values.get("dataset"):
            try:
                dataset = dataset_get(project=self.project, dataset_id=values["dataset"])
            except Http404:
                raise serializers.ValidationError(
                    {"dataset": ["Dataset not found in this project."]}
                ) from None
        try:
            evals = eval_request(
                run=run,
                checkpoints=checkpoints,
                base=values["base_model"],
                dataset=dataset,
                split=values.get("split"),
                k=values.get("k"),
                max_examples=values.get("max_examples"),
            )
        except EvalRefused as exc:
            raise Conflict(str(exc)) from None
        return Response(EvalOutput(evals, many=True).data, status=status.HTTP_201_CREATED)


class EvalDetailApi(ProjectAPIView):
    @extend_schema(responses=EvalOutput, summary="An eval: its progress, then its scores")
    def get(self, request, run_id, eval_id):
        run = run_get(project=self.project, run_id=run_id)
        return Response(EvalOutput(eval_get(run=run, eval_id=eval_id)).data)


class EvalExamplesApi(ProjectAPIView):
    @extend_schema(
        parameters=[
            OpenApiParameter(
                "order", str, enum=list(ORDERS), description="index (default), worst or best first."
            )
        ],
        responses=EvalExampleOutput(many=True),
        summary="An eval's per-example results: the k answers and their rewards",
    )
    def get(self, request, run_id, eval_id):
        run = run_get(project=self.project, run_id=run_id)
        evaluation = eval_get(run=run, eval_id=eval_id)
        order = request.query_params.get("order") or "index"
        if order not in ORDERS:
            raise serializers.ValidationError({"order": [f"Must be one of {', '.join(ORDERS)}."]})
        return self.paginate(eval_examples(evaluation=evaluation, order=order), EvalExampleOutput)
