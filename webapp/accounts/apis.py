from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from webapp.accounts.selectors import api_key_get, api_key_list
from webapp.accounts.services import api_key_create, api_key_revoke
from webapp.api.views import ProjectAPIView


class ProjectOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    created_at = serializers.DateTimeField()


class ProjectDetailApi(ProjectAPIView):
    @extend_schema(responses=ProjectOutput, summary="The project of the authenticating key")
    def get(self, request):
        return Response(ProjectOutput(self.project).data)


class KeyOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    prefix = serializers.CharField()
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    is_active = serializers.BooleanField()


class KeyCreateInput(serializers.Serializer):
    name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class KeyCreateOutput(KeyOutput):
    key = serializers.CharField(help_text="The plaintext key. Shown only in this response.")


class KeyListApi(ProjectAPIView):
    @extend_schema(
        responses=KeyOutput(many=True), summary="List the project's keys (prefixes only)"
    )
    def get(self, request):
        return self.paginate(api_key_list(project=self.project), KeyOutput)

    @extend_schema(
        request=KeyCreateInput,
        responses={201: KeyCreateOutput},
        summary="Create a key (plaintext shown once)",
    )
    def post(self, request):
        data = KeyCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        user = request.user if getattr(request.user, "pk", None) else None
        key, plaintext = api_key_create(project=self.project, user=user, **data.validated_data)
        body = KeyOutput(key).data | {"key": plaintext}
        return Response(body, status=status.HTTP_201_CREATED)


class KeyRevokeApi(ProjectAPIView):
    @extend_schema(request=None, responses=KeyOutput, summary="Revoke a key")
    def post(self, request, key_id):
        key = api_key_revoke(key=api_key_get(project=self.project, key_id=key_id))
        return Response(KeyOutput(key).data)


class KeyDetailApi(ProjectAPIView):
    @extend_schema(
        request=None, responses=KeyOutput, summary="Revoke a key (the record stays, marked revoked)"
    )
    def delete(self, request, key_id):
        key = api_key_revoke(key=api_key_get(project=self.project, key_id=key_id))
        return Response(KeyOutput(key).data)
