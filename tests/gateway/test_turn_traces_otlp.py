"""Traces as an operator turns them on: a uvicorn web server started with
``OTEL_EXPORTER_OTLP_ENDPOINT`` (and nothing else of OpenTelemetry) sends each turn's spans
over OTLP/HTTP to a collector, here a local HTTP server that decodes them with OpenTelemetry's
own protobuf classes."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env
from tests.local_http import serving

pytestmark = pytest.mark.django_db(transaction=True)


class Collector:
    """What an OTLP/HTTP collector received: resource attributes and spans, by span name."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []  # (resource attributes, span)
        self.paths: set[str] = set()
        self.changed = threading.Condition()

    def handler(self) -> type:
        collector = self

        class Receive(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                export = ExportTraceServiceRequest.FromString(body)
                with collector.changed:
                    collector.paths.add(self.path)
                    for resource_spans in export.resource_spans:
                        resource = {
                            a.key: a.value.string_value for a in resource_spans.resource.attributes
                        }
                        for scope in resource_spans.scope_spans:
                            collector.spans += [(resource, span) for span in scope.spans]
                    collector.changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        return Receive

    def wait_for(self, request_id: str, count: int, timeout: float = 60) -> list:
        """The spans carrying ``request_id``, once ``count`` of them arrived."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = [
                    (resource, span)
                    for resource, span in self.spans
                    if any(
                        a.key == "steep.request_id" and a.value.string_value == request_id
                        for a in span.attributes
                    )
                ]
                left = deadline - time.monotonic()
                if len(found) >= count or left <= 0:
                    return found
                self.changed.wait(left)


def test_a_web_server_started_with_an_otlp_endpoint_exports_each_turns_trace(
    make_gateway, project, api_key, tmp_path
):
    from django.conf import settings

    gw = make_gateway(project, api_key)
    collector = Collector()
    with serving(collector.handler()) as endpoint:
        env = steep_env(
            data_dir=settings.DATA_DIR,
            database_url=test_database_url(),
            redis_url=settings.REDIS_URL,
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",  # export within 0.1 s rather than 5
        )
        port = free_port()
        server = f"http://127.0.0.1:{port}"
        with LiveStack(env=env, log_dir=tmp_path) as processes:
            web = processes.start_web(port, name="uvicorn-otlp")
            probe = f"{server}/agents/{gw.agent.id}/v1/models"
            processes.wait_ready(web, lambda: answers(probe, 401), what="uvicorn")
            from openai import OpenAI

            client = OpenAI(
                base_url=f"{server}/agents/{gw.agent.id}/v1", api_key=api_key, max_retries=0
            )
            completion = client.chat.completions.create(
                model=gw.model,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                extra_headers={"X-Request-ID": "otlp-turn"},
            )
            client.close()
            found = collector.wait_for("otlp-turn", count=5)

    assert collector.paths == {"/v1/traces"}  # the SDK's path under OTLP_ENDPOINT
    names = [span.name for _, span in sorted(found, key=lambda pair: pair[1].start_time_unix_nano)]
    assert names == [
        "steep.turn",
        "steep.turn.admit",
        "steep.turn.render",
        "steep.turn.engine",
        "steep.turn.record",
    ]
    assert {resource["service.name"] for resource, _ in found} == {"steep-web"}
    assert len({span.trace_id for _, span in found}) == 1
    root = next(span for _, span in found if span.name == "steep.turn")
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.response.id"].string_value == completion.id
    assert attributes["gen_ai.usage.output_tokens"].int_value == completion.usage.completion_tokens
