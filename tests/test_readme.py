"""The README's API example runs as written, and .ci/run runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_api_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    example = re.search(r"## API\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "torch.Size([4, 16])" in printed and "'kl'" in printed


def test_readme_fused_linear_example_runs():
    text = (ROOT / "README.md").read_text()
    example = re.search(r"## From hidden states.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile("import torch\n" + example, "README.md", "exec"), scope)
    assert scope["hidden"].grad is not None and scope["weight"].grad.shape == (1000, 64)


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    commands = re.search(r"## The two commands.*?```bash\n(.*?)```", text, re.S).group(1)
    test_command = [line for line in commands.splitlines() if "pytest" in line][0].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
