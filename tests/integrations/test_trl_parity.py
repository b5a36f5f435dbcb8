"""FusedGRPOTrainer against the installed TRL's own GRPOTrainer: same loss, gradients and metrics, option by option.

Each case builds both trainers from the same GRPOConfig options and the same tiny model (loaded by path, so the
weights are identical), crafts one micro-batch like `_generate_and_score_completions` returns, and calls
`compute_loss` on both. Trainer state TRL sets only inside its training loop (`current_gradient_accumulation_steps`,
the vLLM switch that needs vLLM installed) is set as attributes, on both trainers alike.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

pytest.importorskip("trl")

import trl
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import grpo_kernels.integrations.trl as fused_trl
from grpo_kernels.integrations.trl import FusedGRPOTrainer, patch_grpo_trainer
from grpo_kernels.integrations.trl_versions import mapping_for

from . import EOS_ID, PAD_ID, VOCAB_SIZE, char_fraction_reward, save_tiny_model

MAPPING, _ = mapping_for(trl.__version__)  # what differs in the running TRL release

B, P, T = 4, 5, 8  # sequences, prompt length, completion length
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# The bounds for fp32: 1e-5 relative on the loss, 1e-4 relative to each gradient's max.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7
GRAD_RTOL = 1e-4
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_moe"), moe=True)


def make_trainer(cls, model_dir, output_dir, *, peft_config=None, trainer_kwargs=None, **options):
    """A trainer of `cls` on the tiny model; `options` are GRPOConfig fields over a small CPU fp32 base,
    `trainer_kwargs` keywords of the trainer's constructor."""
    config = dict(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32 end to end: the tolerances are fp32 ones
        per_device_train_batch_size=B,
        num_generations=B,
        max_completion_length=T,
        temperature=0.7,  # != 1 everywhere, so every case also checks where the temperature is applied
        seed=0,
    )
    config.update(options)
    dataset = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "grpo"]})
    trainer = cls(
        model=str(model_dir),
        reward_funcs=char_fraction_reward(),
        args=GRPOConfig(**config),
        train_dataset=dataset,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )
    # Set by Trainer's loop at each optimizer step (the size of this accumulation window)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def make_inputs(
    trainer,
    *,
    seed: int = 0,
    old: bool = True,
    tool_mask: bool = False,
    is_ratio: str | None = None,
    per_token_advantages: bool = False,
) -> dict:
    """One micro-batch as `_generate_and_score_completions` hands it to the loss.

    Left-padded prompts; completions of lengths 8, 5, 1 and 0 (a truncated completion masked out whole, as
    `mask_truncated_completions` does); old/ref/sampling log-probs from TRL's own fused head plus noise, so that
    ratios fall inside and outside the clip range, zero on padding as TRL's are.
    """
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB_SIZE, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_ids[1, :2], prompt_mask[1, :2] = PAD_ID, 0
    completion_ids = torch.randint(3, VOCAB_SIZE, (B, T), generator=g)
    lengths = torch.tensor([8, 5, 1, 0])
    completion_mask = (torch.arange(T) < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = PAD_ID
    completion_ids[1, 4] = EOS_ID
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T
        )

    def noisy(std):
        return (logps + std * torch.randn(B, T, generator=g)) * completion_mask

    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        # both signs, and row 2 (one token) negative so the off-policy mask can keep or drop it
        "advantages": torch.tensor([0.9, -0.6, -0.4, 1.1]),
        "num_items_in_batch": completion_mask.sum() * trainer.args.steps_per_generation + 3,
        "ref_per_token_logps": noisy(0.2),
    }
    if old:
        # log(π/π_old) per token: both signs in every row, past 1 ± 0.28 (clipped either way), row means of
        # +0.15, -0.1, +0.25, 0 (so the GSPO sequence ratios clip too), plus a little noise
        pattern = torch.tensor([-0.4, 0.3, -0.1, 0.5, 0.05, -0.35, 0.25, -0.05])
        log_ratio = torch.stack([pattern.roll(b) for b in range(B)]) + torch.tensor([0.1, -0.15, 0.2, 0.0])[:, None]
        inputs["old_per_token_logps"] = (logps - log_ratio) * completion_mask + noisy(0.05) - logps * completion_mask
    # sampler log-probs: row 1 drifted (mean KL 0.5, dropped at threshold 0.1), row 2 not; a NaN token (unscored)
    sampling = noisy(0.3) + torch.tensor([0.0, 0.5, -0.2, 0.0])[:, None] * completion_mask
    sampling[0, 3] = float("nan")
    inputs["sampling_per_token_logps"] = sampling
    if per_token_advantages:
        inputs["advantages"] = torch.randn(B, T, generator=g)
    if tool_mask:
        tm = torch.ones(B, T, dtype=torch.long)
        tm[0, 2:5] = 0  # a tool result inside the first completion
        tm[1, 1] = 0
        inputs["tool_mask"] = tm
    if is_ratio == "token":  # vllm_importance_sampling_mode token_*: [B, T]
        rho = torch.exp(0.2 * torch.randn(B, T, generator=g))
        # ordinary padding: ρ = 1 where no token counts (vespo's φ sums log ρ over every position in TRL, over the
        # active ones here: the two agree when padded positions hold 1)
        active = completion_mask.bool() & (inputs["tool_mask"].bool() if tool_mask else True)
        inputs["importance_sampling_ratio"] = torch.where(active, rho, 1.0)
    elif is_ratio == "sequence":  # sequence_*: [B, 1]; 1 for the empty completion (row 3), as ordinary padding
        rho = torch.exp(0.2 * torch.randn(B, 1, generator=g))
        inputs["importance_sampling_ratio"] = torch.where(completion_mask.bool().any(-1, keepdim=True), rho, 1.0)
    return inputs


def fresh_metrics():
    return {"train": defaultdict(list), "eval": defaultdict(list)}


def loss_grads_metrics(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics = fresh_metrics()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()
    }
    metrics = {mode: dict(values) for mode, values in trainer._metrics.items() if values}
    return loss.detach(), grads, metrics


def assert_same(reference, result):
    ref_loss, ref_grads, ref_metrics = reference
    loss, grads, metrics = result
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        bound = GRAD_RTOL * ref.abs().max().item() + 1e-12
        assert err <= bound, f"grad of {name}: max error {err:.3g} > {bound:.3g}"
    assert metrics.keys() == ref_metrics.keys()
    for mode in ref_metrics:
        assert sorted(metrics[mode]) == sorted(ref_metrics[mode]), f"{mode} metric names differ"
        for name, ref_values in ref_metrics[mode].items():
            torch.testing.assert_close(
                torch.tensor(metrics[mode][name], dtype=torch.float64),
                torch.tensor(ref_values, dtype=torch.float64),
                rtol=METRIC_RTOL,
                atol=METRIC_ATOL,
                equal_nan=True,
                msg=lambda m, name=name: f"metric {name}: {m}",
            )


def compare(model_dir, tmp_path, options, *, inputs=None, attrs=None, mode="train"):
    """Build TRL's and our trainer with `options`, set `attrs` on both, compare one compute_loss + backward."""
    trainers = [make_trainer(cls, model_dir, tmp_path, **options) for cls in (GRPOTrainer, FusedGRPOTrainer)]
    for trainer in trainers:
        for name, value in (attrs or {}).items():
            setattr(trainer, name, value)
        trainer.model.train(mode == "train")
    batch = make_inputs(trainers[0], **(inputs or {}))
    reference = loss_grads_metrics(trainers[0], batch)
    result = loss_grads_metrics(trainers[1], batch)
    assert_same(reference, result)
    return reference, result


# ----------------------------------------------------------------------------------------------------------------
# Every loss type, plain and with every option at once

ALL_OPTIONS = dict(
    beta=0.05,
    use_bias_correction_kl=True,
    epsilon=0.15,
    epsilon_high=0.28,
    delta=1.1,
    off_policy_mask_threshold=0.1,
    top_entropy_quantile=0.6,
    entropy_coef=0.02,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    mask_truncated_completions=True,
)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type(model_dir, tmp_path, loss_type):
    compare(model_dir, tmp_path, dict(loss_type=loss_type))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_with_every_option(model_dir, tmp_path, loss_type):
    # beta + bias-corrected KL, asymmetric epsilon, delta, off-policy and entropy masks, the entropy bonus, gradient
    # accumulation with steps_per_generation, a tool mask and the vLLM token-level ratio, all in one micro-batch
    compare(
        model_dir,
        tmp_path,
        dict(loss_type=loss_type, **ALL_OPTIONS),
        inputs=dict(tool_mask=True, is_ratio="token"),
        attrs=dict(use_vllm=True),
    )


@pytest.mark.parametrize("loss_type", ("grpo", "luspo", "dapo"))  # per-sequence mean, per-sequence sum, token sum
def test_sequence_level_importance_sampling(model_dir, tmp_path, loss_type):
    compare(model_dir, tmp_path, dict(loss_type=loss_type, importance_sampling_level="sequence", epsilon=0.05))


# ----------------------------------------------------------------------------------------------------------------
# One option at a time (on the default loss, and where the option interacts with normalizers, on dapo too)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(epsilon=0.1, epsilon_high=0.3), id="asymmetric-epsilon"),  # both clip edges hit
        pytest.param(dict(loss_type="grpo", delta=1.05), id="delta"),  # two-sided clip below 1 + epsilon_high
        pytest.param(dict(beta=0.04), id="beta"),
        pytest.param(dict(beta=0.04, use_bias_correction_kl=True), id="beta-bias-corrected"),
        pytest.param(
            dict(beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
            id="beta-bias-corrected-sequence",
        ),  # the KL times a [B, 1] ratio
        pytest.param(dict(top_entropy_quantile=0.5), id="top-entropy-quantile"),
        pytest.param(dict(loss_type="grpo", entropy_coef=0.03), id="entropy-coef-grpo"),
        pytest.param(
            dict(loss_type="dapo", entropy_coef=0.03, gradient_accumulation_steps=2, steps_per_generation=4),
            id="entropy-coef-dapo-accumulated",
        ),  # bonus scaled by accumulation only, not by N
        pytest.param(dict(entropy_coef=0.03, top_entropy_quantile=0.5), id="entropy-coef-with-entropy-mask"),
        pytest.param(dict(off_policy_mask_threshold=0.1), id="off-policy-mask"),
        pytest.param(dict(loss_type="dr_grpo", max_completion_length=12), id="dr-grpo-max-completion-length"),
        pytest.param(dict(mask_truncated_completions=True), id="mask-truncated-completions"),
    ],
)
def test_option(model_dir, tmp_path, options):
    compare(model_dir, tmp_path, options)


def test_off_policy_mask_without_sampling_logps(model_dir, tmp_path):
    # Without vLLM there are no sampler log-probs: TRL falls back to the old ones
    trainers = [
        make_trainer(c, model_dir, tmp_path, off_policy_mask_threshold=0.0) for c in (GRPOTrainer, FusedGRPOTrainer)
    ]
    for t in trainers:
        t.model.train()
    batch = make_inputs(trainers[0])
    del batch["sampling_per_token_logps"]
    assert_same(loss_grads_metrics(trainers[0], batch), loss_grads_metrics(trainers[1], batch))


@pytest.mark.parametrize("loss_type", ("grpo", "dapo", "vespo"))
@pytest.mark.parametrize("level", ("token", "sequence"))  # vllm_importance_sampling_mode token_* / sequence_*
def test_vllm_importance_sampling_ratio(model_dir, tmp_path, loss_type, level):
    compare(model_dir, tmp_path, dict(loss_type=loss_type), inputs=dict(is_ratio=level), attrs=dict(use_vllm=True))


@pytest.mark.parametrize("loss_type", ("grpo", "vespo"))
def test_importance_sampling_ratio_without_vllm_flag(model_dir, tmp_path, loss_type):
    # TRL multiplies by the ratio only with use_vllm and the correction on, but vespo's φ reads it whenever present
    compare(model_dir, tmp_path, dict(loss_type=loss_type), inputs=dict(is_ratio="token"))


@pytest.mark.parametrize("loss_type", ("grpo", "cispo"))
def test_tool_mask(model_dir, tmp_path, loss_type):
    compare(model_dir, tmp_path, dict(loss_type=loss_type, top_entropy_quantile=0.7), inputs=dict(tool_mask=True))


@pytest.mark.parametrize("loss_type", ("grpo", "cispo", "sapo"))
def test_without_old_logps(model_dir, tmp_path, loss_type):
    # num_iterations 1: TRL skips the old log-probs and uses the detached current ones (ratio exactly 1)
    compare(model_dir, tmp_path, dict(loss_type=loss_type), inputs=dict(old=False))


def test_per_token_advantages(model_dir, tmp_path):
    compare(model_dir, tmp_path, dict(loss_type="grpo"), inputs=dict(per_token_advantages=True))


@pytest.mark.parametrize("temperature", (1.0, 1.3))
def test_temperature(model_dir, tmp_path, temperature):
    compare(model_dir, tmp_path, dict(temperature=temperature))


# ----------------------------------------------------------------------------------------------------------------
# Normalizers: num_items_in_batch, gradient accumulation, steps_per_generation, eval mode


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "accumulation, steps_per_generation, current",
    [
        (2, 4, 2),  # generation batch spans two optimizer steps
        (4, 2, 4),  # two generations per optimizer step
        (4, 4, 3),  # the last, shorter accumulation window of an epoch
    ],
)
def test_accumulation_normalizers(model_dir, tmp_path, loss_type, accumulation, steps_per_generation, current):
    compare(
        model_dir,
        tmp_path,
        dict(
            loss_type=loss_type,
            gradient_accumulation_steps=accumulation,
            steps_per_generation=steps_per_generation,
            entropy_coef=0.01,
        ),
        attrs=dict(current_gradient_accumulation_steps=current),
    )


@pytest.mark.parametrize("loss_type", ("grpo", "dapo", "vespo"))
def test_eval_mode(model_dir, tmp_path, loss_type):
    # No accumulation in eval: dapo divides by N / P only, the entropy bonus by nothing; no entropy_coef metric
    compare(
        model_dir,
        tmp_path,
        dict(loss_type=loss_type, gradient_accumulation_steps=2, steps_per_generation=4, entropy_coef=0.01, beta=0.02),
        mode="eval",
    )


# ----------------------------------------------------------------------------------------------------------------
# Adaptive entropy controller: the same coefficients, gates and window statistics over several micro-batches


@pytest.mark.parametrize(
    "target, quantile",
    [
        (10.0, 1.0),  # entropy below target: the coefficient rises, and the bonus switches on after one window
        (1.0, 1.0),  # entropy above target: the coefficient falls to its minimum, the bonus stays gated off
        (10.0, 0.5),  # with the entropy mask, the controller counts only the masked-in tokens
    ],
)
def test_adaptive_entropy(model_dir, tmp_path, target, quantile):
    options = dict(
        loss_type="dapo",
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_target=target,
        entropy_coef_delta=0.01,
        entropy_coef_min=0.0,
        entropy_coef_max=0.1,
        top_entropy_quantile=quantile,
        gradient_accumulation_steps=2,
    )
    trainers = [make_trainer(c, model_dir, tmp_path, **options) for c in (GRPOTrainer, FusedGRPOTrainer)]
    for t in trainers:
        t.model.train()
    state = trainers[0].accelerator.gradient_state  # shared by both accelerators
    try:
        for micro_batch in range(6):  # three optimizer steps of two micro-batches
            state._set_sync_gradients(micro_batch % 2 == 1)
            batch = make_inputs(trainers[0], seed=micro_batch)
            reference = loss_grads_metrics(trainers[0], batch)
            assert_same(reference, loss_grads_metrics(trainers[1], batch))
            ref, ours = trainers
            assert ours.entropy_coef == pytest.approx(ref.entropy_coef, rel=1e-12)
            if math.isinf(ref._last_world_entropy):
                assert math.isinf(ours._last_world_entropy)
            else:
                assert ours._last_world_entropy == pytest.approx(ref._last_world_entropy, rel=1e-6)
            if ref._entropy_window_stats is None:
                assert ours._entropy_window_stats is None
            else:
                torch.testing.assert_close(ours._entropy_window_stats, ref._entropy_window_stats, rtol=1e-6, atol=1e-6)
    finally:
        state._set_sync_gradients(True)


# ----------------------------------------------------------------------------------------------------------------
# MoE load-balancing loss


@pytest.mark.parametrize("loss_type", ("grpo", "dapo"))
def test_moe_aux_loss(moe_model_dir, tmp_path, loss_type):
    (_, _, ref_metrics), _ = compare(
        moe_model_dir,
        tmp_path,
        dict(loss_type=loss_type, router_aux_loss_coef=0.5, gradient_accumulation_steps=2, steps_per_generation=4),
    )
    assert "aux_loss" in ref_metrics["train"] and ref_metrics["train"]["aux_loss"][0] > 0


# ----------------------------------------------------------------------------------------------------------------
# PEFT: the forward goes through the adapter wrapper, and the gradient reaches the adapters only


def test_peft_lora(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    options = dict(loss_type="grpo", beta=0.04, top_entropy_quantile=0.8)
    trainers = [
        make_trainer(c, model_dir, tmp_path, peft_config=lora, **options) for c in (GRPOTrainer, FusedGRPOTrainer)
    ]
    with torch.no_grad():  # LoRA initializes B to zero (no gradient reaches A) and A at random: make both the same
        for name, p in trainers[0].model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        trainers[1].model.load_state_dict(trainers[0].model.state_dict())
    for t in trainers:
        t.model.train()
    batch = make_inputs(trainers[0])
    reference = loss_grads_metrics(trainers[0], batch)
    assert_same(reference, loss_grads_metrics(trainers[1], batch))
    trained = {n for n, p in trainers[1].model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(reference[1][n].abs().max() > 0 for n in trained)


# ----------------------------------------------------------------------------------------------------------------
# How the loss reads the logits; patching; the version pin


def test_logits_are_a_strided_view_without_temperature_division(model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(FusedGRPOTrainer, model_dir, tmp_path)
    trainer.model.train()
    seen, forward_logits = {}, []
    real_loss = fused_trl.grpo_loss

    def spy(logits, *args, **kwargs):
        seen.update(logits=logits, temperature=kwargs["temperature"])
        return real_loss(logits, *args, **kwargs)

    monkeypatch.setattr(fused_trl, "grpo_loss", spy)
    batch = make_inputs(trainer)
    hook = trainer.model.register_forward_hook(lambda module, args, output: forward_logits.append(output.logits))
    trainer.compute_loss(trainer.model, batch).backward()
    hook.remove()

    (full,) = forward_logits
    logits = seen["logits"]
    assert full.shape == (B, T + 1, VOCAB_SIZE)  # logits_to_keep = T + 1: no logits for the prompt
    assert logits.shape == (B, T, VOCAB_SIZE) and not logits.is_contiguous()
    assert logits.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view, not a copy
    assert seen["temperature"] == trainer.temperature == 0.7
    with torch.no_grad():  # the logits were not divided by the temperature in place
        fresh = trainer.model(
            input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            logits_to_keep=T + 1,
        ).logits
    torch.testing.assert_close(full.detach(), fresh, rtol=0, atol=0)


def _dtype_seen_by_loss(trainer, batch, monkeypatch):
    seen = []
    real_loss = fused_trl.grpo_loss
    monkeypatch.setattr(
        fused_trl, "grpo_loss", lambda logits, *a, **k: seen.append(logits.dtype) or real_loss(logits, *a, **k)
    )
    result = loss_grads_metrics(trainer, batch)
    monkeypatch.setattr(fused_trl, "grpo_loss", real_loss)
    return seen[0], result


def test_cast_lm_head_to_fp32_under_bf16_autocast(model_dir, tmp_path, monkeypatch):
    # bf16 mixed precision (CPU autocast) with TRL's fp32 LM head: the backbone runs in bf16 in both trainers, the
    # head in fp32, so the results agree to fp32 precision, and grpo_loss must see fp32 logits
    options = dict(bf16=True, cast_lm_head_to_fp32=True, beta=0.04)
    trainers = [make_trainer(c, model_dir, tmp_path, **options) for c in (GRPOTrainer, FusedGRPOTrainer)]
    for t in trainers:
        t.model.train()
    assert trainers[1].accelerator.mixed_precision == "bf16"
    batch = make_inputs(trainers[0])
    reference = loss_grads_metrics(trainers[0], batch)
    dtype, result = _dtype_seen_by_loss(trainers[1], batch, monkeypatch)
    assert dtype == torch.float32
    assert_same(reference, result)


def test_bf16_autocast(model_dir, tmp_path, monkeypatch):
    # bf16 logits: TRL's head recomputes bf16 tiles in its backward, ours reads the stored bf16 logits, so the two
    # are different bf16 roundings of the same gradient. The loss (fp32 math over the same bf16 values) stays close.
    trainers = [make_trainer(c, model_dir, tmp_path, bf16=True) for c in (GRPOTrainer, FusedGRPOTrainer)]
    for t in trainers:
        t.model.train()
    batch = make_inputs(trainers[0])
    ref_loss, ref_grads, ref_metrics = loss_grads_metrics(trainers[0], batch)
    dtype, (loss, grads, metrics) = _dtype_seen_by_loss(trainers[1], batch, monkeypatch)
    # TRL 1.15+ runs the forward under autocast itself; before, only accelerate's prepared model does (not here)
    assert dtype == (torch.bfloat16 if MAPPING.forward_in_autocast else torch.float32)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
    for name, ref in ref_grads.items():
        assert (grads[name] - ref).abs().max() <= 3e-2 * ref.abs().max(), name  # a few bf16 ulps (2^-8 each)
    assert metrics.keys() == ref_metrics.keys() and sorted(metrics["train"]) == sorted(ref_metrics["train"])


def _image(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


MULTIMODAL_INPUTS = {
    # Qwen-VL: pixel rows per image from image_grid_thw
    "grid-thw": dict(pixel_values=_image(8, 3), image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]), num_images=[1, 1]),
    # Gemma-style image position ids
    "position-ids": dict(pixel_values=_image(2, 3), image_position_ids=_image(2, 5), num_images=[1, 1]),
    # LFM2-VL: tiles with their own attention mask and spatial shapes
    "spatial-shapes": dict(
        pixel_values=_image(3, 4),
        pixel_attention_mask=torch.ones(3, 4, dtype=torch.long),
        spatial_shapes=torch.tensor([[1, 2], [1, 2], [1, 2]]),
        num_tiles=[1, 2],
        num_images=[1, 1],
    ),
    "tiles": dict(pixel_values=_image(3, 4), num_tiles=[1, 2], num_images=[1, 1]),  # InternVL
    "image-sizes": dict(pixel_values=_image(2, 3), image_sizes=torch.tensor([[4, 4], [4, 4]]), num_images=[1, 1]),
    "per-sequence": dict(
        pixel_values=_image(2, 6),
        pixel_attention_mask=torch.ones(2, 6, dtype=torch.long),
        token_type_ids=torch.zeros(2, 7, dtype=torch.long),
        mm_token_type_ids=torch.zeros(2, 7, dtype=torch.long),
        num_images=[1, 2],  # three images, two pixel rows: pixel_values are indexed by sequence
    ),
}


@pytest.mark.parametrize("case", MULTIMODAL_INPUTS)
def test_multimodal_model_inputs_match_trl(model_dir, tmp_path, case):
    # No tiny VLM here: a stub model records what TRL's forward receives for one chunk of the whole batch, and the
    # integration must pass the same tensors (less TRL's fused-head arguments)
    trainer = make_trainer(FusedGRPOTrainer, model_dir, tmp_path)
    extra = MULTIMODAL_INPUTS[case]
    input_ids, attention_mask = torch.randint(3, VOCAB_SIZE, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    seen = {}

    def stub(**kwargs):
        seen.update(kwargs)
        return types.SimpleNamespace(log_probs=torch.zeros(2, 6), entropy=None, logits=torch.zeros(2, 7, VOCAB_SIZE))

    trainer._get_per_token_logps_and_entropies(stub, input_ids, attention_mask, 3, **extra)
    # what TRL adds besides the model inputs: its fused head's arguments (1.15+), or logits_to_keep and use_cache
    for key in ("labels", "fused_lm_head", "logits_to_keep", "use_cache"):
        seen.pop(key, None)
    ours = fused_trl._model_inputs(extra, input_ids, attention_mask)
    assert sorted(ours) == sorted(seen)
    for key, value in seen.items():
        assert torch.equal(ours[key], value), key


def test_patch_instance(model_dir, tmp_path):
    reference_trainer = make_trainer(GRPOTrainer, model_dir, tmp_path, loss_type="bnpo", beta=0.04)
    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path, loss_type="bnpo", beta=0.04)
    assert patch_grpo_trainer(trainer) is trainer
    assert trainer._compute_loss.__func__ is fused_trl.fused_compute_loss
    assert GRPOTrainer._compute_loss is not fused_trl.fused_compute_loss  # the class is untouched
    for t in (reference_trainer, trainer):
        t.model.train()
    batch = make_inputs(reference_trainer)
    assert_same(loss_grads_metrics(reference_trainer, batch), loss_grads_metrics(trainer, batch))


def test_patch_class(model_dir, tmp_path):
    class MyTrainer(GRPOTrainer):
        pass

    assert patch_grpo_trainer(MyTrainer) is MyTrainer
    assert MyTrainer._compute_loss is fused_trl.fused_compute_loss
    assert GRPOTrainer._compute_loss is not fused_trl.fused_compute_loss
    trainers = [make_trainer(c, model_dir, tmp_path, loss_type="sapo") for c in (GRPOTrainer, MyTrainer)]
    for t in trainers:
        t.model.train()
    batch = make_inputs(trainers[0])
    assert_same(loss_grads_metrics(trainers[0], batch), loss_grads_metrics(trainers[1], batch))


@pytest.mark.parametrize("bad", [object(), torch.nn.Linear(1, 1), dict])
def test_patch_rejects_other_objects(bad):
    with pytest.raises(TypeError, match="GRPOTrainer"):
        patch_grpo_trainer(bad)


def test_first_step_check_passes(model_dir, tmp_path, monkeypatch):
    # verify_first_step: TRL's own _compute_loss beside ours on the first training step agrees, the metrics are logged
    # once (ours), and later steps run the fused loss alone
    options = dict(loss_type="dapo", beta=0.04, entropy_coef=0.01, top_entropy_quantile=0.8)
    options.update(gradient_accumulation_steps=2)
    reference_trainer = make_trainer(GRPOTrainer, model_dir, tmp_path, **options)
    checked = dict(verify_first_step=True)
    trainer = make_trainer(FusedGRPOTrainer, model_dir, tmp_path, trainer_kwargs=checked, **options)
    for t in (reference_trainer, trainer):
        t.model.train()
    calls = []
    trl_loss = fused_trl._TRL_COMPUTE_LOSS
    monkeypatch.setattr(fused_trl, "_TRL_COMPUTE_LOSS", lambda *a, **k: calls.append(1) or trl_loss(*a, **k))
    for seed in (0, 1):
        batch = make_inputs(reference_trainer, seed=seed)
        assert_same(loss_grads_metrics(reference_trainer, batch), loss_grads_metrics(trainer, batch))
    assert calls == [1]
    report = trainer.first_step_report
    assert report is not None and report.problems == [] and report.trl_version == trl.__version__
    assert "everything agrees" in str(report)
