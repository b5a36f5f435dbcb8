"""The trainer's one config dataclass; the CLI makes a flag of every field (`--field-name`).

The loss options live in a `grpo_kernels.LossConfig` (`cfg.loss`), and the CLI gives each of its options a flag of
its own (`--loss-type`, `--beta`, ...). `temperature` and `max_completion_length` serve sampling and loss alike:
they are fields of the trainer, copied into `cfg.loss`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..config import LOSS_TYPES, LossConfig

# Options of the loss that the loop fills in itself rather than the user.
LOOP_SET_LOSS_OPTIONS = ("num_items_in_batch",)
# Options of the loss that are fields of the trainer because sampling uses them too.
SHARED_LOSS_OPTIONS = ("temperature", "max_completion_length")
# The trainer's defaults where they differ from grpo_loss's (TRL's names and defaults otherwise).
TRAINER_LOSS_DEFAULTS: dict[str, Any] = {"beta": 0.04}
LOSS_HELP = {
    "loss_type": f"one of {', '.join(LOSS_TYPES)}",
    "beta": "KL penalty to the reference (the base model, adapter disabled); >= 0",
    "epsilon_low": "lower clip range (TRL's name: --epsilon)",
    "epsilon_high": "upper clip range (default: epsilon_low); cispo's absolute cap",
    "delta": "two-sided clipping bound on the ratio",
    "importance_sampling_level": '"token" or "sequence" (GSPO)',
    "use_bias_correction_kl": "multiply the KL by the importance ratio",
    "sapo_temperature_pos": "sapo: temperature for positive advantages",
    "sapo_temperature_neg": "sapo: temperature for negative advantages",
    "vespo_k_pos": "vespo: k for A >= 0",
    "vespo_lambda_pos": "vespo: lambda for A >= 0",
    "vespo_k_neg": "vespo: k for A < 0",
    "vespo_lambda_neg": "vespo: lambda for A < 0",
    "off_policy_mask_threshold": "mask negative-advantage sequences this far off-policy",
    "top_entropy_quantile": "train only on the top-q entropy tokens",
    "entropy_coef": "entropy bonus coefficient",
    "check_inputs": "raise on NaN/inf at unmasked tokens (logits included: one more pass over them)",
}
# Fields a resumed run may change freely: where and how it reports, not what it computes.
HARMLESS_FIELDS = (
    "output_dir",
    "backend",
    "device",
    "num_threads",
    "save_steps",
    "save_total_limit",
    "resume",
    "overwrite",
    "allow_config_change",
    "progress",
    "logging_steps",
    "plot",
    "zero_variance_warning_steps",
    "log_completions",
)
# Fields that set the learning-rate schedule or the optimizer: a change rebuilds both
SCHEDULE_FIELDS = (
    "max_steps",
    "num_iterations",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
)
DATA_FORMATS = (
    "a local .jsonl (one JSON object per line), .json (a list of objects, or JSON lines), .csv (a header row) or "
    ".parquet file, a Hugging Face hub dataset name, or reasoning-gym:NAME[,NAME...] (procedural tasks, generated "
    "in memory; the reasoning-gym extra)"
)


def loss_options() -> list[str]:
    """The options of `LossConfig` the user sets (each one a CLI flag)."""
    skip = LOOP_SET_LOSS_OPTIONS + SHARED_LOSS_OPTIONS
    return [name for name in LossConfig.option_names() if name not in skip]


DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _help(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class TrainConfig:
    # model and data
    model: str = _help("model folder or Hugging Face hub id", "")
    dataset: str = _help(DATA_FORMATS, "")
    dataset_config: str | None = _help("the dataset's configuration name (hub datasets)", None)
    dataset_split: str = _help(
        "the split of a hub dataset to train on (a local file is one split: another value is refused there)", "train"
    )
    num_examples: int | None = _help(
        "reasoning-gym: examples generated per task, from --seed (default: 1000); other datasets use every row", None
    )
    prompt_column: str = _help("column holding the prompt: text, or a list of chat messages", "prompt")
    answer_column: str = _help(
        "column holding the gold answer (for accuracy_reward); left at its default, a dataset without an 'answer' "
        "column may hold it in TRL's 'solution' column",
        "answer",
    )
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
    num_generations: int = _help("completions per prompt (G), >= 2: the advantage compares a group's rewards", 8)
    max_prompt_length: int = _help("prompts are cut to their last this-many tokens", 512)
    max_completion_length: int = _help("max new tokens per completion (also dr_grpo's normalizer)", 256)
    temperature: float = _help("sampling temperature, also applied to the logits in the loss", 1.0)
    top_p: float = _help("nucleus sampling", 1.0)
    top_k: int = _help("top-k sampling (0: off)", 0)
    mask_truncated_completions: bool = _help("exclude completions that hit the length limit from the loss", False)
    reward_funcs: str = _help(
        "comma-separated: accuracy, format, format_lenient, code, or module:function, a function of your own "
        "(e.g. myrewards:digit_reward for def digit_reward(completions, **columns) in ./myrewards.py; the module is "
        "looked up in the current folder first)",
        "accuracy,format",
    )
    reward_weights: str = _help("comma-separated weights, one per reward function (empty: all 1)", "")
    scale_rewards: str = _help('advantage scaling: "group", "batch" or "none"', "group")

    # optimization
    max_steps: int = _help("rollout batches to train on", 100)
    num_iterations: int = _help("policy updates per rollout batch (mu)", 1)
    gradient_accumulation_steps: int = _help("micro-batches each rollout batch is split into", 1)
    learning_rate: float = _help("peak learning rate", 1e-5)
    lr_scheduler: str = _help('"cosine" or "constant" (TRL\'s name: --lr-scheduler-type)', "cosine")
    warmup_steps: int = _help("optimizer steps of linear warm-up", 0)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    adam_beta1: float = _help("AdamW beta1", 0.9)
    adam_beta2: float = _help("AdamW beta2", 0.99)
    max_grad_norm: float = _help("gradient clipping (0: off)", 1.0)

    # the loss: every option of grpo_loss is a flag of its own (--loss-type, --beta, ...); see LOSS_HELP
    loss: LossConfig = field(default_factory=lambda: LossConfig(**TRAINER_LOSS_DEFAULTS), metadata={"help": ""})
    backend: str = _help('loss backend: "auto", "triton" or "torch"', "auto")

    # runtime
    seed: int = _help("seed for sampling, data order and LoRA init", 0)
    device: str = _help('"auto" (cuda when available), "cpu" or "cuda[:i]"', "auto")
    dtype: str = _help('"auto" (bf16 on GPU, fp32 on CPU), "float32", "bfloat16" or "float16"', "auto")
    num_threads: int = _help("torch CPU threads (0: torch's default)", 0)
    save_steps: int = _help("checkpoint every this many steps (0: only at the end)", 50)
    save_total_limit: int = _help("checkpoints kept, the oldest removed first (0: keep every checkpoint)", 2)
    resume: bool = _help("continue from the newest complete checkpoint in output_dir", False)
    overwrite: bool = _help("replace the run already in output_dir (its metrics, checkpoints, adapter, plot)", False)
    allow_config_change: bool = _help(
        "with --resume: continue although the configuration changed since the checkpoint (the LR schedule is "
        "rebuilt for the new length)",
        False,
    )
    progress: bool = _help("show a rich progress bar (--no-progress: one line per logging step)", True)
    logging_steps: int = _help("print a line every this many steps with --no-progress (metrics.jsonl: every step)", 1)
    zero_variance_warning_steps: int = _help(
        "warn once when every group's rewards are equal for this many steps in a row (0: never)", 10
    )
    plot: bool = _help("write training_curves.png at the end", True)
    log_completions: int = _help(
        "completions appended to completions.jsonl at every logging step, with their prompt, rewards and advantage; "
        "the console shows the best and the worst of them (0: none)",
        4,
    )

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
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2, got {self.num_generations}: GRPO's advantage is a completion's reward "
                "minus the mean of its group of num_generations completions, so a group of one has advantage 0 and "
                "nothing is learned"
            )
        self._check_batch()
        for name in (
            "warmup_steps",
            "save_steps",
            "save_total_limit",
            "top_k",
            "num_threads",
            "max_grad_norm",
            "logging_steps",
            "zero_variance_warning_steps",
            "log_completions",
        ):
            check(getattr(self, name) >= 0, name, ">= 0")
        check(self.num_examples is None or self.num_examples >= 1, "num_examples", ">= 1")
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
        check(self.logging_steps >= 1, "logging_steps", ">= 1")
        check(_is_device(self.device), "device", '"auto", "cpu", "cuda" or "cuda:<index>" (a torch device)')
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: continue the run in output_dir, or replace it")
        if isinstance(self.loss, dict):  # as to_dict() wrote it
            self.loss = LossConfig(**self.loss)
        if not isinstance(self.loss, LossConfig):
            raise TypeError(f"loss must be a grpo_kernels.LossConfig, got {type(self.loss).__name__}")
        # sampling and the loss share the temperature and the length limit (dr_grpo's normalizer)
        self.loss = replace(self.loss, temperature=self.temperature, max_completion_length=self.max_completion_length)

    def _check_batch(self) -> None:
        """The micro-batches fit the rollout batch; the reward weights are numbers (each error names its flag)."""
        sequences = self.prompts_per_step * self.num_generations
        if self.gradient_accumulation_steps > sequences:
            raise ValueError(
                f"gradient_accumulation_steps must be at most the {sequences} sequences of a rollout batch "
                f"(prompts_per_step x num_generations), got {self.gradient_accumulation_steps}: each micro-batch "
                "needs at least one"
            )
        self.parsed_reward_weights(None)

    def loss_options(self) -> dict[str, Any]:
        """The keyword options of `grpo_loss` this config sets (all but those the loop fills in per batch)."""
        return {k: v for k, v in asdict(self.loss).items() if k not in LOOP_SET_LOSS_OPTIONS}

    def parsed_reward_weights(self, num_funcs: int | None) -> list[float]:
        """`reward_weights` as numbers, one per reward function (all 1 when it is empty; `num_funcs` None: as many
        as it lists)."""
        if not self.reward_weights.strip():
            return [1.0] * (num_funcs or 0)
        try:
            weights = [float(w) for w in self.reward_weights.split(",")]
        except ValueError:
            weights = []
        if not weights or not all(math.isfinite(w) for w in weights):
            raise ValueError(
                f"reward_weights must be comma-separated finite numbers, one per reward function (e.g. 1,0.5), got "
                f"{self.reward_weights!r}"
            )
        if num_funcs is not None and len(weights) != num_funcs:
            raise ValueError(f"reward_weights must have {num_funcs} entries (one per reward function), got {weights}")
        return weights

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        """A config from flat options, as the CLI has them: the loss options (`loss_type`, `beta`, ...) beside the
        trainer's fields. An unknown name is an error."""
        known, options = {f.name for f in fields(cls)}, set(loss_options())
        unknown = sorted(set(values) - known - options)
        if unknown:
            raise TypeError(f"unknown TrainConfig option(s) {unknown}")
        loss = TRAINER_LOSS_DEFAULTS | {k: v for k, v in values.items() if k in options}
        return cls(**{k: v for k, v in values.items() if k in known and k != "loss"}, loss=LossConfig(**loss))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The config a checkpoint saved (`to_dict`); names this version does not know are left out."""
        known = {f.name for f in fields(cls)}
        if "loss" not in values:  # saved by a version with the loss options at top level
            values = {**values, "loss": {k: v for k, v in values.items() if k in loss_options()}}
        return cls(**{k: v for k, v in values.items() if k in known})

    def changes_from(self, saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{name: (saved value, this value)} of the options, the loss's included, that differ from a saved
        `to_dict()`; names that only one of the two versions knows are left out."""
        a, b = _flatten(saved), _flatten(self.to_dict())
        return {k: (a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k]}


def _is_device(name: str) -> bool:
    if name == "auto":
        return True
    import torch

    try:
        torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _flatten(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != "loss"} | dict(values.get("loss", {}))
