"""The dashboard's evaluations: the run page's section (empty state, the Evaluate form,
progress polled while one runs), an eval's page with its per-example results, the eval
series charted beside the training reward, and the export and download links."""

from __future__ import annotations

import pytest

from webapp.evals.models import Eval, EvalExample
from webapp.runs.models import Checkpoint, MetricPoint

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def world(project, make_dataset, make_run):
    dataset = make_dataset(project, name="letters", rows=[{"prompt": "Say v.", "answer": "v"}] * 4)
    run = make_run(project, name="toy", dataset=dataset, eval_fraction=0.5, eval_every=10)
    return dataset, run


def run_url(run) -> str:
    return f"/projects/{run.project_id}/runs/{run.id}/"


def _eval(run, dataset, **fields):
    values = {"k": 2, "pass_threshold": 1.0, "max_new_tokens": 4, "temperature": 1.0}
    return Eval.objects.create(project=run.project, run=run, dataset=dataset, **values | fields)


def test_run_page_shows_an_empty_state_and_the_evaluate_form(member_client, world):
    _, run = world
    body = member_client.get(run_url(run)).content.decode()
    section = body[body.index('id="run-evals"') :]
    assert "No evaluations yet" in section and "every 10 steps" in section
    assert 'name="model" value="base"' in section
    assert "hx-trigger" not in section[: section.index(">")]  # nothing to poll


def test_the_evaluate_form_queues_evals_that_the_section_polls(
    member_client, world, tmp_path, django_capture_on_commit_callbacks
):
    _, run = world
    (tmp_path / "ckpt").mkdir()
    checkpoint = Checkpoint.objects.create(run=run, version=3, step=3, path=str(tmp_path / "ckpt"))
    with django_capture_on_commit_callbacks(execute=False) as queued:
        response = member_client.post(
            f"{run_url(run)}evals/new/", {"model": ["base", str(checkpoint.id)]}
        )
    assert response.status_code == 302 and response["Location"] == run_url(run)
    assert len(queued) == 1  # one callback queues both evals' tasks, after the commit
    assert sorted(Eval.objects.values_list("step", "status")) == [(0, "queued"), (3, "queued")]
    body = member_client.get(run_url(run)).content.decode()
    section = body[body.index('id="run-evals"') :]
    assert 'hx-trigger="every 3s"' in section[: section.index(">")]
    assert "base model" in section and "step 3" in section
    fragment = member_client.get(f"{run_url(run)}evals/", **HTMX).content.decode()
    assert fragment.startswith('<section id="run-evals"')


def test_the_evaluate_form_refuses_with_the_reason(member_client, world):
    _, run = world
    response = member_client.post(f"{run_url(run)}evals/new/", {"model": ["77"]}, follow=True)
    assert "has no checkpoint 77" in response.content.decode()
    response = member_client.post(f"{run_url(run)}evals/new/", {}, follow=True)
    assert "Name at least one model" in response.content.decode()
    assert not Eval.objects.exists()


def test_a_running_eval_shows_its_progress(member_client, world):
    dataset, run = world
    _eval(run, dataset, status="running", progress_done=3, progress_total=8)
    body = member_client.get(run_url(run)).content.decode()
    assert '<progress max="8" value="3">' in body and "3/8" in body


def test_an_eval_page_lists_examples_worst_first_and_pages(member_client, world):
    dataset, run = world
    evaluation = _eval(
        run, dataset, status="done", examples=30, mean_reward=0.5, mean_reward_low=0.4,
        mean_reward_high=0.6, pass_at_k=0.7, pass_at_k_low=0.6, pass_at_k_high=0.8,
    )  # fmt: skip
    EvalExample.objects.bulk_create(
        EvalExample(
            eval=evaluation,
            index=i,
            messages=[{"role": "user", "content": f"prompt {i}"}],
            answer="v",
            completions=[f"answer {i}", "v"],
            rewards=[i / 30, 1.0],
            mean_reward=(i / 30 + 1) / 2,
            pass_at_k=1.0,
        )  # fmt: skip
        for i in range(30)
    )
    url = f"{run_url(run)}evals/{evaluation.id}/"
    body = member_client.get(url).content.decode()
    assert "0.5000" in body and "[0.4000, 0.6000]" in body and "pass@2" in body
    assert "prompt 0" in body and "prompt 24" in body and "prompt 25" not in body
    assert "page 1 of 2" in body
    worst = member_client.get(url + "?order=best").content.decode()
    assert worst.index("prompt 29") < worst.index("prompt 28")
    assert "prompt 0" not in worst  # on page 2 now
    assert "prompt 29" in member_client.get(url + "?order=bogus&page=2").content.decode()


def test_eval_pages_of_another_project_are_404(outsider_client, world):
    dataset, run = world
    evaluation = _eval(run, dataset)
    assert outsider_client.get(f"{run_url(run)}evals/{evaluation.id}/").status_code == 404
    assert outsider_client.post(f"{run_url(run)}evals/new/", {"model": "base"}).status_code == 404
    assert outsider_client.get(f"{run_url(run)}evals/", **HTMX).status_code == 404
    assert not Eval.objects.exclude(pk=evaluation.pk).exists()


def test_eval_series_lead_the_charts_beside_the_training_reward(member_client, world):
    dataset, run = world
    for step, value in ((1, 0.1), (2, 0.3)):
        MetricPoint.objects.create(run=run, step=step, name="rollout/reward", value=value)
    MetricPoint.objects.create(run=run, step=2, name="eval/mean_reward", value=0.4)
    body = member_client.get(run_url(run)).content.decode()
    headline = body[body.index('class="headline') : body.index('id="latest-values"')]
    assert 'data-metric="rollout/reward"' in headline
    assert 'data-metric="eval/mean_reward"' in headline


def test_an_exported_checkpoint_offers_its_zip(member_client, world, tmp_path):
    _, run = world
    checkpoint = Checkpoint.objects.create(
        run=run, version=1, step=1, path="/x", export_status="done", export_path=str(tmp_path)
    )
    body = member_client.get(run_url(run)).content.decode()
    link = f"/api/v1/runs/{run.id}/checkpoints/{checkpoint.id}/download/?project={run.project_id}"
    assert link in body
    assert member_client.get(link).status_code == 200


def test_the_checkpoint_list_polls_while_an_export_runs(member_client, outsider_client, world):
    _, run = world
    checkpoint = Checkpoint.objects.create(run=run, version=1, step=1, path="/x")
    body = member_client.get(run_url(run)).content.decode()
    section = body[body.index('id="run-checkpoints"') :]
    assert "hx-trigger" not in section[: section.index(">")]
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_status="running")
    body = member_client.get(run_url(run)).content.decode()
    section = body[body.index('id="run-checkpoints"') :]
    assert 'hx-trigger="every 3s"' in section[: section.index(">")]
    assert "exporting…" in section
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_status="done", export_path="/y")
    fragment = member_client.get(f"{run_url(run)}checkpoints/", **HTMX).content.decode()
    assert fragment.startswith('<section id="run-checkpoints"')
    assert "Download (zip)" in fragment and "hx-trigger" not in fragment
    assert outsider_client.get(f"{run_url(run)}checkpoints/", **HTMX).status_code == 404
