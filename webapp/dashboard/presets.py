"""The run form's presets: starting points that fill in its fields (``?preset=<slug>``, or a click).

Their values live here and nowhere else: the form renders them pre-filled for ``?preset=``
(so they work without JavaScript) and hands them to ``static/run_form.js`` as JSON. A
preset names run settings (``RunConfig`` fields) and ``dataset`` (an id); what it leaves out
keeps the form's default. "Like the demo" is the demo's dataset run, settings and all
(``rl_core.toy.DEMO_SETTINGS``), so it learns what the demo learns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from rl_core.toy import DEMO_SETTINGS, ONLINE_DEMO_SETTINGS
from webapp.datasets.models import Dataset
from webapp.pools.models import Pool
from webapp.runs.demo import DEMO_DATASET, DEMO_POOL

BLANK = "defaults"


@dataclass(frozen=True)
class RunPreset:
    slug: str
    title: str
    description: str
    values: dict[str, Any] = field(default_factory=dict)


def run_presets(*, datasets: Iterable[Dataset], pools: Iterable[Pool]) -> list[RunPreset]:
    """The presets for a project with ``datasets`` on an instance with ``pools``: the defaults,
    "Like the demo", and "LoRA on a shared pool" where there is a pool."""
    demo_dataset = next((d for d in datasets if d.name == DEMO_DATASET), None)
    presets = [
        RunPreset(BLANK, "Defaults", "Steep's defaults: a dataset run scored by exact match."),
        RunPreset(
            "demo",
            "Like the demo",
            "The demo's dataset run: the demo model learns to say the letter a prompt asks for"
            f" ({DEMO_DATASET} dataset{'' if demo_dataset else ', in the demo project'};"
            " a python reward, batches of 64 in groups of 8).",
            {
                "mode": "dataset",
                "base_model": settings.STEEP_DEMO_MODEL,
                "dataset": str(demo_dataset.id) if demo_dataset else "",
                **DEMO_SETTINGS,
            },
        ),
    ]
    pool = _pool_for_lora(list(pools))
    if pool is not None:
        rank = min(ONLINE_DEMO_SETTINGS["lora_rank"], pool.max_lora_rank)
        presets.append(
            RunPreset(
                "lora-pool",
                "LoRA on a shared pool",
                f"An online run that trains a rank-{rank} adapter of {pool.name}'s model, served by"
                f" the shared pool {pool.name} beside the other runs on it (no servers of its own)."
                " Your agents call the run's base_url.",
                {
                    "mode": "online",
                    "base_model": pool.base_model,
                    "reward": {},  # online: the agents report rewards
                    **ONLINE_DEMO_SETTINGS,
                    "lora_rank": rank,
                    "lora_target_modules": list(pool.lora_target_modules),
                    "inference_pool": pool.name,
                    # The demo's online run never completes; one of yours ends at 1,000 steps.
                    "max_steps": 1000,
                },
            )
        )
    return presets


def preset_named(presets: list[RunPreset], slug: str | None) -> RunPreset | None:
    return next((p for p in presets if p.slug == slug), None)


def _pool_for_lora(pools: list[Pool]) -> Pool | None:
    """The demo pool, else the first running pool, else the first."""
    running = [p for p in pools if p.status == Pool.Status.RUNNING]
    named = [p for p in pools if p.name == DEMO_POOL]
    return next(iter(named + running + pools), None)
