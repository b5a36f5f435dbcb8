"""The TRL release table, options refused by name per release, the first-step self-check, and parity against the
oldest supported release (installed beside the venv's TRL in its own folder, run in a subprocess).

The per-release cases run on the installed TRL with `trl.__version__` set to each release, so each release's mapping
drives the fused loss; that is exact because `_compute_loss` is the same text in every release of the range, and
what differs around it is what the mapping records (the subprocess run checks the oldest release's real code).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

pytest.importorskip("trl")

import trl
from trl import GRPOTrainer

import grpo_kernels.integrations.trl as fused_trl
from grpo_kernels.integrations.trl import FirstStepMismatch, FusedGRPOTrainer, patch_grpo_trainer
from grpo_kernels.integrations.trl_versions import MAPPINGS, TESTED_RANGE, UNTESTED_ENV, mapping_for

from .test_trl_parity import assert_same, loss_grads_metrics, make_inputs, make_trainer, model_dir  # noqa: F401

ROOT = Path(__file__).parents[2]
# Every release on the registry from 1.12.0 through 1.16.0
RELEASES = ("1.12.0", "1.13.0", "1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0")
OLDEST = RELEASES[0]
# Where .ci/run installs the oldest release (`pip install --no-deps --target .trl-oldest trl==1.12.0`)
OLDEST_DIR = Path(os.environ.get("GRPO_KERNELS_TRL_OLDEST", ROOT / ".trl-oldest"))


def _as_release(monkeypatch, version: str) -> None:
    monkeypatch.setattr(trl, "__version__", version)


# ----------------------------------------------------------------------------------------------------------------
# The table


@pytest.mark.parametrize("version", RELEASES)
def test_every_release_has_its_mapping(version):
    mapping, tested = mapping_for(version)
    assert tested
    # Read off each release's grpo_trainer.py: before 1.15 the policy forward runs without its own autocast, the
    # fp32 head is a plain F.linear, logits_to_keep goes only to models that accept it, and use_liger_kernel
    # replaces the loss; from 1.15 TRL's fused head does all three and use_liger_kernel patches layers only
    new = Version(version) >= Version("1.15")
    assert mapping.forward_in_autocast is new and mapping.fp32_head_outside_autocast is new
    assert mapping.logits_to_keep_if_accepted is not new
    assert [name for name, _ in mapping.refused] == ([] if new else ["use_liger_kernel"])


def test_the_ranges_do_not_overlap_and_match_the_pyproject():
    import tomllib

    for version in RELEASES:  # exactly one range holds each release
        assert sum(SpecifierSet(m.versions).contains(version) for m in MAPPINGS) == 1, version
    assert {mapping_for(v)[0] for v in RELEASES} == set(MAPPINGS)  # and no range is empty
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    (pin,) = [Requirement(r) for r in extras["trl"] if Requirement(r).name == "trl"]
    for version in (*RELEASES, "1.11.0", "1.16.9", "1.17.0"):
        assert pin.specifier.contains(version) == SpecifierSet(TESTED_RANGE).contains(version), version
    # the tests install TRL through that extra, so they run the range it pins
    test = [Requirement(r) for r in extras["test"]]
    assert any(r.name == "grpo-kernels" and "trl" in r.extras for r in test), extras["test"]
    assert not [r for r in test if r.name == "trl"], extras["test"]


@pytest.mark.parametrize("version", ["1.11.0", "1.0.0", "0.29.1"])
def test_older_release_is_refused(version):
    with pytest.raises(RuntimeError, match=rf"supports trl>=1\.12\.0,<1\.17\.0, found trl {re.escape(version)}"):
        mapping_for(version, allow_untested=True)


@pytest.mark.parametrize("version", ["1.17.0", "1.17.0.dev0", "2.0.0"])
def test_newer_release_needs_the_untested_switch(version):
    with pytest.raises(RuntimeError, match=rf"found trl {re.escape(version)}.*{UNTESTED_ENV}=1 or pass trl_untested"):
        mapping_for(version)
    with pytest.warns(UserWarning, match=r"tested with trl>=1\.12\.0,<1\.17\.0.*first training step"):
        mapping, tested = mapping_for(version, allow_untested=True)
    assert mapping is MAPPINGS[-1] and not tested


# ----------------------------------------------------------------------------------------------------------------
# Per release: an option it lacks, and one it has that the fused loss can't reproduce, are refused by name; an
# option it has is honoured (the same loss, gradients and metrics as TRL's)


@pytest.mark.parametrize("version", RELEASES)
def test_release_refuses_what_it_lacks_and_honours_what_it_has(model_dir, tmp_path, monkeypatch, version):  # noqa: F811
    _as_release(monkeypatch, version)
    mapping, _ = mapping_for(version)
    # vespo's four shape options and the off-policy mask: options every release of the range has
    options = dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5, off_policy_mask_threshold=0.1)
    reference, trainer = (make_trainer(c, model_dir, tmp_path, **options) for c in (GRPOTrainer, GRPOTrainer))
    patch_grpo_trainer(trainer)
    assert trainer._grpo_kernels_state.mapping is mapping
    for t in (reference, trainer):
        t.model.train()
    seen = {}
    real_loss = fused_trl.grpo_loss
    monkeypatch.setattr(fused_trl, "grpo_loss", lambda *a, **k: seen.update(k) or real_loss(*a, **k))
    batch = make_inputs(reference)
    assert_same(loss_grads_metrics(reference, batch), loss_grads_metrics(trainer, batch))
    assert seen["vespo_k_pos"] == 1.5 and seen["vespo_lambda_neg"] == 2.5 and seen["off_policy_mask_threshold"] == 0.1

    # A loss type no release has: TRL itself only fails at the first step ("Unknown loss type")
    trainer.loss_type = "gspo"
    with pytest.raises(ValueError, match=rf"loss_type='gspo': TRL {re.escape(version)}'s GRPOTrainer has no such"):
        patch_grpo_trainer(trainer)
    trainer.loss_type = "vespo"
    trainer.importance_sampling_level = "segment"
    with pytest.raises(ValueError, match=rf"importance_sampling_level='segment': TRL {re.escape(version)}'s"):
        patch_grpo_trainer(trainer)
    trainer.importance_sampling_level = "token"
    # use_liger_kernel: before 1.15 it replaces the loss (refused by name), from 1.15 it patches layers (accepted)
    trainer.args.use_liger_kernel = True
    if mapping.refused:
        with pytest.raises(ValueError, match=rf"use_liger_kernel=True is not supported .* TRL {re.escape(version)}"):
            patch_grpo_trainer(trainer)
    else:
        patch_grpo_trainer(trainer)


def test_refused_option_stops_the_constructor(model_dir, tmp_path, monkeypatch):  # noqa: F811
    _as_release(monkeypatch, "1.13.0")
    with pytest.raises(ValueError, match=r"loss_type='gspo': TRL 1\.13\.0"):
        make_trainer(FusedGRPOTrainer, model_dir, tmp_path, loss_type="gspo")


@pytest.mark.parametrize("engine", ["is_fsdp_enabled", "is_deepspeed_enabled"])
def test_self_check_is_refused_where_it_cannot_run(model_dir, tmp_path, monkeypatch, engine):  # noqa: F811
    trainer = make_trainer(GRPOTrainer, model_dir, tmp_path)
    setattr(trainer, engine, True)
    with pytest.raises(ValueError, match=r"verify_first_step=True, which does not run under FSDP or DeepSpeed"):
        patch_grpo_trainer(trainer, verify_first_step=True)
    patch_grpo_trainer(trainer)  # without the check: as before
    _as_release(monkeypatch, "1.17.0")
    with pytest.raises(ValueError, match=r"an untested TRL \(1\.17\.0\) needs the first-step check"):
        patch_grpo_trainer(trainer, trl_untested=True)


# ----------------------------------------------------------------------------------------------------------------
# The first-step self-check


def _first_step(trainer, batch=None):
    trainer.model.train()
    return loss_grads_metrics(trainer, make_inputs(trainer) if batch is None else batch)


@pytest.mark.parametrize(
    "loss_type, alteration, named",
    [
        # dapo normalized per micro-batch like grpo: the loss and every gradient differ
        ("dapo", dict(token_count_losses=()), [r"- loss: fused", r"- gradient of model\."]),
        # a metric dropped from the table: only that metric differs
        ("vespo", dict(loss_type_metrics=()), [r"metric 'vespo/phi_seq_mean': TRL logs it, the fused loss does not"]),
        # the clip extremes not logged
        ("grpo", dict(clipped_losses=()), [r"metric 'clip_ratio/high_max': TRL logs", r"metric 'clip_ratio/low_min'"]),
    ],
)
def test_self_check_stops_on_an_altered_mapping(model_dir, tmp_path, loss_type, alteration, named):  # noqa: F811
    trainer = make_trainer(
        FusedGRPOTrainer,
        model_dir,
        tmp_path,
        trainer_kwargs=dict(verify_first_step=True),
        loss_type=loss_type,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
    )
    state = trainer._grpo_kernels_state
    state.mapping = dataclasses.replace(state.mapping, **alteration)
    with pytest.raises(FirstStepMismatch, match=r"First-step check against TRL .*Differences:") as error:
        _first_step(trainer)
    for pattern in named:
        assert re.search(pattern, str(error.value)), (pattern, str(error.value))
    if "loss_type_metrics" in alteration:  # nothing else differs
        assert str(error.value).count("\n  - ") == 1


def test_untested_release_is_accepted_with_a_warning_and_checked(model_dir, tmp_path, monkeypatch):  # noqa: F811
    _as_release(monkeypatch, "1.17.0")
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=UNTESTED_ENV):
        make_trainer(FusedGRPOTrainer, model_dir, tmp_path)
    monkeypatch.setenv(UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=r"running trl 1\.17\.0 with the mapping of trl>=1\.15\.0") as record:
        trainer = make_trainer(FusedGRPOTrainer, model_dir, tmp_path, loss_type="sapo", beta=0.04)
    assert sum("running trl 1.17.0" in str(w.message) for w in record) == 1  # once, not once per check
    assert trainer._grpo_kernels_state.verify_pending
    reference = make_trainer(GRPOTrainer, model_dir, tmp_path, loss_type="sapo", beta=0.04)
    reference.model.train()
    batch = make_inputs(reference)
    assert_same(loss_grads_metrics(reference, batch), _first_step(trainer, batch))
    assert trainer.first_step_report.problems == [] and trainer.first_step_report.trl_version == "1.17.0"
    assert not trainer._grpo_kernels_state.verify_pending
    # the constructor argument does the same without the environment variable, and can refuse despite it
    with pytest.raises(RuntimeError, match=UNTESTED_ENV):
        make_trainer(FusedGRPOTrainer, model_dir, tmp_path, trainer_kwargs=dict(trl_untested=False))
    monkeypatch.delenv(UNTESTED_ENV)
    with pytest.warns(UserWarning, match=r"trl 1\.17\.0"):
        make_trainer(FusedGRPOTrainer, model_dir, tmp_path, trainer_kwargs=dict(trl_untested=True))


def test_self_check_in_a_real_training_run(model_dir, tmp_path, monkeypatch):  # noqa: F811
    # Trainer's own loop (accelerate-prepared model, its backward and optimizer step) around the checked step
    from datasets import Dataset

    from . import char_fraction_reward
    from .test_trl_train import PROMPTS, assert_trained, config

    calls = []
    trl_loss = fused_trl._TRL_COMPUTE_LOSS
    monkeypatch.setattr(fused_trl, "_TRL_COMPUTE_LOSS", lambda *a, **k: calls.append(1) or trl_loss(*a, **k))
    options = dict(max_steps=2, beta=0.04, entropy_coef=0.01, loss_type="dapo", gradient_accumulation_steps=2)
    trainer = FusedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=char_fraction_reward(),
        args=config(tmp_path, **options),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        verify_first_step=True,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert calls == [1] and trainer.first_step_report.problems == []
    assert_trained(trainer, before, steps=2)


# ----------------------------------------------------------------------------------------------------------------
# Parity against the oldest supported release, in its own folder first on sys.path

# The cases where 1.12's code differs from the newest around _compute_loss (its text is the same): every loss type
# with every option (the entropy bonus's gradient through H), two plain, the fp32 head and bf16 under autocast, the
# MoE aux loss (its default coefficient differs), PEFT, the multimodal inputs (TRL's forward arguments differ), GSPO,
# eval mode, the adaptive controller, the accumulation normalizers, patching, and the self-check
OLDEST_CASES = (
    "test_loss_type_with_every_option or (test_loss_type and (sapo or cispo)) "
    "or (test_sequence_level_importance_sampling and grpo) or (test_eval_mode and dapo) "
    "or (test_adaptive_entropy and 10.0-0.5) or (test_moe_aux_loss and dapo) or test_peft_lora or test_cast_lm_head "
    "or test_bf16_autocast or test_multimodal or test_patch_instance or test_first_step_check_passes "
    "or (test_accumulation_normalizers and 2-4-2 and (grpo or dapo))"
)


@pytest.mark.slow
def test_parity_against_the_oldest_release():
    if not (OLDEST_DIR / "trl" / "__init__.py").is_file():
        pytest.skip(
            f"TRL {OLDEST} is not installed in {OLDEST_DIR}: `pip install --no-deps --target {OLDEST_DIR} "
            f"trl=={OLDEST}` (.ci/run does), or point GRPO_KERNELS_TRL_OLDEST at such a folder"
        )
    path = [str(OLDEST_DIR), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    probe = "import trl, grpo_kernels.integrations.trl; print(trl.__version__, trl.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-3000:]
    version, where = found.stdout.split()
    assert version == OLDEST and Path(where).is_relative_to(OLDEST_DIR), found.stdout
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-rfEs"]
    command += [str(ROOT / "tests" / "integrations" / "test_trl_parity.py"), "-k", OLDEST_CASES]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    summary = re.search(r"(\d+) passed(.*) in ", result.stdout)
    assert summary and "skipped" not in summary.group(2) and "failed" not in summary.group(2), output
    assert int(summary.group(1)) >= 25, output  # the selection above (28 cases), not an empty run
