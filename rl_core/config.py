"""Run configuration: one dataclass, validated once, shared by the web app and the trainer.

Every field carries a one-line ``help`` in its metadata; the REST serializer and
the dashboard form are built from these fields, so a setting is documented and
validated in exactly one place; ``rl_core.config_groups`` sorts them into the form's
sections. This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_core.config_values import coerce as _coerce
from rl_core.reward_specs import reward_spec_errors
from rl_core.tracker_specs import tracker_spec_errors

MODES = ("online", "dataset")
INFERENCE_BACKENDS = ("auto", "torch", "sglang", "vllm")
ADVANTAGE_ESTIMATORS = ("auto", "grpo", "rloo", "reinforce_pp")
RATIO_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTIONS = ("cap_mask", "truncate", "token_band", "sequence_reject")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean")
KL_ESTIMATORS = ("k1", "k3")
LR_SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")
WEIGHT_SYNC_STRATEGIES = ("distributed", "disk")
# What lora_target_modules = [] means: peft's shorthand for every linear layer of the
# attention and MLP blocks (the output head excluded).
LORA_ALL_LINEAR = "all-linear"
# A multi-agent run's role names: they appear in adapter names and in `model: "policy/<role>"`.
ROLE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
MAX_ROLES = 8


class ConfigError(ValueError):
    """A run config is invalid. ``errors`` maps each bad field to its messages."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        summary = "; ".join(f"{name}: {' '.join(msgs)}" for name, msgs in errors.items())
        super().__init__(f"invalid run config: {summary}")


def _f(default: Any, help: str, **meta: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **meta}
        )
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class RunConfig:
    """Everything a training run needs besides its name and dataset.

    Defaults are sensible for a small model on one machine. ``RunConfig.from_dict``
    is the only way user input becomes a config; it raises ``ConfigError`` naming
    each wrong field and what to set instead.
    """

    # What to train
    mode: str = _f(
        "dataset",
        "online: agents call the base_url; dataset: Steep samples prompts from a dataset.",
        choices=MODES,
    )
    base_model: str = _f(
        "",
        "The causal LM to train: a model this instance offers (GET /api/v1/models/: the demo model, a directory under the operator's model roots, by name or path), or a Hugging Face id where the operator allows them (STEEP_HUB_MODELS).",
        required=True,
    )
    init_checkpoint: str = _f(
        "",
        "The id of a checkpoint of this project (another run's, listed with its id by GET /api/v1/runs/{id}/checkpoints/) whose weights the run starts from instead of base_model's; same architecture and tokenizer. Never a path: the run's job is handed that checkpoint's directory. Empty: base_model's weights.",
        ids=True,
    )
    reward: dict = _f(
        {},
        'How episodes are scored, e.g. {"type": "exact_match"}, {"type": "regex", "pattern": "..."}, {"type": "math"}, {"type": "python", "path": "module:function"} (dataset mode); {"type": "judge", ...} (an LLM judge) or {"type": "human", "timeout_s": ...} (people giving feedback) in either mode. See "Reward types" below.',
    )
    # Rollout and staleness
    max_staleness: int = _f(
        4, "How many policy versions a trained token may lag behind (0 = synchronous RL).", min=0
    )
    batch_size: int = _f(8, "Trajectories per training step.", min=1)
    group_size: int = _f(4, "Answers sampled per prompt in dataset mode (the GRPO group).", min=1)
    max_concurrent_rollouts: int = _f(
        0, "Upper bound on rollouts in flight (0 = no extra cap beyond staleness).", min=0
    )
    max_queued_batches: int = _f(
        0,
        "Batches of finished trajectories that may wait for the trainer beside the one it "
        "trains (0 = no cap beyond staleness). 1 stops generation running ahead of a slower "
        "trainer: what it would generate ahead waits in the queue, ages, and is masked as stale.",
        min=0,
    )
    max_steps: int = _f(100, "Training steps before the run completes.", min=1)
    max_new_tokens: int = _f(256, "Tokens generated per answer in dataset mode.", min=1)
    temperature: float = _f(1.0, "Sampling temperature for dataset-mode rollouts.", min=0.0)
    top_p: float = _f(
        1.0,
        "Nucleus sampling probability mass for dataset-mode rollouts.",
        min=0.0,
        max=1.0,
        min_exclusive=True,
    )
    inference_backend: str = _f(
        "auto",
        "The inference engine: torch (Steep's own engine), sglang (GPUs), vllm (GPUs, or its CPU build from ./steep install --vllm). auto picks sglang on a cluster with GPUs, else the torch engine.",
        choices=INFERENCE_BACKENDS,
    )
    inference_tensor_parallel: int = _f(
        1,
        "GPUs per inference server (SGLang's --tp-size, vLLM's --tensor-parallel-size): room for a large model's weights and KV cache. Counted by the capacity check and the queue; 1 on CPUs.",
        min=1,
    )
    num_inference_servers: int = _f(1, "Inference server replicas the run starts.", min=1)
    weight_sync: str = _f(
        "distributed",
        "How new weights reach the inference servers after each step: distributed broadcasts them from the trainer (SGLang's update_weights_from_distributed); disk saves them and each server loads them. A server the broadcast fails for (STEEP_WEIGHT_SYNC_TIMEOUT_S, default 120 s) moves to disk for the rest of the run.",
        choices=WEIGHT_SYNC_STRATEGIES,
    )
    # Optimisation
    learning_rate: float = _f(1e-5, "AdamW learning rate.", min=0.0, min_exclusive=True)
    lr_schedule: str = _f("constant", "Learning-rate schedule after warm-up.", choices=LR_SCHEDULES)
    lr_warmup_steps: int = _f(0, "Linear warm-up steps.", min=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", min=0.0)
    max_grad_norm: float = _f(1.0, "Gradient-norm clip (0 disables clipping).", min=0.0)
    ppo_minibatches: int = _f(
        1,
        "Optimizer steps per training batch (the batch is split into this many minibatches).",
        min=1,
    )
    micro_batch_tokens: int = _f(
        8192,
        "Token budget of one packed micro-batch (gradient accumulation splits above it).",
        min=16,
    )
    prefix_tree: bool = _f(
        True,
        "Train sequences that share a prefix (a GRPO group's prompt, a forked session's conversation before the fork, a common system prompt) as a prefix tree: each shared prefix runs through the forward and backward once, with the same loss and gradients as packing every sequence whole. Micro-batches then keep such sequences together and count the tree's tokens against micro_batch_tokens.",
    )
    # Trainer scale and memory
    train_workers: int = _f(
        1,
        "Trainer processes, each a Ray actor (one GPU each on a GPU cluster); above 1 they shard parameters and optimizer state with FSDP2 and split every minibatch by token count.",
        min=1,
    )
    precision: str = _f(
        "auto",
        "Training precision: auto = bf16 compute with float32 master weights and optimizer state on CUDA, fp32 on CPU; bf16 needs GPUs.",
        choices=PRECISIONS,
    )
    gradient_checkpointing: bool = _f(
        False,
        "Recompute activations in the backward pass: less memory per token, about a third more compute. Turn it on from 7B, or past 4k tokens per micro-batch (the trainer sizing in docs/deploy.md assumes it).",
    )
    cpu_offload: bool = _f(
        False,
        "Keep the trainer's sharded float32 weights, gradients and AdamW state in CPU memory and step the optimizer there (FSDP2's CPU offload); each layer is copied to the GPU for its forward and backward. For a model whose 16 bytes per parameter do not fit the trainer GPUs (7B on one 80 GB GPU): GPU memory is then about one layer plus activations, steps are slower (bound by host-device copies). Uses FSDP2 with one trainer worker too; needs host memory of 16 bytes per parameter over the workers of a node.",
    )
    activation_offload: bool = _f(
        False,
        "Move the activations the backward pass needs to CPU memory during the forward and back during the backward: less GPU memory per token without recomputing, at the cost of host-device copies. With gradient_checkpointing only the layers' checkpoints move. Try gradient_checkpointing first.",
    )
    lora_rank: int = _f(
        0,
        "LoRA adapter rank (0 = full fine-tuning). With LoRA only the adapter is trained and checkpointed; the base weights never change.",
        min=0,
    )
    lora_alpha: float = _f(
        16.0,
        "LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank.",
        min=0.0,
        min_exclusive=True,
    )
    lora_target_modules: list = _f(
        [],
        'Names of the modules that get an adapter, e.g. ["q_proj", "v_proj"]; empty = every linear layer of the attention and MLP blocks.',
    )
    lora_dropout: float = _f(
        0.0,
        "Dropout on the adapter's input while training (0 keeps the recomputed logprobs deterministic).",
        min=0.0,
        max=1.0,
        max_exclusive=True,
    )
    inference_pool: str = _f(
        "",
        "Name of a shared inference pool to serve the run's adapters (LoRA runs only); empty = the run starts dedicated servers (num_inference_servers).",
    )
    roles: list = _f(
        [],
        'A multi-agent run: the roles it trains, e.g. ["speaker", "listener"], each its own LoRA adapter on base_model (online mode, lora_rank > 0). An agent is bound to a role or names one per request (model "policy/<role>"); advantages, baselines and metrics are per role. Empty = one policy. See docs/multi-agent.md.',
    )
    # Loss
    advantage: str = _f(
        "auto",
        "Advantage estimator; auto = grpo for groups > 1, reinforce_pp (batch baseline) otherwise.",
        choices=ADVANTAGE_ESTIMATORS,
    )
    use_decoupled_loss: bool = _f(
        True,
        "Decoupled PPO (recompute proximal logprobs); off = standard PPO with behaviour logprobs as proximal.",
    )
    eps_clip: float = _f(0.2, "PPO clip range below and above 1.", min=0.0, min_exclusive=True)
    eps_clip_higher: float | None = _f(
        None,
        "Separate upper clip range (DAPO clip-higher); empty = eps_clip.",
        min=0.0,
        min_exclusive=True,
    )
    dual_clip: float | None = _f(
        None,
        "Dual-clip constant c > 1 bounding the loss of negative advantages; empty disables.",
        min=1.0,
        min_exclusive=True,
    )
    behav_imp_weight_cap: float | None = _f(
        5.0,
        "The cap C on the behaviour importance weight w = exp(p - b): tokens above it are masked (rollout_correction cap_mask) or weighted C (truncate); empty = no cap.",
        min=1.0,
    )
    rollout_correction: str = _f(
        "cap_mask",
        "What training does with tokens whose engine logprob b is far from the trainer's recomputation p (w = exp(p - b)): cap_mask masks tokens with w above behav_imp_weight_cap; truncate weights them min(w, cap) (truncated importance sampling); token_band masks tokens with w outside [correction_ratio_low, correction_ratio_high]; sequence_reject masks whole sequences whose geometric-mean w is outside that band. Tokens the last two mask leave the loss's denominator. The correction/ metrics show what each would mask.",
        choices=ROLLOUT_CORRECTIONS,
    )
    correction_ratio_low: float = _f(
        0.5,
        "Lower end of the band of w = exp(p - b) that token_band and sequence_reject keep.",
        min=0.0,
        min_exclusive=True,
    )
    correction_ratio_high: float = _f(
        2.0,
        "Upper end of the band of w = exp(p - b) that token_band and sequence_reject keep.",
        min=1.0,
    )
    ratio_level: str = _f(
        "token",
        "Compute the PPO ratio per token or per sequence (geometric mean).",
        choices=RATIO_LEVELS,
    )
    loss_agg: str = _f(
        "token_mean",
        "Average the loss over all tokens or per sequence first.",
        choices=LOSS_AGGREGATIONS,
    )
    kl_coef: float = _f(
        0.0, "Weight of the KL penalty to the reference (initial) model; 0 disables it.", min=0.0
    )
    kl_estimator: str = _f(
        "k3",
        "KL estimator: k1 = log ratio, k3 = unbiased low-variance (Schulman).",
        choices=KL_ESTIMATORS,
    )
    entropy_coef: float = _f(0.0, "Entropy bonus weight.", min=0.0)
    turn_discount: float = _f(
        1.0,
        "Discount applied to later turns' rewards when credited to earlier turns.",
        min=0.0,
        max=1.0,
    )
    # On-policy distillation (rl_core.distill)
    teacher_url: str = _f(
        "",
        "On-policy distillation: the teacher's server, which scores every token the student was served (its logprob in the same context); each trained token's advantage gains distill_weight x (teacher logprob - student logprob). Empty: no teacher. Its tokenizer must be the student's.",
    )
    teacher_pool: str = _f(
        "",
        "On-policy distillation from a shared inference pool: the pool's base model, served by its servers, is the teacher (instead of teacher_url). Its tokenizer must be the student's.",
    )
    teacher_api: str = _f(
        "sglang",
        "How to ask teacher_url for logprobs: sglang = /generate with prompt logprobs (SGLang, Steep's torch engine); vllm = vLLM's /inference/v1/generate with prompt_logprobs; openai = an OpenAI-compatible /completions echoing the prompt's logprobs (teacher_url ends in /v1).",
        choices=("sglang", "vllm", "openai"),
    )
    teacher_model: str = _f("", "The model name teacher_api openai sends (its 'model' field).")
    teacher_tokenizer: str = _f(
        "",
        "Where the teacher's tokenizer is (a local directory), to check it is the student's; empty = the model path the teacher's server reports.",
    )
    distill_weight: float = _f(
        1.0, "Weight of the teacher's per-token signal in the advantage.", min=0.0
    )
    reward_weight: float = _f(
        1.0,
        "Weight of the reward's advantage beside a teacher's signal (0 = distillation alone; without a teacher it is not used).",
        min=0.0,
    )
    distill_topk: int = _f(
        0,
        "Dense supervision from the teacher: its k likeliest tokens at each trained position and a forward-KL term pulling the student's logprobs of them towards the teacher's (distill_topk_coef), so the student learns what the teacher would say, not only what it sampled. Costs the teacher k logprobs per token (SGLang, vLLM or the torch engine) and the trainer a [tokens, k] gather. 0 = off (the sampled-token signal alone).",
        min=0,
        max=64,
    )
    distill_topk_coef: float = _f(
        1.0,
        "Weight of the top-k forward-KL term in the loss (with distill_topk > 0).",
        min=0.0,
    )
    self_distill: bool = _f(
        False,
        "Self-distillation from feedback: the teacher is the policy itself (its own servers) with the session's hint in context (/rl/set_reward's hint, a feedback comment, a judge's critique); sessions without one train on reward alone. Not with teacher_url.",
    )
    hint_position: str = _f(
        "system",
        "Where self_distill puts the hint: system = a system message before the conversation; before_response = text right before the first answer token.",
        choices=("system", "before_response"),
    )
    hint_template: str = _f(
        "A reviewer's note on this task: {hint}",
        "How self_distill words the hint ({hint} is replaced by it).",
    )
    # Sessions (online mode)
    train_incomplete_sessions: bool = _f(
        False, "Train expired sessions that have at least one reward."
    )
    # Bookkeeping
    save_every: int = _f(
        50,
        "Save a checkpoint every this many steps (and always at the end). After a crash the run"
        " resumes from the last one and trains the steps since again (their trajectories are kept):"
        " lower it for LoRA runs, whose checkpoints are the adapter alone (docs/benchmarks.md).",
        min=1,
    )
    async_checkpoints: bool = _f(
        True,
        "Write checkpoints in the background: a step waits only while the trainer's state is"
        " copied (into memory as large as the checkpoint), not for the disk. A checkpoint counts"
        " for a resume once it is complete. A trainer on several workers saves in step.",
    )
    seed: int = _f(0, "Random seed for sampling and initialisation.", min=0)
    # Evaluation (rl_core.evals, rl_core.evaluate)
    eval_every: int = _f(
        0,
        "Dataset mode: evaluate a checkpoint on the held-out rows every this many steps, while training goes on (a checkpoint is saved at those steps too). 0: never.",
        min=0,
    )
    eval_fraction: float = _f(
        0.0,
        "Share of the dataset's rows held out of training for evaluation (the same rows on every start, chosen by seed). Needed by eval_every; also the default rows of an eval started by hand.",
        min=0.0,
        max=0.9,
    )
    eval_k: int = _f(4, "Answers sampled per example in an evaluation (pass@k uses k).", min=1)
    eval_pass_threshold: float = _f(
        1.0, "An evaluated answer passes (for pass@k) when its reward is at least this."
    )
    eval_max_examples: int = _f(
        100, "Most held-out examples a scheduled evaluation scores (0: all of them).", min=0
    )
    # Experiment trackers (rl_core.trackers, docs/trackers.md)
    trackers: dict = _f(
        {},
        'Mirror the run\'s metrics, config, checkpoints and evaluations to experiment trackers, e.g. {"wandb": {"project": "letters"}, "mlflow": {"tracking_uri": "https://mlflow.example.com"}, "tensorboard": {}}; false turns off one the instance turns on (STEEP_TRACKERS). Credentials (wandb.api_key, mlflow.tracking_token) are stored encrypted and never shown again. A tracker that fails is turned off for the rest of the run, which goes on. See docs/trackers.md.',
        placeholder='{"tensorboard": {}}',
    )

    @classmethod
    def field_specs(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Validate ``data`` and build a config; unknown keys are errors, missing keys take defaults."""
        if not isinstance(data, dict):
            raise ConfigError({"non_field_errors": ["Expected a JSON object of run settings."]})
        errors: dict[str, list[str]] = {}
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key in data:
            if key not in known:
                errors.setdefault(key, []).append(
                    f"Unknown setting '{key}'. Known settings: {', '.join(sorted(known))}."
                )
        for name, f in known.items():
            if name not in data:
                continue
            try:
                values[name] = _coerce(f, data[name])
            except ValueError as exc:
                errors.setdefault(name, []).append(str(exc))
        if errors:
            raise ConfigError(errors)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        errors: dict[str, list[str]] = {}

        def bad(name: str, message: str) -> None:
            errors.setdefault(name, []).append(message)

        if not self.base_model.strip():
            bad(
                "base_model",
                "Set base_model to a model this instance offers (GET /api/v1/models/ lists them).",
            )
        if self.init_checkpoint != self.init_checkpoint.strip():
            bad(
                "init_checkpoint",
                "init_checkpoint is a checkpoint's id without surrounding spaces (or empty for base_model's weights).",
            )
        if self.mode == "dataset":
            if not self.reward:
                bad("reward", 'Dataset mode needs a reward, e.g. {"type": "exact_match"}.')
            else:
                for message in reward_spec_errors(self.reward):
                    bad("reward", message)
        elif self.reward:
            for message in reward_spec_errors(self.reward):
                bad("reward", message)
        if self.lr_warmup_steps >= self.max_steps and self.lr_warmup_steps > 0:
            bad(
                "lr_warmup_steps",
                f"Warm-up ({self.lr_warmup_steps}) must be shorter than max_steps ({self.max_steps}).",
            )
        if not self.correction_ratio_low <= 1.0 <= self.correction_ratio_high:
            bad(
                "correction_ratio_low",
                f"The band [{self.correction_ratio_low}, {self.correction_ratio_high}] must hold 1 (w = 1 when the engine and the trainer agree).",
            )
        if self.ppo_minibatches > self.batch_size:
            bad(
                "ppo_minibatches",
                f"Cannot split a batch of {self.batch_size} into {self.ppo_minibatches} minibatches; set ppo_minibatches <= batch_size.",
            )
        if self.mode == "dataset" and self.batch_size % self.group_size:
            bad(
                "batch_size",
                f"In dataset mode batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}) so groups are trained whole.",
            )
        if self.eval_every and self.mode != "dataset":
            bad(
                "eval_every",
                "Scheduled evaluation needs dataset mode (it scores held-out dataset rows with the run's reward); set eval_every to 0.",
            )
        elif self.eval_every and not self.eval_fraction:
            bad(
                "eval_fraction",
                "eval_every needs held-out rows: set eval_fraction, e.g. 0.1, so they are kept out of training.",
            )
        if self.lora_target_modules and not self.lora_rank:
            bad(
                "lora_target_modules",
                "lora_target_modules only applies with LoRA: set lora_rank above 0, or leave the list empty.",
            )
        if self.inference_pool and not self.lora_rank:
            bad(
                "inference_pool",
                "A full-weight run (lora_rank 0) cannot attach to a shared inference pool: its new weights would replace the pool's base model for every run on it. Set lora_rank above 0, or leave inference_pool empty for servers of its own.",
            )
        if self.inference_tensor_parallel > 1 and self.inference_backend == "torch":
            bad(
                "inference_tensor_parallel",
                "The torch engine serves a model on one device; set inference_backend to sglang or vllm (GPUs) for tensor parallelism, or inference_tensor_parallel to 1.",
            )
        if self.inference_tensor_parallel > 1 and self.inference_pool:
            bad(
                "inference_tensor_parallel",
                "A run on a shared inference pool is served by the pool's servers, sized by the pool; leave inference_tensor_parallel at 1.",
            )
        if self.inference_pool != self.inference_pool.strip():
            bad("inference_pool", "inference_pool is a pool's name, without surrounding spaces.")
        if LORA_ALL_LINEAR in self.lora_target_modules and len(self.lora_target_modules) > 1:
            bad(
                "lora_target_modules",
                f'"{LORA_ALL_LINEAR}" means every linear layer; list module names or use it alone.',
            )
        if self.teacher_url and not self.teacher_url.startswith(("http://", "https://")):
            bad("teacher_url", "teacher_url is the teacher server's http:// or https:// URL.")
        if self.teacher_url and self.teacher_api == "openai" and not self.teacher_model:
            bad(
                "teacher_model",
                "teacher_api openai needs the model name to send: set teacher_model.",
            )
        if self.teacher_url and self.teacher_pool:
            bad("teacher_pool", "Name one teacher: teacher_url or teacher_pool.")
        if self.self_distill and (self.teacher_url or self.teacher_pool):
            bad(
                "self_distill", "self_distill's teacher is the policy: no teacher_url/teacher_pool."
            )
        if self.self_distill and "{hint}" not in self.hint_template:
            bad("hint_template", "hint_template must contain {hint}.")
        has_teacher = bool(self.teacher_url or self.teacher_pool or self.self_distill)
        if self.distill_topk and not has_teacher:
            bad(
                "distill_topk",
                "distill_topk needs a teacher: set teacher_url, teacher_pool or self_distill.",
            )
        topk_trains = bool(self.distill_topk and self.distill_topk_coef)
        if has_teacher and not (self.distill_weight or self.reward_weight or topk_trains):
            bad(
                "distill_weight",
                "distill_weight and reward_weight are both 0: nothing would train.",
            )
        for message in role_errors(self.roles, mode=self.mode, lora_rank=self.lora_rank):
            bad("roles", message)
        for message in tracker_spec_errors(self.trackers):
            bad("trackers", message)
        if errors:
            raise ConfigError(errors)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def lora_targets(self) -> list[str] | str:
        """What peft's ``target_modules`` gets: the listed names, else every linear layer."""
        return list(self.lora_target_modules) or LORA_ALL_LINEAR

    @property
    def resolved_advantage(self) -> str:
        """The estimator actually used: online sessions come in groups of one, so they get a batch baseline."""
        if self.advantage != "auto":
            return self.advantage
        return "grpo" if self.mode == "dataset" and self.group_size > 1 else "reinforce_pp"


def role_errors(roles: list, *, mode: str, lora_rank: int) -> list[str]:
    """What is wrong with a run's ``roles``: names, count, and the mode and LoRA they need."""
    if not roles:
        return []
    bad = [r for r in roles if not isinstance(r, str) or not ROLE_NAME.fullmatch(r)]
    if bad:
        return [
            f"Role names are 1-32 lowercase letters, digits, '_' or '-', starting with a letter; got {bad!r}."
        ]
    out = []
    if len(set(roles)) != len(roles):
        out.append("Each role is named once.")
    if len(roles) > MAX_ROLES:
        out.append(f"A run trains at most {MAX_ROLES} roles; got {len(roles)}.")
    if "default" in roles:
        out.append('"default" is the name of a one-policy run\'s adapter; name the role otherwise.')
    if mode != "online":
        out.append("Roles are for online runs: agents name the role they play; set mode to online.")
    if not lora_rank:
        out.append("Each role trains its own LoRA adapter on base_model: set lora_rank above 0.")
    return out


def stored_setting(config: Mapping[str, Any], name: str) -> Any:
    """A setting of a stored run config (``RunConfig.to_dict()``): ``RunConfig``'s default
    when the dict lacks it or holds null (a config stored before the setting existed), so
    no reader repeats a default."""
    value = config.get(name)
    if value is not None:
        return value
    return _default(_FIELDS[name])


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
