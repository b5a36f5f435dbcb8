"""Every Python block of the README runs as is in a fresh interpreter, every shell command names the virtual
environment and its trainer commands parse, its demo figures come from the demo's summary file, and .ci/run runs the
README's test command."""

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[tuple[str, str]]:
    """(the section it is in, the code) of every ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", README, re.DOTALL | re.MULTILINE):
        section = re.findall(r"^## (.+)$", README[: match.start()], re.MULTILINE)[-1]
        blocks.append((section, match.group(1)))
    return blocks


BLOCKS = python_blocks()


@pytest.mark.parametrize("section, code", BLOCKS, ids=[f"{i}-{s.split(':')[0]}" for i, (s, _) in enumerate(BLOCKS)])
def test_every_python_block_runs_as_is_in_a_fresh_interpreter(section, code, tmp_path):
    # offline, from an empty folder, with nothing imported beforehand: only what the block itself says
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"README block in '{section}' failed:\n{proc.stderr[-3000:]}"
    if "print(" in code:
        assert proc.stdout.strip(), "the block prints nothing"


def test_the_readme_has_the_blocks_a_newcomer_copies():
    sections = [s for s, _ in BLOCKS]
    assert "API" in sections and "Drop-in for TRL" in sections
    trl = dict(BLOCKS)["Drop-in for TRL"]
    assert "FusedGRPOTrainer" in trl and "trainer.train()" in trl


def test_the_demo_figures_are_written_from_the_demo_summary():
    spec = importlib.util.spec_from_file_location("update_demo_figures", ROOT / "scripts" / "update_demo_figures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    summary = json.loads((ROOT / "docs" / "demo" / "summary.json").read_text())
    quoted = re.search(re.escape(script.BEGIN) + "(.*?)" + re.escape(script.END), README, re.DOTALL).group(1)
    assert quoted == script.figures(summary)
    assert f"{summary['after']['accuracy']:.1%}" in quoted
    assert (ROOT / summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"## The two commands.*?```bash\n(.*?)```", README, re.DOTALL).group(1)
    test_command = next(line for line in commands.splitlines() if "pytest" in line).strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()


def bash_blocks() -> list[tuple[str, str, str]]:
    """(the section it is in, the paragraph before it, the commands) of every ```bash block, continuation lines
    joined and comments dropped."""
    blocks, end = [], 0
    for match in re.finditer(r"^```bash\n(.*?)^```", README, re.DOTALL | re.MULTILINE):
        section = re.findall(r"^## (.+)$", README[: match.start()], re.MULTILINE)[-1]
        before = README[end : match.start()].strip().rsplit("\n\n", 1)[-1]
        text = re.sub(r"\\\n\s*", " ", match.group(1))
        commands = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()]
        blocks.append((section, before, "\n".join(c for c in commands if c and not c.startswith("#"))))
        end = match.end()
    return blocks


BASH = bash_blocks()
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def commands(code: str) -> list[list[str]]:
    """Each command of a block (split at &&) as its words, environment assignments dropped."""
    out = []
    for line in code.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            out.append(words)
    return out


def test_every_command_runs_from_the_checkout_with_the_venv_named():
    """A shell has no `grpo-kernels`, `torchrun` or the venv's `python` until the venv is activated: every command
    names it (or is the one that makes it), and every install is of this checkout (`-e .` or `-e '.[extra]'`, the
    extra one of pyproject.toml's), never of a package index."""
    assert len(BASH) >= 4  # the setup, the trainer, the TRL check, the launchers (not vacuous)
    for section, _, code in BASH:
        for words in commands(code):
            program = words[0]
            assert program.startswith(".venv/bin/") or words[:3] == ["python3", "-m", "venv"], (section, words)
            if program.endswith("/pip") and "install" in words:
                targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-") and "==" not in w]
                assert targets and all(re.fullmatch(r"\.(\[[\w,-]+\])?", t) for t in targets), (section, words)
                for target in targets:
                    extras = set(re.findall(r"[\w-]+", target.strip(".[]")))
                    assert extras <= EXTRAS, (section, words, extras - EXTRAS)
                    assert "-e" in words, (section, words)


def trainer_commands() -> list[tuple[str, str, list[str]]]:
    """(section, the paragraph before, the arguments after `train`) of every `grpo-kernels train` in a block."""
    found = []
    for section, before, code in BASH:
        for words in commands(code):
            if "train" in words and any(w.endswith("grpo-kernels") or w == "grpo_kernels.cli" for w in words):
                found.append((section, before, words[words.index("train") + 1 :]))
    return found


def test_every_trainer_command_parses_and_says_what_it_needs():
    """The flags and values of every `grpo-kernels train` command exist and are valid (a renamed flag fails here),
    and a command that needs what a checkout lacks (the hub for a model, a data file of your own, a GPU) says so in
    the paragraph before its block."""
    from grpo_kernels.cli import build_parser
    from grpo_kernels.trainer.config import TrainConfig

    found = trainer_commands()
    assert len(found) >= 3  # the trainer, reasoning-gym (or, before, the launchers): not vacuous
    for section, before, argv in found:
        args = build_parser().parse_args(["train", *argv])
        cfg = TrainConfig.from_flat({k: v for k, v in vars(args).items() if k != "command"})
        suite = cfg.dataset.startswith("reasoning-gym:")
        local = (ROOT / cfg.model).is_dir() and (suite or (ROOT / cfg.dataset).exists())
        if not local:
            assert "needs" in before, (section, argv, before)
            if not (ROOT / cfg.model).is_dir():
                assert "hub" in before, (section, argv, before)


# The sections whose commands a newcomer copies: the setup, the trainer and demo, the TRL install
COMMAND_SECTIONS = ("The two commands", "The demo and the trainer", "Drop-in for TRL")


def test_inline_commands_name_the_venv_and_installs_are_of_the_checkout():
    """Commands quoted in the prose follow the blocks' rules: `pip install` anywhere is an editable install of this
    checkout through the venv (the package is on no index), and in the sections above no command starts with a bare
    `python`, `pip`, `grpo-kernels`, `torchrun` or `accelerate`."""
    spans = []
    for match in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", README):
        section = re.findall(r"^## (.+)$", README[: match.start()], re.MULTILINE)
        spans.append((section[-1] if section else "", match.group(1)))
    installs = [code for _, code in spans if re.search(r"pip install \S", code)]
    assert installs, "no install quoted"
    assert all(code.startswith(".venv/bin/pip install -e ") for code in installs), installs
    bare = [
        (section, code)
        for section, code in spans
        if section in COMMAND_SECTIONS and re.match(r"(python3?|pip|grpo-kernels|torchrun|accelerate)( |$)", code)
    ]
    assert not bare, bare
