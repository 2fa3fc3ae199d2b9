"""Shared bits of the REST views."""

from __future__ import annotations

from rest_framework.views import APIView

from webapp.api.pagination import Pagination


class ProjectAPIView(APIView):
    """A view scoped to ``request.project`` (set by authentication/permission).

    Its GET lists are paged (``paginate``); ``pagination_class`` also tells the OpenAPI schema
    so (``webapp.api.schema``). A view whose GET list is whole sets it to None.
    """

    pagination_class: type[Pagination] | None = Pagination

    @property
    def project(self):
        return self.request.project

    def paginate(self, queryset, serializer_class):
        if self.pagination_class is None:
            raise TypeError(f"{type(self).__name__} answers whole lists (pagination_class None).")
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(queryset, self.request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)
