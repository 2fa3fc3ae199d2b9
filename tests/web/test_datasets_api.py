"""Dataset uploads: every line validated, stored all-or-nothing, deletable unless a run uses it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from webapp.datasets.models import Dataset
from webapp.datasets.selectors import dataset_rows

pytestmark = pytest.mark.django_db


def upload(api, content: bytes, name: str = "prompts"):
    return api.post(
        "/api/v1/datasets/",
        {"name": name, "file": SimpleUploadedFile("data.jsonl", content)},
        format="multipart",
    )


def stored_files(settings, project) -> list[str]:
    directory = Path(settings.DATA_DIR) / "datasets" / str(project.id)
    return sorted(os.listdir(directory)) if directory.exists() else []


def test_good_upload_is_201_with_row_count_and_preview(sample_rows, jsonl, api, project, settings):
    response = upload(api, jsonl(sample_rows) + b"\n   \n")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "prompts"
    assert body["row_count"] == 2
    assert body["preview"] == sample_rows
    assert body["size_bytes"] > 0

    dataset = Dataset.objects.get(pk=body["id"], project=project)
    assert dataset.path.is_file()
    assert stored_files(settings, project) == [dataset.path.name]
    assert list(dataset_rows(dataset=dataset)) == sample_rows
    assert api.get(f"/api/v1/datasets/{dataset.id}/").json()["preview"] == sample_rows


def test_numeric_answers_and_content_part_lists_are_accepted(jsonl, api):
    rows = [
        {"prompt": "2+2", "answer": 4},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    response = upload(api, jsonl(rows))
    assert response.status_code == 201, response.content
    assert response.json()["row_count"] == 2


BAD_LINES = [
    (2, b"{not json", "not valid JSON"),
    (3, b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one"),
    (4, b"[1, 2]", "JSON object"),
    (5, b'{"prompt": ""}', "non-empty string"),
    (6, b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
    (7, b'{"prompt": "x", "extra": 1}', "unknown keys extra"),
    (8, b'{"prompt": "x", "answer": ["4"]}', '"answer"'),
    (9, b'{"prompt": "x", "metadata": "note"}', '"metadata"'),
    (10, b'{"messages": []}', "non-empty list"),
    (11, b"\xff\xfe not utf-8", "not valid JSON"),
]


def test_bad_upload_is_400_with_line_numbered_errors_and_stores_nothing(
    api, project, settings, api_error
):
    lines = [b'{"prompt": "fine"}'] + [line for _, line, _ in BAD_LINES]
    lines += [b'{"prompt": "fine too"}'] + [b"oops"] * 25  # lines 13..37
    response = upload(api, b"\n".join(lines) + b"\n")

    error = api_error(response, 400)
    messages = error["fields"]["file"]
    assert len(messages) == 21
    for (number, _, expected), message in zip(BAD_LINES, messages, strict=False):
        assert message.startswith(f"line {number}: "), message
        assert expected in message, message
    assert messages[10].startswith("line 13: ")
    assert messages[19].startswith("line 22: ")
    assert messages[20] == "... and 15 more invalid line(s)"
    assert "line 2:" in error["message"]

    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_a_few_bad_lines_report_no_more_count(api, api_error):
    messages = api_error(upload(api, b'{"prompt": "ok"}\nnope\n'), 400)["fields"]["file"]
    assert messages == [messages[0]] and messages[0].startswith("line 2: not valid JSON")


def test_empty_file_is_400_and_stores_nothing(api, project, settings, api_error):
    error = api_error(upload(api, b"\n\n"), 400)
    assert "no rows" in " ".join(error["fields"]["file"])
    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_upload_without_a_file_or_name_is_400(api, api_error):
    error = api_error(api.post("/api/v1/datasets/", {}, format="multipart"), 400)
    assert set(error["fields"]) == {"name", "file"}


def test_json_body_instead_of_multipart_is_415_not_500(api, api_error):
    response = api.post("/api/v1/datasets/", {"name": "x", "file": "{}"}, format="json")
    api_error(response, 415)


def test_oversize_upload_is_413_and_stores_nothing(jsonl, api, project, settings, api_error):
    settings.DATASET_MAX_BYTES = 1024
    content = jsonl([{"prompt": "x" * 100}] * 20)
    assert len(content) > 1024
    error = api_error(upload(api, content), 413)
    assert "DATASET_MAX_BYTES" in error["message"]
    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_body_far_over_the_dataset_limit_is_refused_before_parsing(
    jsonl, api, project, settings, api_error
):
    settings.DATASET_MAX_BYTES = 1024
    content = jsonl([{"prompt": "x" * 1000}] * 80)  # > limit + 64 KiB of multipart slack
    assert api_error(upload(api, content), 413)["code"] == "request_too_large"
    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_duplicate_name_is_400_and_keeps_the_first(
    sample_rows, jsonl, api, project, settings, api_error
):
    first = upload(api, jsonl(sample_rows)).json()
    error = api_error(upload(api, jsonl([{"prompt": "other"}])), 400)
    assert "name" in error["fields"]
    assert list(Dataset.objects.values_list("id", flat=True)) == [
        Dataset.objects.get(pk=first["id"]).pk
    ]
    assert len(stored_files(settings, project)) == 1


def test_same_name_in_another_project_is_fine(sample_rows, jsonl, api, other_api):
    assert upload(api, jsonl(sample_rows)).status_code == 201
    assert upload(other_api, jsonl(sample_rows)).status_code == 201


def test_delete_is_204_and_removes_the_file(
    api, project, make_dataset, django_capture_on_commit_callbacks
):
    dataset = make_dataset(project)
    assert dataset.path.is_file()
    with django_capture_on_commit_callbacks(execute=True):
        response = api.delete(f"/api/v1/datasets/{dataset.id}/")
    assert response.status_code == 204
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert not dataset.path.exists()
    assert api.get(f"/api/v1/datasets/{dataset.id}/").status_code == 404


def test_delete_of_a_dataset_used_by_a_run_is_409(
    api, project, make_dataset, make_run, api_error, django_capture_on_commit_callbacks
):
    dataset = make_dataset(project)
    make_run(project, name="uses-it", dataset=dataset)
    with django_capture_on_commit_callbacks(execute=True):
        error = api_error(api.delete(f"/api/v1/datasets/{dataset.id}/"), 409)
    assert "uses-it" in error["message"]
    assert Dataset.objects.filter(pk=dataset.pk).exists()
    assert dataset.path.is_file()


def test_list_shows_datasets_without_previews(api, project, make_dataset):
    make_dataset(project, name="a")
    make_dataset(project, name="b")
    body = api.get("/api/v1/datasets/").json()
    assert body["count"] == 2
    assert {row["name"] for row in body["results"]} == {"a", "b"}
    assert all("preview" not in row and row["row_count"] == 2 for row in body["results"])


def test_stored_file_is_normalised_jsonl(project, make_dataset):
    dataset = make_dataset(project, rows=[{"prompt": "é", "answer": "1"}])
    lines = dataset.path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": "é", "answer": "1"}]
