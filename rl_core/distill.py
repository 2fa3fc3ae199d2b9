"""On-policy distillation (issue 38): a teacher's per-token judgement of the student's own samples.

The teacher scores the exact tokens the student was served: ``log p_teacher(x_t | x_<t)`` for
every token of a trajectory, in one prefill (no generation). Each trained token's signal is
the per-token reverse KL estimate's negative,

    d_t = log p_teacher(x_t) - log p_student(x_t)

with ``log p_student`` the behaviour logprob the engine recorded when it sampled ``x_t``
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"; Thinking Machines' "On-Policy Distillation", 2025, which trains on
it as a per-token advantage with importance-sampled policy gradient, as Steep's PPO loss
does). The advantage of token ``t`` is

    A_t = reward_weight * A_reward_t + distill_weight * d_t

so ``reward_weight = 0`` distils alone and both > 0 mix the teacher with the run's reward.
Where the teacher is more sure of a token than the student, ``d_t > 0`` pushes it up; where
the student sampled what the teacher would not have, ``d_t < 0`` pushes it down. The mean of
``-d_t`` over trained tokens is the reverse KL estimate ``distill/reverse_kl`` each step reports.

Teachers (run settings ``teacher_url``, ``teacher_api``):

- ``sglang``: SGLang's ``/generate`` (``max_new_tokens`` 0, ``return_logprob``,
  ``logprob_start_len`` 0: the prompt's ``input_token_logprobs``); SGLang and Steep's torch
  engine serve it, so a model Steep serves can teach.
- ``vllm``: vLLM's token-in ``/inference/v1/generate`` with ``prompt_logprobs`` 0.
- ``openai``: any OpenAI-compatible ``/v1/completions`` that echoes a token-id prompt with its
  logprobs (``echo``, ``logprobs`` 0; vLLM's and SGLang's OpenAI servers do).

With ``distill_topk`` k > 0 each teacher also returns its k likeliest tokens at every position
(``Teacher.top_logprobs``, ``rl_core.distill_topk``) for the loss's forward-KL term.

The teacher must share the student's tokenizer: it scores the student's token ids.
``check_tokenizer`` refuses a run whose teacher's tokenizer differs, naming both.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from rl_core.distill_topk import (
    TeacherTopK,
    TopKUnsupported,
    openai_rows,
    sglang_rows,
    topk_rows,
    unsupported_message,
    vllm_rows,
)
from rl_core.hints import HintPlacement, signal_of, unhinted
from rl_core.types import Trajectory

if TYPE_CHECKING:  # the loop imports this module; the job's loop process imports no torch
    import torch

logger = logging.getLogger(__name__)

TEACHER_APIS = ("sglang", "vllm", "openai")
# Tokenizer probes: what two tokenizers must encode alike (and the vocabulary's size).
_PROBES = ("Hello, world! 123", " The quick brown fox\njumps over the lazy dog.", "ça va? 日本語")


class TeacherError(RuntimeError):
    """The teacher could not score a trajectory (after retries), or is not usable."""


class TeacherUnsupported(TeacherError):
    """The teacher cannot do what the run asks (top-k logprobs by id): no retry helps."""


class Teacher(Protocol):
    name: str

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        """``log p(input_ids[t] | input_ids[:t])`` for every ``t``; 0.0 at ``t = 0``
        (``adapter``: a LoRA adapter the server has loaded, to score under)."""
        ...

    async def top_logprobs(
        self, input_ids: Sequence[int], k: int, adapter: str | None = None
    ) -> TeacherTopK:
        """``logprobs``' scores and, at every position, the teacher's ``k`` likeliest token
        ids and their logprobs (one call); ``TeacherUnsupported`` where the server cannot."""
        ...

    async def tokenizer_path(self) -> str | None: ...

    async def aclose(self) -> None: ...


class _HTTPTeacher:
    def __init__(
        self,
        url: str,
        *,
        model: str = "",
        timeout_s: float = 120.0,
        http: httpx.AsyncClient | None = None,
    ):
        self.url = url.rstrip("/")
        self.model = model
        self.name = f"{self.url} ({self.api})"
        # A run's job passes a client that screens every request by the instance's rules.
        self._http = http or httpx.AsyncClient()
        self._timeout = timeout_s

    api = ""

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = await self._http.post(f"{self.url}{path}", json=body, timeout=self._timeout)
        if response.status_code >= 400:
            raise TeacherError(
                f"{self.name} answered {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def tokenizer_path(self) -> str | None:
        """Where the served model's tokenizer is, as the server says (None: it does not)."""
        response = await self._http.get(f"{self.url}{self._models_path}")
        if response.status_code >= 400:
            return None
        data = response.json()
        if "data" in data:  # OpenAI's model list: vLLM and SGLang put the path in "root"
            rows = data["data"] or [{}]
            return rows[0].get("root") or None
        return data.get("tokenizer_path") or data.get("model_path") or None

    _models_path = "/v1/models"


class SGLangTeacher(_HTTPTeacher):
    api = "sglang"
    _models_path = "/get_model_info"

    async def _prefill(self, input_ids: Sequence[int], adapter: str | None, k: int) -> dict:
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        if k:
            body["top_logprobs_num"] = k
        if adapter:
            body["lora_path"] = adapter
        return (await self._post("/generate", body))["meta_info"]

    def _own(self, input_ids: Sequence[int], meta: dict) -> list[float]:
        entries = meta["input_token_logprobs"]  # [[logprob | None, id, text?], ...]
        return _aligned(input_ids, [(e[0], e[1]) for e in entries], self.name)

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        return self._own(input_ids, await self._prefill(input_ids, adapter, 0))

    async def top_logprobs(
        self, input_ids: Sequence[int], k: int, adapter: str | None = None
    ) -> TeacherTopK:
        meta = await self._prefill(input_ids, adapter, k)
        return _with_topk(self.name, self._own(input_ids, meta), lambda: sglang_rows(meta), k)


class VLLMTeacher(_HTTPTeacher):
    api = "vllm"

    async def _prefill(self, input_ids: Sequence[int], adapter: str | None, k: int) -> list:
        body: dict[str, Any] = {
            "token_ids": list(input_ids),
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k},
        }
        if adapter:
            body["model"] = adapter  # a loaded adapter is named as a model
        data = await self._post("/inference/v1/generate", body)
        return data.get("prompt_logprobs") or []

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        return self._own(input_ids, await self._prefill(input_ids, adapter, 0))

    async def top_logprobs(
        self, input_ids: Sequence[int], k: int, adapter: str | None = None
    ) -> TeacherTopK:
        rows = await self._prefill(input_ids, adapter, k)
        return _with_topk(self.name, self._own(input_ids, rows), lambda: vllm_rows(rows, k), k)

    def _own(self, input_ids: Sequence[int], rows: list) -> list[float]:
        pairs = []
        for token, row in zip(input_ids, rows, strict=False):
            entry = None if row is None else row.get(str(token), row.get(token))  # type: ignore[call-overload]
            value = (
                None if entry is None else entry["logprob"] if isinstance(entry, dict) else entry
            )
            pairs.append((value, token))
        return _aligned(input_ids, pairs, self.name)


class OpenAITeacher(_HTTPTeacher):
    api = "openai"
    _models_path = "/models"

    async def _echo(self, input_ids: Sequence[int], adapter: str | None, k: int) -> dict:
        body: dict[str, Any] = {
            "model": adapter or self.model,
            "prompt": list(input_ids),
            "max_tokens": 1,
            "echo": True,
            "logprobs": k,
            "temperature": 1.0,
        }
        if k:  # vLLM's extension: top_logprobs keyed "token_id:<id>" rather than by text
            body["return_tokens_as_token_ids"] = True
        return (await self._post("/completions", body))["choices"][0]["logprobs"]

    def _own(self, input_ids: Sequence[int], logprobs: dict) -> list[float]:
        values = logprobs["token_logprobs"][: len(input_ids)]
        return _aligned(input_ids, list(zip(values, input_ids, strict=False)), self.name)

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        return self._own(input_ids, await self._echo(input_ids, adapter, 0))

    async def top_logprobs(
        self, input_ids: Sequence[int], k: int, adapter: str | None = None
    ) -> TeacherTopK:
        got = await self._echo(input_ids, adapter, k)
        rows = (got.get("top_logprobs") or [])[: len(input_ids)]
        if not any(rows):
            raise TeacherUnsupported(unsupported_message(self.name, "it returned no top_logprobs"))
        return _with_topk(self.name, self._own(input_ids, got), lambda: openai_rows(rows), k)


def _aligned(
    input_ids: Sequence[int], pairs: list[tuple[float | None, int]], name: str
) -> list[float]:
    """The teacher's logprobs, one per input token (0.0 for the first), checked to be of
    the very tokens sent."""
    if len(pairs) != len(input_ids):
        raise TeacherError(
            f"{name} scored {len(pairs)} of the {len(input_ids)} tokens sent; it must return "
            "a logprob for every prompt token"
        )
    out = []
    for t, ((value, token), sent) in enumerate(zip(pairs, input_ids, strict=True)):
        if int(token) != int(sent):
            raise TeacherError(f"{name} scored token {token} at position {t}, not {sent}")
        if t and value is None:
            raise TeacherError(f"{name} gave no logprob for token {t}")
        out.append(0.0 if t == 0 else float(value))  # type: ignore[arg-type]
    return out


def _with_topk(
    name: str,
    logprobs: list[float],
    rows: Callable[[], list[list[tuple[float, int]] | None]],
    k: int,
) -> TeacherTopK:
    """``logprobs`` with the top-k ``rows()`` read from the same answer."""
    try:
        ids, values = topk_rows(rows(), len(logprobs), k)
    except TopKUnsupported as exc:
        raise TeacherUnsupported(unsupported_message(name, str(exc))) from None
    except ValueError as exc:
        raise TeacherError(f"{name}: {exc}") from None
    return TeacherTopK(logprobs, ids, values)


def make_teacher(
    url: str, api: str = "sglang", *, model: str = "", http: httpx.AsyncClient | None = None
) -> Teacher:
    if api not in TEACHER_APIS:
        raise ValueError(f"teacher_api {api!r}: use one of {', '.join(TEACHER_APIS)}")
    if api == "vllm":
        return VLLMTeacher(url, model=model, http=http)
    if api == "openai":
        return OpenAITeacher(url, model=model, http=http)
    return SGLangTeacher(url, model=model, http=http)


class ServedModel:
    """A model Steep serves as the teacher: its servers (``urls()``: the current ones, taken in
    turn), asked by their backend's protocol, under ``adapter()`` if it names one. The run's own
    policy (self-distillation) or a shared pool's base model (``teacher_pool``)."""

    def __init__(
        self,
        urls: Callable[[], list[str]],
        backend: str,
        adapter: Callable[[], str | None] = lambda: None,
        *,
        name: str = "",
        http: httpx.AsyncClient | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ):
        self.name = name or f"the policy ({backend} servers)"
        self._urls, self._adapter, self._http = urls, adapter, http
        self._refresh = refresh  # after a server could not be reached: look up the current ones
        self._api = "vllm" if backend == "vllm" else "sglang"  # the torch engine speaks SGLang's
        self._teachers: dict[str, Any] = {}
        self._turn = itertools.count()

    async def logprobs(self, input_ids: Sequence[int], adapter: str | None = None) -> list[float]:
        return await self._ask(lambda t, a: t.logprobs(input_ids, adapter=a), adapter)

    async def top_logprobs(
        self, input_ids: Sequence[int], k: int, adapter: str | None = None
    ) -> TeacherTopK:
        return await self._ask(lambda t, a: t.top_logprobs(input_ids, k, adapter=a), adapter)

    async def _ask(self, call: Callable[[Any, str | None], Awaitable[Any]], adapter: str | None):
        """``call(teacher, adapter)`` on the next server in turn."""
        urls = self._urls()
        if not urls:
            raise TeacherError(f"{self.name} has no inference server to score with")
        url = urls[next(self._turn) % len(urls)]
        if url not in self._teachers:
            # One screened client for all servers (closed once, by aclose).
            self._teachers[url] = make_teacher(url, self._api, http=self._http)
        try:
            return await call(self._teachers[url], adapter or self._adapter())
        except httpx.TransportError:
            if self._refresh is not None:  # a restarted server: the scorer's retry finds it
                await self._refresh()
            raise

    async def tokenizer_path(self) -> str | None:
        return None  # the student's own, or named by the caller

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        else:
            for teacher in self._teachers.values():
                await teacher.aclose()
        self._teachers.clear()


async def connect_teacher(
    cfg: Any,
    rules: Any = None,
    pool: dict | None = None,
    pool_lookup: Callable[[], Awaitable[dict]] | None = None,
) -> TeacherScorer | None:
    """The run's teacher (``RunConfig.teacher_url``, or ``teacher_pool``'s servers as
    ``pool`` describes them: ``{"name", "base_model", "servers": [{"url", "backend"}]}``, looked
    up again by ``pool_lookup`` when one cannot be reached), its tokenizer checked; None
    without one.

    ``rules`` (``rl_core.sources.SourceRules``): every request to the teacher is screened by
    them, and the tokenizer read must be a model directory they allow."""
    if not (cfg.teacher_url or pool):
        return None
    from rl_core.sources import screened_async_client

    setting = "teacher_url" if cfg.teacher_url else "teacher_pool"
    http = screened_async_client(rules, setting=setting) if rules is not None else None
    teacher: Teacher
    tokenizer = cfg.teacher_tokenizer
    if pool is not None:
        servers = [s["url"] for s in pool["servers"]]

        async def refresh() -> None:
            if pool_lookup is not None:
                servers[:] = [s["url"] for s in (await pool_lookup())["servers"]]

        teacher = ServedModel(
            lambda: servers,
            pool["servers"][0]["backend"],
            name=f"pool {pool['name']}",
            http=http,
            refresh=refresh,
        )
        tokenizer = tokenizer or pool["base_model"]
    else:
        teacher = make_teacher(cfg.teacher_url, cfg.teacher_api, model=cfg.teacher_model, http=http)
    try:
        await verify_teacher(teacher, cfg.base_model, tokenizer, rules)
        if cfg.distill_topk:  # a teacher that cannot give its top-k fails the run now
            await teacher.top_logprobs([0, 1], cfg.distill_topk)
    except BaseException:
        await teacher.aclose()
        raise
    return TeacherScorer(teacher, topk=cfg.distill_topk)


@dataclass
class TeacherScorer:
    """Scores a batch's trajectories with ``teacher`` (``concurrency`` calls at a time, each
    retried ``retries`` times with backoff) and keeps count for the step's metrics.

    With ``hints`` (self-distillation, ``rl_core.hints``) only the trajectories with a hint are
    scored, each with its hint in the teacher's context, and ``on_signals`` receives what the
    hints produced, by session (for the session page).

    With ``topk`` (``distill_topk``) each trajectory also gets the teacher's top-k at every
    position (``teacher_topk_ids`` / ``teacher_topk_logprobs``), from the same call."""

    teacher: Teacher
    concurrency: int = 8
    retries: int = 3
    backoff_s: float = 0.5
    hints: HintPlacement | None = None
    on_signals: Callable[[dict[str, dict]], Awaitable[None]] | None = None
    topk: int = 0
    # The adapter each trajectory is scored under (a multi-agent run's self-distillation: its
    # role's current one); None: the teacher's own choice.
    adapter_for: Callable[[Trajectory], str | None] | None = None

    async def aclose(self) -> None:
        await self.teacher.aclose()

    async def score(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Sets each trajectory's ``teacher_logprobs``; the step's ``distill/`` metrics."""
        gate = asyncio.Semaphore(self.concurrency)
        calls, retried, seconds = [0], [0], [0.0]
        jobs: list[tuple[Trajectory, tuple[list[int], int, int]]] = []
        for traj in trajectories:
            context = self._context(traj)
            if context is not None:
                jobs.append((traj, context))

        async def one(traj: Trajectory, context: tuple[list[int], int, int]) -> None:
            input_ids, at, length = context
            async with gate:
                for attempt in range(self.retries + 1):
                    started = time.perf_counter()
                    try:
                        calls[0] += 1
                        await self._score_one(traj, input_ids, at, length)
                        seconds[0] += time.perf_counter() - started
                        return
                    except TeacherUnsupported:
                        raise
                    except (httpx.HTTPError, TeacherError, KeyError, TypeError) as exc:
                        seconds[0] += time.perf_counter() - started
                        if attempt == self.retries:
                            raise TeacherError(
                                f"the teacher {self.teacher.name} could not score a trajectory "
                                f"after {self.retries + 1} tries: {exc}"
                            ) from exc
                        retried[0] += 1
                        logger.warning("teacher call failed (%s); retrying", exc)
                        await asyncio.sleep(self.backoff_s * 2**attempt)

        await asyncio.gather(*(one(t, c) for t, c in jobs))
        if self.hints is not None and self.on_signals is not None and jobs:
            await self.on_signals(_signals_by_session([t for t, _ in jobs]))
        gaps = reverse_kl_terms(trajectories)
        metrics = {
            "distill/teacher_calls": float(calls[0]),
            "distill/teacher_retries": float(retried[0]),
            "distill/teacher_tokens": float(sum(len(c[0]) for _, c in jobs)),
            "distill/teacher_latency_s": seconds[0] / max(calls[0], 1),
            "distill/reverse_kl": float(-gaps.mean()) if gaps.numel() else 0.0,
        }
        if self.hints is not None:
            metrics["distill/hinted_trajectories"] = float(len(jobs))
        return metrics

    async def _score_one(
        self, traj: Trajectory, input_ids: list[int], at: int, length: int
    ) -> None:
        adapter = self.adapter_for(traj) if self.adapter_for is not None else None
        kwargs = {"adapter": adapter} if adapter else {}
        if not self.topk:
            scores = await self.teacher.logprobs(input_ids, **kwargs)
            traj.teacher_logprobs = unhinted(scores, at, length) if length else scores
            return
        got = await self.teacher.top_logprobs(input_ids, self.topk, **kwargs)
        got = got.without(at, length) if length else got
        traj.teacher_logprobs = got.logprobs
        traj.teacher_topk_ids, traj.teacher_topk_logprobs = got.ids, got.topk_logprobs

    def _context(self, traj: Trajectory) -> tuple[list[int], int, int] | None:
        """What the teacher reads: the trajectory's tokens, or with its hint (None: no hint,
        not scored)."""
        if self.hints is None:
            return list(traj.input_ids), 0, 0
        return self.hints.hinted(traj)


def _signals_by_session(trajectories: Sequence[Trajectory]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for traj in trajectories:
        session = traj.session_id.split("#")[0]
        entry = out.setdefault(session, {"hint": traj.metadata.get("hint"), "trajectories": []})
        entry["trajectories"].append(signal_of(traj))
    return out


def reverse_kl_terms(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """``log p_teacher - log p_student`` over every trained token of the batch (flat)."""
    import torch

    parts = []
    for traj in trajectories:
        if traj.teacher_logprobs is None:
            continue
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        diff = torch.tensor(traj.teacher_logprobs) - torch.tensor(traj.logprobs)  # [L]
        parts.append(diff[mask])
    return torch.cat(parts) if parts else torch.zeros(0)


def distill_advantages(
    trajectories: Sequence[Trajectory],
    reward_advantages: Sequence[torch.Tensor],
    reward_weight: float,
    distill_weight: float,
) -> list[torch.Tensor]:
    """``A_t = reward_weight * A_reward_t + distill_weight * (log p_teacher - log p_student)``
    on trained tokens (0 elsewhere); a trajectory the teacher did not score keeps its reward
    advantage scaled by ``reward_weight``."""
    import torch

    out = []
    for traj, adv in zip(trajectories, reward_advantages, strict=True):
        total = adv * reward_weight  # [L]
        if traj.teacher_logprobs is not None:
            mask = torch.tensor(traj.loss_mask, dtype=torch.float32)  # [L]
            diff = torch.tensor(traj.teacher_logprobs) - torch.tensor(traj.logprobs)  # [L]
            total = total + distill_weight * diff * mask
        out.append(total)
    return out


async def verify_teacher(
    teacher: Teacher, student_dir: str, teacher_tokenizer: str = "", rules: Any = None
) -> str:
    """Refuse a teacher that does not share the student's tokenizer; the tokenizer compared.

    ``teacher_tokenizer`` (the run setting) names the teacher's tokenizer; without it, the
    path the teacher's server reports for its model is used. With ``rules``, only a model
    directory they allow is read (a server cannot make the job read any path it names)."""
    source = teacher_tokenizer or await teacher.tokenizer_path()
    if not source:
        raise TeacherError(
            f"cannot tell which tokenizer the teacher {teacher.name} uses (it does not report "
            "its model's path): set teacher_tokenizer to a copy of it"
        )
    if rules is not None:
        from rl_core.sources import SourceRefused, tokenizer_source

        try:
            source = tokenizer_source(source, rules)
        except SourceRefused as exc:
            raise TeacherError(f"{exc}; set teacher_tokenizer to one that is") from None
    try:
        check_tokenizer(student_dir, source)
    except (OSError, ValueError) as exc:
        raise TeacherError(
            f"cannot read the teacher's tokenizer at {source}: {exc}; set teacher_tokenizer "
            "to a local copy of it"
        ) from exc
    return source


def check_tokenizer(student_dir: str, teacher_tokenizer: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's (``teacher_tokenizer``: a local
    tokenizer directory or Hugging Face id). The same vocabulary, and the same ids for probe
    texts, or ``TeacherError`` naming both."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_dir)
    teacher = AutoTokenizer.from_pretrained(teacher_tokenizer)
    same = len(student) == len(teacher) and all(
        student.encode(p, add_special_tokens=False) == teacher.encode(p, add_special_tokens=False)
        for p in _PROBES
    )
    if not same or student.get_vocab() != teacher.get_vocab():
        raise TeacherError(
            f"the teacher's tokenizer ({teacher_tokenizer}, {len(teacher):,} tokens) is not the "
            f"student's ({student_dir}, {len(student):,} tokens): on-policy distillation scores "
            "the student's own token ids, so teacher and student must share one tokenizer"
        )
