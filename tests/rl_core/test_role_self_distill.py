"""Self-distillation in a multi-agent run: each trajectory is scored under the current adapter
of the role that produced it (``<run>-<role>-v<N>``), not under one run-wide adapter."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from rl_core.config import RunConfig
from rl_core.distill import TeacherScorer
from rl_core.types import Trajectory


class _RecordingTeacher:
    name = "recording"

    def __init__(self) -> None:
        self.adapters: list[str | None] = []

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        self.adapters.append(adapter)
        return [0.0] + [-1.0] * (len(input_ids) - 1)

    async def aclose(self) -> None:
        pass


def _traj(role: str) -> Trajectory:
    return Trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -1.0], [-1, -1, 3, 3], [1.0],
                      role=role)  # fmt: skip


async def test_each_trajectory_is_scored_under_its_roles_adapter():
    teacher = _RecordingTeacher()
    scorer = TeacherScorer(teacher, adapter_for=lambda t: f"run7-{t.role}-v3")
    await scorer.score([_traj("speaker"), _traj("listener")])
    assert sorted(teacher.adapters) == ["run7-listener-v3", "run7-speaker-v3"]


async def test_the_jobs_self_teacher_names_the_current_adapter_of_the_trajectorys_role(
    tiny_model_dir,
):
    from workers.ray_job import self_teacher

    config = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            "mode": "online",
            "lora_rank": 8,
            "roles": ["speaker", "listener"],
            "self_distill": True,
        }
    )
    loop = SimpleNamespace(version=3)
    sync = SimpleNamespace(urls=[])
    scorer = self_teacher(config, "run7", loop, sync, "torch", SimpleNamespace(hint_signals=None))
    assert scorer.adapter_for is not None
    assert scorer.adapter_for(_traj("listener")) == "run7-listener-v3"
    assert scorer.adapter_for(_traj("speaker")) == "run7-speaker-v3"
