"""A run killed with SIGKILL and resumed ends with exactly the adapter of an uninterrupted run (same seed, CPU)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_kernels.trainer.checkpoint import ADAPTER_FILE, latest_checkpoint

from .conftest import tiny_argv

REPO = Path(__file__).resolve().parents[2]
TIMING = ("tokens_per_s", "time/generate_s", "time/step_s", "peak_memory_mb")


def cli_train(model_dir, dataset_file, output_dir, **overrides):
    # mu = 2 and a KL term, a checkpoint every step, the last two kept
    argv = tiny_argv(
        model_dir,
        dataset_file,
        output_dir,
        max_steps=8,
        num_iterations=2,
        beta=0.1,
        reward_funcs="tests.trainer.helpers:digit_reward",
        save_total_limit=2,
        **overrides,
    )
    # Each run gets its own datasets cache: two runs building one cache entry at the same moment is a race that
    # once made this test fail for a reason unrelated to resuming.
    cache = Path(output_dir).parent / f"{Path(output_dir).name}-datasets-cache"
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_kernels.cli", *argv],
        cwd=REPO,
        env={**os.environ, "HF_DATASETS_CACHE": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def metrics(output_dir):
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(model_dir, dataset_file, tmp_path):
    straight = cli_train(model_dir, dataset_file, tmp_path / "straight")
    killed = cli_train(model_dir, dataset_file, tmp_path / "killed")
    deadline = time.monotonic() + 240
    while (
        latest_checkpoint(tmp_path / "killed") is None or latest_checkpoint(tmp_path / "killed").name == "checkpoint-1"
    ):
        assert killed.poll() is None, killed.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    interrupted_at = latest_checkpoint(tmp_path / "killed").name
    assert interrupted_at != "checkpoint-8", "the run finished before it was killed; the test proves nothing"

    resumed = cli_train(model_dir, dataset_file, tmp_path / "killed", resume=True)
    for proc in (straight, resumed):
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out

    straight_metrics, resumed_metrics = metrics(tmp_path / "straight"), metrics(tmp_path / "killed")
    for x, y in zip(straight_metrics, resumed_metrics):  # same rewards, losses, KL at every step
        assert x == y, f"step {x['step']} differs after resuming from {interrupted_at}"
    a = load_file(tmp_path / "straight" / "adapter" / ADAPTER_FILE)
    b = load_file(tmp_path / "killed" / "adapter" / ADAPTER_FILE)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), f"adapters differ after resuming from {interrupted_at}"
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)  # training did move the adapter
    assert len(straight_metrics) == len(resumed_metrics) == 8
    assert sorted(os.listdir(tmp_path / "killed")) == sorted(os.listdir(tmp_path / "straight"))  # no stray temporaries
