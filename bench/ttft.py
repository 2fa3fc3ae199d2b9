"""Time to first token through Steep's gateway vs straight to the engine (issue #15).

``python bench/gateway.py --workload ttft`` runs it: the stand-in (``bench/standin.py``)
generates ``--tokens`` tokens at ``--token-delay-ms`` each, and C clients (``--conns``,
default 1 and 64) each loop one request after another for ``--duration`` seconds after
``--warmup``. Cells, at every C:

- ``direct, stream``: ``POST /generate`` with ``stream: true`` to the stand-in; the first
  token is the first SSE event that carries output ids;
- ``Steep, stream``: ``POST /agents/{id}/v1/chat/completions`` with ``stream: true`` and the
  project key (each a recorded one-turn session); the first token is the first chunk with
  non-empty ``delta.content``;
- ``Steep, no stream``: the same request unstreamed (its "first token" is the whole answer).

TTFT overhead is Steep's streamed p50 minus the direct p50 at one client; streaming
throughput is the streamed cell's completions per second against the unstreamed one's.
The client is aiohttp in the benchmark's own process, the same for every cell.

Each cell also reports the CPU time that the gateway, the stand-in and the client spent per
completion in the measured window (``/proc/<pid>/stat``; the client's own process time): on
a machine where all three share the cores, what one process spends is what the others lack.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field


@dataclass
class TTFTCell:
    target: str
    conns: int
    completions: int
    errors: int
    seconds: float
    ttft_ms: list[float] = field(default_factory=list, repr=False)
    total_ms: list[float] = field(default_factory=list, repr=False)
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, in the window

    @property
    def rps(self) -> float:
        return self.completions / self.seconds if self.seconds else 0.0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def as_json(self) -> dict:
        out = asdict(self)
        out.pop("ttft_ms")
        out.pop("total_ms")
        out.update(
            rps=self.rps,
            ttft_p50_ms=self.pct(self.ttft_ms, 0.5),
            ttft_p99_ms=self.pct(self.ttft_ms, 0.99),
            total_p50_ms=self.pct(self.total_ms, 0.5),
            cpu_ms_per_completion={
                name: 1000 * seconds / self.completions if self.completions else float("nan")
                for name, seconds in self.cpu_s.items()
            },
        )
        return out


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (``client``: this one)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"client": time.process_time()}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _first_token(line: bytes, direct: bool) -> bool:
    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
        return False
    data = json.loads(line[6:])
    if direct:
        return bool(data.get("output_ids"))
    return any((c.get("delta") or {}).get("content") for c in data.get("choices") or [])


async def _one(session, url: str, body: dict, headers: dict, stream: bool, direct: bool):
    started = time.perf_counter()
    first = None
    async with session.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            await response.read()
            return None
        if not stream:
            await response.read()
            first = time.perf_counter()
        else:
            # Lines are looked at only until the first token; after it the body is read as it
            # comes, so the client's own cost per event stays small (it shares the cores).
            buffer = b""
            async for piece in response.content.iter_any():
                if first is not None:
                    continue
                buffer += piece
                *lines, buffer = buffer.split(b"\n")
                if any(_first_token(line.strip(), direct) for line in lines):
                    first = time.perf_counter()
    ended = time.perf_counter()
    return (first or ended) - started, ended - started


async def _cell(
    target: str, url: str, body: dict, headers: dict, *, stream: bool, direct: bool, conns: int,
    duration: float, warmup: float, pids: dict[str, int],
) -> TTFTCell:  # fmt: skip
    import aiohttp

    cell = TTFTCell(target, conns, 0, 0, duration)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        measure_from = time.perf_counter() + warmup
        stop = measure_from + duration

        async def client() -> None:
            while time.perf_counter() < stop:
                began = time.perf_counter()
                try:
                    timing = await _one(session, url, body, headers, stream, direct)
                except aiohttp.ClientError:
                    timing = None
                if began < measure_from or time.perf_counter() > stop:
                    continue
                if timing is None:
                    cell.errors += 1
                    continue
                cell.completions += 1
                cell.ttft_ms.append(timing[0] * 1000)
                cell.total_ms.append(timing[1] * 1000)

        async def cpu() -> None:
            await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
            before = _cpu_seconds(pids)
            await asyncio.sleep(max(0.0, stop - time.perf_counter()))
            after = _cpu_seconds(pids)
            cell.cpu_s = {name: after[name] - before[name] for name in after}

        await asyncio.gather(cpu(), *(client() for _ in range(conns)))
    return cell


def measure(
    *, standin_url: str, chat_url: str, key: str, conns: list[int], duration: float,
    warmup: float, tokens: int, log, targets: tuple[str, ...] | None = None,
    pids: dict[str, int] | None = None,
) -> list[TTFTCell]:  # fmt: skip
    """Every cell of the TTFT workload, in order: direct, Steep streamed, Steep unstreamed."""
    generate = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0},
        "return_logprob": True,
        "stream": True,
    }
    chat = {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": tokens,
    }
    auth = {"Authorization": f"Bearer {key}"}
    cells = []
    for c in conns:
        plan = [
            ("direct, stream", f"{standin_url}/generate", generate, {}, True, True),
            ("Steep, stream", chat_url, chat | {"stream": True}, auth, True, False),
            ("Steep, no stream", chat_url, chat, auth, False, False),
        ]
        for target, url, body, headers, stream, direct in plan:
            if targets is not None and target not in targets:
                continue
            cell = asyncio.run(
                _cell(
                    target, url, body, headers, stream=stream, direct=direct, conns=c,
                    duration=duration, warmup=warmup, pids=pids or {},
                )
            )  # fmt: skip
            row = cell.as_json()
            log(
                f"  {target:<18} c={c:<3} {row['rps']:>8.1f} compl/s  TTFT p50 "
                f"{row['ttft_p50_ms']:8.2f} ms  p99 {row['ttft_p99_ms']:8.2f} ms  "
                f"total p50 {row['total_p50_ms']:8.2f} ms  errors {cell.errors}  CPU ms/compl "
                + " ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_completion"].items())
            )
            cells.append(cell)
    return cells


def report(cells: list[TTFTCell]) -> str:
    """A markdown table, then the two verdicts (TTFT overhead at 1 client, streamed throughput)."""
    lines = [
        "| target | clients | completions/s | TTFT p50 ms | TTFT p99 ms | total p50 ms | errors "
        "| CPU ms per completion: gateway / stand-in / client |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = {(c.target, c.conns): c.as_json() for c in cells}
    for cell in cells:
        row = rows[(cell.target, cell.conns)]
        lines.append(
            f"| {cell.target} | {cell.conns} | {row['rps']:.1f} | {row['ttft_p50_ms']:.2f} | "
            f"{row['ttft_p99_ms']:.2f} | {row['total_p50_ms']:.2f} | {cell.errors} | "
            + " / ".join(
                f"{row['cpu_ms_per_completion'][k]:.2f}"
                if k in row["cpu_ms_per_completion"]
                else "–"
                for k in ("gateway", "standin", "client")
            )
            + " |"
        )
    notes = []
    for conns in sorted({c.conns for c in cells}):
        direct, streamed, plain = (
            rows.get((t, conns)) for t in ("direct, stream", "Steep, stream", "Steep, no stream")
        )
        if direct and streamed:
            notes.append(
                f"- {conns} client(s): TTFT overhead (Steep p50 - direct p50) "
                f"{streamed['ttft_p50_ms'] - direct['ttft_p50_ms']:.2f} ms"
            )
        if streamed and plain and plain["rps"]:
            notes.append(
                f"- {conns} client(s): streamed throughput {100 * streamed['rps'] / plain['rps']:.0f}% "
                "of the unstreamed path"
            )
    return "\n".join(lines + [""] + notes) + "\n"
