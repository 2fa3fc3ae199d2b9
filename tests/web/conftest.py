"""Recorded sessions for the web tests, written straight through the ORM (no engine needed).

- ``tokenizer_dir``: the tiny model's tokenizer and chat template alone (byte-level:
  one token per byte, plus ChatML specials), built without torch. A run whose
  ``base_model`` is this directory gets its tokens decoded on the session page.
- ``make_session(agent, turns, ...)``: a session as the gateway records it. Each turn
  is ``{"messages": [new messages], "answer": str, "versions": v | (old, new, k), "reward": x}``;
  prompts are the chat template rendered and tokenized, answers end with
  ``<|im_end|>``, and a turn whose prompt extends the previous turn's exact tokens is
  marked ``prefix_reused`` (pass ``"rewrite": True`` to start the history afresh).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rl_core.tiny import CHAT_TEMPLATE, IM_END, _byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    _byte_level_tokenizer().save(str(path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": IM_END, "pad_token": "<|pad|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def chat_tokenizer(tokenizer_dir):
    from rl_core.chat import ChatTokenizer

    return ChatTokenizer.from_pretrained(tokenizer_dir)


def _logprobs(n: int, turn: int) -> list[float]:
    return [round(-0.05 - 0.37 * ((i * 7 + turn) % 5), 4) for i in range(n)]


@pytest.fixture
def make_session(db, chat_tokenizer) -> Callable[..., Any]:
    from django.utils import timezone

    from webapp.gateway import deltas
    from webapp.gateway.models import Interaction, Session

    tok = chat_tokenizer
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    clock = {"now": timezone.now() - timedelta(hours=1)}

    def make(
        agent,
        turns: list[dict],
        *,
        run=None,
        project=None,
        status: str = Session.Status.ENDED,
        trajectory: str = Session.Trajectory.READY,
        task_id: str = "",
        metadata: dict | None = None,
        one_turn: bool = False,
        admitted_version: int = 0,
        stored_as_added: bool = False,
    ):
        """``stored_as_added``: a turn that continues the last one stores only what it added,
        as the gateway writes it (``webapp.gateway.deltas``)."""
        clock["now"] += timedelta(minutes=1)
        created = clock["now"]
        session = Session.objects.create(
            project=project or agent.project,
            agent=agent,
            run=run if run is not None else agent.run,
            one_turn=one_turn,
            task_id=task_id,
            metadata=metadata or {},
            status=status,
            trajectory=trajectory,
            admitted_version=admitted_version,
            interaction_count=len(turns),
            created_at=created,
            last_activity_at=created + timedelta(seconds=len(turns)),
            ended_at=None if status == Session.Status.OPEN else created + timedelta(seconds=30),
        )
        messages: list[dict] = []
        previous: list[int] | None = None
        sent: list[dict] = []  # the last turn's messages
        for index, turn in enumerate(turns):
            messages = (
                list(turn["messages"]) if turn.get("rewrite") else messages + turn["messages"]
            )
            input_ids = tok.encode(tok.render(messages))
            output_ids = tok.encode(turn["answer"]) + [im_end]
            reused = previous is not None and input_ids[: len(previous)] == previous
            iid = f"chatcmpl-{session.id.hex[:8]}{index:04d}"
            prefix = None
            if stored_as_added and reused and not turn.get("rewrite"):
                prefix = deltas.Prefix(index - 1, 0, len(sent), len(previous or []))
            Interaction.objects.create(
                id=iid,
                session=session,
                turn=index,
                request_hash=f"{iid}-hash",
                **deltas.stored(prefix, messages, input_ids),
                sampling={"max_new_tokens": 256, "temperature": 1.0, "n": 1},
                prefix_reused=reused,
                outputs=[
                    {
                        "output_ids": output_ids,
                        "logprobs": _logprobs(len(output_ids), index),
                        "versions": _versions(turn, len(output_ids)),
                        "finish_reason": "stop",
                        "text": turn["answer"],
                    }
                ],
                response={
                    "id": iid,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": turn["answer"]},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": len(input_ids),
                        "completion_tokens": len(output_ids),
                        "total_tokens": len(input_ids) + len(output_ids),
                    },
                },
                reward=turn.get("reward"),
                rewarded_at=created if turn.get("reward") is not None else None,
                latency_ms=120.0 + index,
                created_at=created + timedelta(seconds=index),
            )
            sent = messages
            messages = messages + [{"role": "assistant", "content": turn["answer"]}]
            previous = input_ids + output_ids
        return session

    return make


def _versions(turn: dict, n: int) -> list[int]:
    """One version for every token (an int), or ``(old, new, k)``: the weights changed after k tokens."""
    versions = turn.get("versions", 0)
    if isinstance(versions, int):
        return [versions] * n
    old, new, k = versions
    assert 0 < k < n, f"switch at token {k} of {n}"
    return [old] * k + [new] * (n - k)
