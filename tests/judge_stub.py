"""A stand-in OpenAI-compatible judge: a real HTTP server on a thread answering
``POST /v1/chat/completions`` (the judge models themselves cannot run here).

``mode``: ``"grade"`` scores each answer by ``grader(answer text)`` (default: 1.0 when it says
"4"), read from the prompt the judge is sent, so a verdict follows the answer; ``"garbage"``
answers text that is not JSON; ``"garbage-once"`` does that once, then grades; ``"down"``
answers HTTP 503. It counts requests and keeps their bodies and Authorization headers.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ANSWER = re.compile(r"### Answer (\d+)\n(.*?)(?=\n\n### Answer |\n\nReply as)", re.DOTALL)


def answer_of(prompt: str) -> str:
    """The answer being judged, out of an absolute judge's prompt."""
    return prompt.rsplit("[assistant, the answer to judge]", 1)[-1].split("\n\nReply as")[0]


def says_four(answer: str) -> float:
    return 1.0 if "4" in answer else 0.0


class StubJudge:
    def __init__(self):
        self.mode = "grade"
        self.grader: Callable[[str], float] = says_four
        self.requests: list[dict] = []
        self.auth: list[str] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests.append(body)
                    stub.auth.append(self.headers.get("Authorization", ""))
                    mode = stub.mode
                    if mode == "garbage-once":
                        stub.mode = "grade"
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": "not found"}})
                if mode == "down":
                    return self._send(503, {"error": {"message": "judge overloaded"}})
                prompt = body["messages"][-1]["content"]
                if mode in ("garbage", "garbage-once"):
                    content = "I think it is quite good!"
                elif "### Answer" in prompt:
                    scores = [
                        {
                            "id": int(n),
                            "score": stub.grader(answer_of("[assistant, the answer to judge]" + t)),
                        }
                        for n, t in _ANSWER.findall(prompt)
                    ]
                    content = json.dumps({"scores": scores})
                else:
                    content = json.dumps(
                        {"score": stub.grader(answer_of(prompt)), "reason": "graded"}
                    )
                self._send(
                    200,
                    {
                        "id": "chatcmpl-judge",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": content},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 100,
                            "completion_tokens": 20,
                            "total_tokens": 120,
                        },
                    },
                )

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
