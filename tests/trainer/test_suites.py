"""reasoning-gym's procedural tasks as a dataset (`--dataset reasoning-gym:NAME,...`), scored by their own scorers."""

import importlib.util
import json
import sys

import pytest

from grpo_kernels.cli import main
from grpo_kernels.trainer.suites import load_suite

HAVE_REASONING_GYM = importlib.util.find_spec("reasoning_gym") is not None
needs_reasoning_gym = pytest.mark.skipif(
    not HAVE_REASONING_GYM,
    reason="the reasoning-gym extra is not installed (.venv/bin/pip install -e '.[reasoning-gym]')",
)
# leg_counting has a gold answer; graph_color has none (any proper colouring is right) and scores from its metadata
TASKS = "reasoning-gym:leg_counting,graph_color"


def answer(text: str) -> str:
    return f"<think>...</think><answer>{text}</answer>"


@needs_reasoning_gym
def test_the_tasks_own_scorers_give_gold_answers_1_and_wrong_ones_less():
    rows, accuracy = load_suite(TASKS, 6, seed=3)
    assert [r["task"] for r in rows] == ["leg_counting"] * 6 + ["graph_color"] * 6
    assert load_suite(TASKS, 6, seed=3)[0] == rows and load_suite(TASKS, 6, seed=4)[0] != rows  # from the seed
    legs, colourings = rows[:6], rows[6:]
    assert all(r["answer"] for r in legs) and all(r["answer"] is None for r in colourings)
    gold = [answer(r["answer"]) for r in legs] + [
        answer(json.dumps(r["metadata"]["possible_answer"])) for r in colourings
    ]
    wrong = [answer(str(int(r["answer"]) + 1)) for r in legs]
    wrong += [answer(json.dumps({str(v): 1 for v in r["metadata"]["puzzle"]["vertices"]})) for r in colourings]
    columns = {k: [r.get(k) for r in rows] for k in ("question", "answer", "metadata", "task")}
    assert accuracy(gold, **columns) == [1.0] * 12
    scores = accuracy(wrong, **columns)
    edged = [bool(r["metadata"]["puzzle"]["edges"]) for r in colourings]  # one colour for all is wrong with an edge
    assert all(s < 1.0 for s in scores[:6]) and all(s < 1.0 for s, e in zip(scores[6:], edged) if e) and any(edged)
    assert accuracy(["no answer block"] * 12, **columns) == [0.0] * 12


@needs_reasoning_gym
def test_two_tasks_train_a_few_steps_on_a_tiny_model(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--dataset", TASKS, "--num-examples", "4", "--output-dir", str(out)]
    argv += ["--system-prompt", "none", "--max-prompt-length", "24", "--max-completion-length", "8"]
    argv += [
        "--prompts-per-step",
        "2",
        "--num-generations",
        "2",
        "--max-steps",
        "2",
        "--reward-funcs",
        "accuracy,format",
    ]
    argv += [
        "--lora-r",
        "2",
        "--lora-target-modules",
        "q_proj,v_proj",
        "--no-progress",
        "--no-plot",
        "--num-threads",
        "1",
    ]
    assert main(argv) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("rewards/accuracy/mean" in m for m in metrics)
    rows, _ = load_suite(TASKS, 4, seed=0)  # --seed 0
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert logged and all(r["prompt"] in {row["question"] for row in rows} for r in logged)
    assert all(0.0 <= r["rewards"]["accuracy"] <= 1.0 for r in logged)
    assert "trained 2 steps" in capsys.readouterr().out


def test_suite_errors_name_what_to_do(tmp_path, capsys, monkeypatch):
    base = ["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path / "run")]
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as when the extra is not installed
    assert main([*base, "--dataset", TASKS]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "install the reasoning-gym extra: .venv/bin/pip install -e '.[reasoning-gym]'"
    )
    monkeypatch.undo()
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main([*base, "--dataset", str(tmp_path / "d.jsonl"), "--num-examples", "5"]) == 2
    assert "--num-examples applies to reasoning-gym task suites" in capsys.readouterr().err
    if HAVE_REASONING_GYM:
        assert main([*base, "--dataset", "reasoning-gym:leg_countin"]) == 2
        assert "reasoning-gym has no task 'leg_countin'; did you mean leg_counting" in capsys.readouterr().err
        assert main([*base, "--dataset", TASKS, "--prompt-column", "q"]) == 2
        assert "--prompt-column does not apply to --dataset" in capsys.readouterr().err
