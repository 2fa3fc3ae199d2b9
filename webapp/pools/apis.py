"""``/api/v1/pools/``: shared inference pools, for Steep's operators (staff users) only.

A logged-in staff user (session) may list, create, scale, start and stop pools. Anyone
else is refused: a project key or a non-staff member gets 403 on the collection and 404
on a pool (a pool's servers and the runs on it are no project's business, and a 404
does not confirm that a name exists).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, permissions, serializers, status
from rest_framework.response import Response

from webapp.api.errors import Conflict
from webapp.api.views import ProjectAPIView
from webapp.pools import selectors, services
from webapp.pools.models import Pool


def _is_staff(request) -> bool:
    user = request.user
    return bool(user and user.is_authenticated and getattr(user, "is_staff", False))


# The OpenAPI schema names this enum by it (SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]).
POOL_STATUSES = Pool.Status.values


class IsStaff(permissions.BasePermission):
    """Staff users only: 403 on the collection, 404 on a pool for anyone else."""

    def has_permission(self, request, view):
        if _is_staff(request):
            return True
        if not (request.user and request.user.is_authenticated):
            raise exceptions.NotAuthenticated(
                "Log in as a staff user: pools are managed by Steep's operators."
            )
        if "name" in view.kwargs:
            raise exceptions.NotFound()
        raise exceptions.PermissionDenied(
            "Pools are managed by Steep's operators (staff users); a project key or a "
            "project member cannot list or create them."
        )


class StaffAPIView(ProjectAPIView):
    permission_classes = [IsStaff]

    def pool(self, name: str) -> Pool:
        pool = selectors.pool_get(name=name)
        if pool is None:
            raise exceptions.NotFound(f"No inference pool is named '{name}'.")
        return pool


class PoolInput(serializers.Serializer):
    name = serializers.CharField(max_length=63, help_text="Unique; lowercase, digits and dashes.")
    base_model = serializers.CharField(max_length=500)
    backend = serializers.ChoiceField(choices=Pool.Backend.values, default=Pool.Backend.AUTO)
    replicas = serializers.IntegerField(default=1, min_value=0, max_value=services.MAX_REPLICAS)
    tensor_parallel = serializers.IntegerField(
        default=1, min_value=1, help_text="GPUs per server (SGLang and vLLM on GPUs); 1 on CPUs."
    )
    max_lora_rank = serializers.IntegerField(default=64, min_value=1)
    lora_target_modules = serializers.ListField(
        child=serializers.CharField(), default=list, allow_empty=True
    )
    max_loaded_adapters = serializers.IntegerField(default=8, min_value=1)
    max_sessions_per_run = serializers.IntegerField(default=0, min_value=0)
    max_requests_per_run = serializers.IntegerField(default=0, min_value=0)
    start = serializers.BooleanField(default=True, help_text="Start its servers now.")

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({key: [f"Unknown field '{key}'."] for key in unknown})
        return attrs


class RunWeightsInput(serializers.Serializer):
    run_weights = serializers.DictField(
        child=serializers.FloatField(min_value=1e-6),
        help_text="Run id → weight in the servers' fair share of the batch; runs not named weigh 1.",
    )


class ScaleInput(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=0, max_value=services.MAX_REPLICAS)


class PoolOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    base_model = serializers.CharField()
    backend = serializers.CharField()
    replicas = serializers.IntegerField(help_text="Servers wanted.")
    tensor_parallel = serializers.IntegerField(help_text="GPUs per server.")
    status = serializers.ChoiceField(choices=POOL_STATUSES)
    max_lora_rank = serializers.IntegerField()
    lora_target_modules = serializers.ListField(child=serializers.CharField())
    max_loaded_adapters = serializers.IntegerField()
    max_sessions_per_run = serializers.IntegerField()
    max_requests_per_run = serializers.IntegerField()
    run_weights = serializers.DictField(child=serializers.FloatField())
    error = serializers.CharField()
    created_at = serializers.DateTimeField()


class PoolDetailOutput(PoolOutput):
    stats = serializers.SerializerMethodField(
        help_text="servers (URLs up), runs attached (with their current adapter), loaded_adapters."
    )

    def get_stats(self, pool) -> dict:
        return selectors.pool_stats(pool=pool)


def _body(request) -> dict:
    if not isinstance(request.data, dict):
        raise serializers.ValidationError({"non_field_errors": ["Expected a JSON object."]})
    return request.data


class PoolListApi(StaffAPIView):
    @extend_schema(responses=PoolOutput(many=True), summary="List inference pools (staff)")
    def get(self, request):
        return self.paginate(selectors.pool_list(), PoolOutput)

    @extend_schema(
        request=PoolInput, responses={201: PoolDetailOutput}, summary="Create a pool (staff)"
    )
    def post(self, request):
        data = PoolInput(data=_body(request))
        data.is_valid(raise_exception=True)
        try:
            pool = services.pool_create(**data.validated_data)
        except services.PoolInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(PoolDetailOutput(pool).data, status=status.HTTP_201_CREATED)


class PoolDetailApi(StaffAPIView):
    @extend_schema(responses=PoolDetailOutput, summary="A pool, its servers and attached runs")
    def get(self, request, name):
        return Response(PoolDetailOutput(self.pool(name)).data)


class PoolScaleApi(StaffAPIView):
    @extend_schema(
        request=ScaleInput, responses={202: PoolDetailOutput}, summary="Scale a pool (staff)"
    )
    def post(self, request, name):
        pool = self.pool(name)
        data = ScaleInput(data=_body(request))
        data.is_valid(raise_exception=True)
        pool = services.pool_scale(pool=pool, replicas=data.validated_data["replicas"])
        return Response(PoolDetailOutput(pool).data, status=status.HTTP_202_ACCEPTED)


class PoolRunWeightsApi(StaffAPIView):
    @extend_schema(
        request=RunWeightsInput,
        responses={200: PoolDetailOutput},
        summary="Set attached runs' fair-share weights (staff)",
    )
    def post(self, request, name):
        pool = self.pool(name)
        data = RunWeightsInput(data=_body(request))
        data.is_valid(raise_exception=True)
        try:
            pool = services.pool_set_run_weights(
                pool=pool, run_weights=data.validated_data["run_weights"]
            )
        except services.PoolInvalid as exc:
            raise serializers.ValidationError(exc.errors) from None
        return Response(PoolDetailOutput(pool).data)


class PoolStartApi(StaffAPIView):
    @extend_schema(request=None, responses={202: PoolDetailOutput}, summary="Start a pool")
    def post(self, request, name):
        try:
            pool = services.pool_start(pool=self.pool(name))
        except services.IllegalPoolTransition as exc:
            raise Conflict(str(exc)) from None
        return Response(PoolDetailOutput(pool).data, status=status.HTTP_202_ACCEPTED)


class PoolStopApi(StaffAPIView):
    @extend_schema(request=None, responses={202: PoolDetailOutput}, summary="Stop a pool")
    def post(self, request, name):
        try:
            pool = services.pool_stop(pool=self.pool(name))
        except services.IllegalPoolTransition as exc:
            raise Conflict(str(exc)) from None
        return Response(PoolDetailOutput(pool).data, status=status.HTTP_202_ACCEPTED)
