"""A run's folder and its resume: one run per folder, checkpoints that count only when complete, a torn metrics
line repaired, storage errors in one line, resume refusing a changed configuration, Ctrl-C, guard-rail warnings."""

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_kernels.cli import main
from grpo_kernels.rewards import RewardError, call_reward
from grpo_kernels.trainer import checkpoint, loop, train
from grpo_kernels.trainer.checkpoint import (
    ADAPTER_FILE,
    COMPLETE_MARKER,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from grpo_kernels.trainer.errors import StorageError
from grpo_kernels.trainer.rundir import JsonLog, prepare_output_dir

from . import helpers
from .conftest import tiny_argv, tiny_config

REPO = Path(__file__).resolve().parents[2]
# The cheapest run that trains: 2 prompts x 2 completions of at most 6 tokens per step
CHEAP = {"num_generations": 2, "max_completion_length": 6, "reward_funcs": "tests.trainer.helpers:digit_reward"}


def records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_a_folder_holding_a_run_is_refused_unless_resume_or_overwrite(model_dir, dataset_file, tmp_path, capsys):
    train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, **CHEAP))
    assert f"starting fresh in {tmp_path}" in capsys.readouterr().err
    refused = r"already holds a run \(adapter, checkpoint-1, completions.jsonl, metrics.jsonl\).*--resume.*--overwrite"
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
    prepare_output_dir(tmp_path, resume=True, overwrite=False)  # what a run does first: the temporaries go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), to be filled up; skipped where the test can't mount one (not root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, check=False, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` up, then free `leave` bytes again (tmpfs counts whole 4 KiB pages)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def test_a_full_disk_ends_in_one_line_naming_the_path_whichever_library_writes(
    model_dir, dataset_file, small_disk, capfd, monkeypatch
):
    """The disk fills up while checkpoint-2 is being written: with 8 KiB left the adapter's safetensors writer fails
    (SafetensorError, "I/O error: No space left on device"), with 32 KiB left torch.save does (RuntimeError
    "unexpected pos 64 vs 0", the errno lost). Either way one line names the checkpoint and the cause, nothing is
    left half-written, and the last complete checkpoint resumes."""
    real_save = loop.save_checkpoint
    causes = []
    for leave_kib, library in ((8, "SafetensorError"), (32, "RuntimeError")):
        out = small_disk / f"run-{leave_kib}"

        def filling(out_dir, step, *args, leave=leave_kib * 1024, **kwargs):
            if step == 2:
                fill(small_disk, leave)
            return real_save(out_dir, step, *args, **kwargs)

        monkeypatch.setattr(loop, "save_checkpoint", filling)
        with pytest.raises(StorageError) as failed:  # what main() reports
            train(tiny_config(model_dir, dataset_file, out, max_steps=3, **CHEAP))
        causes.append(type(failed.value.__cause__).__name__)
        assert causes[-1] == library
        assert str(failed.value).startswith(f"cannot write {str(out / 'checkpoint-2')!r}: No space left on device")
        # nothing torn: the last complete checkpoint, whole lines of metrics, no temporaries
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "completions.jsonl", "metrics.jsonl"]
        assert [r["step"] for r in records(out)] == [1, 2]
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
        (small_disk / "filler").unlink()
    assert causes == ["SafetensorError", "RuntimeError"]

    # the CLI says it in one line, with the checkpoint to resume from; which then resumes
    out = small_disk / "run-cli"
    monkeypatch.setattr(loop, "save_checkpoint", filling)  # leaves 32 KiB at checkpoint-2
    capfd.readouterr()
    assert main(tiny_argv(model_dir, dataset_file, out, max_steps=3, **CHEAP)) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"grpo-kernels train: error: cannot write {str(out / 'checkpoint-2')!r}: No space left on device "
        f"({err[-1].split('(')[1].split(')')[0]}); last checkpoint: {out / 'checkpoint-1'} (continue with --resume)"
    )
    assert "Traceback" not in "\n".join(err)
    (small_disk / "filler").unlink()
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    assert main(tiny_argv(model_dir, dataset_file, out, max_steps=3, resume=True, **CHEAP)) == 0
    assert [r["step"] for r in records(out)] == [1, 2, 3]


def test_an_append_that_fills_the_disk_is_cut_back_to_whole_lines(small_disk):
    log_path = small_disk / "metrics.jsonl"
    with JsonLog(log_path) as log:
        log.append([{"step": 1}])
        fill(small_disk, 0)
        with pytest.raises(StorageError, match=f"cannot write {str(log_path)!r}: No space left on device"):
            log.append([{"step": 2, "text": "x" * 100_000}])  # more than a page: part of it was written
    assert log_path.read_text() == '{"step": 1}\n'


def test_an_output_folder_that_cannot_be_written_fails_before_training_in_one_line(
    model_dir, dataset_file, tmp_path, capsys
):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(tiny_argv(model_dir, dataset_file, blocked / "run", max_steps=1, **CHEAP)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"grpo-kernels train: error: cannot write {str(blocked / 'run')!r}: Not a directory"
    ]


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
    assert f"read what the model wrote and how each reward scored it in {tmp_path / 'completions.jsonl'}" in err


def test_zero_variance_warning_steps_0_never_warns(model_dir, dataset_file, tmp_path, capsys):
    varying = CHEAP | {"reward_funcs": "tests.trainer.helpers:digit_reward"}
    train(tiny_config(model_dir, dataset_file, tmp_path, max_steps=1, zero_variance_warning_steps=0, **varying))
    assert records(tmp_path)[0]["frac_reward_zero_std"] < 1.0  # a step whose rewards vary: the counter is 0
    assert "in a row every group" not in capsys.readouterr().err


def test_completions_are_logged_with_prompt_rewards_and_advantage_and_two_are_shown(
    model_dir, dataset_file, tmp_path, capsys
):
    cfg = tiny_config(model_dir, dataset_file, tmp_path / "run", log_completions=3, logging_steps=2, max_steps=3)
    result = train(cfg)
    out = capsys.readouterr().out.splitlines()
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    # logging steps 2 and 3 (the last), 3 completions each: the first of both prompts, then the second of the first
    assert [r["step"] for r in logged] == [2, 2, 2, 3, 3, 3]
    assert len({r["prompt"] for r in logged[:2]}) == 2 and logged[2]["prompt"] == logged[0]["prompt"]
    questions = {json.loads(line)["question"] for line in dataset_file.read_text().splitlines()}
    for r in logged:
        assert sorted(r) == ["advantage", "completion", "prompt", "reward", "rewards", "step"]
        assert r["prompt"] in questions
        fmt = float(bool(re.search(r"<think>.*?</think>.*?<answer>.*?</answer>", r["completion"], re.DOTALL)))
        assert r["rewards"]["format_lenient"] == fmt  # the reward of this very completion
        assert r["reward"] == pytest.approx(fmt + (r["rewards"]["accuracy"] or 0.0))
    # each step's advantages are those of the metrics' rewards: group-normalized
    assert all(math.isfinite(r["advantage"]) for r in logged) and result.records[-1]["step"] == 3
    # the console: the step lines of logging steps, each followed by the best and worst of its completions
    step_lines = [i for i, line in enumerate(out) if line.startswith("step ")]
    assert [out[i].split()[1] for i in step_lines] == ["2/3", "3/3"]
    for i in step_lines:
        assert out[i + 1].startswith("  reward ") and "advantage" in out[i + 1] and " -> " in out[i + 1]

    train(tiny_config(model_dir, dataset_file, tmp_path / "none", log_completions=0, max_steps=1))
    assert not (tmp_path / "none" / "completions.jsonl").exists()
    assert not any(line.startswith("  reward ") for line in capsys.readouterr().out.splitlines())


def test_rewards_get_every_column_the_prompts_own_under_its_name(model_dir, dataset_file, tmp_path, monkeypatch):
    monkeypatch.setattr(helpers, "CALLS", [])
    train(
        tiny_config(
            model_dir, dataset_file, tmp_path, max_steps=1, reward_funcs="tests.trainer.helpers:question_reward"
        )
    )
    (call,) = helpers.CALLS
    questions = {json.loads(line)["question"] for line in dataset_file.read_text().splitlines()}
    # the dataset's prompt column is "question" and its answer column "solution" (--prompt-column, --answer-column)
    assert sorted(call) == ["answer", "prompts", "question", "solution"]
    assert len(call["question"]) == 8 and set(call["question"]) <= questions
    assert call["answer"] == call["solution"]


@pytest.mark.parametrize(
    "reward, message",
    [
        (
            "word_reward",
            (
                "returned 'high' (a str) for completion 1 of 8: each value must be a number, or None where the "
                "reward does not apply"
            ),
        ),
        ("short_reward", "returned 7 values for 8 completions"),
        ("digit_reward", None),  # the control: the same run, a reward that returns numbers
    ],
)
def test_a_reward_that_returns_a_wrong_type_or_count_is_named(
    reward, message, model_dir, dataset_file, tmp_path, capsys
):
    argv = tiny_argv(model_dir, dataset_file, tmp_path, max_steps=1, reward_funcs=f"tests.trainer.helpers:{reward}")
    assert main(argv) == (2 if message else 0)
    if message:
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"grpo-kernels train: error: reward tests.trainer.helpers:{reward} {message}"
        )


def test_call_reward_checks_what_a_reward_returns():
    values = call_reward(lambda c, **k: [1, None, True, float("nan")], list("abcd"))  # None, NaN: not applicable
    assert values[0] == values[2] == 1.0 and math.isnan(values[1]) and math.isnan(values[3])
    assert call_reward(lambda c, **k: torch.full((4,), 0.5), list("abcd")) == [0.5] * 4
    for bad, message in (
        (lambda c, **k: "high", "returned a str, not a list"),
        (lambda c, **k: [float("inf")] * 4, "returned inf for completion 1 of 4: rewards must be finite"),
        (lambda c, **k: {"a": 1}, "returned a dict"),
        (lambda c, **k: [1] * 3, "returned 3 values for 4 completions"),
        (lambda c, question, **k: [0.0] * 4, r"raised TypeError: .*'question' \(defined at test_runs.py:\d+\)"),
        (lambda c, **k: [1 / 0] * 4, r"raised ZeroDivisionError: division by zero \(at test_runs.py:\d+\)"),
    ):
        with pytest.raises(RewardError, match=message):
            call_reward(bad, list("abcd"))


# ----------------------------------------------------------------------------------------------------------------
# Preemption: Ctrl-C and SIGTERM


@pytest.fixture(scope="module")
def straight(model_dir, dataset_file, tmp_path_factory):
    """The uninterrupted 4-step run the stopped and resumed ones must reproduce (no checkpoints but the last)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    train(tiny_config(model_dir, dataset_file, out, max_steps=4, save_steps=0, **SIGNALLED))
    return out


SIGNALLED = CHEAP | {"reward_funcs": "tests.trainer.helpers:signalling_reward"}


def same_run(a: Path, b: Path) -> None:
    """Bit for bit: the adapters, and the metrics and completions but for the timings."""
    x, y = load_file(a / "adapter" / ADAPTER_FILE), load_file(b / "adapter" / ADAPTER_FILE)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    timing = ("tokens_per_s", "time/generate_s", "time/step_s", "peak_memory_mb")
    assert [{k: v for k, v in r.items() if k not in timing} for r in records(a)] == [
        {k: v for k, v in r.items() if k not in timing} for r in records(b)
    ]
    assert (a / "completions.jsonl").read_text() == (b / "completions.jsonl").read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_says_so_at_once_finishes_the_step_saves_it_and_resume_continues_bit_for_bit(
    signum, straight, model_dir, dataset_file, tmp_path, capfd, monkeypatch
):
    """The signal arrives while step 2 is being scored, as SLURM's or Kubernetes' SIGTERM or a Ctrl-C may."""
    monkeypatch.setattr(helpers, "CALLS", [])
    monkeypatch.setattr(helpers, "SIGNAL_AT", {2: signum})
    argv = tiny_argv(model_dir, dataset_file, tmp_path, max_steps=4, save_steps=0, **SIGNALLED)
    assert main(argv) == 128 + signum  # 143 for SIGTERM, 130 for SIGINT
    name = signal.Signals(signum).name
    err = capfd.readouterr().err.splitlines()
    # said at once, while step 2 is still in progress (its reward has not returned yet)
    said = err.index(f"{name}: stopping after step 2; send again to stop now")
    assert said < err.index("the reward of step 2 returns")
    assert (
        err[-1]
        == f"{name}: stopped after step 2 of 4; last checkpoint: {tmp_path / 'checkpoint-2'} (continue with --resume)"
    )
    assert "Traceback" not in "\n".join(err)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]  # the stop saved it (save_steps 0)
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    if signum == signal.SIGTERM:
        assert (
            main(tiny_argv(model_dir, dataset_file, tmp_path, max_steps=4, save_steps=0, resume=True, **SIGNALLED)) == 0
        )
        same_run(tmp_path, straight)


def test_a_second_signal_stops_at_once_and_leaves_the_last_checkpoint_whole(
    straight, model_dir, dataset_file, tmp_path, capfd, monkeypatch
):
    """The first SIGTERM comes during step 2, the second while its checkpoint is being written: the run stops
    there, the half-written checkpoint-2 is gone, and checkpoint-1 resumes to the uninterrupted run's adapter."""
    monkeypatch.setattr(helpers, "CALLS", [])
    monkeypatch.setattr(helpers, "SIGNAL_AT", {2: signal.SIGTERM})
    real_save = checkpoint.torch.save

    def interrupted_save(obj, path):
        if "checkpoint-2" in str(path):
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(obj, path)

    monkeypatch.setattr(checkpoint.torch, "save", interrupted_save)
    argv = tiny_argv(model_dir, dataset_file, tmp_path, max_steps=4, save_steps=1, save_total_limit=0, **SIGNALLED)
    assert main(argv) == 143
    err = capfd.readouterr().err.splitlines()
    assert err[-1] == (
        f"grpo-kernels train: terminated (SIGTERM); last checkpoint: {tmp_path / 'checkpoint-1'} "
        "(continue with --resume)"
    )
    assert "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "completions.jsonl", "metrics.jsonl"]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert main([*argv, "--resume"]) == 0
    same_run(tmp_path, straight)


@pytest.mark.slow
def test_sigterm_from_outside_stops_after_the_step_with_rc_143_and_no_progress_prints_each_step(
    model_dir, dataset_file, tmp_path
):
    """`kill` (SIGTERM) from another process, as a scheduler sends it, to `grpo-kernels train` run as a program."""
    argv = tiny_argv(model_dir, dataset_file, tmp_path, max_steps=40, save_steps=0, **CHEAP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_kernels.cli", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the order of what it says is kept
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    seen = len(records(tmp_path))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    done = len(records(tmp_path))
    assert seen <= done <= seen + 2 < 40  # the step in progress is finished, no more
    lines = out.splitlines()
    assert "Traceback" not in out
    # the first line comes while step `done` is in progress, before its progress line
    said = lines.index(f"SIGTERM: stopping after step {done}; send again to stop now")
    assert said < next(i for i, line in enumerate(lines) if line.startswith(f"step {done}/40 "))
    assert lines[-1] == (
        f"SIGTERM: stopped after step {done} of 40; last checkpoint: {tmp_path / f'checkpoint-{done}'} "
        "(continue with --resume)"
    )
    assert latest_checkpoint(tmp_path).name == f"checkpoint-{done}"
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{s}/40" for s in range(1, done + 1)]  # one per step
    assert "reward" in steps[0] and "loss" in steps[0]
