"""Tiny-model smoke runs of the GRPO loop: every metric logged, checkpoints, the adapter, the plot, loss options."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from grpo_kernels.trainer import train
from grpo_kernels.trainer.checkpoint import ADAPTER_FILE, list_checkpoints

from .conftest import tiny_config

DIGITS = "tests.trainer.helpers:digit_reward"


def test_two_steps_log_every_metric_and_save_everything(model_dir, dataset_file, tmp_path):
    # mu = 2 and two micro-batches: old log-probs, accumulation and the KL to the adapter-disabled base all run.
    cfg = tiny_config(
        model_dir,
        dataset_file,
        tmp_path,
        reward_funcs=f"accuracy,format,{DIGITS}",
        reward_weights="1,0.5,1",
        num_iterations=2,
        gradient_accumulation_steps=2,
        beta=0.1,
        plot=True,
    )
    result = train(cfg)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records == result.records
    for key in (
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "rewards/format/std",
        "rewards/digit/mean",
        "accuracy",
        "loss",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "tokens_per_s",
        "peak_memory_mb",
        "grad_norm",
        "learning_rate",
    ):
        assert key in records[-1] and math.isfinite(records[-1][key]), key
    assert 1 <= records[-1]["completions/mean_length"] <= 12
    assert records[-1]["kl"] > 0  # the adapter moved away from the reference after the first update

    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    ckpt = tmp_path / "checkpoint-2"
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= {p.name for p in ckpt.iterdir()}
    final = load_file(result.adapter_dir / ADAPTER_FILE)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in final.items())
    assert torch.equal(final[next(iter(final))], load_file(ckpt / ADAPTER_FILE)[next(iter(final))])
    assert result.plot_path is not None and result.plot_path.stat().st_size > 10_000


def test_reference_is_the_base_model_with_the_adapter_disabled(model_dir, dataset_file, tmp_path):
    from grpo_kernels.trainer.loop import load_model

    result = train(tiny_config(model_dir, dataset_file, tmp_path, reward_funcs=DIGITS, max_steps=1, save_steps=0))
    base, _ = load_model(str(model_dir))
    ids = torch.tensor([[5, 9, 10, 11]])
    with torch.no_grad(), result.model.disable_adapter():
        assert torch.equal(result.model(ids).logits, base(ids).logits)
    assert sum(p.numel() for p in result.model.parameters() if p.requires_grad) < sum(
        p.numel() for p in base.parameters()
    )


@pytest.mark.parametrize(
    "options",
    [
        {
            "loss_type": "dapo",
            "epsilon_high": 0.28,
            "mask_truncated_completions": True,
        },  # token-sum normalizer, masking
        {"loss_type": "dr_grpo", "scale_rewards": "none"},  # constant normalizer, unscaled advantages
        {"loss_type": "cispo", "epsilon_high": 5.0, "num_iterations": 2},  # stop-gradient coefficient
        {"loss_type": "sapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01},  # soft gate, entropy mask and bonus
        {
            "loss_type": "luspo",
            "importance_sampling_level": "sequence",
            "num_iterations": 2,
        },  # GSPO-style sequence ratio
        {"loss_type": "vespo", "off_policy_mask_threshold": 0.5, "scale_rewards": "batch", "lr_scheduler": "constant"},
    ],
    ids=lambda o: o["loss_type"],
)
def test_every_loss_type_trains(model_dir, dataset_file, tmp_path, options):
    result = train(
        tiny_config(model_dir, dataset_file, tmp_path, reward_funcs=DIGITS, max_steps=1, save_steps=0, **options)
    )
    assert math.isfinite(result.records[0]["loss"])
