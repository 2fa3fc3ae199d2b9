"""Cost models of GPU work for the cluster simulation: how long a decode step, a prefill, a
training step and a weight update take on H100s, so stand-ins can sleep instead of computing.

Inference (``EngineCost``), one SGLang server on one GPU, per decode step of a running batch::

    step_s(B, K) = base_s + per_seq_s * B + per_kv_token_s * K

with ``B`` the running requests and ``K`` the tokens in their KV cache (every step reads
the weights once: ``base_s``; per sequence sampling and MLP work: ``per_seq_s``; attention
reads each cached token's K and V: ``per_kv_token_s``). A prefill costs ``prefill_per_token_s``
per prompt token. The defaults (``ENGINE_PRESETS``):

- ``7b`` (Qwen2.5-7B / Llama-3.1-8B class, bf16, one H100 SXM): ``base_s`` 6.5 ms is the
  weight read (15.2 GB at 3.35 TB/s = 4.5 ms) plus SGLang's per-step overhead, in line with
  the ~7 ms per token single-stream decode reported for 8B models on H100; ``per_seq_s`` is
  set so that a 256-request batch of ShareGPT-length requests gives about 16,000 output
  tokens/s, SGLang's offline throughput for Llama-3.1-8B-Instruct bf16 on one H100 in
  AIMultiple's engine benchmark (https://research.aimultiple.com/inference-engines, 16,215
  tok/s); ``per_kv_token_s`` is one token's K and V (28 layers x 4 KV heads x 128 x 2 x 2 B =
  57 KB) at 3 TB/s; prefill is ``2 * params`` FLOPs per token at 50% of 989 TFLOP/s.
- ``1.5b`` (Qwen2.5-1.5B, the model of AReaL's 2.77x figure): derived the same way, not
  measured: weights 3.1 GB (0.9 ms) so a step is launch-overhead bound (``base_s`` 3 ms),
  KV 28 KB per token, prefill from FLOPs. Calibrate on a GPU before trusting the absolute
  numbers; the async/sync ratios depend on the *shape* of the model (fixed step cost vs
  per-sequence cost), which these keep. SGLang cannot run on the GPU machines lent to Steep's
  sessions, so these two stay derived, not measured.
- ``1.5b-torch`` (measured, 2026-11-27, one H200, ``bench/engine_step.py --model qwen2-1.5b
  --device cuda --dtype bfloat16``): Steep's own torch engine on a GPU, for contrast. Its step
  is bound by the host: 61 ms per step whatever the batch (transformers' per-module Python and
  attention calls) and 4.8 ms per sequence (it samples on the CPU from per-request
  generators, over a 151,936-token vocabulary), so a batch of 128 makes 189 tokens/s where
  SGLang makes thousands: the reason a GPU deployment serves with SGLang.

Training (``TrainerCost``): ``tokens * flops_per_token_factor * params / (gpus * peak *
mfu)`` seconds per step (the issue's 6 x params FLOPs per token: forward + backward), with
``mfu`` measured: Steep's trainer (``bench/train_step.py --model qwen2-1.5b --device cuda``,
packed bf16, 16,384-token micro-batches, one H200) trains 15,904 tokens/s, which is
``6 * 1.54e9 * 15,904 / 989e12`` = 0.15 of peak in this 6 x params accounting (its own MFU,
20%, also counts the proximal-logprob forward and attention). Replaced 2026-11-27: ``mfu``
0.4 (assumed) -> 0.15, ``disk_write_Bps`` 1.0 -> 0.63 GB/s and ``disk_read_Bps`` 1.5 -> 1.54
GB/s (``bench/engine_step.py``'s round trip of a 0.72 GB bf16 weight file on that machine's
local disk, twice: written with fsync at 0.62 and 0.64 GB/s, read onto the GPU at 1.58 and
1.50 GB/s; the means). ``broadcast_Bps`` stays assumed: one GPU
cannot measure a broadcast between two. Per update a weight sync: ``distributed`` broadcasts
``2 * params`` bytes at
``broadcast_Bps`` (the servers are paused in place for it); ``disk`` saves them at
``disk_write_Bps`` and each server loads them at ``disk_read_Bps`` (paused meanwhile);
``lora`` saves and loads only the adapter (``lora_fraction`` of the weights) and pauses
nothing. Pure arithmetic; no torch, no Django.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM (NVIDIA's datasheet)


@dataclass(frozen=True)
class EngineCost:
    """Simulated time of one inference server's GPU work (see the module docstring)."""

    name: str
    params: float  # model parameters
    base_s: float  # per decode step, whatever the batch
    per_seq_s: float  # per running request per decode step
    per_kv_token_s: float  # per cached token per decode step (attention reads K and V)
    prefill_per_token_s: float  # per prompt token
    max_running_requests: int = 256  # SGLang's --max-running-requests

    def step_seconds(self, batch: int, kv_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``kv_tokens`` cached tokens."""
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_kv_token_s * kv_tokens

    def prefill_seconds(self, tokens: int) -> float:
        """Prefilling ``tokens`` prompt tokens (one forward over them)."""
        return self.prefill_per_token_s * max(0, tokens)

    def peak_tokens_per_s(self, context: float) -> float:
        """Output tokens/s of a full batch whose requests hold ``context`` tokens each on average."""
        b = self.max_running_requests
        return b / self.step_seconds(b, int(b * context))

    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16


def _engine(
    name: str, params: float, base_s: float, per_seq_s: float, kv_bytes: float
) -> EngineCost:
    return EngineCost(
        name=name,
        params=params,
        base_s=base_s,
        per_seq_s=per_seq_s,
        per_kv_token_s=kv_bytes / 3.0e12,
        prefill_per_token_s=2.0 * params / (0.5 * H100_BF16_FLOPS),
    )


ENGINE_PRESETS: dict[str, EngineCost] = {
    "1.5b": _engine("1.5b", 1.54e9, 3.0e-3, 0.008e-3, 28_672),
    "7b": _engine("7b", 7.6e9, 6.5e-3, 0.030e-3, 57_344),
    # Least squares over 7 measured (B, K) cells; prefill from B 32 x 1,024 prompt tokens
    # (0.464 s, less 32 first samples at 4.8 ms).
    "1.5b-torch": EngineCost(
        name="1.5b-torch",
        params=1.54e9,
        base_s=61.2e-3,
        per_seq_s=4.79e-3,
        per_kv_token_s=3.0e-7,
        prefill_per_token_s=9.5e-6,
        max_running_requests=128,
    ),
}

MEASURED_TRAINER_MFU = 0.15  # see the module docstring


@dataclass(frozen=True)
class TrainerCost:
    """Simulated time of a trainer's step and of publishing its weights (see the module docstring)."""

    params: float
    gpus: int = 1  # trainer stand-ins (data-parallel GPUs)
    mfu: float = MEASURED_TRAINER_MFU  # achieved fraction of peak FLOP/s
    peak_flops: float = H100_BF16_FLOPS
    flops_per_token_factor: float = 6.0  # forward + backward = 6 x params per token
    broadcast_Bps: float = 20e9  # NCCL broadcast trainer -> servers (bytes/s)
    disk_write_Bps: float = 0.63e9  # saving safetensors (measured, see the docstring)
    disk_read_Bps: float = 1.54e9  # a server loading them onto its GPU (measured)
    lora_fraction: float = 0.01  # adapter size / weights size (rank ~32 on all linear layers)

    def step_seconds(self, tokens: int) -> float:
        """One training step over ``tokens`` tokens (prompt and response)."""
        flops = tokens * self.flops_per_token_factor * self.params
        return flops / (self.gpus * self.peak_flops * self.mfu)

    def weight_bytes(self) -> float:
        return 2.0 * self.params

    def adapter_bytes(self) -> float:
        return self.lora_fraction * self.weight_bytes()

    def with_gpus(self, gpus: int) -> TrainerCost:
        return replace(self, gpus=gpus)
