"""FusedGRPOTrainer(use_fused_linear=True) against TRL 1.16's own GRPOTrainer: the loss from the hidden states and the
lm_head weight (`fused_linear_grpo_loss`), with the same loss, gradient and metrics, and without (B, T, V) logits.

The trainers, inputs and comparisons are those of test_trl_parity.py; only the trainer class differs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("trl")
pytest.importorskip("peft")

from trl import GRPOTrainer

import grpo_kernels.integrations.trl as fused_trl
import grpo_kernels.integrations.trl_fused_linear as fused_linear_mode
from grpo_kernels.integrations.trl import FusedGRPOTrainer, patch_grpo_trainer
from grpo_kernels.ops import linear_folds_torch

from . import save_tiny_model
from .test_trl_parity import ALL_OPTIONS, MAPPING, B, T, assert_same, loss_grads_metrics, make_inputs, make_trainer

FusedLinearTrainer = functools.partial(FusedGRPOTrainer, use_fused_linear=True)


def save_variant(path, seed: int = 1, **config_fields):
    """The tiny Qwen2 of test_trl_parity with some config fields set (in config.json), tokenizer kept, under `path`."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    save_tiny_model(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config_fields}))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return save_variant(tmp_path_factory.mktemp("tiny_qwen2_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def wide_vocab_model_dir(tmp_path_factory):
    # V = 4096 >> H = 16, so that B·T·V exceeds every other tensor of the step (the weight and its gradient are
    # V·H = B·T·V / 2): a tensor that large can only be logits
    return save_variant(
        tmp_path_factory.mktemp("tiny_qwen2_wide"), vocab_size=4096, hidden_size=16, intermediate_size=32
    )


def compare_fused(model_dir, tmp_path, options, *, inputs=None, attrs=None, peft_config=None, prepare=None):
    """TRL's trainer and ours in fused-linear mode on the same model and micro-batch: one compute_loss + backward."""
    trainers = [
        make_trainer(cls, model_dir, tmp_path, peft_config=peft_config, **options)
        for cls in (GRPOTrainer, FusedLinearTrainer)
    ]
    assert trainers[1].use_fused_linear and not getattr(trainers[0], "use_fused_linear", False)
    if prepare is not None:
        prepare(*trainers)
    for trainer in trainers:
        for name, value in (attrs or {}).items():
            setattr(trainer, name, value)
        trainer.model.train()
    batch = make_inputs(trainers[0], **(inputs or {}))
    reference = loss_grads_metrics(trainers[0], batch)
    result = loss_grads_metrics(trainers[1], batch)
    assert_same(reference, result)
    return trainers, reference, result


# ----------------------------------------------------------------------------------------------------------------
# Parity with TRL


@pytest.mark.parametrize(
    "options, inputs, attrs",
    [
        pytest.param(dict(loss_type="grpo"), None, None, id="grpo"),
        pytest.param(
            dict(loss_type="dapo", beta=0.04, gradient_accumulation_steps=2, steps_per_generation=4),
            None,
            None,
            id="dapo-beta-accumulated",
        ),
        pytest.param(
            dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, top_entropy_quantile=0.5),
            None,
            None,
            id="gspo-sequence-entropy-mask",
        ),
        pytest.param(dict(loss_type="cispo", entropy_coef=0.02), None, None, id="cispo-entropy-bonus"),
        pytest.param(dict(loss_type="sapo"), dict(old=False), None, id="sapo-without-old-logps"),
        pytest.param(
            dict(loss_type="vespo", **ALL_OPTIONS),
            dict(tool_mask=True, is_ratio="token"),
            dict(use_vllm=True),
            id="vespo-every-option",
        ),
    ],
)
def test_parity(model_dir, tmp_path, options, inputs, attrs):
    compare_fused(model_dir, tmp_path, options, inputs=inputs, attrs=attrs)


def test_eval_mode(model_dir, tmp_path):
    trainers = [
        make_trainer(c, model_dir, tmp_path, loss_type="dapo", beta=0.02, entropy_coef=0.01)
        for c in (GRPOTrainer, FusedLinearTrainer)
    ]
    batch = make_inputs(trainers[0])
    results = []
    for trainer in trainers:
        trainer.model.eval()
        with torch.no_grad():
            results.append((trainer.compute_loss(trainer.model, batch), dict(trainer._metrics["eval"])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-7)
    assert results[1][1].keys() == results[0][1].keys()


def test_tied_embeddings(tied_model_dir, tmp_path):
    trainers, (_, ref_grads, _), _ = compare_fused(tied_model_dir, tmp_path, dict(loss_type="grpo", beta=0.04))
    model = trainers[1].model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one parameter: both gradients land in it
    assert ref_grads["model.embed_tokens.weight"].abs().max() > 0


def _spy_operand_dtypes(monkeypatch):
    seen = []
    real = fused_linear_mode.fused_linear_grpo_loss

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(fused_linear_mode, "fused_linear_grpo_loss", spy)
    return seen


def test_cast_lm_head_to_fp32_under_bf16_autocast(model_dir, tmp_path, monkeypatch):
    # The body in bf16 (CPU autocast), TRL's fp32 head: the fused loss must get fp32 operands, as the head does
    seen = _spy_operand_dtypes(monkeypatch)
    compare_fused(model_dir, tmp_path, dict(bf16=True, cast_lm_head_to_fp32=True, beta=0.04))
    assert seen == [(torch.float32, torch.float32)]


def test_bf16_autocast(model_dir, tmp_path, monkeypatch):
    # Under autocast the head's matmul runs in bf16: the fused loss gets bf16 operands (as autocast's F.linear would)
    # and forms fp32 logits from them, where TRL's head rounds its logits to bf16; so bf16 tolerances, as in
    # test_trl_parity's test_bf16_autocast
    seen = _spy_operand_dtypes(monkeypatch)
    trainers = [make_trainer(c, model_dir, tmp_path, bf16=True) for c in (GRPOTrainer, FusedLinearTrainer)]
    for t in trainers:
        t.model.train()
    batch = make_inputs(trainers[0])
    ref_loss, ref_grads, ref_metrics = loss_grads_metrics(trainers[0], batch)
    loss, grads, metrics = loss_grads_metrics(trainers[1], batch)
    # TRL 1.15+ runs the forward under autocast itself; before, only accelerate's prepared model does (not here)
    amp = torch.bfloat16 if MAPPING.forward_in_autocast else torch.float32
    assert seen == [(amp, amp)]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-5)
    for name, ref in ref_grads.items():
        assert (grads[name] - ref).abs().max() <= 3e-2 * ref.abs().max(), name
    assert sorted(metrics["train"]) == sorted(ref_metrics["train"])


# ----------------------------------------------------------------------------------------------------------------
# PEFT


def _randomize_lora(reference, ours):
    # LoRA initializes B to zero (no gradient reaches A): give both trainers the same non-zero B
    with torch.no_grad():
        for name, p in reference.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        ours.model.load_state_dict(reference.model.state_dict())


def test_peft_lora(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainers, (_, ref_grads, _), _ = compare_fused(
        model_dir,
        tmp_path,
        dict(loss_type="grpo", beta=0.04, top_entropy_quantile=0.8),
        peft_config=lora,
        prepare=_randomize_lora,
    )
    trained = {n for n, p in trainers[1].model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(ref_grads[n].abs().max() > 0 for n in trained)


def test_peft_lora_with_trained_lm_head(model_dir, tmp_path):
    # lm_head in modules_to_save: PEFT trains a copy of it, which the fused loss must read (and give the gradient)
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)
    trainers, (_, ref_grads, _), _ = compare_fused(
        model_dir, tmp_path, dict(loss_type="dapo"), peft_config=lora, prepare=_randomize_lora
    )
    head_copies = [n for n, p in trainers[1].model.named_parameters() if p.requires_grad and "lm_head" in n]
    assert head_copies and all(ref_grads[n].abs().max() > 0 for n in head_copies)


def test_lora_on_lm_head_is_refused(model_dir, tmp_path):
    # TRL refuses `target_modules` with lm_head at construction; an adapter put on the head afterwards is refused too
    from peft import LoraConfig, inject_adapter_in_model

    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]), trainer.model)
    with pytest.raises(ValueError, match="use_fused_linear=True: the lm_head carries a PEFT adapter"):
        patch_grpo_trainer(trainer, use_fused_linear=True)


# ----------------------------------------------------------------------------------------------------------------
# What the fused-linear mode refuses


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("final_logit_softcapping", 30.0, "final logit softcapping"),
        ("logit_scale", 0.0625, "scales its logits"),
        ("logits_scaling", 8.0, "scales its logits"),
    ],
)
def test_logit_transform_configs_are_refused(model_dir, tmp_path, field, value, reason):
    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path)
    setattr(trainer.model.config, field, value)
    with pytest.raises(ValueError, match=rf"use_fused_linear=True: .*{reason}.*config\.{field}"):
        patch_grpo_trainer(trainer, use_fused_linear=True)
    # and at the first loss, for a trainer whose model changed after it was patched
    setattr(trainer.model.config, field, None)
    patch_grpo_trainer(trainer, use_fused_linear=True)
    setattr(trainer.model.config, field, value)
    with pytest.raises(ValueError, match=reason):
        trainer.compute_loss(trainer.model, make_inputs(trainer))


def test_softcapping_refused_at_construction(tmp_path):
    softcapped = save_variant(tmp_path / "softcapped", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final logit softcapping"):
        make_trainer(FusedLinearTrainer, softcapped, tmp_path)
    make_trainer(FusedGRPOTrainer, softcapped, tmp_path)  # the logits mode computes what the model returns


def test_unnamed_logit_transform_is_refused(model_dir, tmp_path):
    # A model that rescales its logits without a config field saying so: caught from the autograd graph
    trainer = make_trainer(FusedLinearTrainer, model_dir, tmp_path)
    trainer.model.train()
    batch = make_inputs(trainer)

    def rescale(module, args, output):
        output.logits = output.logits * 2.0
        return output

    trainer.model.register_forward_hook(rescale)
    with pytest.raises(ValueError, match=r"transforms its lm_head output .*MulBackward0"):
        trainer.compute_loss(trainer.model, batch)


def test_non_linear_head_is_refused(model_dir, tmp_path):
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path)
    trainer.model.lm_head.__class__ = ScaledLinear
    with pytest.raises(ValueError, match=r"lm_head is a ScaledLinear, not a plain torch.nn.Linear"):
        patch_grpo_trainer(trainer, use_fused_linear=True)


# ----------------------------------------------------------------------------------------------------------------
# Patching, and how the loss reads the model


def test_patch_instance_and_class(model_dir, tmp_path):
    reference = make_trainer(GRPOTrainer, model_dir, tmp_path, loss_type="bnpo", beta=0.04)
    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path, loss_type="bnpo", beta=0.04)
    assert patch_grpo_trainer(trainer, use_fused_linear=True) is trainer and trainer.use_fused_linear
    assert not getattr(GRPOTrainer, "use_fused_linear", False)  # the class is untouched
    for t in (reference, trainer):
        t.model.train()
    batch = make_inputs(reference)
    assert_same(loss_grads_metrics(reference, batch), loss_grads_metrics(trainer, batch))

    class MyTrainer(GRPOTrainer):
        pass

    assert patch_grpo_trainer(MyTrainer, use_fused_linear=True) is MyTrainer
    assert MyTrainer.use_fused_linear and MyTrainer._compute_loss is fused_trl.fused_compute_loss
    assert not FusedGRPOTrainer.use_fused_linear


class LargestFloatTensor(TorchDispatchMode):
    """Records the largest floating-point tensor any op returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


def test_no_logits_sized_tensor(wide_vocab_model_dir, tmp_path, monkeypatch):
    # Vocabulary tiles of 128 columns (the production tile would span this small vocabulary whole)
    monkeypatch.setattr(linear_folds_torch.BACKEND, "tile_elements", 4096)
    monkeypatch.setattr(linear_folds_torch.BACKEND, "min_vocab_tile", 128)
    trainer = make_trainer(FusedLinearTrainer, wide_vocab_model_dir, tmp_path, loss_type="grpo", beta=0.04)
    trainer.model.train()
    vocab, width = trainer.model.lm_head.weight.shape
    assert vocab == 4096 and width == 16
    batch = make_inputs(trainer)

    seen = {}
    real = fused_linear_mode.fused_linear_grpo_loss

    def spy(hidden, weight, *args, **kwargs):
        seen.update(hidden=hidden, weight=weight, bias=kwargs["bias"])
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(fused_linear_mode, "fused_linear_grpo_loss", spy)
    with LargestFloatTensor() as fused:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    assert fused.numel < B * T * vocab, f"{fused.op} returned {fused.numel} elements (B·T·V = {B * T * vocab})"

    # The hidden states are a strided view of the lm_head's input, the weight the head's own parameter
    hidden = seen["hidden"]
    assert hidden.shape == (B, T, width) and not hidden.is_contiguous() and hidden._base is not None
    assert seen["weight"] is trainer.model.lm_head.weight and seen["bias"] is None
    assert trainer.model.lm_head.weight.grad is not None

    # The logits mode on the same trainer: the recorder does see the logits, and the loss is the same
    trainer.use_fused_linear = False
    with LargestFloatTensor() as logits_mode:
        reference = trainer.compute_loss(trainer.model, batch)
    assert logits_mode.numel >= B * T * vocab
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-5, atol=1e-7)


def test_trains(tmp_path, model_dir, monkeypatch):
    # A real train(): generation (the model's forward untouched between losses), optimizer steps, every metric logged
    from datasets import Dataset

    from . import char_fraction_reward
    from .test_trl_train import PROMPTS, assert_trained, config

    calls = []
    real = fused_linear_mode.fused_linear_grpo_loss
    monkeypatch.setattr(fused_linear_mode, "fused_linear_grpo_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer = FusedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=char_fraction_reward(),
        args=config(tmp_path, max_steps=2, beta=0.04, entropy_coef=0.01, loss_type="grpo"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        use_fused_linear=True,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert_trained(trainer, before, steps=2)
    assert len(calls) == 2
    assert not trainer.model.lm_head._forward_pre_hooks and not trainer.model.lm_head._forward_hooks  # hooks removed


def test_fsdp1_is_refused(model_dir, tmp_path):
    # accelerate's FSDP1 flattens the head into a FlatParameter; FSDP2 (accelerator.is_fsdp2) is let through and
    # tested in test_trl_fsdp.py
    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path)
    trainer.is_fsdp_enabled = True
    assert not trainer.accelerator.is_fsdp2
    with pytest.raises(ValueError, match="use_fused_linear=True: FSDP1 flattens the lm_head weight"):
        patch_grpo_trainer(trainer, use_fused_linear=True)
