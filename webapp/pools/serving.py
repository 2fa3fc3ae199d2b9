"""What a pool's servers report about the runs they serve (``GET /get_server_info``).

The torch engine reports, per run (the adapter name without its version), the requests
running and waiting, the tokens generated and tokens/s over the last 10 s, and which
adapters it holds loaded or has evicted (``rl_core/inference/torch_engine/fair.py``,
``lora.py``). SGLang's server info has none of these per-run fields: its servers count as
not reporting, and the pool page says so instead of showing zeros.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx

logger = logging.getLogger("steep.pools")

STATS_TIMEOUT_S = 1.0  # a staff page waits at most this long for a slow server


def _state(url: str) -> dict | None:
    try:
        response = httpx.get(f"{url.rstrip('/')}/get_server_info", timeout=STATS_TIMEOUT_S)
        response.raise_for_status()
        states = response.json().get("internal_states") or [{}]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.info("no statistics from pool server %s: %s", url, exc)
        return None
    state = states[0] if isinstance(states[0], dict) else {}
    return state if "tenants" in state else None


def server_states(urls: list[str]) -> dict[str, dict | None]:
    """Each server's internal state, or None when it did not answer with per-run figures."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        return dict(zip(urls, pool.map(_state, urls), strict=True))


def per_run(states: dict[str, dict | None]) -> dict[str, dict[str, float]]:
    """Summed over the reporting servers: run (adapter prefix) → running, queue depth, tokens/s."""
    runs: dict[str, dict[str, float]] = {}
    for state in states.values():
        for tenant, figures in (state or {}).get("tenants", {}).items():
            row = runs.setdefault(
                tenant, {"running_requests": 0, "queue_depth": 0, "tokens_per_s": 0.0}
            )
            row["running_requests"] += int(figures.get("running_reqs", 0))
            row["queue_depth"] += int(figures.get("waiting_reqs", 0))
            row["tokens_per_s"] += float(figures.get("tokens_per_s", 0.0))
    return runs
