"""The trainer's one config dataclass; the CLI makes a flag of every field (`--field-name`).

The loss fields mirror `grpo_kernels.LossConfig` one to one (a test keeps them in step), so every option of the
loss is reachable from the command line; `temperature` and `max_completion_length` serve sampling and loss alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..config import LOSS_TYPES, LossConfig

# Options of the loss that the loop fills in itself rather than the user.
LOOP_SET_LOSS_OPTIONS = ("num_items_in_batch",)
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _help(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class TrainConfig:
    # model and data
    model: str = _help("model folder or Hugging Face hub id", "")
    dataset: str = _help("a local .jsonl/.json/.csv/.parquet file or a Hugging Face dataset name", "")
    dataset_config: str | None = _help("the dataset's configuration name (hub datasets)", None)
    dataset_split: str = _help("the split to train on", "train")
    prompt_column: str = _help("column holding the question", "prompt")
    answer_column: str = _help("column holding the gold answer (for accuracy_reward)", "answer")
    tests_column: str = _help("column holding the test code (for code_reward)", "tests")
    system_prompt: str = _help('"r1" (DeepSeek-R1\'s prompt), "none", or the literal text of a system prompt', "r1")
    chat_template: bool = _help("use the tokenizer's chat template when it has one", True)
    output_dir: str = _help("where metrics.jsonl, the checkpoints, the final adapter and the plot go", "runs/grpo")

    # LoRA
    lora_r: int = _help("LoRA rank", 16)
    lora_alpha: float = _help("LoRA alpha", 32.0)
    lora_dropout: float = _help("LoRA dropout", 0.0)
    lora_target_modules: str = _help('comma-separated module names, or "all-linear"', DEFAULT_LORA_TARGETS)

    # rollouts
    prompts_per_step: int = _help("prompts per rollout batch (B)", 8)
    num_generations: int = _help("completions per prompt (G)", 8)
    max_prompt_length: int = _help("prompts are cut to their last this-many tokens", 512)
    max_completion_length: int = _help("max new tokens per completion (also dr_grpo's normalizer)", 256)
    temperature: float = _help("sampling temperature, also applied to the logits in the loss", 1.0)
    top_p: float = _help("nucleus sampling", 1.0)
    top_k: int = _help("top-k sampling (0: off)", 0)
    mask_truncated_completions: bool = _help("exclude completions that hit the length limit from the loss", False)
    reward_funcs: str = _help(
        "comma-separated: accuracy, format, format_lenient, code, or module:function", "accuracy,format"
    )
    reward_weights: str = _help("comma-separated weights, one per reward function (empty: all 1)", "")
    scale_rewards: str = _help('advantage scaling: "group", "batch" or "none"', "group")

    # optimization
    max_steps: int = _help("rollout batches to train on", 100)
    num_iterations: int = _help("policy updates per rollout batch (mu)", 1)
    gradient_accumulation_steps: int = _help("micro-batches each rollout batch is split into", 1)
    learning_rate: float = _help("peak learning rate", 1e-5)
    lr_scheduler: str = _help('"cosine" or "constant"', "cosine")
    warmup_steps: int = _help("optimizer steps of linear warm-up", 0)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    adam_beta1: float = _help("AdamW beta1", 0.9)
    adam_beta2: float = _help("AdamW beta2", 0.99)
    max_grad_norm: float = _help("gradient clipping (0: off)", 1.0)

    # the loss (grpo_loss options, TRL's names and defaults except loss_type/beta, which follow the seeds)
    loss_type: str = _help(f"one of {', '.join(LOSS_TYPES)}", "grpo")
    beta: float = _help("KL penalty to the reference (the base model, adapter disabled)", 0.04)
    epsilon_low: float = _help("lower clip range", 0.2)
    epsilon_high: float | None = _help("upper clip range (default: epsilon_low); cispo's absolute cap", None)
    delta: float | None = _help("two-sided clipping bound on the ratio", None)
    importance_sampling_level: str = _help('"token" or "sequence" (GSPO)', "token")
    use_bias_correction_kl: bool = _help("multiply the KL by the importance ratio", False)
    sapo_temperature_pos: float = _help("sapo: temperature for positive advantages", 1.0)
    sapo_temperature_neg: float = _help("sapo: temperature for negative advantages", 1.05)
    vespo_k_pos: float = _help("vespo: k for A >= 0", 2.0)
    vespo_lambda_pos: float = _help("vespo: lambda for A >= 0", 3.0)
    vespo_k_neg: float = _help("vespo: k for A < 0", 3.0)
    vespo_lambda_neg: float = _help("vespo: lambda for A < 0", 2.0)
    off_policy_mask_threshold: float | None = _help("mask negative-advantage sequences this far off-policy", None)
    top_entropy_quantile: float = _help("train only on the top-q entropy tokens", 1.0)
    entropy_coef: float = _help("entropy bonus coefficient", 0.0)
    check_inputs: bool = _help("raise on NaN/inf at unmasked tokens (logits included: one more pass over them)", False)
    backend: str = _help('loss backend: "auto", "triton" or "torch"', "auto")

    # runtime
    seed: int = _help("seed for sampling, data order and LoRA init", 0)
    device: str = _help('"auto" (cuda when available), "cpu" or "cuda[:i]"', "auto")
    dtype: str = _help('"auto" (bf16 on GPU, fp32 on CPU), "float32", "bfloat16" or "float16"', "auto")
    num_threads: int = _help("torch CPU threads (0: torch's default)", 0)
    save_steps: int = _help("checkpoint every this many steps (0: only at the end)", 50)
    save_total_limit: int = _help("checkpoints kept (oldest removed first)", 2)
    resume: bool = _help("continue from the newest checkpoint in output_dir", False)
    progress: bool = _help("show a rich progress bar", True)
    plot: bool = _help("write training_curves.png at the end", True)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        for name in (
            "lora_r",
            "prompts_per_step",
            "num_generations",
            "max_prompt_length",
            "max_completion_length",
            "max_steps",
            "num_iterations",
            "gradient_accumulation_steps",
        ):
            check(getattr(self, name) >= 1, name, ">= 1")
        for name in ("warmup_steps", "save_steps", "save_total_limit", "top_k", "num_threads", "max_grad_norm"):
            check(getattr(self, name) >= 0, name, ">= 0")
        check(self.temperature > 0, "temperature", "> 0")
        check(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.scale_rewards in ("group", "batch", "none"), "scale_rewards", '"group", "batch" or "none"')
        check(self.lr_scheduler in ("cosine", "constant"), "lr_scheduler", '"cosine" or "constant"')
        check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            '"auto", "float32", "bfloat16" or "float16"',
        )
        self.loss_config()  # validates every loss option now, not at the first step

    def loss_options(self) -> dict[str, Any]:
        """The keyword options of `grpo_loss` this config sets (all but those the loop fills in per batch)."""
        return {name: getattr(self, name) for name in LossConfig.option_names() if name not in LOOP_SET_LOSS_OPTIONS}

    def loss_config(self) -> LossConfig:
        return LossConfig(**self.loss_options())

    def weights(self, num_funcs: int) -> list[float]:
        if not self.reward_weights.strip():
            return [1.0] * num_funcs
        weights = [float(w) for w in self.reward_weights.split(",")]
        if len(weights) != num_funcs:
            raise ValueError(f"reward_weights must have {num_funcs} entries (one per reward function), got {weights}")
        return weights

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
