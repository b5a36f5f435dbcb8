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
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from grpo_kernels.trainer import loop, model, train
from grpo_kernels.trainer.checkpoint import ADAPTER_FILE, list_checkpoints

from ..once import computed_once
from ..ranks import rank_results
from .conftest import tiny_argv, tiny_config

REPO = Path(__file__).resolve().parents[2]
TIMING = ("tokens_per_s", "time/generate_s", "time/step_s", "peak_memory_mb")
STEPS = 3
# The run the accelerate and resume tests compare with: 2 micro-batches per step, so no_sync is exercised too
GRPO = {"loss_type": "grpo", "gradient_accumulation_steps": 2}
pytestmark = pytest.mark.slow  # each test starts 2 or 3 processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(
    model_dir, dataset_file, output_dir, nproc: int, launcher: str = "torchrun", *, returncode: int = 0, **overrides
) -> str:
    """The CLI's output (stdout and stderr in order) under `launcher` with `nproc` processes, on the CPU with gloo
    (--device cpu and no visible GPU: on a machine with one GPU, 2 NCCL ranks would share it)."""
    values = {
        "device": "cpu",
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
            "0",  # accelerate picks a free port itself
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
    assert proc.returncode == returncode, proc.stdout
    return proc.stdout


def metrics(output_dir):
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def adapter(output_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(output_dir) / "adapter" / ADAPTER_FILE)


@pytest.fixture(scope="module")
def trained(model_dir, dataset_file, shared_tmp):
    """`trained(nproc, launcher, **options)` runs the CLI once per distinct arguments in the test run (whichever
    xdist worker asks first; the others wait for it) and returns the output folder, so the tests below share their
    reference runs. Callers copy a folder before changing it."""

    def run(nproc: int, launcher: str = "torchrun", **options) -> Path:
        name = "-".join([launcher, str(nproc), *(f"{k}={v}" for k, v in sorted(options.items()))])

        def train_once() -> Path:
            out = shared_tmp / "trained" / name / "run"
            log = run_cli(model_dir, dataset_file, out, nproc, launcher, **options)
            assert log.count(f"trained {STEPS} steps") == 1, log  # rank 0 alone reports
            return out

        return computed_once(shared_tmp / "trained", name, train_once)

    return run


# grpo with 2 micro-batches per step: DDP accumulates the first under no_sync and all-reduces once, at the second
@pytest.mark.parametrize(
    "options",
    [GRPO, {"loss_type": "dapo", "gradient_accumulation_steps": 1}],
    ids=lambda o: f"{o['loss_type']}-{o['gradient_accumulation_steps']}",
)
def test_two_processes_train_the_adapter_of_one(trained, options):
    one, two = trained(1, **options), trained(2, **options)

    # rank 0 alone writes: one record per step (not one per rank), the same files and checkpoints as one process
    m1, m2 = metrics(one), metrics(two)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3]
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))
    assert [p.name for p in list_checkpoints(two)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # the same completions logged, gathered from both ranks: prompts, texts, rewards and advantages
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()

    for x, y in zip(m1, m2):
        # the same completions, hence the same rewards, whichever rank sampled them
        for key in ("reward", "reward_std", "completions/mean_length", "completions/max_length"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)

    a, b = adapter(one), adapter(two)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"{options['loss_type']}: max |adapter(1 proc) - adapter(2 procs)| = {diff:.3e}")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a), diff
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)  # training did move the adapter


def test_a_bad_row_under_torchrun_is_one_line_from_rank_0_and_every_rank_exits_with_its_code(
    model_dir, dataset_file, tmp_path
):
    """Rank 0 reads the data first while rank 1 waits; its bad row used to leave rank 1 with ~70 lines of gloo
    tracebacks ("Connection closed by peer"). Now every rank stops at once with exit code 2, rank 0 alone says why,
    and the output is rank 0's line and torchrun's own summary of the failed ranks."""
    rows = dataset_file.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*rows[:4], '{"question": "", "solution": "7"}', *rows[4:8]]) + "\n")
    out = run_cli(model_dir, bad, tmp_path / "run", 2, returncode=1)  # torchrun's code when a rank fails
    expected = (
        f"grpo-kernels train: error: dataset {str(bad)!r}, line 5: the prompt column 'question' (--prompt-column) "
        "is empty"
    )
    lines = out.splitlines()
    assert [line for line in lines if "error:" in line] == [expected], out
    assert out.count("exitcode  : 2") == 2, out  # both ranks, in torchrun's summary
    assert "Connection closed" not in out, out
    assert not any('File "' in line and "grpo_kernels" in line for line in lines), out  # no rank's traceback
    assert len(lines) <= 45, out  # rank 0's line and torchrun's summary (41 lines, its own traceback included)
    assert not (tmp_path / "run").exists()  # stopped before the output folder was made


def test_accelerate_launch_trains_the_adapter_of_torchrun(trained):
    """`accelerate launch --multi_gpu --num_processes 2` (accelerate's torchrun launcher; on a CPU it starts gloo
    processes, where `--cpu` would start one process) runs the same data-parallel job as torchrun: the same 2
    processes doing the same float operations in the same order, so the adapters are compared bit for bit. A launch
    that fell back to 2 independent single-process runs would report twice and train the 1-process adapter."""
    reference, launched = trained(2, **GRPO), trained(2, "accelerate", **GRPO)
    a, b = adapter(reference), adapter(launched)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |adapter(accelerate, 2 procs) - adapter(torchrun, 2 procs)| = {diff:.3e}")
    assert all(torch.equal(a[k], b[k]) for k in a), diff
    assert metrics(launched) == metrics(reference)


def test_a_resumed_two_process_run_trains_the_uninterrupted_adapter(trained, model_dir, dataset_file, tmp_path):
    """A finished 2-process torchrun run, cut back to its step-2 checkpoint as a kill during step 3 leaves it (the
    step-3 checkpoint, the adapter and the last record gone), is resumed by the same torchrun command with --resume.
    Every rank loads the one checkpoint (adapter, Adam moments, scheduler) before DDP wraps the model, and the step-3
    completions come from per-completion seeds, not from RNG state, so step 3 repeats the uninterrupted run's float
    operations exactly: the adapter is compared bit for bit."""
    reference = trained(2, **GRPO)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoint-3")
    shutil.rmtree(resumed / "adapter")
    records = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(records[:-1]) + "\n")

    out = run_cli(model_dir, dataset_file, resumed, 2, resume=True, **GRPO)
    assert out.count(f"trained {STEPS} steps") == 1, out
    a, b = adapter(reference), adapter(resumed)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |adapter(resumed) - adapter(uninterrupted)| = {diff:.3e}")
    assert all(torch.equal(a[k], b[k]) for k in a), diff
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3]  # one record per step, not one per rank or attempt
    assert metrics(resumed) == metrics(reference)
    assert [p.name for p in list_checkpoints(resumed)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def _counting_allreduce(state: dict, bucket):
    # DDP calls the hook once per gradient bucket of every synchronizing backward; bucket 0 counts the backwards
    state["all_reduces"] += bucket.index() == 0
    return allreduce_hook(None, bucket)


def _record_forwards(rank: int, world: int, out_dir: Path, model_dir: Path, dataset_file: Path) -> dict:
    """One rank of a 2-process `train` (a group the caller initialized, as under accelerate's Accelerator): records
    which model every `completion_logits` call got, with or without autograd, and DDP's gradient all-reduces."""
    os.environ["HF_DATASETS_CACHE"] = str(out_dir.parent / f"datasets-cache-{rank}")
    calls, comm = [], {"all_reduces": 0}
    real = loop.completion_logits

    def recording(model, *args, **kwargs):
        if isinstance(model, DistributedDataParallel) and "hooked" not in comm:  # once: DDP takes one hook
            model.register_comm_hook(comm, _counting_allreduce)
            comm["hooked"] = True
        calls.append([torch.is_grad_enabled(), type(model).__name__])
        return real(model, *args, **kwargs)

    loop.completion_logits = model.completion_logits = recording  # the update's forwards and the log-probs'
    cfg = tiny_config(
        model_dir,
        dataset_file,
        out_dir,
        device="cpu",
        max_steps=1,
        num_iterations=2,
        gradient_accumulation_steps=2,
        beta=0.1,
        reward_funcs="tests.trainer.helpers:digit_reward",
    )
    result = train(cfg)
    lora = {k: v.tolist() for k, v in result.model.named_parameters() if v.requires_grad}
    return {"calls": calls, **comm, "lora": lora}


def test_the_policy_update_runs_through_ddp_with_one_all_reduce_per_optimizer_step(model_dir, dataset_file, tmp_path):
    """Under 2 processes every forward with autograd (the policy update) goes through DistributedDataParallel and
    every forward without (old and reference log-probs) through the unwrapped peft model; of the 2 micro-batch
    backwards of each of the 2 optimizer steps only the last all-reduces (no_sync), and the ranks end with the same
    adapter. Dropping no_sync doubles the all-reduces (the adapter would not change: averaging is linear), which no
    adapter comparison can see."""
    ranks = rank_results(_record_forwards, (tmp_path / "run", model_dir, dataset_file), 2)
    for rec in ranks:
        update = [name for grad, name in rec["calls"] if grad]
        logp = [name for grad, name in rec["calls"] if not grad]
        assert update == ["DistributedDataParallel"] * 4, rec["calls"]  # 2 optimizer steps x 2 micro-batches
        assert logp == ["PeftModelForCausalLM"] * 4, rec["calls"]  # old and ref log-probs, 2 micro-batches each
        assert rec["all_reduces"] == 2
    assert ranks[0]["lora"] == ranks[1]["lora"]
