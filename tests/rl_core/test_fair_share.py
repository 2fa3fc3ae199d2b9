"""The torch engine's weighted fair share of the batch (rl_core/inference/torch_engine/fair.py).

Deterministic: the queue is driven step by step as the engine's scheduler drives it (one
``pick`` per step, requests finishing after a fixed number of steps), no threads or clocks.
"""

from __future__ import annotations

import collections

import pytest

from rl_core.inference.torch_engine.fair import BASE, FairQueue, tenant_of


class Req:
    def __init__(self, lora_path: str | None, steps: int = 4):
        self.lora_path = lora_path
        self.steps_left = steps
        self.tenant = ""


def simulate(queue: FairQueue, arrivals: dict[int, list[Req]], steps: int) -> list[list[Req]]:
    """Run ``steps`` scheduler steps: requests arrive, ``pick`` admits, each running request
    finishes after its ``steps_left`` steps. Returns the batch after each step's admission."""
    running: list[Req] = []
    batches = []
    for step in range(steps):
        for req in arrivals.get(step, []):
            queue.append(req)
        running += queue.pick(running)
        batches.append(list(running))
        for req in running:
            req.steps_left -= 1
        running = [r for r in running if r.steps_left > 0]
    return batches


def test_tenant_is_the_adapter_name_without_its_version():
    assert tenant_of("3f2a-run-v12") == "3f2a-run"
    assert tenant_of("run-v1") == tenant_of("run-v2") == "run"
    assert tenant_of("plain-name") == "plain-name"
    assert tenant_of(None) == BASE


def test_a_run_alone_gets_the_whole_batch():
    queue = FairQueue(capacity=8)
    flood = [Req("b-v1", steps=100) for _ in range(20)]
    batches = simulate(queue, {0: flood}, steps=1)
    assert len(batches[0]) == 8


def test_a_flooding_run_leaves_the_light_run_its_share_and_the_light_request_joins_first():
    queue = FairQueue(capacity=8)
    flood = [Req("b-v1", steps=4) for _ in range(80)]
    light = [Req("a-v3", steps=2) for _ in range(3)]
    # The flood arrives first and fills the batch; the light run's requests come later.
    batches = simulate(queue, {0: flood, 5: [light[0]], 9: [light[1]], 13: [light[2]]}, steps=16)
    assert len(batches[4]) == 8 and {r.tenant for r in batches[4]} == {"b"}
    # Step 5: no free row (no preemption); the flood's rows all finish after step 7, and
    # the light request takes a freed row at step 8, ahead of the flood's 64 waiting ones.
    assert light[0] not in batches[7]
    assert light[0] in batches[8]
    # From then on the flood refills only its half of the batch, also in the gaps between
    # the light run's requests (steps 11, 12: it lingers), so they join on arrival.
    assert light[1] in batches[9]
    assert light[2] in batches[13]
    for batch in batches[8:]:
        assert collections.Counter(r.tenant for r in batch)["b"] <= 4


def test_first_come_first_served_would_have_kept_the_light_request_waiting():
    # The same flood under a single FIFO (what the engine did before): the light request
    # waits behind all 64 queued flood requests, 8 more batches of 4 steps.
    fifo: collections.deque[Req] = collections.deque(Req("b", steps=4) for _ in range(80))
    light, running, joined = Req("a", steps=2), [], None
    for step in range(60):
        if step == 5:
            fifo.append(light)
        while fifo and len(running) < 8:
            running.append(fifo.popleft())
        if light in running and joined is None:
            joined = step
        for req in running:
            req.steps_left -= 1
        running = [r for r in running if r.steps_left > 0]
    assert joined == 40


def test_without_a_free_row_the_light_run_waits_only_for_the_next_freed_row():
    queue = FairQueue(capacity=4)
    flood = [Req("b-v1", steps=3) for _ in range(40)]
    light = Req("a-v1", steps=1)
    batches = simulate(queue, {0: flood, 1: [light]}, steps=5)
    # Step 1: the batch is full of the flood. Step 3: the first flood rows finish, and the
    # light request takes the first freed row, ahead of the flood's 36 waiting requests.
    assert light not in batches[2]
    assert light in batches[3]


def test_weights_split_the_batch_and_the_admissions():
    queue = FairQueue(capacity=9)
    queue.set_weights({"heavy": 2.0})
    heavy = [Req("heavy-v1", steps=1) for _ in range(60)]
    light = [Req("light-v1", steps=1) for _ in range(60)]
    batches = simulate(queue, {0: heavy + light}, steps=5)
    for batch in batches:
        counts = collections.Counter(r.tenant for r in batch)
        assert counts == {"heavy": 6, "light": 3}  # 2:1 of 9 rows


def test_deficit_round_robin_keeps_the_weight_ratio_one_free_row_at_a_time():
    queue = FairQueue(capacity=100)  # shares never bind: only the order decides
    queue.set_weights({"x": 2.0, "y": 1.0})
    for _ in range(30):
        queue.append(Req("x-v1"))
        queue.append(Req("y-v1"))
    order = []
    running: list[Req] = [Req("z-v1") for _ in range(99)]  # one free row per step
    for _ in range(30):
        (req,) = queue.pick(running)
        order.append(req.tenant)
    assert collections.Counter(order) == {"x": 20, "y": 10}
    assert order[:6] == ["x", "x", "y", "x", "x", "y"]


def test_a_refused_request_holds_back_only_its_own_run():
    queue = FairQueue(capacity=8)
    for _ in range(3):
        queue.append(Req("a-v1"))
        queue.append(Req("b-v1"))
    admitted = queue.pick([], may_join=lambda req, admitted: req.tenant != "a")
    assert [r.tenant for r in admitted] == ["b", "b", "b"]
    assert queue.depth() == {"a": 3}
    assert len(queue.pick([], may_join=None)) == 3


def test_removing_and_clearing_keep_the_queue_consistent():
    queue = FairQueue(capacity=4)
    a, b = Req("a-v1"), Req(None)
    queue.append(a)
    queue.append(b)
    assert a in queue and b in queue and len(queue) == 2
    queue.remove(a)
    assert a not in queue and queue.depth() == {BASE: 1}
    queue.clear()
    assert not queue and len(queue) == 0


@pytest.mark.parametrize("weight", [0, -1, float("inf"), float("nan")])
def test_weights_must_be_positive_numbers(weight):
    with pytest.raises(ValueError, match="positive"):
        FairQueue(capacity=4).set_weights({"a": weight})


def test_a_run_idle_for_longer_than_the_linger_gives_its_share_back():
    queue = FairQueue(capacity=8, linger_steps=3)
    flood = [Req("b-v1", steps=1) for _ in range(200)]
    light = Req("a-v1", steps=1)
    batches = simulate(queue, {0: flood, 2: [light]}, steps=10)
    counts = [collections.Counter(r.tenant for r in batch)["b"] for batch in batches]
    # Alone: 8 rows; beside the light run (and 3 steps after it left): 4; then all 8 again.
    assert counts == [8, 8, 4, 4, 4, 4, 8, 8, 8, 8]


def test_token_rates_count_the_last_window_per_run():
    from rl_core.inference.torch_engine.fair import TokenRates

    rates = TokenRates(window_s=10)
    rates.add(collections.Counter({"a": 3, "b": 1}), now=100.2)
    rates.add(collections.Counter({"a": 2}), now=100.7)
    rates.add(collections.Counter({"a": 5}), now=105.0)
    assert rates.per_second(105.5) == {"a": 1.0, "b": 0.1}
    assert rates.per_second(110.5) == {"a": 0.5}  # the second 100 left the window
    rates.add(collections.Counter({"b": 4}), now=200.0)
    assert rates.per_second(200.0) == {"b": 0.4}


def test_a_multi_agent_runs_roles_are_one_tenant_with_the_runs_weight():
    run = "5bb5e265-eb68-4037-8d16-5e44adf5babb"
    assert tenant_of(f"{run}-speaker-v3") == tenant_of(f"{run}-listener-v3") == run
    assert tenant_of(f"{run}-v3") == run
    assert tenant_of("plain-speaker-v3") == "plain-speaker"  # not a run id: left as it is
    queue = FairQueue(capacity=8)
    queue.set_weights({run: 3.0})
    roles = [Req(f"{run}-{role}-v1", steps=100) for role in ("speaker", "listener") * 10]
    other = [Req("other-v1", steps=100) for _ in range(10)]
    batch = simulate(queue, {0: roles + other}, steps=1)[0]
    # Two tenants, weights 3 and 1: the run's roles together hold 6 of the 8 rows, not a share
    # each (with one each they would take 2 x 8/3 rows between them and weigh 1 apiece).
    held = collections.Counter(r.tenant for r in batch)
    assert held == {run: 6, "other": 2}
