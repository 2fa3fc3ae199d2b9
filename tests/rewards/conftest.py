"""A stub OpenAI-compatible judge (``tests.judge_stub``) and sessions to reward."""

from __future__ import annotations

import pytest

from tests.judge_stub import StubJudge
from tests.rl_core.conftest import (  # noqa: F401  (a torch engine and a reference forward)
    reference,
    torch_engine,
    torch_engine_factory,
)
from tests.web.conftest import (  # noqa: F401  (recorded sessions, written through the ORM)
    chat_tokenizer,
    make_session,
    tokenizer_dir,
)


@pytest.fixture
def judge_server():
    stub = StubJudge()
    yield stub
    stub.close()


@pytest.fixture
def judge_spec(judge_server):
    return {
        "type": "judge",
        "rubric": "Score 1 if the answer is the number 4, else 0.",
        "base_url": judge_server.base_url,
        "model": "stub-judge",
        "api_key": "sk-judge-secret-123",
        "timeout_s": 5,
    }
