"""Every Python block of the README runs as is in a fresh interpreter, its demo figures come from the demo's
summary file, and .ci/run runs the README's test command."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[tuple[str, str]]:
    """(the section it is in, the code) of every ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", README, re.S | re.M):
        section = re.findall(r"^## (.+)$", README[: match.start()], re.M)[-1]
        blocks.append((section, match.group(1)))
    return blocks


BLOCKS = python_blocks()


@pytest.mark.parametrize("section, code", BLOCKS, ids=[f"{i}-{s.split(':')[0]}" for i, (s, _) in enumerate(BLOCKS)])
def test_every_python_block_runs_as_is_in_a_fresh_interpreter(section, code, tmp_path):
    # offline, from an empty folder, with nothing imported beforehand: only what the block itself says
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
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
    quoted = re.search(re.escape(script.BEGIN) + "(.*?)" + re.escape(script.END), README, re.S).group(1)
    assert quoted == script.figures(summary)
    assert f"{summary['after']['accuracy']:.1%}" in quoted
    assert (ROOT / summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"## The two commands.*?```bash\n(.*?)```", README, re.S).group(1)
    test_command = [line for line in commands.splitlines() if "pytest" in line][0].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
