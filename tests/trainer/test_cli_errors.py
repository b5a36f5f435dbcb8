"""What a new user types wrong gets one line on stderr that names the flag or the file (and the line, for data),
and exit code 2, before any model loads (but where the model's own limits are the problem).

The command runs in a fresh interpreter: one per case costs seconds of imports, so one interpreter runs every case
of the table through the console command's entry point (`grpo_kernels.command.main`, what `grpo-kernels` calls),
each with its own stderr and exit code; `python -m grpo_kernels.cli` runs once on its own, from sys.argv."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs each argv of the JSON list on stdin through the command, as `grpo-kernels ARGV` would (an exception that
# escapes it: its traceback and exit code 1), and prints [(exit code, stderr)] as JSON.
DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys, traceback
    from grpo_kernels.command import main
    results = []
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code
            except Exception:  # what the interpreter would print before exiting with 1
                traceback.print_exc()
                code = 1
        results.append((code, err.getvalue()))
    print(json.dumps(results))
    """
)


def run_commands(cases: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(cases), cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, model_dir):
    """A folder with the files the cases name: good and bad data, rewards of one's own, a folder that is no model."""
    folder = tmp_path_factory.mktemp("cli")
    good = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
    (folder / "good.jsonl").write_text(good)
    (folder / "latin1.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "4"}\n')
    (folder / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + good.encode())
    (folder / "header.csv").write_text("prompt,answer\n")
    (folder / "my_rewards.py").write_text(
        "NOT_CALLABLE = 3\n\n\ndef wrong_signature(completions):\n    return [0.0 for _ in completions]\n\n\n"
        "def nan_reward(completions, **columns):\n    return [float('nan') for _ in completions]\n"
    )
    (folder / "not-a-model").mkdir()
    (folder / "not-a-model" / "notes.txt").write_text("weights elsewhere\n")
    (folder / "afile").write_text("")
    return folder


def train(folder: Path, *flags: str, dataset: str = "good.jsonl", model: str = "no-model") -> list[str]:
    """`train` on a model folder that does not exist unless given: an error about the model shows that every
    check before it passed."""
    return ["train", "--model", str(folder / model), "--dataset", str(folder / dataset),
            "--output-dir", str(folder / "run"), "--no-progress", *flags]  # fmt: skip


ONE_SMALL_STEP = ("--max-steps", "1", "--prompts-per-step", "1", "--num-generations", "2")  # should a check be missing

# (name, argv maker, the one line expected on stderr, after "grpo-kernels <command>: error: ")
ROWS = [
    ("demo --sft-steps 0", lambda f, m: ["demo", "--sft-steps", "0"], "argument --sft-steps: must be >= 1, got 0"),
    ("demo --sft-steps -3", lambda f, m: ["demo", "--sft-steps", "-3"], "argument --sft-steps: must be >= 1, got -3"),
    ("demo --grpo-steps 0", lambda f, m: ["demo", "--grpo-steps", "0"], "argument --grpo-steps: must be >= 1, got 0"),
    (
        "not callable",
        lambda f, m: train(f, "--reward-funcs", "my_rewards:NOT_CALLABLE"),
        "reward function 'my_rewards:NOT_CALLABLE' is a int, not a function",
    ),
    (
        "wrong signature",
        lambda f, m: train(f, "--reward-funcs", "my_rewards:wrong_signature"),
        "reward my_rewards:wrong_signature cannot take the arguments every reward is called with",
    ),
    ("--device gpu", lambda f, m: train(f, "--device", "gpu"), "--device must be \"auto\", \"cpu\", \"cuda\""),
    (
        "non-UTF-8 data",
        lambda f, m: train(f, dataset="latin1.jsonl"),
        "latin1.jsonl', line 2: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8",
    ),
    ("a BOM is read", lambda f, m: train(f, dataset="bom.jsonl"), "no-model' does not exist"),
    (
        "a folder that is no model",
        lambda f, m: train(f, model="not-a-model"),
        "not-a-model' has no config.json, so it is not a model folder as save_pretrained writes it",
    ),
    (
        "a CSV with only a header",
        lambda f, m: train(f, dataset="header.csv"),
        "header.csv' has no rows: only a header row ('prompt,answer')",
    ),
    (
        "--reward-weights a,b",
        lambda f, m: train(f, "--reward-weights", "a,b"),
        "--reward-weights must be comma-separated finite numbers",
    ),
    ("--output-dir a file", lambda f, m: train(f, "--output-dir", str(f / "afile")), "afile' is a file, not a folder"),
    ("--learning-rate -1e-5", lambda f, m: train(f, "--learning-rate", "-1e-5"), "--learning-rate must be > 0"),
    (
        "--dataset-split on a local file",
        lambda f, m: train(f, "--dataset-split", "test"),
        "--dataset-split 'test' applies to hub datasets, not to the local file",
    ),
    (
        "more micro-batches than sequences",
        lambda f, m: train(f, "--prompts-per-step", "2", "--num-generations", "3", "--gradient-accumulation-steps=7"),
        "--gradient-accumulation-steps must be at most the 6 sequences of a rollout batch",
    ),
    (
        "--max-completion-length past the context",
        lambda f, m: train(f, "--max-completion-length", "100000", *ONE_SMALL_STEP, model=str(m)),
        "--max-completion-length 100000 does not fit the model's context of 64 positions",
    ),
    (
        "prompts past the context",
        lambda f, m: train(f, "--max-completion-length", "60", "--system-prompt", "r1", *ONE_SMALL_STEP, model=str(m)),
        "(max_position_embeddings): lower --max-prompt-length to at most 4, or --max-completion-length",
    ),
    (
        "a reward that is NaN for every completion",
        lambda f, m: train(
            f, "--reward-funcs", "my_rewards:nan_reward", "--max-completion-length", "4", "--system-prompt", "none",
            "--prompts-per-step", "2", "--num-generations", "2", "--max-steps", "1", model=str(m),
        ),
        "no reward gave a value for any of the 4 completions of this step: my_rewards:nan_reward returned None",
    ),
]


# The cases about the model's limits or the rewards' values, which only a loaded model or a first step shows
RUNS = {
    "--max-completion-length past the context",
    "prompts past the context",
    "a reward that is NaN for every completion",
}


@pytest.mark.slow
def test_each_bad_input_is_one_line_naming_it_exit_code_2(workdir, model_dir):
    results = run_commands([make(workdir, model_dir) for _, make, _ in ROWS], cwd=workdir)
    failures = []
    for (name, make, expected), (code, err) in zip(ROWS, results):
        lines = err.strip().splitlines()
        if name in RUNS:  # the model loads (its bar) and the run starts (its note): the error is the last line
            lines = lines[-1:] if "Traceback" not in err else lines
        command = make(workdir, model_dir)[0]
        ok = code == 2 and len(lines) == 1 and lines[0].startswith(f"grpo-kernels {command}: error: ")
        if not ok or expected not in lines[0]:
            failures.append(f"{name}: exit {code}, stderr {err[-600:]!r}")
    assert not failures, "\n".join(failures)


def test_python_m_cli_reads_its_flags_from_the_command_line(workdir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "grpo_kernels.cli", *train(workdir, "--learning-rate", "-1e-5")]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["grpo-kernels train: error: --learning-rate must be > 0, got -1e-05"]
