"""Evaluate a model (a run's base model or one of its checkpoints) on dataset rows.

``python -m rl_core.evaluate MODEL ROWS OUT --tokenizer DIR --reward JSON --k K ...`` samples
``k`` answers per row with the run's chat template and scores each with the run's reward
function (``rl_core.rewards``), writing one JSON line per row to ``OUT``:
``{"index", "messages", "answer", "completions", "rewards", "errors"}``; the summary
(pass@k, mean reward, intervals) is ``rl_core.evals.summarize`` over the rewards.

Why a process of its own, at the lowest CPU priority, and not the run's inference servers:
an evaluation during training must never hold training up. Sharing the run's servers would
queue its requests beside the rollouts (and a weight update pauses them mid-eval, so one
eval would straddle two policies); a separate process loads the checkpoint it was asked
about, so its answers all come from one set of weights, and ``nice`` 19 (``STEEP_EVAL_NICE``)
lets the trainer and the servers take the CPU first. On a GPU cluster the same process
runs on whatever device it is given (``STEEP_EVAL_DEVICE``; default CPU), and by default
(``--engine auto``, ``STEEP_EVAL_ENGINE``) it does not sample from a float32 model of its own
but from an inference server of the run's backend that it starts on the model
(``rl_core.eval_server``), batching the answers as the run's servers do.

Progress goes to stdout as ``progress <done> <total>`` lines. A LoRA checkpoint's adapter
is merged into its base weights first (``rl_core.lora``). Sampling is seeded per row, so a
rerun of the same model gives the same answers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from rl_core import lora
from rl_core.chat import ChatTokenizer, load_chat_tokenizer
from rl_core.hf import cache_kwargs, load_causal_lm, returned_cache
from rl_core.inference.process import when_parent_exits
from rl_core.rewards import RewardFn, load_reward_fn, score
from rl_core.rollout import member_seed, row_messages, row_metadata
from rl_core.sampling import SAMPLING_EPS, outside_nucleus


def load_model(path: str | os.PathLike, device: torch.device) -> Any:
    """The model at ``path`` (a model folder, or a run's full or LoRA checkpoint), for inference."""
    lora.refuse_role_checkpoint(path, "evaluate")
    if lora.is_lora_checkpoint(path):
        from peft import PeftModel

        base = load_causal_lm(lora.adapter_base(path), torch.float32, device)
        model = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    else:
        model = load_causal_lm(path, torch.float32, device)
    return model.eval()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [k, V] with everything outside each row's smallest set of most likely tokens
    whose mass reaches ``top_p`` set to 0 (``rl_core.sampling.outside_nucleus``, as the engine)."""
    if top_p >= 1.0:
        return probs
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    ranked = ranked.masked_fill(outside_nucleus(ranked, top_p), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, ranked)


@torch.no_grad()
def sample(
    model: Any,
    prompt: list[int],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    stop_ids: set[int],
    seed: int,
    top_p: float = 1.0,
) -> list[list[int]]:
    """``k`` answers to ``prompt`` (each ending at its first stop token, which is kept),
    sampled as the run's rollouts are: at ``temperature``, from the nucleus ``top_p``."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model(torch.tensor([prompt] * k, device=device), use_cache=True)
    answers: list[list[int]] = [[] for _ in range(k)]
    done = [False] * k
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()  # [k, V]
        if temperature < SAMPLING_EPS:  # greedy, as SGLang
            tokens = logits.argmax(-1)  # [k]
        else:
            probs = nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
            tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [k]
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                answers[i].append(token)
                done[i] = token in stop_ids
        if all(done):
            break
        cache = cache_kwargs(model, returned_cache(out))
        out = model(tokens[:, None], use_cache=True, **cache)
    return answers


def evaluate_row(
    model: Any,
    tokenizer: ChatTokenizer,
    reward_fn: RewardFn,
    row: dict[str, Any],
    index: int,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    top_p: float = 1.0,
) -> dict[str, Any]:
    messages = row_messages(row)
    prompt_text = tokenizer.render(messages)
    answers = sample(
        model,
        tokenizer.encode(prompt_text),
        k=k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_ids=set(tokenizer.eos_token_ids),
        seed=member_seed(seed, index, 0),
    )
    return score_answers(tokenizer, reward_fn, row, index, prompt_text, answers)


def score_answers(
    tokenizer: ChatTokenizer,
    reward_fn: RewardFn,
    row: dict[str, Any],
    index: int,
    prompt_text: str,
    answers: list[list[int]],
) -> dict[str, Any]:
    """One row's result line: each answer decoded and scored with the run's reward."""
    completions, rewards, errors = [], [], []
    for ids in answers:
        text = tokenizer.decode(ids)
        reward, error = score(reward_fn, prompt_text, text, row.get("answer"), row_metadata(row))
        completions.append(text)
        rewards.append(reward)
        errors.append(error)
    return {
        "index": index,
        "messages": row_messages(row),
        "answer": row.get("answer"),
        "completions": completions,
        "rewards": rewards,
        "errors": errors,
    }


def evaluate(
    model_path: str | os.PathLike,
    rows: list[dict[str, Any]],
    out: str | os.PathLike,
    *,
    tokenizer: str,
    reward: dict[str, Any] | str,
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    engine: str = "local",
    backend: str = "auto",
) -> list[dict[str, Any]]:
    """Evaluate ``model_path`` on ``rows``; each row's result is appended to ``out`` as it is
    done. Returns the results. ``engine``: ``local`` (the model in this process, on ``device``),
    ``server`` (a server of ``backend`` started on it: ``rl_core.eval_server``), or ``auto``
    (``server`` where CUDA is available)."""
    reward_fn = load_reward_fn(reward)
    chat = load_chat_tokenizer(str(tokenizer))
    if engine == "auto":
        engine = "server" if torch.cuda.is_available() else "local"
    if engine not in ("local", "server"):
        raise ValueError(f"engine {engine!r}: use local, server or auto")
    results: list[dict[str, Any]] = []
    with open(out, "w", encoding="utf-8") as handle:

        def done(result: dict[str, Any]) -> None:
            handle.write(json.dumps(result, ensure_ascii=False) + "\n")
            handle.flush()
            results.append(result)
            print(f"progress {len(results)} {len(rows)}", flush=True)

        if engine == "server":
            from rl_core.eval_server import sample_rows, served

            def on_row(index: int, prompt_text: str, answers: list[list[int]]) -> None:
                done(score_answers(chat, reward_fn, rows[index], index, prompt_text, answers))

            from rl_core.inference.launch import choose_backend

            backend = choose_backend(backend)
            cuda = torch.cuda.is_available()
            kwargs = {"device": "cuda" if cuda and device == "cpu" else device}
            with served(
                model_path, backend, Path(out).parent, **(kwargs if backend == "torch" else {})
            ) as client:
                sample_rows(
                    client, chat, rows, k=k, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=seed, on_row=on_row,
                )  # fmt: skip
            return results
        model = load_model(model_path, torch.device(device))
        for index, row in enumerate(rows):
            done(
                evaluate_row(
                    model, chat, reward_fn, row, index, k=k, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=seed,
                )
            )  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder, or a run's checkpoint directory")
    parser.add_argument("rows", help="dataset rows, JSON lines")
    parser.add_argument("out", help="where to write one result line per row")
    parser.add_argument("--tokenizer", required=True, help="the run's base model directory")
    parser.add_argument("--reward", required=True, help="the run's reward setting, as JSON")
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, required=True)
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1: none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        default=os.environ.get("STEEP_EVAL_ENGINE", "auto"),
        choices=["auto", "local", "server"],
        help="local: the model in this process; server: an inference server of --backend "
        "started on it; auto: server where CUDA is available",
    )
    parser.add_argument("--backend", default="auto", help="the run's inference_backend")
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="Exit when this process (the worker that started the eval) is gone: the eval is"
        " queued again by whoever finds it stopped, and must not write beside its next attempt.",
    )
    args = parser.parse_args(argv)
    if args.parent_pid:
        when_parent_exits(args.parent_pid, lambda: os._exit(1))
    os.nice(int(os.environ.get("STEEP_EVAL_NICE", "19")))
    torch.set_num_threads(
        int(os.environ.get("STEEP_TORCH_THREADS", "0")) or torch.get_num_threads()
    )
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    evaluate(
        args.model,
        rows,
        args.out,
        tokenizer=args.tokenizer,
        reward=json.loads(args.reward),
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        device=os.environ.get("STEEP_EVAL_DEVICE", "cpu"),
        engine=args.engine,
        backend=args.backend,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
