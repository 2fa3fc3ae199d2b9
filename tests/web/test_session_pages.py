"""Dashboard pages for agents and sessions: snippet, live counts, turns with version-coloured tokens."""

from __future__ import annotations

import ast
import html
import re
from types import SimpleNamespace

import pytest

from webapp.agents.snippets import openai_snippet
from webapp.gateway.models import Session

pytestmark = pytest.mark.django_db

S, T = Session.Status, Session.Trajectory
HTMX = {"HTTP_HX_REQUEST": "true"}
USER = {"role": "user"}


@pytest.fixture
def world(project, other_project, make_run, make_agent, make_session, tokenizer_dir):
    run = make_run(project, name="online", base_model=str(tokenizer_dir))
    agent = make_agent(project, name="solver", run=run)
    chat = make_session(
        agent,
        [
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    USER | {"content": "What is 2 + 2?"},
                ],
                "answer": "It is 4.",
                "versions": 3,
                "reward": 0.5,
            },
            {
                "messages": [USER | {"content": "And times 3?"}],
                "answer": "That makes 12.",
                "versions": (3, 4, 6),
                "reward": 1.0,
            },
        ],
        task_id="arith-1",
        metadata={"split": "train", "difficulty": 2},
        admitted_version=3,
    )
    live = make_session(
        agent,
        [{"messages": [USER | {"content": "Name a prime."}], "answer": "7", "versions": 4}],
        status=S.OPEN,
        trajectory=T.PENDING,
    )
    other_run = make_run(other_project, name="rival-run", base_model=str(tokenizer_dir))
    other_agent = make_agent(other_project, name="rival-agent", run=other_run)
    secret = make_session(
        other_agent,
        [{"messages": [USER | {"content": "secret prompt"}], "answer": "secret", "reward": 1}],
    )
    return SimpleNamespace(
        project=project,
        run=run,
        agent=agent,
        chat=chat,
        live=live,
        other_project=other_project,
        other_agent=other_agent,
        secret=secret,
    )


def agent_url(project, agent) -> str:
    return f"/projects/{project.id}/agents/{agent.id}/"


def session_url(project, session) -> str:
    return f"/projects/{project.id}/sessions/{session.id}/"


def page(client, url: str, **extra) -> str:
    response = client.get(url, **extra)
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


GENERATED = re.compile(
    r'<span class="tok v\d" data-version="(-?\d+)" data-id="(\d+)" data-lp="(-?[\d.]+)">(.*?)</span>',
    re.S,
)
PROMPT = re.compile(r'<span class="tok prompt" data-id="(\d+)">(.*?)</span>', re.S)


def token_spans(body: str) -> list[tuple[int, str]]:
    """(version, text) of every generated-token span in the page's answers."""
    return [(int(v), html.unescape(text)) for v, _, _, text in GENERATED.findall(body)]


# --- the snippet ------------------------------------------------------------------------------


def test_openai_snippet_is_python_that_calls_the_rl_protocol():
    code = openai_snippet(base_url="http://steep.test/agents/abc/v1", api_key="sk-steep-xyz")
    ast.parse(code)
    assert "OpenAI(base_url=BASE_URL, api_key=session_key)" in code
    assert 'BASE_URL = "http://steep.test/agents/abc/v1"' in code
    assert 'PROJECT_KEY = "sk-steep-xyz"' in code
    calls = re.findall(r"/rl/(\w+)", code)
    assert calls == ["start_session", "set_reward", "end_session"]
    assert (
        'started.json()["api_key"]' in code
    )  # the session key, not the project key, drives the client


# --- agent page -------------------------------------------------------------------------------


def test_agent_page_shows_base_url_snippet_and_live_sessions(member_client, world):
    body = page(member_client, agent_url(world.project, world.agent))
    assert "<html" in body
    assert html.escape(world.agent.base_url) in body
    assert html.escape(f'BASE_URL = "{world.agent.base_url}"') in body
    for call in ("/rl/start_session", "/rl/set_reward", "/rl/end_session"):
        assert call in body
    assert re.search(r'<b id="open-count">1</b> open session\b', body)
    for session in (world.chat, world.live):
        assert session_url(world.project, session) in body
    assert "arith-1" in body
    assert str(world.secret.id) not in body and "secret prompt" not in body


def test_agent_page_lists_recent_interactions_linking_to_their_session(member_client, world):
    body = page(member_client, agent_url(world.project, world.agent))
    section = body[body.index("Recent interactions") :]
    assert f'{session_url(world.project, world.chat)}#turn-1"' in section
    assert f'{session_url(world.project, world.chat)}#turn-0"' in section
    assert f'{session_url(world.project, world.live)}#turn-0"' in section
    assert "And times 3?" in section and "That makes 12." in section
    assert "v3, v4" in section
    assert section.index("Name a prime.") < section.index("And times 3?")  # newest first


def test_agent_page_open_count_is_an_htmx_fragment_that_polls(member_client, world, make_session):
    url = agent_url(world.project, world.agent)
    fragment = page(member_client, url, **HTMX)
    assert "<html" not in fragment and "Use it from Python" not in fragment
    assert "Recent interactions" not in fragment  # heavy: loaded with the page, not every poll
    assert fragment.lstrip().startswith('<div id="agent-live"')
    assert f'hx-get="{url}"' in fragment and 'hx-trigger="every 3s"' in fragment
    assert '<b id="open-count">1</b>' in fragment
    make_session(world.agent, [], status=S.OPEN, trajectory=T.PENDING)
    assert '<b id="open-count">2</b> open sessions' in page(member_client, url, **HTMX)
    full = page(member_client, url)
    assert "<html" in full and 'id="agent-live"' in full and "Use it from Python" in full
    assert "Recent interactions" in full


def test_agent_page_htmx_links_keep_their_href(member_client, world):
    body = page(member_client, agent_url(world.project, world.agent))
    tags = re.findall(r"<a [^>]*hx-get=[^>]*>", body)
    assert len(tags) == 7  # the open count, "all" and five status filters
    for tag in tags:
        hx = re.search(r'hx-get="([^"]+)"', tag).group(1)
        assert f'href="{hx}"' in tag, tag


def test_agent_page_filters_sessions_by_status(member_client, world):
    url = agent_url(world.project, world.agent)
    open_only = page(member_client, f"{url}?status=open", **HTMX)
    assert session_url(world.project, world.live) in open_only
    assert session_url(world.project, world.chat) not in open_only
    assert f'hx-get="{url}?status=open"' in open_only  # polling keeps the filter
    ready = page(member_client, f"{url}?status=ready").split("Recent interactions")[0]
    assert session_url(world.project, world.chat) in ready
    assert session_url(world.project, world.live) not in ready
    assert "No expired sessions" in page(member_client, f"{url}?status=expired")
    assert page(member_client, f"{url}?status=bogus")  # ignored, not an error


def test_agent_page_empty_states(member_client, project, make_agent, make_run):
    bare = page(member_client, agent_url(project, make_agent(project, name="unbound")))
    assert "No sessions yet" in bare and "has no run" in bare
    assert "No completions yet" in bare
    bound = make_agent(project, name="bound", run=make_run(project, name="r"))
    body = page(member_client, agent_url(project, bound))
    assert "No sessions yet" in body and "Run the snippet above" in body
    assert '<b id="open-count">0</b> open sessions' in body


# --- session page -----------------------------------------------------------------------------


def test_session_page_shows_turns_with_version_coloured_tokens(member_client, world):
    body = page(member_client, session_url(world.project, world.chat))
    spans = token_spans(body)
    legend = body[body.index('id="version-legend"') : body.index("<article")]
    assert re.findall(r'data-version="(\d+)">v\d+<', legend) == ["3", "4"]
    answers = spans
    assert "".join(text for _, text in answers) == "It is 4.<|im_end|>That makes 12.<|im_end|>"
    assert [v for v, _ in answers] == [3] * 9 + [3] * 6 + [4] * 9
    # Same version, same colour; different versions, different colours.
    classes = re.findall(r'<span class="tok (v\d)" data-version="(\d+)"', body)
    assert {c for c, v in classes if v == "3"} == {"v0"}
    assert {c for c, v in classes if v == "4"} == {"v1"}


def test_session_page_tokens_carry_their_id_and_logprob_for_the_hover_card(member_client, world):
    body = page(member_client, session_url(world.project, world.chat))
    recorded = [
        (token_id, logprob)
        for interaction in world.chat.interactions.order_by("turn")
        for token_id, logprob in zip(
            interaction.outputs[0]["output_ids"], interaction.outputs[0]["logprobs"], strict=True
        )
    ]
    shown = [(int(i), float(lp)) for _, i, lp, _ in GENERATED.findall(body)]
    assert shown == recorded
    assert body.count('class="tokens" tabindex="0"') >= 2  # reachable with the keyboard


def test_session_page_shows_the_prompt_tokens_each_turn_added_apart_from_generated_ones(
    member_client, world, chat_tokenizer
):
    body = page(member_client, session_url(world.project, world.chat))
    first, second = world.chat.interactions.order_by("turn")
    turn0 = body[body.index('id="turn-0"') : body.index('id="turn-1"')]
    turn1 = body[body.index('id="turn-1"') :]
    ids0 = [int(i) for i, _ in PROMPT.findall(turn0)]
    assert ids0 == first.input_ids  # the first turn: its whole prompt
    assert "Prompt tokens · 57 new<" in turn0 and len(first.input_ids) == 57
    # The second turn's prompt extends the first turn's tokens and answer: only the rest is new.
    before = first.input_ids + first.outputs[0]["output_ids"]
    ids1 = [int(i) for i, _ in PROMPT.findall(turn1)]
    assert ids1 == second.input_ids[len(before) :]
    assert f"{len(ids1)} new of {len(second.input_ids)}" in turn1
    text1 = "".join(html.unescape(t) for _, t in PROMPT.findall(turn1))
    assert text1 == chat_tokenizer.decode(ids1, skip_special_tokens=False)
    assert "And times 3?" in text1 and "What is 2 + 2?" not in text1
    legend = body[body.index('id="version-legend"') : body.index("<article")]
    assert '<span class="tok prompt">prompt</span>' in legend


def test_session_page_shows_each_turns_new_messages_and_reward(member_client, world):
    body = page(member_client, session_url(world.project, world.chat))
    turn0 = body[body.index('id="turn-0"') : body.index('id="turn-1"')]
    turn1 = body[body.index('id="turn-1"') :]
    assert "You are terse." in turn0 and "What is 2 + 2?" in turn0
    assert "reward 0.500" in turn0
    # The second turn shows only what it added: not the system prompt, not the first question,
    # not the echoed first answer.
    assert "And times 3?" in turn1
    assert "You are terse." not in turn1 and "What is 2 + 2?" not in turn1
    assert "reward 1.000" in turn1 and "prefix reused" in turn1
    assert body.count("What is 2 + 2?") == 1


def test_session_page_shows_status_task_and_metadata(member_client, world):
    body = page(member_client, session_url(world.project, world.chat))
    assert '<span class="badge session-ended">ended</span>' in body
    assert '<span class="badge trajectory-ready">ready</span>' in body
    assert "arith-1" in body and "&quot;difficulty&quot;: 2" in body
    assert '<b id="reward-total">1.500</b>' in body
    assert f"/projects/{world.project.id}/agents/{world.agent.id}/" in body
    assert f"/projects/{world.project.id}/runs/{world.run.id}/" in body


def test_session_page_shows_a_character_split_over_byte_tokens_once(
    member_client, world, make_session
):
    session = make_session(
        world.agent,
        [{"messages": [USER | {"content": "Coffee?"}], "answer": "café →", "versions": 5}],
    )
    texts = [
        text for _, text in token_spans(page(member_client, session_url(world.project, session)))
    ]
    # é is two bytes (two tokens), → three: the first token of each shows the character.
    assert texts == ["c", "a", "f", "é", "", " ", "→", "", "", "<|im_end|>"]


def test_session_page_without_a_tokenizer_shows_token_ids(
    member_client, world, make_run, make_agent, make_session, settings
):
    settings.STEEP_HUB_MODELS = True  # a Hugging Face id this machine never downloaded
    run = make_run(world.project, name="remote", base_model="Org/not-here-7B")
    agent = make_agent(world.project, name="remote-agent", run=run)
    session = make_session(
        agent, [{"messages": [USER | {"content": "Hi"}], "answer": "Hey", "versions": 2}]
    )
    body = page(member_client, session_url(world.project, session))
    assert "can't be loaded here" in body and "Org/not-here-7B" in body
    ids = session.interactions.get().outputs[0]["output_ids"]
    assert token_spans(body) == [(2, str(i)) for i in ids]
    assert "Hey" in body  # the recorded text is still shown


def test_session_page_of_rewritten_history_shows_every_message(member_client, world, make_session):
    session = make_session(
        world.agent,
        [
            {"messages": [USER | {"content": "Count to 3."}], "answer": "1 2 3"},
            {"messages": [USER | {"content": "Count to 4."}], "answer": "1 2 3 4", "rewrite": True},
        ],
    )
    turn1 = page(member_client, session_url(world.project, session)).split('id="turn-1"')[1]
    assert "rewrote its history" in turn1 and "Count to 4." in turn1


def test_session_page_polls_only_while_the_session_is_open(member_client, world):
    live_url = session_url(world.project, world.live)
    fragment = page(member_client, live_url, **HTMX)
    assert "<html" not in fragment and fragment.lstrip().startswith('<div id="session-live"')
    assert f'hx-get="{live_url}"' in fragment and "every 3s" in fragment
    full = page(member_client, live_url)
    assert "<html" in full and 'id="session-live"' in full
    assert "every 3s" not in page(member_client, session_url(world.project, world.chat))


def test_session_page_of_a_session_without_turns_or_agent(member_client, world, make_session):
    empty = make_session(world.agent, [], status=S.OPEN, trajectory=T.PENDING)
    assert "No turns yet" in page(member_client, session_url(world.project, empty))
    rollout = make_session(
        world.agent, [{"messages": [USER | {"content": "2+2?"}], "answer": "4", "reward": 1}]
    )
    Session.objects.filter(pk=rollout.pk).update(agent=None)
    assert "rollout driver" in page(member_client, session_url(world.project, rollout))


def test_run_page_lists_recent_sessions_and_the_export(member_client, world):
    body = page(member_client, f"/projects/{world.project.id}/runs/{world.run.id}/")
    section = body[body.index('id="run-sessions"') :]
    assert session_url(world.project, world.chat) in section
    assert session_url(world.project, world.live) in section
    export = f"/api/v1/runs/{world.run.id}/trajectories/export"
    assert f"{export}?project={world.project.id}" in section
    assert f"{export}?format=parquet&amp;project={world.project.id}" in section
    assert str(world.secret.id) not in body


# --- access -----------------------------------------------------------------------------------


def test_pages_redirect_to_login_when_logged_out(client, world):
    for url in (agent_url(world.project, world.agent), session_url(world.project, world.chat)):
        response = client.get(url)
        assert response.status_code == 302 and "/login/" in response["Location"]


def test_pages_are_404_for_non_members(outsider_client, world):
    for url in (agent_url(world.project, world.agent), session_url(world.project, world.chat)):
        assert outsider_client.get(url).status_code == 404
        assert outsider_client.get(url, **HTMX).status_code == 404


def test_another_projects_session_is_404_under_ones_own_project(
    outsider_client, member_client, world
):
    # The outsider is a member of other_project: naming it does not reach project's session.
    theirs = f"/projects/{world.other_project.id}/sessions/{world.chat.id}/"
    assert outsider_client.get(theirs).status_code == 404
    assert (
        member_client.get(f"/projects/{world.project.id}/sessions/{world.secret.id}/").status_code
        == 404
    )
    assert page(outsider_client, session_url(world.other_project, world.secret))
    assert (
        member_client.get(f"/projects/{world.project.id}/sessions/not-a-uuid/").status_code == 404
    )


def test_session_page_marks_an_aborted_turn_as_not_trained(member_client, world):
    turn = world.live.interactions.get()
    assert "aborted, not trained" not in page(member_client, session_url(world.project, world.live))
    turn.outputs[0] |= {"aborted": True, "finish_reason": "abort"}
    turn.save(update_fields=["outputs"])
    body = page(member_client, session_url(world.project, world.live))
    assert "aborted, not trained" in body and "(abort)" in body


def test_a_long_session_stored_as_added_shows_its_turns_a_page_at_a_time(
    member_client, world, make_session
):
    """Issue 36: 45 turns, each stored as what it added, are shown twenty to a page (the latest
    page by default), each with the prompt tokens it added, as a session stored whole is."""
    turns = [
        {
            "messages": [USER | {"content": f"Question {i}?"}],
            "answer": f"Answer {i}.",
            "versions": 2,
        }
        for i in range(45)
    ]
    long = make_session(world.agent, turns, stored_as_added=True)
    whole = make_session(world.agent, turns)
    stored = list(long.interactions.values_list("prefix_turn", flat=True).order_by("turn"))
    assert stored == [None, *range(44)]  # really stored as added

    last = page(member_client, session_url(world.project, long))
    assert re.findall(r'id="turn-(\d+)"', last) == [str(t) for t in range(40, 45)]
    assert "45 turns, 20 a page:" in last
    assert '<a href="?page=1">0–19</a>' in last and '<b aria-current="page">40–44</b>' in last
    first = page(member_client, session_url(world.project, long) + "?page=1")
    assert re.findall(r'id="turn-(\d+)"', first) == [str(t) for t in range(20)]
    fallback = page(member_client, session_url(world.project, long) + "?page=x")
    assert re.findall(r'id="turn-(\d+)"', fallback) == [str(t) for t in range(40, 45)]
    for number in ("1", "2", "3"):
        body = page(member_client, session_url(world.project, long) + f"?page={number}")
        same = page(member_client, session_url(world.project, whole) + f"?page={number}")
        assert PROMPT.findall(body) == PROMPT.findall(same)
        assert re.findall(r"\d+ new of \d+", body) == re.findall(r"\d+ new of \d+", same)
        assert token_spans(body) == token_spans(same)
    turn30 = page(member_client, session_url(world.project, long) + "?page=2")
    turn30 = turn30[turn30.index('id="turn-30"') : turn30.index('id="turn-31"')]
    assert "Question 30?" in turn30 and "Question 29?" not in turn30
