"""A trainer stand-in: the ``Trainer`` the training loop and both weight syncs call, charging
simulated GPU time (``rl_core.sim.cost.TrainerCost``) instead of computing.

``train_step`` costs ``TrainerCost.step_seconds(tokens)`` of the batch's real tokens and
records how many versions behind the step's starting policy every trained token is (the
staleness distribution the simulation reports). ``save_weights`` / ``save_adapter`` write a
small marker directory and charge the disk time; ``broadcast_weights`` charges the
broadcast. Called through ``asyncio.to_thread`` under ``SimEventLoop``, so the charges are
simulated time during which generation goes on.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_core.sim.clock import charge
from rl_core.sim.cost import TrainerCost
from rl_core.types import Trajectory


class SimTrainer:
    """``M`` data-parallel trainer GPUs as one stand-in (``cost.gpus``); see the module docstring."""

    def __init__(self, cost: TrainerCost, *, tokens_per_id: int = 1, version: int = 0):
        self.cost = cost
        self.g = max(1, int(tokens_per_id))
        self.version = version
        self.busy_s = 0.0  # simulated seconds spent in train_step
        self.trained_tokens = 0  # real response tokens trained
        self.trained_trajectories = 0
        self.staleness: collections.Counter[int] = collections.Counter()  # real tokens by lag

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        tokens = sum(len(t.input_ids) for t in trajectories) * self.g
        seconds = self.cost.step_seconds(tokens)
        charge(seconds)
        self.busy_s += seconds
        for t in trajectories:
            lags = collections.Counter(v for v, m in zip(t.versions, t.loss_mask, strict=True) if m)
            for v, n in lags.items():
                self.staleness[self.version - v] += n * self.g
                self.trained_tokens += n * self.g
        self.trained_trajectories += len(trajectories)
        self.version += 1
        return {"loss": 0.0, "sim/train_seconds": seconds}

    def _marker(self, path: str, nbytes: float) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sim.json").write_text(json.dumps({"version": self.version, "bytes": nbytes}))
        return path

    def save_weights(self, path: str) -> str:
        charge(self.cost.weight_bytes() / self.cost.disk_write_Bps)
        return self._marker(path, self.cost.weight_bytes())

    def save_adapter(self, path: str) -> str:
        charge(self.cost.adapter_bytes() / self.cost.disk_write_Bps)
        return self._marker(path, self.cost.adapter_bytes())

    def save_checkpoint(self, path: str) -> str:
        return self._marker(path, 0.0)

    def load_checkpoint(self, path: str) -> None:
        self.version = int(json.loads((Path(path) / "sim.json").read_text())["version"])

    # ----- the distributed weight sync's side (rl_core.weight_sync)

    def weight_metadata(self) -> dict[str, list]:
        """One bf16 tensor of ``params`` elements: the broadcast's size is what matters."""
        return {"names": ["model"], "dtypes": ["bfloat16"], "shapes": [[int(self.cost.params)]]}

    def weight_group_address(self) -> tuple[str, int]:
        return "127.0.0.1", 1  # never connected to: the stand-ins have no process group

    def init_weight_group(self, **kwargs: Any) -> None:
        return None

    def destroy_weight_group(self, group_name: str) -> None:
        return None

    def broadcast_weights(self, group_name: str) -> dict[str, Any]:
        nbytes = self.cost.weight_bytes()
        charge(nbytes / self.cost.broadcast_Bps)
        return {"ok": True, "bytes": nbytes}
