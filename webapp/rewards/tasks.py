"""The worker's reward task (beat: every ``STEEP_JUDGE_INTERVAL_S``)."""

from __future__ import annotations

from celery import shared_task

from webapp.rewards.services import rewards_tick


@shared_task(name="rewards.tick", ignore_result=True)
def rewards_tick_task() -> dict[str, int]:
    return rewards_tick()
