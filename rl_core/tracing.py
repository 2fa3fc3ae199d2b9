"""OpenTelemetry traces of Steep's two loops: an agent's turn in the gateway and a training step.

Off by default. A process turns them on at start (``setup``: the web server in
``webapp/asgi.py``, a run's job in ``workers/ray_job.py``) when its environment asks, read as
the OpenTelemetry SDK reads it:

- ``OTEL_SDK_DISABLED=true`` keeps them off, whatever else is set;
- else they are on when ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``
  (``otlp``, ``console``), or, with it unset, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (the SDK's default exporter is OTLP, but a
  process that sets nothing should not try to reach ``localhost:4318``).

The exporter (OTLP over HTTP/protobuf, or gRPC when ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` and
its package is there), the batch processor, the sampler and the resource then read the rest of
``OTEL_*`` themselves (endpoint, headers, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``). The packages are the ``tracing`` extra; without them
a request for traces logs one warning and Steep runs untraced.

Why a module-level ``ON`` and explicit spans: the gateway's turn is its hot path (thousands a
second per process, docs/benchmarks.md), so with tracing off a call site costs one boolean test
(``trace = ... if tracing.ON else None``, then ``if trace is not None: ...``): no tracer lookup,
no context manager, nothing allocated. And a turn's phases do not nest as ``with`` blocks: a
stream's engine call and record end in the task that sends the stream, after the turn's
function returned, so a ``Trace`` begins and ends its spans explicitly, each phase a child of
the trace's root. A trace the sampler drops is not made at all (``start`` returns None).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

Attributes = Mapping[str, Any]

ON = False  # read by every call site: the one thing a turn pays for with tracing off
_tracer: Any = None
_api: Any = None  # the ``opentelemetry.trace`` module, once tracing is on
_EXPORTERS = ("otlp", "otlp_proto_http", "otlp_proto_grpc", "console")


def requested(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces (the rule in the module's docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip():
        return bool(_exporter_names(environ))
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    value = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not value:
        return ["otlp"]  # the SDK's default
    return [name.strip() for name in value.split(",") if name.strip() not in ("", "none")]


def setup(service_name: str, attributes: Attributes | None = None) -> bool:
    """Turn traces on when the environment asks (see the module's docstring); True if it did.

    ``service_name``: the ``service.name`` unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``) says otherwise; ``attributes``: more resource attributes. A
    process already traced by ``opentelemetry-instrument`` keeps that provider and exporters.
    """
    if not requested(os.environ):
        return False
    try:
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning(
            "OTEL_* asks for traces but OpenTelemetry's SDK is not installed: running untraced "
            "(install Steep's tracing extra: pip install 'steep[tracing]')."
        )
        return False
    current = api.get_tracer_provider()
    if isinstance(current, TracerProvider):
        use(current)
        return True
    exporters = [e for e in map(_exporter, _exporter_names(os.environ)) if e is not None]
    if not exporters:
        return False
    resource = Resource.create(dict(attributes or {}))
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    api.set_tracer_provider(provider)  # other instrumentation's spans join the same traces
    use(provider)
    name = resource.attributes.get("service.name")
    logger.info("traces on: %s, as %s", ", ".join(_exporter_names(os.environ)), name)
    return True


def _exporter(name: str) -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        if name == "otlp_proto_grpc" or (name == "otlp" and protocol == "grpc"):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()
        if name in ("otlp", "otlp_proto_http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
    except ImportError as exc:
        logger.warning(
            "traces: exporter %r is not installed (%s); not exporting with it", name, exc
        )
        return None
    logger.warning("traces: unknown OTEL_TRACES_EXPORTER %r (known: %s)", name, _EXPORTERS)
    return None


def use(provider: Any) -> None:
    """Trace with ``provider`` (an OpenTelemetry ``TracerProvider``; the tests give one with an
    in-memory exporter), or, with None, stop tracing."""
    global ON, _tracer, _api
    if provider is None:
        ON, _tracer = False, None
        return
    from opentelemetry import trace as api

    _api, _tracer, ON = api, provider.get_tracer("steep"), True


def _clean(attributes: Attributes) -> dict[str, Any]:
    return {name: value for name, value in attributes.items() if value is not None}


def _close(span: Any, attributes: Attributes | None, error: BaseException | str | None) -> None:
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        if isinstance(error, BaseException):
            span.record_exception(error)
            span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(_api.Status(_api.StatusCode.ERROR, str(error)))
    span.end()


def start(
    name: str, common: Attributes, attributes: Attributes | None = None, *, kind: str = "INTERNAL"
) -> Trace | None:
    """A new trace (call only when ``ON``), or None when the sampler drops it
    (``OTEL_TRACES_SAMPLER``): the caller then goes the way it goes with traces off, having paid
    for the root span's sampling only."""
    trace = Trace(name, common, attributes, kind=kind)
    return trace if trace.recording else None


class Trace:
    """One trace: a root span and its phases, each a child span of the root, one open at a time.

    Made by ``start``. ``common`` attributes (the gateway's request id) go on every
    span. ``begin`` ends the open phase and opens the next; ``end`` ends it; ``finish`` ends the
    open phase and the root. ``ends_later`` is set by whoever takes over finishing it (a
    stream), so that the code that began it does not.
    """

    __slots__ = (
        "root",
        "common",
        "ends_later",
        "recording",
        "_context",
        "_phase",
        "_phase_started",
    )

    def __init__(
        self,
        name: str,
        common: Attributes,
        attributes: Attributes | None = None,
        *,
        kind: str = "INTERNAL",
    ) -> None:
        self.common = _clean(common)
        self.root = _tracer.start_span(
            name,
            kind=getattr(_api.SpanKind, kind),
            attributes={**self.common, **_clean(attributes or {})},
        )
        self.recording = self.root.is_recording()  # False: the sampler dropped it
        self._context = _api.set_span_in_context(self.root)
        self._phase: Any = None
        self._phase_started = 0.0
        self.ends_later = False

    def begin(self, name: str, attributes: Attributes | None = None, *, kind: str = "INTERNAL"):
        """End the open phase, if any, and open phase ``name``."""
        self.end()
        self._phase_started = time.perf_counter()
        self._phase = _tracer.start_span(
            name,
            context=self._context,
            kind=getattr(_api.SpanKind, kind),
            attributes={**self.common, **_clean(attributes or {})},
        )

    def end(
        self, attributes: Attributes | None = None, error: BaseException | str | None = None
    ) -> None:
        """End the open phase, if any, with ``attributes`` added (and ``error`` as its status)."""
        span, self._phase = self._phase, None
        if span is not None:
            _close(span, attributes, error)

    def set(self, attributes: Attributes) -> None:
        """Add ``attributes`` to the open phase."""
        if self._phase is not None:
            self._phase.set_attributes(_clean(attributes))

    def elapsed(self) -> float:
        """Seconds since the open phase began."""
        return time.perf_counter() - self._phase_started

    def note(self, attributes: Attributes) -> None:
        """Add ``attributes`` to the root."""
        self.root.set_attributes(_clean(attributes))

    def finish(
        self, attributes: Attributes | None = None, error: BaseException | str | None = None
    ) -> None:
        """End the open phase and the root (with ``attributes`` and ``error``); then the trace
        is exported."""
        self.end(error=error)
        _close(self.root, attributes, error)
