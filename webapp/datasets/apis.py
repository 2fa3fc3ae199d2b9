from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response

from webapp.api.errors import Conflict, PayloadTooLarge
from webapp.api.views import ProjectAPIView
from webapp.datasets.selectors import dataset_get, dataset_list
from webapp.datasets.services import (
    DatasetInUse,
    DatasetInvalid,
    DatasetNameTaken,
    DatasetTooLarge,
    dataset_create,
    dataset_delete,
)


class DatasetOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    row_count = serializers.IntegerField()
    size_bytes = serializers.IntegerField()
    created_at = serializers.DateTimeField()


class DatasetDetailOutput(DatasetOutput):
    preview = serializers.ListField(child=serializers.DictField())


class DatasetCreateInput(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    file = serializers.FileField(
        help_text='JSONL: one {"prompt"} or {"messages"} object per line, optional "answer" and '
        '"metadata". Or a run\'s trajectory export (JSONL or Parquet, from '
        "runs/{id}/trajectories/export): each trajectory becomes a row, its messages before "
        "the answer, the answer, and every other column in metadata."
    )


class DatasetListApi(ProjectAPIView):
    parser_classes = [MultiPartParser]

    @extend_schema(responses=DatasetOutput(many=True), summary="List datasets")
    def get(self, request):
        return self.paginate(dataset_list(project=self.project), DatasetOutput)

    @extend_schema(
        request={"multipart/form-data": DatasetCreateInput},
        responses={201: DatasetDetailOutput},
        summary="Upload a dataset (JSONL, or a trajectory export as JSONL or Parquet)",
    )
    def post(self, request):
        data = DatasetCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        user = request.user if getattr(request.user, "pk", None) else None
        try:
            dataset = dataset_create(project=self.project, user=user, **data.validated_data)
        except DatasetTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None
        except DatasetNameTaken:
            raise serializers.ValidationError(
                {"name": ["A dataset with this name already exists in the project."]}
            ) from None
        except DatasetInvalid as exc:
            report = exc.report
            messages = [f"line {e['line']}: {e['message']}" for e in report.errors]
            more = report.bad_lines - len(report.errors)
            if more > 0:
                messages.append(f"... and {more} more invalid line(s)")
            raise serializers.ValidationError({"file": messages}) from None
        return Response(DatasetDetailOutput(dataset).data, status=status.HTTP_201_CREATED)


class DatasetDetailApi(ProjectAPIView):
    @extend_schema(
        responses=DatasetDetailOutput, summary="A dataset with a preview of its first rows"
    )
    def get(self, request, dataset_id):
        return Response(
            DatasetDetailOutput(dataset_get(project=self.project, dataset_id=dataset_id)).data
        )

    @extend_schema(responses={204: None}, summary="Delete a dataset")
    def delete(self, request, dataset_id):
        dataset = dataset_get(project=self.project, dataset_id=dataset_id)
        try:
            dataset_delete(dataset=dataset)
        except DatasetInUse as exc:
            raise Conflict(str(exc)) from None
        return Response(status=status.HTTP_204_NO_CONTENT)
