"""The trainer reads like nanoGPT's train.py: every function of the trainer and the CLI fits on a screen."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "grpo_kernels"
MAX_LINES = 60


def test_trainer_functions_fit_on_a_screen():
    files = [*sorted((PACKAGE / "trainer").glob("*.py")), PACKAGE / "cli.py"]
    long = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}::{node.name} ({lines} lines)")
    assert files and not long, long
