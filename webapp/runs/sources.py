"""The instance's rules for what a run may name (``rl_core.sources``), applied at every door.

Run creation (REST, the dashboard form, clone: all through ``run_create``) calls
``config_sourced``; the launch of a run's job and the config the job fetches call
``run_sourced``, so a config written before the rules (or by hand) is refused when it runs.
Checkpoints are named by id within the run's project: another project's answers as an unknown
one does.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings

from rl_core.config import ConfigError, RunConfig
from rl_core.sources import SourceRefused, SourceRules, config_source_errors, model_source
from webapp.accounts.models import Project
from webapp.runs.models import Checkpoint, Run


@functools.lru_cache(maxsize=8)
def _addresses_of(host: str) -> tuple[str, ...]:
    try:
        return tuple(sorted({info[4][0] for info in socket.getaddrinfo(host, None)}))
    except OSError:
        return ()


def _own_hosts() -> tuple[str, ...]:
    hosts = {urlsplit(url).hostname for url in (settings.SITE_URL, settings.INTERNAL_API_URL)}
    hosts |= {h for h in settings.ALLOWED_HOSTS if h and "*" not in h and not h.startswith(".")}
    hosts.add(socket.gethostname())
    found: set[str] = set()
    for host in filter(None, hosts):
        host = host.strip("[]")
        found.add(host)
        found.update(_addresses_of(host))
    return tuple(sorted(found))


def source_rules(*, unrestricted: bool = False) -> SourceRules:
    """The rules as this instance's settings say (``unrestricted``: an operator's bypass)."""
    return SourceRules(
        model_roots=tuple(settings.STEEP_MODEL_ROOTS),
        offered_models=(settings.STEEP_DEMO_MODEL,),
        hub_models=settings.STEEP_HUB_MODELS,
        private_dirs=(str(Path(settings.DATA_DIR) / "runs"),),
        reward_modules=tuple(settings.STEEP_REWARD_MODULES),
        outbound_allow=tuple(settings.STEEP_OUTBOUND_ALLOW),
        own_hosts=_own_hosts(),
        unrestricted=unrestricted,
    )


def _not_found(value: str) -> SourceRefused:
    return SourceRefused(
        "init_checkpoint",
        f"No checkpoint {value!r} in this project: init_checkpoint takes the id of one of this"
        " project's checkpoints (GET /api/v1/runs/{run_id}/checkpoints/ lists them, with their"
        " ids), never a path.",
    )


def checkpoint_reference(*, project: Project, value: str, legacy_paths: bool = False) -> Checkpoint:
    """The checkpoint of ``project`` that ``init_checkpoint`` = ``value`` names: its id (or,
    with ``legacy_paths``, the path a config written before ids recorded), else
    ``SourceRefused``. Another project's checkpoint is refused as an unknown one is."""
    value = str(value).strip()
    found = None
    if value.isdigit():
        found = Checkpoint.objects.filter(pk=int(value), run__project=project).first()
    elif legacy_paths and value:
        found = Checkpoint.objects.filter(path=value, run__project=project).first()
    if found is None:
        raise _not_found(value)
    return found


def _errors(config: RunConfig, rules: SourceRules) -> dict[str, list[str]]:
    """What ``rules`` refuse in ``config``, a checkpoint recorded anywhere named as a model too."""
    errors = config_source_errors(config, rules)
    name = config.base_model.strip()
    if (
        "base_model" not in errors
        and not rules.unrestricted
        and Checkpoint.objects.filter(path__in={name, name.rstrip("/")}).exists()
    ):
        errors["base_model"] = [
            f"base_model {name!r} is a run's checkpoint, not a model: start from a checkpoint"
            " of your project with init_checkpoint (its id)."
        ]
    return errors


def config_sourced(
    *, project: Project, config: RunConfig, rules: SourceRules
) -> tuple[RunConfig, dict[str, list[str]]]:
    """``config`` as it is stored (base_model as the server loads it, init_checkpoint as a
    checkpoint id of ``project``) and what the rules refuse in it (empty: nothing)."""
    errors = _errors(config, rules)
    changes: dict[str, str] = {}
    if "base_model" not in errors:
        changes["base_model"] = model_source(config.base_model, rules)
    if config.init_checkpoint:
        try:
            checkpoint = checkpoint_reference(project=project, value=config.init_checkpoint)
            changes["init_checkpoint"] = str(checkpoint.pk)
        except SourceRefused as exc:
            errors.setdefault(exc.setting, []).append(str(exc))
    return dataclasses.replace(config, **changes), errors


def run_sourced(*, run: Run) -> tuple[dict, dict[str, list[str]]]:
    """The settings a run's job starts from (``init_checkpoint`` resolved to the checkpoint's
    directory) and what the rules refuse in the stored config, checked again as it runs."""
    rules = source_rules(unrestricted=run.sources_unrestricted)
    stored = dict(run.config)
    known = {spec.name for spec in RunConfig.field_specs()}
    try:
        config = RunConfig.from_dict({k: v for k, v in stored.items() if k in known})
    except ConfigError as exc:
        return stored, exc.errors
    errors = _errors(config, rules)
    if config.init_checkpoint:
        try:
            checkpoint = checkpoint_reference(
                project=run.project, value=config.init_checkpoint, legacy_paths=True
            )
            stored["init_checkpoint"] = checkpoint.path
        except SourceRefused as exc:
            errors.setdefault(exc.setting, []).append(str(exc))
    return stored, errors
