"""The runs list: each run's latest reward and its progress, the model by its short name."""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

pytestmark = pytest.mark.django_db


def report(run, rewards: list[float], *, step: int | None = None) -> None:
    """The run's trainer reported ``rewards`` at steps 1, 2, ... (and a loss beside each)."""
    from webapp.runs.models import MetricPoint, Run

    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, step=i, name=name, value=value)
        for i, reward in enumerate(rewards, start=1)
        for name, value in (("rollout/reward", reward), ("ppo/loss", -reward))
    )
    last = step if step is not None else len(rewards)
    Run.objects.filter(pk=run.pk).update(status="running", step=last, weight_version=last)


def row(html: str, name: str) -> str:
    """The runs table's row for the run called ``name``, as HTML."""
    for tr in re.findall(r"<tr>.*?</tr>", html, flags=re.S):
        if f">{name}</a>" in tr:
            return tr
    raise AssertionError(f"no row for {name!r} in the runs list")


def cell(tr: str, css_class: str) -> str:
    """The text of the row's cell of ``css_class``, whitespace collapsed."""
    match = re.search(rf'<td class="{css_class}"[^>]*>(.*?)</td>', tr, flags=re.S)
    assert match, f"no {css_class} cell in {tr}"
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", match.group(1))).split())


def runs_page(client, project) -> str:
    response = client.get(reverse("dashboard:runs", args=[project.id]))
    assert response.status_code == 200
    return response.content.decode()


def test_runs_list_shows_each_runs_latest_reward(member_client, project, make_run):
    climbing = make_run(project, name="climbing")
    report(climbing, [0.012, 0.25, 0.6875])
    make_run(project, name="fresh")

    html = runs_page(member_client, project)
    assert cell(row(html, "climbing"), "run-reward") == "0.688"  # step 3's, not an older one
    assert cell(row(html, "fresh"), "run-reward") == "—"


def test_dataset_run_shows_step_of_max_steps_with_a_bar(
    member_client, project, make_run, make_dataset
):
    run = make_run(project, name="gsm", dataset=make_dataset(project), max_steps=200)
    report(run, [0.1] * 3, step=40)

    tr = row(runs_page(member_client, project), "gsm")
    assert cell(tr, "run-progress") == "step 40 / 200"
    assert '<progress max="200" value="40">' in tr
    # The step and the weight version are one column now, the version on hover.
    assert 'title="weight version v40"' in tr and ">v40<" not in tr


def test_online_run_shows_its_step_without_a_bar_toward_max_steps(member_client, project, make_run):
    run = make_run(project, name="agents", max_steps=1_000_000)
    report(run, [0.3], step=14)

    tr = row(runs_page(member_client, project), "agents")
    assert cell(tr, "run-progress") == "step 14"
    assert "<progress" not in tr and "1000000" not in tr


@pytest.mark.parametrize(
    ("base_model", "shown"),
    [
        ("/srv/steep/data/models/Qwen3-0.6B", "Qwen3-0.6B"),
        ("/srv/steep/data/models/Qwen3-0.6B/", "Qwen3-0.6B"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_runs_list_names_the_model_shortly_with_its_full_path_on_hover(
    member_client, project, make_run, base_model, shown
):
    from webapp.runs.models import Run

    run = make_run(project, name="named")
    Run.objects.filter(pk=run.pk).update(base_model=base_model)

    tr = row(runs_page(member_client, project), "named")
    assert f'<code class="model-name" title="{base_model}">{shown}</code>' in tr


def test_rewards_of_every_run_come_in_one_query(member_client, project, make_run):
    def page_queries() -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            runs_page(member_client, project)
        return [query["sql"] for query in captured.captured_queries]

    report(make_run(project, name="run-0"), [0.5, 0.7])
    few = page_queries()
    for i in range(1, 6):
        report(make_run(project, name=f"run-{i}"), [0.1 * i] * 4)
    many = page_queries()
    assert len(many) == len(few)  # not one more query per run
    assert len([sql for sql in many if "rollout/reward" in sql]) == 1

    html = runs_page(member_client, project)
    assert [cell(row(html, f"run-{i}"), "run-reward") for i in range(6)] == [
        "0.700", "0.100", "0.200", "0.300", "0.400", "0.500",
    ]  # fmt: skip
