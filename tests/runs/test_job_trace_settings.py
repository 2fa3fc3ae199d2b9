"""A run's Ray job exports its training steps' traces where the web app's processes would:
the worker that submits it passes its ``OTEL_*`` settings on, all but the service's name
(the job is ``steep-trainer``, ``workers.ray_job``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from webapp.runs import launching


@pytest.mark.django_db
def test_the_job_gets_the_otel_settings_but_not_the_service_name(monkeypatch, project, make_run):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "steep-web-eu")
    submitted: dict = {}
    monkeypatch.setattr(launching, "steep_cluster", lambda: SimpleNamespace(local=False))
    monkeypatch.setattr(launching, "submit_job", lambda cluster, **job: submitted.update(job))

    launching._submit(make_run(project))

    env = submitted["env"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert "OTEL_SERVICE_NAME" not in env
    assert submitted["entrypoint"][2] == "workers.ray_job"  # which calls tracing.setup
