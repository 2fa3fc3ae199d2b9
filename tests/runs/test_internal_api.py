"""The internal API a run's job uses: per-attempt secrets, reports, trajectories."""

from __future__ import annotations

import pytest

from webapp.gateway.models import Interaction, Session
from webapp.runs.jobs import job_secret_issue
from webapp.runs.models import Checkpoint, MetricPoint


def url(run, name: str) -> str:
    return f"/internal/v1/runs/{run.id}/{name}"


@pytest.fixture
def running(project, make_run, set_status):
    run = make_run(project, batch_size=2)
    return set_status(run, "running")


@pytest.fixture
def job(client, running):
    secret = job_secret_issue(run=running)

    def call(method: str, name: str, body=None, **kw):
        kw.setdefault("HTTP_AUTHORIZATION", f"Bearer {secret}")
        if method == "GET":
            return client.get(url(running, name), **kw)
        return client.post(
            url(running, name),
            data=body if body is not None else {},
            content_type="application/json",
            **kw,
        )

    call.secret = secret
    return call


def episode(reward: float, version: int = 0, group: str = "g1") -> dict:
    return {
        "input_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "versions": [version, version],
        "reward": reward,
        "finish_reason": "stop",
        "text": "ok",
        "messages": [{"role": "user", "content": "hi"}],
        "group_id": group,
        "task_id": "t",
    }


def test_config_needs_the_current_job_secret(client, running, job, api_key):
    assert job("GET", "config").json()["config"]["batch_size"] == 2
    assert client.get(url(running, "config")).status_code == 401
    assert (
        client.get(url(running, "config"), HTTP_AUTHORIZATION=f"Bearer {api_key}").status_code
        == 401
    )


def test_a_new_attempt_locks_out_the_previous_jobs_secret(client, running, job):
    old = job.secret
    job_secret_issue(run=running)
    assert client.get(url(running, "config"), HTTP_AUTHORIZATION=f"Bearer {old}").status_code == 401


def test_it_validates_ownership_another_runs_secret_is_refused(
    client, other_project, make_run, running, set_status
):
    other = set_status(make_run(other_project, name="theirs"), "running")
    their_secret = job_secret_issue(run=other)
    response = client.get(url(running, "config"), HTTP_AUTHORIZATION=f"Bearer {their_secret}")
    assert response.status_code == 401


def test_metrics_are_stored_once_per_name_and_step_and_advance_the_run(job, running):
    assert (
        job(
            "POST",
            "metrics",
            {"step": 1, "version": 1, "metrics": {"rollout/reward": 0.25, "ppo/loss": 1.0}},
        ).status_code
        == 200
    )
    assert (
        job(
            "POST", "metrics", {"step": 1, "version": 1, "metrics": {"rollout/reward": 0.5}}
        ).status_code
        == 200
    )
    points = MetricPoint.objects.filter(run=running, name="rollout/reward")
    assert [(p.step, p.value) for p in points] == [(1, 0.5)]
    running.refresh_from_db()
    assert (running.step, running.weight_version) == (1, 1)


def test_bad_reports_are_400_and_store_nothing(job, running):
    assert job("POST", "metrics", {"step": "one", "metrics": {}}).status_code == 400
    assert job("POST", "metrics", {"step": 1, "metrics": [1, 2]}).status_code == 400
    assert job("POST", "status", {"status": "exploded"}).status_code == 400
    assert job("POST", "claim", {"limit": 0}).status_code == 400
    assert MetricPoint.objects.filter(run=running).count() == 0


def error_message(response) -> str:
    assert response.status_code == 400, response.content
    return response.json()["error"]["message"]


def test_a_checkpoint_without_a_path_is_400(job, running):
    assert "'path'" in error_message(job("POST", "checkpoints", {"version": 1, "step": 1}))
    assert "'path'" in error_message(
        job("POST", "checkpoints", {"version": 1, "step": 1, "path": ""})
    )
    assert "'path'" in error_message(
        job("POST", "checkpoints", {"version": 1, "step": 1, "path": ["/x"]})
    )
    assert not Checkpoint.objects.filter(run=running).exists()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"reward": None}, "reward"),
        ({"reward": "1.0"}, "reward"),
        ({"reward": float("nan")}, "reward"),
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"output_ids": [4, "5"]}, "output_ids"),
        ({"versions": [0, True]}, "versions"),
        ({"logprobs": [-0.5, None]}, "logprobs"),
        ({"logprobs": [-0.5]}, "one entry per generated token"),
        ({"metadata": ["not", "a", "dict"]}, "metadata"),
        ({"messages": "hi"}, "messages"),
        ({"task_id": 7}, "task_id"),
    ],
)
def test_a_malformed_episode_is_400_and_records_nothing(job, running, change, field):
    bad = episode(1.0) | change
    message = error_message(job("POST", "episodes", {"episodes": [episode(0.0), bad]}))
    assert "episodes[1]" in message and field in message
    assert not Session.objects.filter(run=running).exists()


def test_an_episode_missing_a_required_key_is_400(job, running):
    for key in ("input_ids", "output_ids", "logprobs", "versions", "reward"):
        incomplete = {k: v for k, v in episode(1.0).items() if k != key}
        assert key in error_message(job("POST", "episodes", {"episodes": [incomplete]}))
    assert "episodes[0]" in error_message(job("POST", "episodes", {"episodes": ["nope"]}))
    assert not Session.objects.filter(run=running).exists()


def test_session_ids_that_are_not_ids_are_400(job, running):
    for body in ({"version": 1, "trained": ["not-an-id"]}, {"version": 1, "dropped": [1]}):
        assert "session ids" in error_message(job("POST", "trained", body))
    assert "session ids" in error_message(job("POST", "release", {"sessions": "all"}))


def test_reports_with_wrongly_typed_fields_are_400(job, running):
    assert "'error'" in error_message(job("POST", "status", {"status": "failed", "error": 1}))
    assert "'message'" in error_message(job("POST", "events", {"message": {"a": 1}}))
    assert "'action'" in error_message(
        job("POST", "servers", {"url": "http://127.0.0.1:1", "action": "remove"})
    )
    running.refresh_from_db()
    assert running.status == "running" and not running.servers.exists()


def test_episodes_are_recorded_like_gateway_sessions_and_claimed_once(job, running):
    created = job("POST", "episodes", {"episodes": [episode(1.0), episode(0.0)]})
    assert created.status_code == 201
    ids = created.json()["sessions"]
    assert Session.objects.filter(pk__in=ids, trajectory="ready").count() == 2
    assert Interaction.objects.filter(session_id__in=ids).count() == 2

    first = job("POST", "claim", {"limit": 1}).json()["sessions"]
    second = job("POST", "claim", {"limit": 5}).json()["sessions"]
    assert len(first) == len(second) == 1
    assert first[0]["session_id"] != second[0]["session_id"]
    trajectory = first[0]["trajectories"][0]
    assert trajectory["input_ids"] == [1, 2, 3, 4, 5]
    assert trajectory["loss_mask"] == [0, 0, 0, 1, 1]
    assert trajectory["versions"] == [-1, -1, -1, 0, 0]
    assert trajectory["group_id"] == "g1"
    assert trajectory["temperatures"] is None  # no sampling given: temperature 1
    assert job("POST", "claim", {"limit": 5}).json()["sessions"] == []


def test_an_episodes_sampling_settings_are_stored_on_its_turn_and_reach_the_trajectory(
    job, running
):
    sampled = episode(1.0) | {"sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 20}}
    greedy = episode(0.0) | {"sampling": {"temperature": 0.0}}
    ids = job("POST", "episodes", {"episodes": [sampled, greedy]}).json()["sessions"]
    turns = {
        str(i.session_id): (i.temperature, i.top_p, i.top_k)
        for i in Interaction.objects.filter(session_id__in=ids)
    }
    assert [turns[sid] for sid in ids] == [(0.5, 0.9, 20), (0.0, 1.0, -1)]
    claimed = {
        item["session_id"]: item["trajectories"][0]
        for item in job("POST", "claim", {"limit": 2}).json()["sessions"]
    }
    # The tokens' logprob temperatures: the prompt's and a greedy turn's are 1.
    assert claimed[ids[0]]["temperatures"] == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert claimed[ids[1]]["temperatures"] is None


def test_an_episode_with_a_non_numeric_temperature_is_refused(job, running):
    bad = episode(1.0) | {"sampling": {"temperature": "hot"}}
    assert "sampling.temperature" in error_message(job("POST", "episodes", {"episodes": [bad]}))


def test_trained_and_released_sessions_change_state(job, running):
    ids = job("POST", "episodes", {"episodes": [episode(1.0), episode(0.5), episode(0.0)]}).json()[
        "sessions"
    ]
    job("POST", "claim", {"limit": 3})
    assert (
        job("POST", "trained", {"version": 1, "trained": ids[:1], "dropped": ids[1:2]}).status_code
        == 200
    )
    assert job("POST", "release", {}).json()["released"] == 1
    states = dict(Session.objects.filter(pk__in=ids).values_list("pk", "trajectory"))
    assert sorted(states.values()) == ["dropped", "ready", "trained"]


@pytest.mark.parametrize("final", ["completed", "stopped", "failed"])
def test_a_job_that_ends_gives_back_what_it_claimed_but_did_not_train(job, running, final):
    # The job's source may hold claimed trajectories past its last step (a session rendered
    # as two trajectories, one trained, one buffered): they must not stay claimed forever.
    ids = job("POST", "episodes", {"episodes": [episode(1.0), episode(0.5)]}).json()["sessions"]
    job("POST", "claim", {"limit": 2})
    job("POST", "trained", {"version": 1, "trained": ids[:1], "dropped": []})
    assert job("POST", "status", {"status": final}).json()["status"] == final
    states = {str(pk): t for pk, t in Session.objects.values_list("pk", "trajectory")}
    assert [states[sid] for sid in ids] == ["trained", "ready"]


def test_checkpoints_reported_by_the_job_are_listed_by_the_rest_api(job, running, api):
    assert (
        job(
            "POST",
            "checkpoints",
            {"version": 3, "step": 3, "path": "/data/ckpt/v3", "size_bytes": 1234},
        ).status_code
        == 200
    )
    assert Checkpoint.objects.filter(run=running, version=3).exists()
    listed = api.get(f"/api/v1/runs/{running.id}/checkpoints/").json()["results"]
    assert listed[0]["version"] == 3 and listed[0]["size_bytes"] == 1234


def test_status_reports_move_the_state_machine(job, running):
    assert (
        job("POST", "status", {"status": "completed", "message": "done"}).json()["status"]
        == "completed"
    )
    running.refresh_from_db()
    assert running.status == "completed" and running.finished_at is not None
    assert job("POST", "status", {"status": "running"}).status_code == 409


def test_servers_registered_by_the_job_turn_a_starting_run_running(
    client, project, make_run, set_status
):
    run = set_status(make_run(project, name="boot"), "starting")
    secret = job_secret_issue(run=run)
    response = client.post(
        url(run, "servers"),
        data={"url": "http://127.0.0.1:1", "backend": "torch"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert response.status_code == 200
    run.refresh_from_db()
    assert run.status == "running"
    assert list(run.servers.values_list("url", flat=True)) == ["http://127.0.0.1:1"]


def test_the_job_reports_the_clusters_gpus_and_cpus(job):
    from webapp.runs.models import ClusterReport

    assert job("POST", "cluster", {"gpus": 2, "cpus": 48.0}).status_code == 200
    report = ClusterReport.objects.get()
    assert (report.gpus, report.cpus) == (2.0, 48.0)
    for bad in ({"gpus": -1, "cpus": 4}, {"gpus": "2", "cpus": 4}, {"cpus": 4}):
        response = job("POST", "cluster", bad)
        assert response.status_code == 400, bad
        assert "must be a number" in response.json()["error"]["message"]
    assert ClusterReport.objects.get().gpus == 2.0


def test_resume_rewinds_the_run_and_answers_what_the_job_resumes_from(job, running):
    assert job("POST", "episodes", {"episodes": [episode(1.0), episode(0.5)]}).status_code == 201
    claimed = [s["session_id"] for s in job("POST", "claim", {"limit": 2}).json()["sessions"]]
    assert job("POST", "trained", {"version": 1, "trained": claimed}).status_code == 200
    answer = job("POST", "resume", {"step": 0, "version": 0})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["released"], body["rewound"], body["accepted"], body["rows_used"]) == (0, 2, 2, {})
    assert body["dropped"] == 0
    assert set(Session.objects.values_list("trajectory", flat=True)) == {"ready"}


@pytest.mark.parametrize(
    "body",
    [
        {"step": "3", "version": 3},
        {"step": 3},
        {"step": -1, "version": 0},
        {"step": 1, "version": True},
    ],
)
def test_resume_refuses_what_is_not_a_step_and_a_version(job, body):
    response = job("POST", "resume", body)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "internal_api_error"


def test_resume_needs_the_job_secret(client, running):
    response = client.post(url(running, "resume"), data={}, content_type="application/json")
    assert response.status_code == 401
    assert client.get(url(running, "resume")).status_code == 405  # a POST only
