from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    """``?page=N&page_size=M``; responses carry count, next and previous links."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
    page_query_description = "The page, from 1. Following `next` is simpler than counting."
    page_size_query_description = (
        f"Items per page: {page_size} by default, at most {max_page_size}."
    )

    # Said in every paged list's description in the OpenAPI schema (webapp.api.schema).
    SCHEMA_NOTE = (
        f"**Paged**: at most {page_size} items a page (`?page_size=` up to {max_page_size}). "
        "The answer is `{count, next, previous, results}`; `next` is the URL of the following "
        "page (null on the last), so a client follows `next` until it is null. "
        "Query parameters: `page` (from 1) and `page_size`."
    )

    def get_paginated_response_schema(self, schema: dict) -> dict:
        page = super().get_paginated_response_schema(schema)
        page["description"] = (
            f"One page of at most {self.page_size} items (`?page_size=` to change)."
        )
        properties = page["properties"]
        properties["next"]["description"] = "The following page's URL; null on the last page."
        properties["next"]["example"] = "http://localhost:8000/api/v1/runs/?page=3"
        properties["previous"]["example"] = "http://localhost:8000/api/v1/runs/?page=1"
        return page
