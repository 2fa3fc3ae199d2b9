"""Shared bits of the REST views."""

from __future__ import annotations

from rest_framework.views import APIView


class ProjectAPIView(APIView):
    """A view scoped to ``request.project`` (set by authentication/permission)."""

    @property
    def project(self):
        return self.request.project

    def paginate(self, queryset, serializer_class):
        paginator = self.pagination_class_instance()
        page = paginator.paginate_queryset(queryset, self.request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)

    def pagination_class_instance(self):
        from webapp.api.pagination import Pagination

        return Pagination()
