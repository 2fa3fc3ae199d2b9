"""A run judged by its own model on its own inference servers (``"judge": "self"``), against a
stand-in for SGLang's ``/generate`` (SGLang cannot run here) that reads the prompt's token ids
with the run's tokenizer and answers a verdict's token ids."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.rewards.models import JudgeCall, RewardRequest
from webapp.rewards.services import rewards_tick
from webapp.runs.jobs import job_submit_episodes

pytestmark = pytest.mark.django_db

T = Session.Trajectory


@pytest.fixture
def engine(chat_tokenizer):
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            prompt = chat_tokenizer.decode(body["input_ids"], skip_special_tokens=False)
            answer = prompt.rsplit("[assistant, the answer to judge]", 1)[-1].split("Reply as")[0]
            verdict = json.dumps({"score": 1.0 if "4" in answer else 0.0, "reason": "read it"})
            ids = chat_tokenizer.encode(verdict)
            data = json.dumps(
                {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}}}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def run(project, make_dataset, make_run, tokenizer_dir):
    """A dataset run judged by its own model (``tokenizer_dir``'s tokenizer), groups of one."""
    return make_run(
        project,
        dataset=make_dataset(project),
        base_model=str(tokenizer_dir),
        reward={"type": "judge", "judge": "self", "rubric": "1 if the answer is 4, else 0."},
        group_size=1,
    )


def _episode(answer: str) -> dict:
    return {
        "input_ids": [1, 2],
        "output_ids": [3],
        "logprobs": [-0.1],
        "versions": [0],
        "reward": None,
        "text": answer,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "group_id": answer,
    }


def test_a_self_judged_run_waits_for_its_server_then_its_own_model_scores_it(run, engine):
    url, seen = engine
    ids = job_submit_episodes(run=run, episodes=[_episode("4"), _episode("5")])

    rewards_tick()  # no server up yet: waiting, not lost
    requests = RewardRequest.objects.filter(session_id__in=ids)
    assert {r.state for r in requests} == {RewardRequest.State.PENDING}
    assert all("no inference server up" in r.reason for r in requests)

    InferenceServer.objects.create(run=run, url=url, backend="sglang")
    RewardRequest.objects.filter(session_id__in=ids).update(next_attempt_at=run.created_at)
    counts = rewards_tick()

    assert counts["scored"] == 2 and len(seen) == 2
    assert "lora_path" not in seen[0]  # the base model answers, never an adapter
    assert seen[0]["sampling_params"]["temperature"] == 0.0
    rewards = {
        i.response["choices"][0]["message"]["content"]: i.reward
        for i in Interaction.objects.filter(session__run=run)
    }
    assert rewards == {"4": 1.0, "5": 0.0}
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}
    assert sum(JudgeCall.objects.filter(run=run).values_list("completion_tokens", flat=True)) > 0


def test_a_self_judge_asks_the_runs_next_server_when_one_is_down(run, engine):
    from rl_core.inference.process import free_ports

    url, seen = engine
    (dead_port,) = free_ports(1)  # nothing listens there: refused at once
    dead = InferenceServer.objects.create(run=run, url=f"http://127.0.0.1:{dead_port}")
    InferenceServer.objects.create(run=run, url=url, backend="sglang")
    ids = job_submit_episodes(run=run, episodes=[_episode("4")])

    counts = rewards_tick()

    assert counts["scored"] == 1 and len(seen) == 1  # the second server answered
    assert Interaction.objects.get(session_id=ids[0]).reward == 1.0
    # With every server down the call is an outage that waits, naming each server's failure.
    InferenceServer.objects.exclude(pk=dead.pk).update(url=f"http://127.0.0.1:{dead_port}/b")
    InferenceServer.objects.filter(pk=dead.pk).update(url=f"http://127.0.0.1:{dead_port}/a")
    (other,) = job_submit_episodes(run=run, episodes=[_episode("5")])
    rewards_tick()
    request = RewardRequest.objects.get(session_id=other)
    assert request.state == RewardRequest.State.PENDING
    assert "no inference server of the run answered" in request.reason
    assert request.reason.count("is unreachable") == 2
