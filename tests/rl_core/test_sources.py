"""rl_core.sources: what a run's settings may make the server read, import and call."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from rl_core.config import RunConfig
from rl_core.sources import (
    SourceRefused,
    SourceRules,
    config_source_errors,
    model_source,
    reward_source_errors,
    screened_client,
    url_errors,
)
from tests.local_http import redirecting, serving


@pytest.fixture
def roots(tmp_path: Path) -> SourceRules:
    (tmp_path / "models" / "smol").mkdir(parents=True)
    (tmp_path / "data" / "runs" / "r1" / "checkpoints" / "step_20").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return SourceRules(
        model_roots=(str(tmp_path / "models"),),
        offered_models=("/opt/demo-model",),
        private_dirs=(str(tmp_path / "data" / "runs"),),
    )


def refused(name: str, rules: SourceRules) -> str:
    with pytest.raises(SourceRefused) as raised:
        model_source(name, rules)
    assert raised.value.setting == "base_model"
    return str(raised.value)


# -- models --------------------------------------------------------------------------------


def test_a_model_under_a_root_is_offered_by_path_and_by_bare_name(roots, tmp_path):
    smol = str(tmp_path / "models" / "smol")
    assert model_source(smol, roots) == smol
    assert model_source("smol", roots) == smol  # stored as the server loads it
    assert model_source(smol + "/", roots) == smol


def test_the_demo_model_is_offered_as_named(roots):
    assert model_source("/opt/demo-model", roots) == "/opt/demo-model"


@pytest.mark.parametrize("name", ["/etc", "/", "~", ".", "../../etc", "smol/../../elsewhere"])
def test_directories_outside_the_roots_are_refused_saying_where_models_may_come_from(roots, name):
    message = refused(name, roots)
    assert "STEEP_MODEL_ROOTS" in message and "GET /api/v1/models/" in message


def test_a_root_itself_and_a_missing_directory_are_refused(roots, tmp_path):
    refused(str(tmp_path / "models"), roots)
    refused(str(tmp_path / "models" / "not-there"), roots)
    refused("not-there", roots)


def test_a_symlink_inside_a_root_that_leads_out_of_it_is_refused(roots, tmp_path):
    os.symlink(tmp_path / "elsewhere", tmp_path / "models" / "escape")
    refused(str(tmp_path / "models" / "escape"), roots)
    refused("escape", roots)


def test_a_checkpoint_directory_is_refused_even_under_a_root(tmp_path):
    rules = SourceRules(model_roots=(str(tmp_path),), private_dirs=(str(tmp_path / "runs"),))
    (tmp_path / "runs" / "r1" / "step_20").mkdir(parents=True)
    assert "init_checkpoint" in refused(str(tmp_path / "runs" / "r1" / "step_20"), rules)


def test_hugging_face_ids_only_where_the_operator_allows_them(roots):
    assert "STEEP_HUB_MODELS" in refused("Qwen/Qwen2.5-7B-Instruct", roots)
    hub = SourceRules(**{**roots.to_dict(), "hub_models": True})
    assert model_source("Qwen/Qwen2.5-7B-Instruct", hub) == "Qwen/Qwen2.5-7B-Instruct"
    for not_an_id in ("/etc/passwd", "../x/y", "a/b/c", "os:system"):
        refused(not_an_id, hub)


def test_a_hugging_face_id_that_is_a_relative_path_here_is_refused(roots, tmp_path, monkeypatch):
    hub = SourceRules(**{**roots.to_dict(), "hub_models": True})
    (tmp_path / "runs" / "step_20").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # where a process resolving "runs/step_20" would read it
    assert "names a path here" in refused("runs/step_20", hub)


def test_an_operators_bypass_takes_any_model(roots):
    assert model_source("/etc", SourceRules(unrestricted=True)) == "/etc"


def test_rules_travel_to_the_job_unchanged(roots):
    assert SourceRules.from_dict(roots.to_dict()) == roots


# -- reward code ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "os:system",
        "subprocess:run",
        "runpy:run_module",
        "builtins:exec",
        "rl_core.rewards:import_function",  # Steep's own module, but not a reward function
        "rl_core.toy:_private_reward_fn_helper",
    ],
)
def test_reward_code_the_operator_did_not_allow_is_refused(path):
    (message,) = reward_source_errors({"type": "python", "path": path}, SourceRules())
    assert path in message and "STEEP_REWARD_MODULES" in message


def test_steeps_own_reward_functions_are_always_allowed():
    for path in ("rl_core.toy:say_letter_reward_fn", "rl_core.rewards:exact_match_reward_fn"):
        assert reward_source_errors({"type": "python", "path": path}, SourceRules()) == []


def test_the_operators_modules_are_allowed_by_prefix():
    rules = SourceRules(reward_modules=("mycorp.rewards",))
    ok = ["mycorp.rewards:score", "mycorp.rewards.code:passes"]
    for path in ok:
        assert reward_source_errors({"type": "python", "path": path}, rules) == []
    for path in ("mycorp.rewardsx:score", "mycorp:score", "mycorp.rewards:_private"):
        assert reward_source_errors({"type": "python", "path": path}, rules), path


# -- outbound URLs --------------------------------------------------------------------------

EMBEDDED = SourceRules(outbound_allow=("127.0.0.0/8", "::1", "localhost"))


@pytest.mark.parametrize(
    "url,kind",
    [
        ("http://127.0.0.1:8000/v1", "loopback"),
        ("http://[::1]/v1", "loopback"),
        ("http://[::ffff:127.0.0.1]/v1", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[fe80::1]/v1", "link-local"),
        ("http://10.1.2.3/v1", "private"),
        ("http://192.168.0.10:11434/v1", "private"),
        ("https://172.16.5.4/v1", "private"),
        ("http://0.0.0.0/v1", "address"),
        ("http://100.64.0.1/v1", "address"),  # carrier-grade NAT: not global
    ],
)
def test_literal_addresses_that_are_not_global_are_refused_naming_the_setting(url, kind):
    (message,) = url_errors(url, SourceRules(), setting="reward.base_url")
    assert message.startswith("reward.base_url:") and kind in message
    assert "STEEP_OUTBOUND_ALLOW" in message


def test_a_public_address_is_allowed():
    assert url_errors("https://8.8.8.8/v1", SourceRules(), setting="reward.base_url") == []


def test_names_are_resolved_and_refused_when_any_address_is_private():
    def resolve(host: str) -> list[str]:
        return {"judge.example": ["93.184.216.34", "10.0.0.7"], "ok.example": ["93.184.216.34"]}[
            host
        ]

    (message,) = url_errors(
        "https://judge.example/v1", SourceRules(), setting="reward.base_url", resolve=resolve
    )
    assert "judge.example" in message and "10.0.0.7" in message and "private" in message
    assert url_errors("https://ok.example/v1", SourceRules(), setting="x", resolve=resolve) == []


def test_a_name_that_does_not_resolve_is_refused():
    def resolve(host: str) -> list[str]:
        raise OSError("Name or service not known")

    (message,) = url_errors("https://nowhere.invalid/", SourceRules(), setting="x", resolve=resolve)
    assert "cannot be resolved" in message


def test_the_operators_allowance_by_network_and_by_host_name():
    rules = SourceRules(outbound_allow=("10.0.0.0/8", "judge.internal"))
    assert url_errors("http://10.9.8.7/v1", rules, setting="x") == []
    assert url_errors("http://192.168.1.1/v1", rules, setting="x")

    def resolve(host: str) -> list[str]:
        return ["192.168.7.7"]

    assert url_errors("http://judge.internal/v1", rules, setting="x", resolve=resolve) == []
    assert url_errors("http://other.internal/v1", rules, setting="x", resolve=resolve)


def test_the_instances_own_address_is_refused_unless_allowed():
    rules = SourceRules(own_hosts=("steep.example.com", "203.0.113.9"))
    (message,) = url_errors(
        "https://steep.example.com/api", rules, setting="x", resolve=lambda h: ["203.0.113.9"]
    )
    assert "this Steep instance itself" in message
    assert url_errors("http://203.0.113.9/", rules, setting="x")


def test_the_embedded_default_allows_the_loopback_only():
    assert url_errors("http://127.0.0.1:9000/v1", EMBEDDED, setting="x") == []
    assert url_errors("http://localhost:9000/v1", EMBEDDED, setting="x") == []
    assert url_errors("http://10.0.0.1/v1", EMBEDDED, setting="x")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://x/", "http:///nohost"])
def test_what_is_not_an_http_url_is_refused(url):
    (message,) = url_errors(url, SourceRules(), setting="x")
    assert "http(s) URL" in message


def test_a_config_names_each_refused_setting():
    config = RunConfig.from_dict(
        {
            "mode": "online",
            "base_model": "/etc",
            "reward": {
                "type": "judge",
                "rubric": "r",
                "model": "m",
                "base_url": "http://169.254.169.254/v1",
            },
        }
    )
    errors = config_source_errors(config, SourceRules())
    assert set(errors) == {"base_model", "reward"}
    assert "reward.base_url" in errors["reward"][0]


# -- the screen as requests are sent ---------------------------------------------------------


@pytest.fixture
def redirecting_server():
    """A local endpoint that redirects every request to a cloud's metadata address."""
    hits: list[str] = []
    with serving(redirecting("http://169.254.169.254/latest/meta-data/", hits)) as url:
        yield url, hits


def test_redirects_are_not_followed_past_the_screen(redirecting_server):
    url, hits = redirecting_server
    with screened_client(EMBEDDED, setting="reward.base_url") as client:
        response = client.get(url + "/v1/models")
        assert response.status_code == 302 and len(hits) == 1
        with pytest.raises(httpx.ConnectError, match="link-local"):
            client.get(response.headers["Location"])  # followed by hand: screened too
    assert len(hits) == 1


def test_a_name_is_screened_again_when_the_request_is_sent(redirecting_server):
    url, hits = redirecting_server
    port = url.rsplit(":", 1)[1]
    # judge.example passed the screen when the run was created; it resolves to the loopback now.
    with screened_client(
        SourceRules(), setting="reward.base_url", resolve=lambda host: ["127.0.0.1"]
    ) as client:
        with pytest.raises(httpx.ConnectError, match="reward.base_url: 'judge.example'"):
            client.get(f"http://judge.example:{port}/v1/models")
    assert hits == []
