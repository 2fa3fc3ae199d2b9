"""The run page's layout of a multi-agent run's ``roles/<role>/<name>`` metrics: a column per
role in the run's order, the role's reward first, none of them in the folded groups."""

from __future__ import annotations

from webapp.dashboard.charts import chart_layout, role_of

SERIES = {
    name: [[1, 2], [0.0, 1.0]]
    for name in (
        "rollout/reward",
        "ppo/loss",
        "roles/speaker/staleness_max",
        "roles/speaker/reward",
        "roles/listener/ppo/approx_kl",
        "roles/listener/reward",
        "roles/judge/reward",
    )
}


def test_role_metrics_get_a_column_per_role_with_the_reward_first():
    layout = chart_layout(SERIES, roles=["speaker", "listener"])
    assert [(c.role, c.charts) for c in layout.roles] == [
        ("speaker", ["roles/speaker/reward", "roles/speaker/staleness_max"]),
        ("listener", ["roles/listener/reward", "roles/listener/ppo/approx_kl"]),
        ("judge", ["roles/judge/reward"]),  # reported, though not in the run's roles: after them
    ]
    assert [g.id for g in layout.groups] == ["ppo"]


def test_a_run_without_role_metrics_has_no_roles_section():
    assert chart_layout({"rollout/reward": [[1], [0.5]]}).roles == []
    assert role_of("roles/speaker") is None and role_of("rollout/reward") is None
