"""Exporting a checkpoint as a standalone model folder: the REST action, its status on the
checkpoint, and the dashboard button. The export itself really runs (``python -m
rl_core.export`` in a subprocess of the eagerly run Celery task) on a LoRA checkpoint of
the tiny model."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.runs.models import Checkpoint, RunEvent

E = Checkpoint.ExportStatus


@pytest.fixture
def eager_tasks(monkeypatch, settings, tmp_path):
    from webapp.runs.tasks import checkpoint_export

    monkeypatch.setitem(checkpoint_export.app.conf, "task_always_eager", True)
    settings.DATA_DIR = tmp_path / "data"


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_model_dir, tmp_path_factory):
    """A LoRA run's checkpoint after one training step, and that trainer."""
    import torch

    from rl_core.config import RunConfig
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            "reward": {"type": "exact_match"},
            "batch_size": 2,
            "group_size": 2,
            "lora_rank": 4,
            "learning_rate": 1e-2,
        }
    )
    trainer = PPOTrainer(cfg, device="cpu")
    gen = torch.Generator().manual_seed(0)
    batch = []
    for i in range(2):
        ids = torch.randint(0, 256, (8,), generator=gen).tolist()
        mask = [0] * 3 + [1] * 5
        batch.append(Trajectory(ids, mask, [0.0] * 8, [0 if m else -1 for m in mask], [float(i)]))
    trainer.train_step(batch)
    path = tmp_path_factory.mktemp("lora-run") / "step_000001"
    trainer.save_checkpoint(path)
    return path, trainer


def _checkpoint(run, path, step=1):
    return Checkpoint.objects.create(run=run, version=step, step=step, path=str(path))


def _url(run, checkpoint_id, export=False):
    base = f"/api/v1/runs/{run.id}/checkpoints/{checkpoint_id}/"
    return base + "export/" if export else base


def test_export_runs_in_a_worker_and_the_checkpoint_shows_its_merged_model_folder(
    api, project, make_run, lora_checkpoint, eager_tasks, django_capture_on_commit_callbacks
):
    import torch
    from transformers import AutoModelForCausalLM

    path, trainer = lora_checkpoint
    run = make_run(project)
    checkpoint = _checkpoint(run, path)
    assert api.get(_url(run, checkpoint.id)).json()["export_status"] == "none"

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = api.post(_url(run, checkpoint.id, export=True))
        assert response.status_code == 202, response.content
        body = response.json()
        assert body["export_status"] == "running" and body["export_path"] == ""
        assert body["id"] == checkpoint.id and body["step"] == 1
    assert len(callbacks) == 1

    shown = api.get(_url(run, checkpoint.id)).json()
    assert shown["export_status"] == "done", shown["export_error"]
    assert shown["export_error"] == "" and shown["export_finished_at"]
    assert shown["export_path"].endswith(f"{run.id}/step_000001")
    listed = api.get(f"/api/v1/runs/{run.id}/checkpoints/").json()["results"][0]
    assert listed["export_status"] == "done"
    exported = AutoModelForCausalLM.from_pretrained(shown["export_path"])
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, trainer.model(input_ids=ids).logits, rtol=0, atol=1e-4
        )
    kinds = list(RunEvent.objects.filter(run=run, kind="export").values_list("message", flat=True))
    assert len(kinds) == 2 and "written to" in kinds[-1]

    # Idempotent: a done export is returned as it is, nothing is queued.
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        again = api.post(_url(run, checkpoint.id, export=True))
    assert again.status_code == 202 and again.json() == shown
    assert callbacks == []


def test_a_second_export_while_one_runs_is_a_clear_409(
    api, project, make_run, lora_checkpoint, api_error, django_capture_on_commit_callbacks
):
    run = make_run(project)
    checkpoint = _checkpoint(run, lora_checkpoint[0])
    with django_capture_on_commit_callbacks(execute=False):
        assert api.post(_url(run, checkpoint.id, export=True)).status_code == 202
        error = api_error(api.post(_url(run, checkpoint.id, export=True)), 409)
    assert "still running" in error["message"] and "step 1" in error["message"]
    assert error["code"] == "conflict"


def test_an_export_whose_worker_died_long_ago_can_start_again(
    api, project, make_run, lora_checkpoint, django_capture_on_commit_callbacks
):
    run = make_run(project)
    checkpoint = _checkpoint(run, lora_checkpoint[0])
    Checkpoint.objects.filter(pk=checkpoint.pk).update(
        export_status=E.RUNNING, export_started_at=timezone.now() - timedelta(hours=3)
    )
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post(_url(run, checkpoint.id, export=True))
    assert response.status_code == 202 and len(callbacks) == 1
    assert (
        response.json()["export_started_at"] > (timezone.now() - timedelta(minutes=1)).isoformat()
    )


def test_a_failed_export_says_why_and_can_be_retried(
    api, project, make_run, tmp_path, eager_tasks, django_capture_on_commit_callbacks
):
    broken = tmp_path / "step_000002"
    broken.mkdir()
    (broken / "trainer_state.pt").write_bytes(b"not a checkpoint")
    run = make_run(project)
    checkpoint = _checkpoint(run, broken, step=2)
    with django_capture_on_commit_callbacks(execute=True):
        assert api.post(_url(run, checkpoint.id, export=True)).status_code == 202
    shown = api.get(_url(run, checkpoint.id)).json()
    assert shown["export_status"] == "failed" and shown["export_path"] == ""
    assert "Error" in shown["export_error"], shown["export_error"]

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        retry = api.post(_url(run, checkpoint.id, export=True))
    assert retry.status_code == 202 and retry.json()["export_status"] == "running"
    assert retry.json()["export_error"] == "" and len(callbacks) == 1


def test_exporting_a_checkpoint_whose_files_are_gone_is_409(
    api, project, make_run, tmp_path, api_error
):
    run = make_run(project)
    checkpoint = _checkpoint(run, tmp_path / "deleted")
    error = api_error(api.post(_url(run, checkpoint.id, export=True)), 409)
    assert "are gone" in error["message"]
    assert Checkpoint.objects.get(pk=checkpoint.pk).export_status == E.NONE


def test_it_validates_ownership_of_checkpoints(
    api, other_api, project, other_project, make_run, lora_checkpoint, api_error
):
    run = make_run(project)
    checkpoint = _checkpoint(run, lora_checkpoint[0])
    other_run = make_run(other_project)
    others = _checkpoint(other_run, lora_checkpoint[0])
    for client, run_, checkpoint_id in [
        (other_api, run, checkpoint.id),  # another project's run
        (api, run, others.id),  # another run's checkpoint
        (api, other_run, others.id),
        (api, run, "not-a-number"),
    ]:
        api_error(client.get(_url(run_, checkpoint_id)), 404)
        api_error(client.post(_url(run_, checkpoint_id, export=True)), 404)
    assert not Checkpoint.objects.exclude(export_status=E.NONE).exists()


def test_the_run_page_has_an_export_button_that_starts_one(
    member_client,
    outsider_client,
    project,
    make_run,
    lora_checkpoint,
    django_capture_on_commit_callbacks,
):
    run = make_run(project)
    checkpoint = _checkpoint(run, lora_checkpoint[0])
    page = member_client.get(f"/projects/{project.id}/runs/{run.id}/").content.decode()
    action = f"/projects/{project.id}/runs/{run.id}/checkpoints/{checkpoint.id}/export/"
    assert f'action="{action}"' in page and ">Export</button>" in page

    assert outsider_client.post(action).status_code == 404
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = member_client.post(action, follow=True)
    assert response.redirect_chain[-1][0] == f"/projects/{project.id}/runs/{run.id}/"
    assert len(callbacks) == 1
    page = response.content.decode()
    assert "Exporting the checkpoint at step 1" in page and "exporting…" in page
    assert Checkpoint.objects.get(pk=checkpoint.pk).export_status == E.RUNNING
