"""The demo's promise: with a fixed seed, GRPO raises held-out greedy accuracy over the cold-start SFT model."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_kernels.trainer.demo import DemoConfig, default_grpo_config, run_demo


@pytest.mark.slow
def test_grpo_improves_held_out_accuracy(tmp_path):
    # Half the demo's GRPO steps, to keep the suite short; on this seed it still gains well over 5 points.
    grpo = replace(default_grpo_config(str(tmp_path), seed=0), max_steps=30)
    lines = []
    cfg = DemoConfig(output_dir=str(tmp_path), seed=0, grpo=grpo, eval_every=15)
    result = run_demo(cfg, progress=False, log=lines.append)
    assert 0.2 <= result.before["accuracy"] <= 0.7, "the cold start should leave room to improve"
    assert result.after["accuracy"] >= result.before["accuracy"] + 0.05, (result.before, result.after)
    assert result.after["reward"] > result.before["reward"]
    assert Path(result.plot_path).exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["after"] == result.after
    # the held-out curve the plot leads with: before GRPO, every 15 steps, and after the last
    assert [p["step"] for p in summary["eval_curve"]] == [0, 15, 30]
    assert summary["eval_curve"][0]["accuracy"] == result.before["accuracy"]
    assert summary["eval_curve"][-1]["accuracy"] == result.after["accuracy"]
    assert any(line.startswith("before GRPO: held-out accuracy") for line in lines)
    assert any(line.startswith("after GRPO:  held-out accuracy") for line in lines)
