"""One long agent session through the gateway (issue 36): what a turn costs as the session grows.

    .venv/bin/python bench/long_session.py [--turns 128] [--tokens 4] [--json out.json]

Starts a private Steep (a fresh DATA_DIR on the embedded SQLite, uvicorn, no worker) and two
torch engines serving the tiny model at 8,192 positions: one with its prefix cache (the
default) and one without (``--disable-radix-cache``: every turn prefills the whole
conversation, as before issue 36). Against each, one session of ``--turns`` turns through the
official ``openai`` SDK: every turn re-sends the whole conversation, gets an answer of
``--tokens`` tokens and adds a short user message. Each turn is timed three ways:

- ``sdk``: the ``chat.completions.create`` call, what the agent waits for;
- ``http``: the HTTP exchange alone (the SDK's ``httpx`` event hooks: from the request's
  headers out to the response's), Steep's time and the engine's: the rest of ``sdk`` is the
  SDK's own work on the growing message list, in the agent's process;
- ``engine``: the engine's ``busy_seconds`` (its time in prefill and decode steps) per turn.

It reports the mean of turns 1-8 and of the last eight, their ratio, and the bytes each turn's
row wrote (its ``messages`` and ``input_ids`` columns, read back from the database) against
what a whole row of the last turn holds. Everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.livestack import LiveStack, bench_instance  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from rl_core.inference.launch import TorchEngineServer
    from rl_core.tiny import build_tiny_model

    results = []
    settings = {"DEBUG": "false", "ALLOWED_HOSTS": "127.0.0.1,localhost", "LOG_LEVEL": "WARNING"}
    with bench_instance("long-session", worker=False, access_log=False, **settings) as instance:
        work, data_dir = instance.work, instance.data_dir
        model = build_tiny_model(data_dir / "models" / "tiny-8k", max_positions=8192)
        engines = {
            "prefix cache": TorchEngineServer(
                model, host="127.0.0.1", num_threads=1, log_path=work / "engine-cache.log"
            ),
            "no prefix cache": TorchEngineServer(
                model,
                host="127.0.0.1",
                num_threads=1,
                log_path=work / "engine-plain.log",
                extra_args=["--disable-radix-cache"],
            ),
        }
        try:
            for engine in engines.values():
                engine.start()
            for label, engine in engines.items():
                engine.wait_healthy(timeout=120)
                agent_id = _agent(instance.stack, model, engine.url, label)
                results.append(
                    _session(
                        instance.url,
                        instance.key,
                        agent_id,
                        engine.url,
                        label,
                        args,
                        data_dir / "steep.sqlite3",
                    )
                )
        finally:
            for engine in engines.values():
                engine.stop()
    print(_table(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _agent(stack: LiveStack, model: Path, engine_url: str, label: str) -> str:
    code = textwrap.dedent(
        f"""
        from rl_core.config import RunConfig
        from webapp.accounts.models import Project
        from webapp.agents.services import agent_create
        from webapp.runs.services import run_create
        project = Project.objects.get(name="bench")
        config = RunConfig.from_dict({{"mode": "online", "base_model": {str(model)!r},
                                      "max_staleness": 1000000, "batch_size": 1000}})
        run = run_create(project=project, name={label!r}, config=config)
        agent = agent_create(project=project, name={label!r}, run=run)
        print("IDS", run.id, agent.id)
        """
    )
    out = stack.manage("shell", "-c", code)
    _, run_id, agent_id = [line for line in out.splitlines() if line.startswith("IDS ")][-1].split()
    stack.manage("attach_inference_server", "--run", run_id, "--url", engine_url)
    return agent_id


def _busy(engine_url: str) -> float:
    info = httpx.get(engine_url + "/server_info", timeout=30).json()["internal_states"][0]
    return float(info["busy_seconds"])


def _session(site, key, agent_id, engine_url, label, args, database: Path) -> dict:
    import openai

    marks: dict[str, float] = {}

    def sent(request) -> None:
        marks["sent"] = time.perf_counter()

    def received(response) -> None:
        marks["received"] = time.perf_counter()

    base = f"{site}/agents/{agent_id}/v1"
    started = httpx.post(
        f"{base}/rl/start_session", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).json()
    http = httpx.Client(timeout=60, event_hooks={"request": [sent], "response": [received]})
    client = openai.OpenAI(base_url=base, api_key=started["api_key"], http_client=http)
    messages: list[dict] = [{"role": "user", "content": "Hi"}]
    sdk, wire, engine = [], [], []
    for turn in range(args.turns):
        busy = _busy(engine_url)
        begun = time.perf_counter()
        completion = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=args.tokens, seed=turn
        )
        sdk.append((time.perf_counter() - begun) * 1000)
        wire.append((marks["received"] - marks["sent"]) * 1000)
        engine.append((_busy(engine_url) - busy) * 1000)
        answer = completion.choices[0].message.content
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Result {turn}."},
        ]
    httpx.post(f"{base}/rl/end_session", headers={"Authorization": f"Bearer {started['api_key']}"})
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "SELECT i.turn, length(i.messages) + length(i.input_ids), i.prefix_turn"
            " FROM gateway_interaction i WHERE i.session_id = ? ORDER BY i.turn",
            [started["session_id"].replace("-", "")],
        ).fetchall()
    whole = len(json.dumps(messages[:-2])) + len(
        json.dumps(list(range(completion.usage.prompt_tokens)))
    )
    return {
        "engine": label,
        "turns": args.turns,
        "prompt_tokens_last": completion.usage.prompt_tokens,
        "sdk_ms": sdk,
        "http_ms": wire,
        "engine_ms": engine,
        "row_bytes": [size for _, size, _ in rows],
        "rows_continuing": sum(1 for *_, prefix in rows if prefix is not None),
        "whole_row_bytes_last": whole,
    }


def _table(results: list[dict], args) -> str:
    def span(values: list[float]) -> tuple[float, float]:
        return statistics.mean(values[1:9]), statistics.mean(values[-8:])

    lines = [
        f"One session of {args.turns} turns, {args.tokens} tokens per answer, tiny model "
        "(torch engine, one thread), SQLite, one uvicorn worker; means in ms (turn 0 left out: "
        "it loads the tokenizer).",
        "",
        "| engine | timed | turns 1-8 | last 8 | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for result in results:
        for name in ("sdk", "http", "engine"):
            first, last = span(result[f"{name}_ms"])
            lines.append(
                f"| {result['engine']} | {name} | {first:.1f} | {last:.1f} | {last / first:.2f}x |"
            )
    result = results[0]
    first, last = span([float(b) for b in result["row_bytes"]])
    lines += [
        "",
        f"Row bytes written per turn (messages + input_ids): {first:.0f} at turns 1-8, "
        f"{last:.0f} at the last 8; a whole row of the last turn holds "
        f"{result['whole_row_bytes_last']:,} bytes ({result['prompt_tokens_last']:,} prompt "
        f"tokens). Rows stored as what they added: {result['rows_continuing']} of {result['turns']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
