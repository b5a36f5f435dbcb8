"""A real `FusedGRPOTrainer.train()` on CPU: generation, a rule-based reward, the fused loss, optimizer steps, logs."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import grpo_kernels.integrations.trl as fused_trl
from grpo_kernels.integrations.trl import FusedGRPOTrainer, patch_grpo_trainer

from . import char_fraction_reward, save_tiny_model

PROMPTS = ["abc", "hello", "xyz", "grpo", "kernel", "fused", "loss", "trl"]


def config(tmp_path, **options):
    base = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,  # large, so that every trained parameter visibly moves in a few steps
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    base.update(options)
    return GRPOConfig(**base)


@pytest.fixture
def loss_calls(monkeypatch):
    """Counts the calls into grpo_loss, so a test sees that the fused path (not TRL's) trained the model."""
    calls = []
    real_loss = fused_trl.grpo_loss

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(fused_trl, "grpo_loss", counting)
    return calls


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_trained(trainer, before, steps):
    assert trainer.state.global_step == steps
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == steps
    for h in logs:
        for name in (
            "loss",
            "grad_norm",
            "reward",
            "entropy",
            "kl",
            "clip_ratio/region_mean",
            "clip_ratio/low_min",
            "clip_ratio/high_max",
            "policy_loss",
            "entropy_coef",
        ):
            assert name in h and math.isfinite(h[name]), (name, h)
    after = dict(trainer.model.named_parameters())
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(before[name], after[name].detach()), f"{name} did not change"


def test_fused_trainer_trains(tmp_path, loss_calls):
    model_dir = save_tiny_model(tmp_path / "model")
    args = config(tmp_path, max_steps=3, gradient_accumulation_steps=2, beta=0.04, entropy_coef=0.01, loss_type="dapo")
    trainer = FusedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=char_fraction_reward(),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert_trained(trainer, before, steps=3)
    assert len(loss_calls) == 3 * 2 and all(loss_calls)  # one differentiable call per micro-batch


def test_patched_trl_trainer_trains_and_evaluates(tmp_path, loss_calls):
    model_dir = save_tiny_model(tmp_path / "model")
    args = config(
        tmp_path,
        max_steps=2,
        beta=0.02,
        loss_type="grpo",
        importance_sampling_level="sequence",
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        top_entropy_quantile=0.8,
        per_device_eval_batch_size=4,
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = patch_grpo_trainer(
        GRPOTrainer(
            model=str(model_dir),
            reward_funcs=char_fraction_reward(),
            args=args,
            train_dataset=dataset,
            eval_dataset=dataset.select(range(2)),
        )
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert_trained(trainer, before, steps=2)
    assert len(loss_calls) == 2
    metrics = trainer.evaluate()  # eval mode under no_grad: grpo_loss takes its no-gradient path
    assert math.isfinite(metrics["eval_loss"]) and "eval_entropy" in metrics
    assert len(loss_calls) == 2 + 2 and not any(loss_calls[2:])  # two eval prompts x 4 generations = 2 batches
