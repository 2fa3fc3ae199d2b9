"""Every run setting is in exactly one of the form's groups, so none can be left off the form."""

from __future__ import annotations

from collections import Counter

from rl_core.config import RunConfig
from rl_core.config_groups import ESSENTIALS, POOL_SETTINGS, SETTING_GROUPS


def test_every_setting_is_in_exactly_one_group():
    listed = Counter(name for names in SETTING_GROUPS.values() for name in names)
    fields = {spec.name for spec in RunConfig.field_specs()}
    assert {name for name, n in listed.items() if n > 1} == set(), "listed in two groups"
    assert fields - set(listed) == set(), (
        "add these settings to a group in rl_core/config_groups.py"
    )
    assert set(listed) - fields == set(), "not RunConfig settings"


def test_the_essentials_come_first_and_the_pool_settings_are_settings():
    assert next(iter(SETTING_GROUPS)) == ESSENTIALS
    assert {"mode", "base_model", "reward", "max_steps"} == set(SETTING_GROUPS[ESSENTIALS])
    assert set(POOL_SETTINGS) <= {spec.name for spec in RunConfig.field_specs()}
