"""The run settings in groups: the sections of the dashboard's run form and of docs/run-settings.md.

Every ``RunConfig`` field is in exactly one group (a test holds this, so a new setting cannot
be left out of the form). The first group, ``ESSENTIALS``, is what a first run needs and the
form shows open; the others are folded under *Advanced*. No Django, no torch.
"""

from __future__ import annotations

ESSENTIALS = "Essentials"

SETTING_GROUPS: dict[str, tuple[str, ...]] = {
    ESSENTIALS: ("mode", "base_model", "reward", "max_steps"),
    "Model and LoRA": (
        "init_checkpoint",
        "lora_rank",
        "lora_alpha",
        "lora_target_modules",
        "lora_dropout",
        "inference_pool",
        "roles",
    ),
    "Optimisation": (
        "learning_rate",
        "lr_schedule",
        "lr_warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "ppo_minibatches",
        "seed",
    ),
    "PPO and loss": (
        "advantage",
        "use_decoupled_loss",
        "eps_clip",
        "eps_clip_higher",
        "dual_clip",
        "behav_imp_weight_cap",
        "rollout_correction",
        "correction_ratio_low",
        "correction_ratio_high",
        "ratio_level",
        "loss_agg",
        "kl_coef",
        "kl_estimator",
        "entropy_coef",
        "turn_discount",
    ),
    "Rollouts and staleness": (
        "batch_size",
        "group_size",
        "max_staleness",
        "max_concurrent_rollouts",
        "max_queued_batches",
        "max_new_tokens",
        "temperature",
        "top_p",
        "train_incomplete_sessions",
    ),
    "Inference": (
        "inference_backend",
        "num_inference_servers",
        "inference_tensor_parallel",
        "weight_sync",
    ),
    "Trainer scale and memory": (
        "train_workers",
        "precision",
        "micro_batch_tokens",
        "prefix_tree",
        "gradient_checkpointing",
        "cpu_offload",
        "activation_offload",
    ),
    "Checkpoints and evaluations": (
        "save_every",
        "async_checkpoints",
        "eval_every",
        "eval_fraction",
        "eval_k",
        "eval_pass_threshold",
        "eval_max_examples",
    ),
    "Distillation": (
        "teacher_url",
        "teacher_pool",
        "teacher_api",
        "teacher_model",
        "teacher_tokenizer",
        "distill_weight",
        "distill_topk",
        "distill_topk_coef",
        "reward_weight",
        "self_distill",
        "hint_position",
        "hint_template",
    ),
    "Experiment trackers": ("trackers",),
}

# What a LoRA run on a shared pool needs besides the essentials: the form shows them open
# where the instance has pools.
POOL_SETTINGS = ("inference_pool", "lora_rank")
