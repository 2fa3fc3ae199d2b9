"""Which distribution a recorded logprob is of, so the trainer recomputes the same one.

A token sampled at temperature ``T`` has behaviour logprob ``log_softmax(logits / T)``:
the inference servers report that (SGLang's default, which Steep's launcher keeps; the
torch engine does the same), and the trainer divides each token's logits by its own
turn's ``T`` before ``log_softmax`` for the proximal, current and reference policies
(``rl_core.packing.packed_logprobs``). The behaviour weight ``exp(p - b)`` of decoupled
PPO is then exactly 1 for on-policy tokens at any temperature.

Two cases are chosen here, as SGLang chooses them:

* Greedy (``T < SAMPLING_EPS``): SGLang turns the request into ``T = 1, top_k = 1`` and
  reports ``log_softmax(logits)``. The recorded logprob is the temperature-1 one, so the
  token's *logprob temperature* is 1.0 (``logprob_temperature``).
* ``top_p < 1`` / ``top_k`` / ``min_p``: the token is drawn from the truncated,
  renormalised distribution, but the logprob is of the full tempered distribution
  (SGLang computes it before truncation; renormalising on the trainer would need a
  sort over the vocabulary per token and would disagree with what SGLang reports).
  Both sides use the full tempered distribution, so the behaviour weight stays 1
  on-policy; what remains is a documented bias: for a token inside the kept set the
  true sampling probability is ``q = p / Z`` (``Z`` the kept mass, ``<= 1``), so the
  recorded ``b`` is ``log Z`` lower than the truth and off-policy corrections use
  ``p`` where ``q`` was meant. With ``top_p = 1``, ``top_k`` off and ``min_p = 0``
  (the defaults) there is no bias at all.

Pure Python: the web app uses it to build trajectories from recorded turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SAMPLING_EPS = 1e-6  # temperatures below this are greedy (SGLang's _SAMPLING_EPS)


def outside_nucleus(ranked: Any, top_p: Any) -> Any:
    """Where ``ranked`` (a tensor of probabilities, descending along its last dim) falls
    outside the smallest set of most likely tokens whose mass reaches ``top_p`` (a number, or
    a tensor per row): SGLang's top-p, for the torch engine and the evals alike. Tensor
    methods only, so this module still imports no torch."""
    return ranked.cumsum(dim=-1) - ranked > top_p


def logprob_temperature(temperature: float) -> float:
    """The temperature the recorded logprob of a token sampled at ``temperature`` is taken at."""
    return 1.0 if temperature < SAMPLING_EPS else float(temperature)


@dataclass(frozen=True)
class TurnSampling:
    """The sampling settings of one turn that decide its logprobs (SGLang's names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> TurnSampling:
        """From SGLang ``sampling_params`` (absent or ``None`` values take the defaults)."""
        params = params or {}

        def get(name: str, default: Any) -> Any:
            value = params.get(name)
            return default if value is None else value

        top_k = int(get("top_k", -1))
        return cls(
            temperature=float(get("temperature", 1.0)),
            top_p=float(get("top_p", 1.0)),
            top_k=-1 if top_k <= 0 else top_k,
        )

    @property
    def logprob_temperature(self) -> float:
        return logprob_temperature(self.temperature)

    @property
    def truncated(self) -> bool:
        """Whether top-p/top-k cut the distribution sampled (the recorded logprob is of the full one)."""
        return self.temperature >= SAMPLING_EPS and (self.top_p < 1.0 or self.top_k > 0)
