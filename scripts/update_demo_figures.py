"""Copy a demo run's summary and plot into docs/demo/ and write the README's demo figures from that summary.

    grpo-kernels demo && python scripts/update_demo_figures.py runs/demo

The README quotes the demo between the `<!-- demo-figures -->` markers; a test checks that the text there is
exactly what `figures()` makes of docs/demo/summary.json, so no figure is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "demo"
BEGIN, END = "<!-- demo-figures -->", "<!-- /demo-figures -->"


def figures(summary: dict[str, Any]) -> str:
    """The README's sentence of demo figures, from the demo's summary.json."""
    before, after, machine = summary["before"], summary["after"], summary.get("machine", {})
    curve = summary.get("eval_curve", [])
    best = max(curve, key=lambda p: p["accuracy"]) if curve else None
    where = f" on a {machine['cores']}-core {machine['cpu']} CPU" if machine else ""
    if "load_average" in machine:
        where += f" (load average {machine['load_average']} at the end: a shared machine)"
    text = (
        f"**{before['accuracy']:.1%} → {after['accuracy']:.1%} held-out accuracy** (mean reward "
        f"{before['reward']:.3f} → {after['reward']:.3f}) in {summary['seconds']:.0f} s{where}, seed "
        f"{summary['config']['seed']}, {summary['grpo']['max_steps']} GRPO steps"
    )
    if best is not None and best["accuracy"] > after["accuracy"]:
        text += f"; the held-out curve peaks at {best['accuracy']:.1%} (step {best['step']})"
    return text + "."


def update_readme(summary: dict[str, Any], readme: Path = ROOT / "README.md") -> None:
    text = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{BEGIN}{figures(summary)}{END}", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", default="runs/demo", help="the demo's --output-dir (default: runs/demo)")
    run = Path(parser.parse_args().run)
    summary = json.loads((run / "summary.json").read_text())
    DOCS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "training_curves.png", DOCS / "training_curves.png")
    summary["plot"] = "docs/demo/training_curves.png"
    summary["config"]["output_dir"], summary["grpo"]["output_dir"] = str(run), str(run / "grpo")
    (DOCS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    update_readme(summary)
    print(f"README demo figures: {figures(summary)}")


if __name__ == "__main__":
    main()
