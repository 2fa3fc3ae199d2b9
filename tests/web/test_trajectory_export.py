"""Taking data away: a run's trajectories as JSON lines or Parquet (loadable by ``datasets``),
uploaded back as a dataset with the same rows, and a checkpoint's model folder as a zip."""

from __future__ import annotations

import io
import json
import uuid
import zipfile
from datetime import timedelta
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from django.utils import timezone

from webapp.accounts.services import api_key_create
from webapp.datasets.models import Dataset
from webapp.datasets.selectors import dataset_rows
from webapp.gateway.models import Session
from webapp.gateway.selectors import session_trajectories
from webapp.runs.models import Checkpoint

pytestmark = pytest.mark.django_db

S, T = Session.Status, Session.Trajectory
COLUMNS = {
    "format", "run_id", "session_id", "agent_id", "task_id", "group_id", "role", "status",
    "trajectory", "created_at", "ended_at", "messages", "completion", "input_ids",
    "loss_mask", "logprobs", "versions", "temperatures", "turn_ends", "rewards", "reward",
    "metadata",
}  # fmt: skip


@pytest.fixture
def recorded(project, other_project, make_run, make_agent, make_session, tokenizer_dir):
    run = make_run(project, name="online", base_model=str(tokenizer_dir))
    agent = make_agent(project, name="solver", run=run)
    user = {"role": "user"}
    multi = make_session(
        agent,
        [
            {"messages": [user | {"content": "What is 2 + 2?"}], "answer": "4", "versions": 3},
            {
                "messages": [user | {"content": "And times 3?"}],
                "answer": "That makes 12.",
                "versions": (3, 4, 6),
                "reward": 1.0,
            },
        ],
        task_id="arith-1",
        metadata={"group_id": "g1"},
    )
    multi.interactions.filter(turn=0).update(reward=0.5)
    parts = make_session(
        agent,
        [
            {
                "messages": [user | {"content": [{"type": "text", "text": "Say hé."}]}],
                "answer": "hé",
                "reward": 0.25,
            }
        ],
        trajectory=T.TRAINED,
        task_id="greet",
    )
    unrewarded = make_session(
        agent,
        [{"messages": [user | {"content": "Say hi."}], "answer": "hi"}],
        trajectory=T.UNREWARDED,
    )
    other_run = make_run(other_project, name="rival", base_model=str(tokenizer_dir))
    make_session(
        make_agent(other_project, name="rival-agent", run=other_run),
        [{"messages": [user | {"content": "secret prompt"}], "answer": "secret", "reward": 1}],
    )
    return SimpleNamespace(
        run=run, agent=agent, multi=multi, parts=parts, unrewarded=unrewarded, other_run=other_run
    )


def url(run, query: str = "", slash: bool = False) -> str:
    return f"/api/v1/runs/{run.id}/trajectories/export{'/' if slash else ''}{query}"


def fetch(client, path: str, content_type: str) -> bytes:
    response = client.get(path)
    assert response.status_code == 200, response.content[:500]
    assert response.streaming
    assert response["Content-Type"] == content_type
    return b"".join(response.streaming_content)


def jsonl_rows(client, run, query: str = "") -> list[dict]:
    body = fetch(client, url(run, query), "application/x-ndjson").decode()
    return [json.loads(line) for line in body.splitlines()]


def test_jsonl_rows_carry_messages_tokens_logprobs_versions_and_rewards(api, recorded):
    r = recorded
    rows = jsonl_rows(api, r.run)
    assert [row["session_id"] for row in rows] == [
        str(r.multi.id),
        str(r.parts.id),
        str(r.unrewarded.id),
    ]
    assert all(set(row) == COLUMNS for row in rows)
    first = rows[0]
    (trajectory,) = session_trajectories(r.multi)
    assert first["input_ids"] == trajectory.input_ids
    assert first["loss_mask"] == trajectory.loss_mask
    assert first["logprobs"] == trajectory.logprobs
    assert first["versions"] == trajectory.versions
    assert first["rewards"] == [0.5, 1.0] and first["reward"] == 1.5
    assert first["turn_ends"] == [end for _, end in trajectory.turn_spans()]
    assert first["temperatures"] == [1.0] * len(trajectory.input_ids)
    assert first["messages"] == [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "That makes 12."},
    ]
    assert first["completion"] == "That makes 12."
    assert (first["run_id"], first["agent_id"], first["task_id"]) == (
        str(r.run.id),
        str(r.agent.id),
        "arith-1",
    )
    assert (first["group_id"], first["status"], first["trajectory"]) == ("g1", "ended", "ready")
    assert first["role"] == ""  # a one-policy run
    assert first["created_at"] == r.multi.created_at.isoformat()
    assert first["ended_at"] == r.multi.ended_at.isoformat()
    assert json.loads(first["metadata"])["task_id"] == "arith-1"
    # Content parts become their text; non-ASCII survives.
    assert rows[1]["messages"][0] == {"role": "user", "content": "Say hé."}
    assert rows[1]["completion"] == "hé"


def test_the_exact_path_and_its_slash_form_answer_the_same(api, recorded):
    exact = fetch(api, url(recorded.run), "application/x-ndjson")
    assert exact == fetch(api, url(recorded.run, slash=True), "application/x-ndjson")
    response = api.get(url(recorded.run))
    assert response["Content-Disposition"] == (
        f'attachment; filename="run-{recorded.run.id}-trajectories.jsonl"'
    )


def test_status_filters_the_export(api, recorded):
    assert [r["session_id"] for r in jsonl_rows(api, recorded.run, "?status=trained")] == [
        str(recorded.parts.id)
    ]


def test_parquet_holds_the_same_rows_as_jsonl(api, recorded):
    body = fetch(api, url(recorded.run, "?format=parquet"), "application/vnd.apache.parquet")
    assert body[:4] == b"PAR1" and body[-4:] == b"PAR1"
    assert pq.read_table(io.BytesIO(body)).to_pylist() == jsonl_rows(api, recorded.run)


def test_parquet_streams_a_row_group_at_a_time(recorded):
    from webapp.exports.trajectories import export_rows, parquet_chunks

    chunks = list(parquet_chunks(export_rows(run=recorded.run), rows_per_group=1))
    assert len(chunks) == 4 and all(chunks)  # three groups, then the footer
    assert pq.ParquetFile(io.BytesIO(b"".join(chunks))).num_row_groups == 3


def test_export_of_a_run_without_sessions_is_an_empty_file(api, project, make_run):
    run = make_run(project, name="idle")
    assert jsonl_rows(api, run) == []
    body = fetch(api, url(run, "?format=parquet"), "application/vnd.apache.parquet")
    table = pq.read_table(io.BytesIO(body))
    assert table.num_rows == 0 and set(table.column_names) == COLUMNS


def test_exports_load_with_datasets_and_reimport_as_a_dataset_with_the_same_rows(
    api, recorded, tmp_path
):
    import datasets

    jsonl = fetch(api, url(recorded.run), "application/x-ndjson")
    parquet = fetch(api, url(recorded.run, "?format=parquet"), "application/vnd.apache.parquet")
    exported = [json.loads(line) for line in jsonl.decode().splitlines()]
    (tmp_path / "t.jsonl").write_bytes(jsonl)
    (tmp_path / "t.parquet").write_bytes(parquet)
    for builder, name in (("json", "t.jsonl"), ("parquet", "t.parquet")):
        loaded = datasets.load_dataset(
            builder, data_files=str(tmp_path / name), split="train", cache_dir=str(tmp_path / "hf")
        )
        assert loaded.to_list() == exported, builder

    for name, body in (("from-jsonl", jsonl), ("from-parquet", parquet)):
        response = api.post(
            "/api/v1/datasets/",
            {"name": name, "file": io.BytesIO(body)},
            format="multipart",
        )
        assert response.status_code == 201, response.content[:500]
        assert response.json()["row_count"] == len(exported)
        rows = list(dataset_rows(dataset=Dataset.objects.get(name=name)))
        assert len(rows) == len(exported)
        for row, original in zip(rows, exported, strict=True):
            assert (
                row["messages"] + [{"role": "assistant", "content": row["answer"]}]
                == (original["messages"])
            )
            meta = dict(row["metadata"])
            assert meta.pop("trajectory_metadata") == json.loads(original["metadata"])
            assert meta == {
                k: v
                for k, v in original.items()
                if k not in {"format", "messages", "completion", "metadata"}
            }


def test_an_unreadable_parquet_upload_is_400_and_stores_nothing(api, api_error):
    response = api.post(
        "/api/v1/datasets/",
        {"name": "broken", "file": io.BytesIO(b"PAR1 this is not parquet")},
        format="multipart",
    )
    error = api_error(response, 400)
    assert "Parquet" in " ".join(error["fields"]["file"])
    assert not Dataset.objects.filter(name="broken").exists()


def test_bad_format_is_400(api, recorded, api_error):
    error = api_error(api.get(url(recorded.run, "?format=csv")), 400)
    assert error["fields"]["format"] == ["Must be one of jsonl, parquet."]
    api_error(api.get(url(recorded.run, "?status=nope")), 400)


@pytest.mark.parametrize("bad", ["not-a-uuid", str(uuid.uuid4())])
def test_unknown_run_is_404(api, api_error, bad):
    api_error(api.get(f"/api/v1/runs/{bad}/trajectories/export"), 404)


def test_another_projects_run_is_404_without_its_data(other_api, api, recorded, api_error):
    for query in ("", "?format=parquet"):
        response = other_api.get(url(recorded.run, query))
        api_error(response, 404)
        assert "2 + 2" not in response.content.decode()
    theirs = jsonl_rows(other_api, recorded.other_run)
    assert [row["completion"] for row in theirs] == ["secret"]


def test_expired_revoked_or_missing_key_is_401(anon_api, project, recorded, api_error):
    from rest_framework.test import APIClient

    _, expired = api_key_create(
        project=project, name="old", expires_at=timezone.now() - timedelta(minutes=1)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {expired}")
    api_error(client.get(url(recorded.run)), 401)
    api_error(anon_api.get(url(recorded.run)), 401)


# --- checkpoint download --------------------------------------------------------------------


@pytest.fixture
def exported_checkpoint(recorded, tmp_path):
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 9000)  # > one read chunk
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return Checkpoint.objects.create(
        run=recorded.run,
        version=2,
        step=2,
        path=str(tmp_path / "ckpt"),
        export_status=Checkpoint.ExportStatus.DONE,
        export_path=str(folder),
    )


def download_url(checkpoint) -> str:
    return f"/api/v1/runs/{checkpoint.run_id}/checkpoints/{checkpoint.id}/download/"


def test_download_streams_the_exported_folder_as_a_zip(api, exported_checkpoint, tmp_path):
    c = exported_checkpoint
    body = fetch(api, download_url(c), "application/zip")
    root = f"run-{c.run_id}-step2"
    with zipfile.ZipFile(io.BytesIO(body)) as archive:
        assert sorted(archive.namelist()) == [
            f"{root}/config.json",
            f"{root}/model.safetensors",
            f"{root}/sub/tokenizer.json",
        ]
        assert archive.testzip() is None
        assert archive.read(f"{root}/model.safetensors") == bytes(range(256)) * 9000
    response = api.get(download_url(c))
    assert response["Content-Disposition"] == f'attachment; filename="{root}.zip"'


def test_download_before_the_export_is_409_saying_what_to_do(api, recorded, api_error):
    checkpoint = Checkpoint.objects.create(run=recorded.run, version=1, step=1, path="/nowhere")
    error = api_error(api.get(download_url(checkpoint)), 409)
    assert "export" in error["message"] and "POST" in error["message"]
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_status="running")
    assert "still running" in api_error(api.get(download_url(checkpoint)), 409)["message"]


def test_download_of_unknown_or_another_projects_checkpoint_is_404(
    api, other_api, exported_checkpoint, recorded, api_error
):
    api_error(other_api.get(download_url(exported_checkpoint)), 404)
    bad = f"/api/v1/runs/{recorded.run.id}/checkpoints/99999/download/"
    api_error(api.get(bad), 404)
    wrong_run = (
        f"/api/v1/runs/{recorded.other_run.id}/checkpoints/{exported_checkpoint.id}/download/"
    )
    api_error(api.get(wrong_run), 404)


@pytest.mark.django_db(transaction=True)
def test_both_formats_and_the_zip_stream_in_batches_under_asgi(
    api_key, recorded, exported_checkpoint
):
    """Under ASGI a sync iterator would be read whole before the first byte; these are not."""
    import warnings

    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def fetch(path: str):
        response = await AsyncClient().get(path, headers={"Authorization": f"Bearer {api_key}"})
        return response, [chunk async for chunk in response.streaming_content]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jsonl, jsonl_chunks = async_to_sync(fetch)(url(recorded.run))
        parquet, parquet_chunks = async_to_sync(fetch)(url(recorded.run, "?format=parquet"))
        archive, zip_chunks = async_to_sync(fetch)(download_url(exported_checkpoint))
    assert not [w for w in caught if "StreamingHttpResponse" in str(w.message)]
    for response in (jsonl, parquet, archive):
        assert response.status_code == 200 and response.is_async
    rows = [json.loads(line) for line in b"".join(jsonl_chunks).decode().splitlines()]
    assert [row["session_id"] for row in rows] == [
        str(recorded.multi.id),
        str(recorded.parts.id),
        str(recorded.unrewarded.id),
    ]
    assert pq.read_table(io.BytesIO(b"".join(parquet_chunks))).to_pylist() == rows
    with zipfile.ZipFile(io.BytesIO(b"".join(zip_chunks))) as z:
        assert z.testzip() is None and len(z.namelist()) == 3
