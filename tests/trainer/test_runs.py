"""A run's folder and its resume: one run per folder, checkpoints that count only when complete, a torn metrics
line repaired, storage errors in one line, resume refusing a changed configuration, Ctrl-C, guard-rail warnings."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kernels.cli import main
from grpo_kernels.trainer import checkpoint, train
from grpo_kernels.trainer.checkpoint import COMPLETE_MARKER, latest_checkpoint, list_checkpoints, save_checkpoint

from .conftest import tiny_argv, tiny_config

REPO = Path(__file__).resolve().parents[2]
# The cheapest run that trains: 2 prompts x 2 completions of at most 6 tokens per step
CHEAP = {"num_generations": 2, "max_completion_length": 6, "reward_funcs": "tests.trainer.helpers:digit_reward"}


def records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_a_folder_holding_a_run_is_refused_unless_resume_or_overwrite(model_dir, dataset_file, tmp_path, capsys):
    train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, **CHEAP))
    assert f"starting fresh in {tmp_path}" in capsys.readouterr().err
    refused = r"already holds a run \(adapter, checkpoint-1, metrics.jsonl.*--resume.*--overwrite"
    with pytest.raises(ValueError, match=refused):
        train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, **CHEAP))
    (tmp_path / "checkpoint-7").mkdir()  # an old run's higher step, which pruning or resume must never pick up
    (tmp_path / "checkpoint-7" / COMPLETE_MARKER).write_text("7\n")
    train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, overwrite=True, **CHEAP))
    assert [r["step"] for r in records(tmp_path)] == [1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]


class _FakeModel:
    def save_pretrained(self, folder, safe_serialization=True):
        (Path(folder) / "adapter_model.safetensors").write_bytes(b"weights")


class _FakeState:
    def state_dict(self):
        return {}


def test_pruning_never_leaves_a_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _FakeModel(), _FakeState(), _FakeState(), {}, keep=2)
    assert all((p / COMPLETE_MARKER).exists() for p in list_checkpoints(tmp_path))
    # a kill in the middle of pruning: the deletion of checkpoint-1 never gets to run
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)
    save_checkpoint(tmp_path, 3, _FakeModel(), _FakeState(), _FakeState(), {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert not (tmp_path / "checkpoint-1").exists()  # renamed to a hidden name before being deleted
    monkeypatch.undo()
    checkpoint.remove_partial_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def test_a_full_disk_ends_in_one_line_and_no_half_written_checkpoint(
    model_dir, dataset_file, tmp_path, capsys, monkeypatch
):
    real_save = checkpoint.torch.save

    def full_disk(obj, path):
        real_save(obj, path)
        with open(path, "r+b") as f:  # the state file half written, as when the disk fills
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    out = tmp_path / "run"
    assert main(tiny_argv(model_dir, dataset_file, out, max_steps=1, **CHEAP)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"grpo-kernels train: error: cannot write checkpoint-1 to the output folder {str(out)!r}: "
        "No space left on device"
    )
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no checkpoint, no temporary
    # an output folder that cannot be created or written fails before any training, also in one line
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(tiny_argv(model_dir, dataset_file, blocked / "run", max_steps=1, **CHEAP)) == 2
    assert "cannot write the run's files to the output folder" in capsys.readouterr().err


def test_resume_refuses_a_changed_run_allows_harmless_changes_and_repairs_a_torn_line(
    model_dir, dataset_file, tmp_path, capsys
):
    base = {"max_steps": 2, "lr_scheduler": "cosine", **CHEAP}
    train(tiny_config(model_dir, dataset_file, tmp_path, **base))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward": 0.2')  # a record torn by a crash during its append
    capsys.readouterr()

    refused = r"differs from that of .*checkpoint-2.*max_steps 2 -> 4.*--allow-config-change"
    with pytest.raises(ValueError, match=refused):
        train(tiny_config(model_dir, dataset_file, tmp_path, resume=True, **(base | {"max_steps": 4})))
    with pytest.raises(ValueError, match=r"beta 0.04 -> 0.1"):
        train(tiny_config(model_dir, dataset_file, tmp_path, resume=True, beta=0.1, **base))

    # harmless: logging, saving, progress; nothing left to train, the torn line dropped and said so
    train(tiny_config(model_dir, dataset_file, tmp_path, resume=True, save_total_limit=5, logging_steps=3, **base))
    err = capsys.readouterr().err
    assert f"resuming from {tmp_path / 'checkpoint-2'} (step 2 of 2)" in err
    assert "dropped its torn last line (line 3" in err
    assert [r["step"] for r in records(tmp_path)] == [1, 2]

    # allowed: a longer schedule, rebuilt and said so; step 3 is on the 4-step cosine curve
    longer = base | {"max_steps": 4}
    train(tiny_config(model_dir, dataset_file, tmp_path, resume=True, allow_config_change=True, **longer))
    err = capsys.readouterr().err
    assert "max_steps 2 -> 4" in err and "LR schedule rebuilt for 4 steps" in err
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[2]["learning_rate"] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


def test_resume_in_an_empty_folder_says_it_starts_fresh(model_dir, dataset_file, tmp_path, capsys):
    train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, resume=True, **CHEAP))
    assert f"starting fresh in {tmp_path} (--resume: no complete checkpoint there)" in capsys.readouterr().err


def test_zero_reward_variance_warns_once(model_dir, dataset_file, tmp_path, capsys):
    constant = CHEAP | {"reward_funcs": "tests.trainer.helpers:zero_reward"}
    cfg = tiny_config(model_dir, dataset_file, tmp_path, max_steps=3, zero_variance_warning_steps=2, **constant)
    train(cfg)
    err = capsys.readouterr().err
    assert err.count("warning: for 2 steps in a row every group of 2 completions got equal rewards") == 1
    assert "nothing is being learned" in err and "--answer-column" in err


def test_ctrl_c_stops_after_the_step_with_one_line_and_no_progress_prints_each_step(model_dir, dataset_file, tmp_path):
    argv = tiny_argv(model_dir, dataset_file, tmp_path, max_steps=40, save_steps=0, **CHEAP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_kernels.cli", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    seen = len(records(tmp_path))
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    done = len(records(tmp_path))
    assert seen <= done <= seen + 2 < 40  # the step in progress is finished, no more
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"interrupted after step {done} of 40; last checkpoint: {tmp_path / f'checkpoint-{done}'} "
        "(continue with --resume)"
    )
    assert latest_checkpoint(tmp_path).name == f"checkpoint-{done}"
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{s}/40" for s in range(1, done + 1)]  # one per step
    assert "reward" in lines[0] and "loss" in lines[0]
