"""Serializer fields that pass values through untouched, typed for the OpenAPI schema.

Run settings are validated by ``rl_core.config.RunConfig`` alone, so the serializer
must not coerce ("4" → 4) or pre-validate them with rules of its own.
"""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers


@extend_schema_field(OpenApiTypes.INT)
class RawInt(serializers.JSONField):
    pass


@extend_schema_field(OpenApiTypes.NUMBER)
class RawFloat(serializers.JSONField):
    pass


@extend_schema_field(OpenApiTypes.BOOL)
class RawBool(serializers.JSONField):
    pass


@extend_schema_field(OpenApiTypes.STR)
class RawStr(serializers.JSONField):
    pass


@extend_schema_field(OpenApiTypes.OBJECT)
class RawObject(serializers.JSONField):
    pass


@extend_schema_field({"type": "array", "items": {"type": "string"}})
class RawStrList(serializers.JSONField):
    pass


RAW_FIELDS = {
    "int": RawInt,
    "float": RawFloat,
    "bool": RawBool,
    "str": RawStr,
    "dict": RawObject,
    "list": RawStrList,
}
