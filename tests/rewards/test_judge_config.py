"""A judge reward's settings: every mistake is a 400 naming it, the key is kept encrypted
(also through a clone) and never shown, and a key from the environment is read at call time."""

from __future__ import annotations

import pytest

from webapp.rewards.secrets import REDACTED, judge_api_key, redact_config, seal_config
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

GOOD = {
    "type": "judge",
    "rubric": "Is the answer correct?",
    "base_url": "http://127.0.0.1:9/v1",
    "model": "judge-model",
}
RUN = {"name": "judged", "base_model": "tiny-llama", "mode": "online"}


@pytest.mark.parametrize(
    "reward, message",
    [
        ({k: v for k, v in GOOD.items() if k != "rubric"}, '"rubric"'),
        (GOOD | {"rubric": "  "}, '"rubric"'),
        ({k: v for k, v in GOOD.items() if k != "model"}, '"model"'),
        (GOOD | {"base_url": "ftp://judge"}, '"base_url"'),
        (GOOD | {"base_url": 7}, '"base_url"'),
        (GOOD | {"api_key": "sk-1", "api_key_env": "JUDGE_KEY"}, "one way"),
        (GOOD | {"api_key_env": "not a name"}, "api_key_env"),
        (GOOD | {"api_key": ""}, "api_key"),
        (GOOD | {"relative": "yes"}, "relative"),
        (GOOD | {"timeout_s": -1}, "timeout_s"),
        (GOOD | {"max_tokens": 3}, "max_tokens"),
        (GOOD | {"judge": "self"}, "leave out base_url, model"),
        ({"type": "judge", "judge": "self"}, '"rubric"'),
        ({"type": "judge", "judge": "gpt", "rubric": "r"}, 'can only be "self"'),
        (GOOD | {"stars": 5}, "Unknown reward keys"),
    ],
)
def test_a_bad_judge_setting_is_400_naming_it(api, api_error, reward, message):
    error = api_error(api.post("/api/v1/runs/", RUN | {"reward": reward}, format="json"), 400)
    assert message in " ".join(error["fields"]["reward"]), error
    assert not Run.objects.exists()


def test_a_judge_key_given_by_value_is_stored_encrypted_and_survives_a_clone(api):
    response = api.post(
        "/api/v1/runs/", RUN | {"reward": GOOD | {"api_key": "sk-judge-9"}}, format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["config"]["reward"]["api_key"] == REDACTED
    run = Run.objects.get()
    assert "sk-judge-9" not in str(run.config)
    assert judge_api_key(run.config["reward"]) == "sk-judge-9"
    clone = api.post(f"/api/v1/runs/{run.id}/clone/", {}, format="json")
    assert clone.status_code == 201, clone.content
    copied = Run.objects.exclude(pk=run.pk).get()
    assert judge_api_key(copied.config["reward"]) == "sk-judge-9"
    assert "sk-judge-9" not in str(copied.config)


def test_a_key_from_the_environment_is_read_when_the_judge_is_called(monkeypatch):
    spec = GOOD | {"api_key_env": "STEEP_TEST_JUDGE_KEY"}
    monkeypatch.setenv("STEEP_TEST_JUDGE_KEY", "sk-from-env")
    assert judge_api_key(spec) == "sk-from-env"
    assert seal_config({"reward": spec}) == {"reward": spec}  # nothing to encrypt
    assert redact_config({"reward": spec}) == {"reward": spec}  # the name is no secret


def test_a_key_encrypted_under_another_secret_key_is_an_outage_saying_why(settings):
    sealed = seal_config({"reward": GOOD | {"api_key": "sk-1"}})["reward"]
    settings.SECRET_KEY = "another-secret-key-entirely-0123456789"
    from webapp.rewards.judge import judge_answers

    result = judge_answers(sealed, ["[user] hi\n[assistant, the answer to judge] hello"])
    assert result.outage and "cannot be decrypted" in result.error and result.verdict is None
