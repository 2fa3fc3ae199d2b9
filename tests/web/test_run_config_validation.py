"""Creating a run: RunConfig is the one validator, and each error names its field."""

from __future__ import annotations

import pytest

from rl_core.config import RunConfig
from webapp.runs.models import Run, RunEvent

pytestmark = pytest.mark.django_db

ONLINE = {"name": "r1", "mode": "online", "base_model": "tiny-llama"}
DATASET = {"name": "r1", "mode": "dataset", "base_model": "tiny-llama"}


@pytest.fixture
def dataset(project, make_dataset):
    return make_dataset(project)


@pytest.mark.parametrize(
    "payload,field,phrase",
    [
        (ONLINE | {"max_staleness": -1}, "max_staleness", "at least 0"),
        (ONLINE | {"batch_size": "4"}, "batch_size", "whole number"),
        (ONLINE | {"batch_size": 4.5}, "batch_size", "whole number"),
        (ONLINE | {"batch_size": True}, "batch_size", "whole number"),
        (ONLINE | {"learning_rate": "1e-5"}, "learning_rate", "number"),
        (ONLINE | {"learning_rate": 0}, "learning_rate", "greater than 0"),
        (ONLINE | {"top_p": 1.5}, "top_p", "at most 1"),
        (ONLINE | {"use_decoupled_loss": "yes"}, "use_decoupled_loss", "true or false"),
        (ONLINE | {"learning_rat": 1e-5}, "learning_rat", "Unknown"),
        (ONLINE | {"inference_backend": "tgi"}, "inference_backend", "auto, torch, sglang, vllm"),
        (ONLINE | {"mode": "offline"}, "mode", "online, dataset"),
        (ONLINE | {"inference_tensor_parallel": 0}, "inference_tensor_parallel", "at least 1"),
        (
            ONLINE | {"inference_backend": "torch", "inference_tensor_parallel": 2},
            "inference_tensor_parallel",
            "torch engine serves a model on one device",
        ),
        ({"name": "r1", "mode": "online"}, "base_model", "required"),
        (ONLINE | {"base_model": "   "}, "base_model", "base_model"),
        (ONLINE | {"base_model": None}, "base_model", "null"),
        (ONLINE | {"init_checkpoint": 7}, "init_checkpoint", "No checkpoint '7' in this project"),
        (ONLINE | {"init_checkpoint": 7.5}, "init_checkpoint", "string"),
        (ONLINE | {"init_checkpoint": " /c/step_20"}, "init_checkpoint", "surrounding spaces"),
        (DATASET | {"reward": {"type": "exact_match"}}, "dataset", "Dataset mode needs a dataset"),
        (DATASET, "reward", "needs a reward"),
        (ONLINE | {"reward": "exact_match"}, "reward", "JSON object"),
        (ONLINE | {"reward": {"type": "regex", "pattern": "("}}, "reward", "regular expression"),
        (ONLINE | {"reward": {"type": "regex"}}, "reward", "pattern"),
        (ONLINE | {"reward": {"type": "python"}}, "reward", "module.submodule:function"),
        (ONLINE | {"reward": {"type": "python", "path": "no colon"}}, "reward", "path"),
        (ONLINE | {"reward": {"type": "telepathy"}}, "reward", "reward.type"),
        (ONLINE | {"reward": {"type": "math", "bonus": 1}}, "reward", "Unknown reward keys"),
        (ONLINE | {"lr_warmup_steps": 100, "max_steps": 100}, "lr_warmup_steps", "shorter"),
        (ONLINE | {"ppo_minibatches": 16, "batch_size": 8}, "ppo_minibatches", "batch_size"),
        (ONLINE | {"train_workers": 0}, "train_workers", "at least 1"),
        (ONLINE | {"precision": "fp16"}, "precision", "auto, fp32, bf16"),
        (ONLINE | {"gradient_checkpointing": 1}, "gradient_checkpointing", "true or false"),
        (ONLINE | {"lora_rank": -1}, "lora_rank", "at least 0"),
        (ONLINE | {"lora_rank": 8, "lora_alpha": 0}, "lora_alpha", "greater than 0"),
        (ONLINE | {"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout", "less than 1"),
        (
            ONLINE | {"lora_rank": 8, "lora_target_modules": {"q": 1}},
            "lora_target_modules",
            "list of names",
        ),
        (
            ONLINE | {"lora_rank": 8, "lora_target_modules": ["q_proj", 3]},
            "lora_target_modules",
            "list of names",
        ),
        (ONLINE | {"lora_target_modules": ["q_proj"]}, "lora_target_modules", "lora_rank above 0"),
        (
            ONLINE | {"lora_rank": 8, "lora_target_modules": ["all-linear", "q_proj"]},
            "lora_target_modules",
            "alone",
        ),
        ({**ONLINE, "name": ""}, "name", "blank"),
        ({k: v for k, v in ONLINE.items() if k != "name"}, "name", "required"),
    ],
)
def test_invalid_settings_are_400_naming_the_field(api, api_error, payload, field, phrase):
    response = api.post("/api/v1/runs/", payload, format="json")
    error = api_error(response, 400)
    assert error["code"] == "invalid"
    assert field in error["fields"], error
    assert phrase in " ".join(map(str, error["fields"][field])), error["fields"][field]
    assert field in error["message"]
    assert not Run.objects.exists()


def test_dataset_mode_batch_must_hold_whole_groups(api, api_error, dataset):
    payload = DATASET | {"reward": {"type": "math"}, "dataset": str(dataset.id)}
    error = api_error(
        api.post("/api/v1/runs/", payload | {"batch_size": 6, "group_size": 4}, format="json"),
        400,
    )
    assert "multiple of group_size" in error["fields"]["batch_size"][0]


def test_several_bad_fields_are_all_reported(api, api_error):
    payload = ONLINE | {"max_staleness": -1, "seed": "x", "top_p": 0}
    error = api_error(api.post("/api/v1/runs/", payload, format="json"), 400)
    assert set(error["fields"]) == {"max_staleness", "seed", "top_p"}


def test_unknown_dataset_id_is_400_not_found(api, api_error):
    payload = DATASET | {"reward": {"type": "exact_match"}, "dataset": "not-a-uuid"}
    error = api_error(api.post("/api/v1/runs/", payload, format="json"), 400)
    assert "not found" in error["fields"]["dataset"][0].lower()


def test_online_run_gets_every_default_filled_in(api, model_named):
    response = api.post("/api/v1/runs/", ONLINE, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    expected = RunConfig(mode="online", base_model=model_named("tiny-llama")).to_dict()
    assert body["config"] == expected
    assert body["config"]["max_staleness"] == 4 and body["config"]["batch_size"] == 8
    assert body["status"] == "draft" and body["mode"] == "online" and body["dataset"] is None
    assert body["step"] == 0 and body["weight_version"] == 0
    assert [event["kind"] for event in body["events"]] == ["created"]

    run = Run.objects.get(pk=body["id"])
    assert run.config == expected
    assert RunConfig.from_dict(run.config) == RunConfig.from_dict(expected)
    assert RunEvent.objects.filter(run=run, kind="created").count() == 1


def test_dataset_run_keeps_given_settings_and_links_the_dataset(api, dataset):
    payload = DATASET | {
        "dataset": str(dataset.id),
        "reward": {"type": "regex", "pattern": r"\d+"},
        "max_staleness": 0,
        "batch_size": 16,
        "group_size": 8,
        "learning_rate": 3e-6,
        "eps_clip_higher": 0.28,
        "inference_backend": "torch",
    }
    response = api.post("/api/v1/runs/", payload, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["dataset"] == str(dataset.id) and body["mode"] == "dataset"
    config = body["config"]
    assert config["reward"] == {"type": "regex", "pattern": r"\d+"}
    assert (config["max_staleness"], config["batch_size"], config["group_size"]) == (0, 16, 8)
    assert config["learning_rate"] == 3e-6 and config["eps_clip_higher"] == 0.28
    assert config["dual_clip"] is None and config["seed"] == 0


def test_integral_float_for_an_int_setting_is_accepted_as_int(api):
    response = api.post("/api/v1/runs/", ONLINE | {"max_steps": 10.0}, format="json")
    assert response.status_code == 201
    assert response.json()["config"]["max_steps"] == 10
    assert isinstance(response.json()["config"]["max_steps"], int)


def test_empty_optional_float_means_none(api):
    response = api.post("/api/v1/runs/", ONLINE | {"dual_clip": ""}, format="json")
    assert response.status_code == 201
    assert response.json()["config"]["dual_clip"] is None


def test_lora_settings_round_trip_through_the_api(api):
    response = api.post(
        "/api/v1/runs/",
        ONLINE | {"lora_rank": 8, "lora_target_modules": "q_proj, v_proj", "precision": "fp32"},
        format="json",
    )
    assert response.status_code == 201, response.json()
    config = response.json()["config"]
    assert config["lora_rank"] == 8
    assert config["lora_target_modules"] == ["q_proj", "v_proj"]
    assert (config["train_workers"], config["lora_alpha"]) == (1, 16.0)
    assert (config["precision"], config["gradient_checkpointing"]) == ("fp32", False)
    assert (
        RunConfig.from_dict({"base_model": "m", "mode": "online", "lora_rank": 4}).lora_targets
        == "all-linear"
    )


def test_a_lora_run_may_shard_over_several_trainer_workers(api):
    response = api.post(
        "/api/v1/runs/", ONLINE | {"lora_rank": 8, "train_workers": 2}, format="json"
    )
    assert response.status_code == 201, response.json()
    config = response.json()["config"]
    assert (config["lora_rank"], config["train_workers"]) == (8, 2)
