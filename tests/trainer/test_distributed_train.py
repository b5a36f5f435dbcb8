"""`torchrun --nproc_per_node 2` trains the adapter a single process trains (same seed, same global batch; CPU, gloo).

Each rank samples half of every step's prompts, each with its whole group; completions come from per-completion
seeds, so both runs sample the same ones. The gradients are averaged over the ranks and the losses normalized so that
the average is the whole batch's gradient; what differs is only the float summation order (the all-reduce, a
prompt batch padded to a different length), hence allclose with a tight tolerance rather than equality. Those
~1e-7 relative differences in the gradients stay ~1e-7 in the losses and gradient norms (checked at rel 1e-4), but
Adam divides each gradient element by its own running RMS, so an element whose gradient is near Adam's eps (a LoRA A
weight in the first updates after B leaves zero) carries the noise up to a few 1e-6 in absolute terms (measured: 2e-7
for grpo, 5e-6 for dapo on weights up to 0.2; a single process with gradient_accumulation_steps=2 instead of 1
differs from itself by the same 5e-6), hence atol 1e-5.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_kernels.trainer.checkpoint import ADAPTER_FILE, list_checkpoints

from .conftest import tiny_argv

REPO = Path(__file__).resolve().parents[2]
TIMING = ("tokens_per_s", "time/generate_s", "time/step_s", "peak_memory_mb")
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(model_dir, dataset_file, output_dir, nproc: int, launcher: str = "torchrun", **overrides) -> str:
    values = {
        "max_steps": STEPS,
        "prompts_per_step": 4,
        "num_generations": 4,
        "num_iterations": 2,
        "beta": 0.1,
        "reward_funcs": "tests.trainer.helpers:digit_reward",
        "save_total_limit": 0,
    }
    argv = tiny_argv(model_dir, dataset_file, output_dir, **(values | overrides))
    if nproc == 1:
        launch = [sys.executable, "-m", "grpo_kernels.cli"]
    elif launcher == "accelerate":  # --multi_gpu is accelerate's torchrun launcher; on a CPU it runs gloo processes
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            "-m",
            "grpo_kernels.cli",
        ]
    else:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "grpo_kernels.cli",
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["HF_HOME"] = str(Path(output_dir).parent / "hf-home")  # no accelerate config file of the machine's is read
    env |= {"HF_DATASETS_CACHE": str(Path(output_dir).parent / f"{Path(output_dir).name}-datasets-cache")}
    env |= {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [*launch, *argv],
        check=False,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def metrics(output_dir):
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def adapter(output_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(output_dir) / "adapter" / ADAPTER_FILE)


# grpo with 2 micro-batches per step: DDP accumulates the first under no_sync and all-reduces once, at the second
@pytest.mark.parametrize(("loss_type", "accumulation"), [("grpo", 2), ("dapo", 1)])
def test_two_processes_train_the_adapter_of_one(model_dir, dataset_file, tmp_path, loss_type, accumulation):
    options = {"loss_type": loss_type, "gradient_accumulation_steps": accumulation}
    one = run_cli(model_dir, dataset_file, tmp_path / "one", 1, **options)
    two = run_cli(model_dir, dataset_file, tmp_path / "two", 2, **options)
    assert one.count("trained 3 steps") == 1
    assert two.count("trained 3 steps") == 1, two  # rank 0 alone reports

    # rank 0 alone writes: one record per step (not one per rank), the same files and checkpoints as one process
    m1, m2 = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))
    assert [p.name for p in list_checkpoints(tmp_path / "two")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]

    for x, y in zip(m1, m2):
        # the same completions, hence the same rewards, whichever rank sampled them
        for key in ("reward", "reward_std", "completions/mean_length", "completions/max_length"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)

    a, b = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"{loss_type}: max |adapter(1 proc) - adapter(2 procs)| = {diff:.3e}")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a), diff
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)  # training did move the adapter


def test_prompts_per_step_must_divide_among_the_processes(model_dir, dataset_file, tmp_path):
    with pytest.raises(AssertionError, match="must be divisible by the number of processes"):
        run_cli(model_dir, dataset_file, tmp_path / "odd", 2, prompts_per_step=3)


def test_accelerate_launch_and_a_resumed_torchrun_run_train_the_same_adapter(model_dir, dataset_file, tmp_path):
    """`accelerate launch` runs the same data-parallel job as torchrun; and a 2-process run resumed from its step-2
    checkpoint (the step-3 checkpoint, the adapter and the last record gone, as after a kill) retrains step 3 to the
    same adapter. Both are the same 2 processes doing the same float operations in the same order as the
    uninterrupted torchrun run, so both are compared bit for bit."""
    run_cli(model_dir, dataset_file, tmp_path / "torchrun", 2)
    reference = adapter(tmp_path / "torchrun")

    out = run_cli(model_dir, dataset_file, tmp_path / "accelerate", 2, launcher="accelerate")
    assert out.count("trained 3 steps") == 1, out  # rank 0 alone reports
    launched = adapter(tmp_path / "accelerate")
    assert launched.keys() == reference.keys()
    assert all(torch.equal(launched[k], reference[k]) for k in reference)
    assert metrics(tmp_path / "accelerate") == metrics(tmp_path / "torchrun")

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "torchrun", resumed)
    shutil.rmtree(resumed / "checkpoint-3")
    shutil.rmtree(resumed / "adapter")
    records = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(records[:-1]) + "\n")
    out = run_cli(model_dir, dataset_file, resumed, 2, resume=True)
    assert out.count("trained 3 steps") == 1, out
    again = adapter(resumed)
    diff = max((again[k] - reference[k]).abs().max().item() for k in reference)
    print(f"max |resumed - uninterrupted| = {diff:.3e}")
    assert all(torch.equal(again[k], reference[k]) for k in reference), diff
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3]
    assert metrics(resumed) == metrics(tmp_path / "torchrun")
    assert [p.name for p in list_checkpoints(resumed)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
