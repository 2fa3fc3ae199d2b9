"""A judge's base_url is screened as each request is sent, through the official openai SDK:
redirects are not followed (a 3xx is an outage, not a hop to the metadata address), and a host
the rules refuse is never contacted."""

from __future__ import annotations

import http.server
import threading

import pytest

from webapp.rewards.judge import judge_answers

pytestmark = pytest.mark.django_db


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


@pytest.fixture
def redirecting_judge():
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            hits.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(307)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/iam/")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", hits
    server.shutdown()
    server.server_close()
    thread.join(5)


def _spec(base_url: str) -> dict:
    return {"type": "judge", "rubric": "Is it right?", "model": "judge", "base_url": base_url}


def test_a_redirect_from_the_judge_is_an_outage_and_is_not_followed(redirecting_judge):
    base_url, hits = redirecting_judge
    result = judge_answers(_spec(base_url), ["user: 2+2?\nassistant: 4"])
    assert result.outage and result.verdict is None
    assert "307" in result.error
    assert hits == ["/v1/chat/completions"]  # asked once, then nothing followed the Location


def test_a_judge_the_rules_refuse_now_is_never_contacted(redirecting_judge, settings):
    base_url, hits = redirecting_judge
    settings.STEEP_OUTBOUND_ALLOW = []  # e.g. the operator took back the loopback allowance
    result = judge_answers(_spec(base_url), ["user: 2+2?\nassistant: 4"])
    assert result.outage and "reward.base_url" in result.error
    assert "STEEP_OUTBOUND_ALLOW" in result.error
    assert hits == []
