"""The config (every loss option exposed), data loading and prompts, checkpoints on disk, the plot, and the CLI."""

import csv
import json
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from grpo_kernels import LossConfig
from grpo_kernels.cli import build_parser, main
from grpo_kernels.trainer.checkpoint import (
    COMPLETE_MARKER,
    latest_checkpoint,
    list_checkpoints,
)
from grpo_kernels.trainer.config import LOOP_SET_LOSS_OPTIONS, TrainConfig
from grpo_kernels.trainer.data import R1_SYSTEM_PROMPT, prompt_indices, read_rows, render_prompt, reward_columns
from grpo_kernels.trainer.demo import build_char_tokenizer
from grpo_kernels.trainer.plotting import plot_metrics
from grpo_kernels.trainer.rowcheck import Columns
from grpo_kernels.trainer.rundir import prepare_output_dir

from .conftest import tiny_argv


def test_every_loss_option_is_a_flag_and_reaches_the_loss_config():
    flags = set(vars(build_parser().parse_args(["train"])))
    assert set(LossConfig.option_names()) - set(LOOP_SET_LOSS_OPTIONS) <= flags
    assert {f.name for f in fields(TrainConfig)} - {"loss"} <= flags
    args = vars(build_parser().parse_args(["train", "--beta", "0.5", "--vespo-k-neg", "4", "--temperature", "0.7"]))
    cfg = TrainConfig.from_flat({k: v for k, v in args.items() if k != "command"})
    assert isinstance(cfg.loss, LossConfig)
    assert (cfg.loss.beta, cfg.loss.vespo_k_neg, cfg.loss.temperature) == (0.5, 4.0, 0.7)  # sampling shares it
    assert cfg.loss.max_completion_length == cfg.max_completion_length
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # as a checkpoint saves and reads it


def test_flags_parse_into_the_config():
    args = build_parser().parse_args(
        [
            "train",
            "--model",
            "m",
            "--dataset",
            "d",
            "--loss-type",
            "dapo",
            "--epsilon-high",
            "0.28",
            "--delta",
            "none",
            "--no-progress",
            "--top-k",
            "5",
        ]
    )
    assert (args.loss_type, args.epsilon_high, args.delta, args.progress, args.top_k) == ("dapo", 0.28, None, False, 5)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_generations": 0}, "num_generations must be >= 1"),
        ({"num_generations": 1}, "num_generations must be >= 2.*a group of one has advantage 0"),
        ({"beta": -1.0}, "beta must be >= 0.*negative beta would reward moving away"),
        ({"resume": True, "overwrite": True}, "resume and overwrite exclude each other"),
        ({"loss_type": "ppo"}, "loss_type must be one of"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"scale_rewards": "std"}, "scale_rewards must be"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in"),
    ],
)
def test_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flat(bad)


def test_rows_keep_their_columns_from_jsonl_csv_parquet(tmp_path):
    records = [{"q": "1+1=", "gold": "2", "extra": "a"}, {"q": "2+2=", "gold": "4", "extra": "b"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["q", "gold", "extra"])
        writer.writeheader()
        writer.writerows(records)
    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.jsonl", "d.csv", "d.parquet"):
        rows, _ = read_rows(str(tmp_path / name))
        assert [(r["q"], str(r["gold"]), r["extra"]) for r in rows] == [("1+1=", "2", "a"), ("2+2=", "4", "b")]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"))


def test_rewards_get_every_column_under_its_own_name_and_the_answer_as_answer():
    rows = [{"question": "1+1=", "solution": "2", "level": 1}, {"question": "2+2=", "solution": "4", "level": 3}]
    kwargs = reward_columns(rows, Columns(prompt="question", answer="solution"), repeat=2)
    assert kwargs == {
        "question": ["1+1=", "1+1=", "2+2=", "2+2="],  # the prompt's own column, under its own name
        "solution": ["2", "2", "4", "4"],
        "answer": ["2", "2", "4", "4"],  # --answer-column, also as accuracy_reward's `answer`
        "level": [1, 1, 3, 3],
    }


def test_render_prompt_plain_r1_and_chat_template():
    tokenizer = build_char_tokenizer()
    assert render_prompt(tokenizer, "1+1=") == "1+1="
    assert render_prompt(tokenizer, "1+1=", R1_SYSTEM_PROMPT) == f"{R1_SYSTEM_PROMPT} User: 1+1= Assistant:"
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert render_prompt(tokenizer, "1+1=", "be brief") == "[system]be brief[user]1+1=[assistant]"
    assert render_prompt(tokenizer, "1+1=", "be brief", use_chat_template=False) == "be brief User: 1+1= Assistant:"


def test_prompt_order_is_a_function_of_step_and_seed():
    first_epoch = [i for step in range(5) for i in prompt_indices(step, 4, 20, seed=3)]
    assert sorted(first_epoch) == list(range(20))  # every row once per epoch
    assert prompt_indices(7, 4, 20, seed=3) == prompt_indices(7, 4, 20, seed=3)
    assert prompt_indices(0, 4, 20, seed=3) != prompt_indices(0, 4, 20, seed=4)


def test_partial_checkpoints_are_never_picked(tmp_path):
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-12", ".tmp-checkpoint-11-abc", "checkpoint-x"):
        (tmp_path / name).mkdir()
    for name in ("checkpoint-2", "checkpoint-10"):  # complete: with their marker; checkpoint-12 lacks it
        (tmp_path / name / COMPLETE_MARKER).write_text("\n")
    (tmp_path / ".deleting-checkpoint-1").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"
    prepare_output_dir(tmp_path, resume=True, overwrite=False)  # what a run does first: the temporaries go
    assert not (tmp_path / ".tmp-checkpoint-11-abc").exists() and not (tmp_path / ".deleting-checkpoint-1").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]


def test_plot_leads_with_held_out_accuracy_and_leaves_out_flat_panels(tmp_path, monkeypatch):
    import matplotlib.figure

    records = [
        {
            "step": s,
            "reward": 0.1 * s,
            "accuracy": 0.05 * s,
            "rewards/accuracy/mean": 0.05 * s,
            "rewards/format/mean": 0.5 + 0.1 * s,
            "loss": 0.01 * s,
            "kl": 0.001 * s,
            "clip_ratio/region_mean": 0.0,  # mu = 1: always 0, a panel with nothing to show
            "entropy": 4.6055 + 1e-5 * s,  # a narrow range, which matplotlib would label as an offset
            "completions/mean_length": 20,  # constant too
            **({"eval/accuracy": 0.4 + 0.05 * s} if s % 2 == 0 else {}),
        }
        for s in range(1, 3)  # two steps: matplotlib's own ticks would be 1.0, 1.2, ... 2.0
    ]
    figures = []
    real_savefig = matplotlib.figure.Figure.savefig

    def saving(fig, *args, **kwargs):
        figures.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", saving)
    path = plot_metrics(records, tmp_path / "curves.png", before={"accuracy": 0.4})
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = figures[0].axes
    titles = [ax.get_title() for ax in axes]
    assert titles[0] == "held-out accuracy: 40.0% → 50.0%"  # step 0 (before), then the evaluations
    assert titles[1].startswith("training reward")
    # every reward function's mean beside the total, and a note saying what the lines and bands are
    assert [line.get_label() for line in axes[1].get_lines()] == ["total (weighted sum)", "accuracy", "format"]
    assert len(axes[1].collections) == 3  # a band each
    assert axes[1].get_legend().get_title().get_text() == (
        "lines: 1-step rolling means\nbands: ± 1 std of the step means in the window"
    )
    assert not any("clip" in t or "length" in t for t in titles)
    assert list(axes[0].get_lines()[0].get_xdata()) == [0, 2]
    figures[0].canvas.draw()
    for ax in axes:
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_title()  # whole steps only
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_title()  # no "+4.6055" above the axis


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch, dataset_file):
    from grpo_kernels.trainer import data

    monkeypatch.setattr(data, "_hub_offline", lambda: True)  # as on the CI machine; no test waits on the network
    assert (
        main(
            ["train", "--model", str(tmp_path / "nope"), "--dataset", str(dataset_file), "--prompt-column", "question"]
        )
        == 2
    )
    assert "model folder" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--model",
                "someone/not-a-model-xyz",
                "--dataset",
                str(dataset_file),
                "--prompt-column",
                "question",
                "--output-dir",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "not a local folder" in err and "hub is unreachable" in err
    assert main(["train", "--model", str(tmp_path), "--dataset", "someone/not-a-dataset-xyz"]) == 2
    assert "neither a local file nor reachable" in capsys.readouterr().err
    # errors name the flags that were typed, not the config's fields
    for flags, message in (
        (["--loss-type", "ppo"], "error: --loss-type must be one of"),
        (["--num-generations", "1"], "error: --num-generations must be >= 2, got 1: GRPO's advantage"),
        (["--resume", "--overwrite"], "error: --resume and --overwrite exclude each other"),
        (["--beta", "-1"], "error: --beta must be >= 0"),
    ):
        assert main(["train", "--model", "m", "--dataset", "d", *flags]) == 2
        assert message in capsys.readouterr().err


def test_cli_train_on_a_saved_model_folder(model_dir, dataset_file, tmp_path, capsys):
    argv = tiny_argv(
        model_dir,
        dataset_file,
        tmp_path,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        lora_r=2,
        lora_target_modules="q_proj,v_proj",
        plot=True,
    )
    code = main(argv)
    assert code == 0
    out = capsys.readouterr().out
    assert "adapter:" in out and (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert (tmp_path / "training_curves.png").exists()
    saved = json.loads((tmp_path / "checkpoint-1" / "train_config.json").read_text())
    assert saved["lora_target_modules"] == "q_proj,v_proj"
    assert torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=False)["step"] == 1


def test_data_errors_are_one_line_naming_the_file_and_the_problem(model_dir, tmp_path, capsys):
    empty, bad, rows = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl", tmp_path / "rows.jsonl"
    empty.write_text("")
    good = '{"prompt": "1+1=", "answer": "2"}\n'
    bad.write_text(good + good + '{"prompt": "3+3=", "answer"\n')  # row 3 is cut off after its last key
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cases = [
        (empty, [], f"dataset {str(empty)!r} is empty (0 bytes)"),
        (bad, [], f"dataset {str(bad)!r}, line 3: not valid JSON (Expecting ':' delimiter at column 28)"),
        (
            rows,
            ["--answer-column", "solution", "--reward-funcs", "accuracy"],
            (
                f"dataset {str(rows)!r}, line 1: column 'solution' (--answer-column), which reward accuracy needs, "
                "is missing; its columns: ['answer', 'prompt']"
            ),
        ),
    ]
    # a 1-step run of tiny completions, should a check be missing
    small = ["--max-steps", "1", "--num-generations", "2", "--max-completion-length", "4", "--no-progress"]
    for path, flags, message in cases:
        argv = ["train", "--model", str(model_dir), "--dataset", str(path), "--output-dir", str(tmp_path / path.stem)]
        argv += small
        assert main([*argv, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"grpo-kernels train: error: {message}"]


PROMPT = "the prompt column 'question' (--prompt-column)"
BAD_ROWS = [  # (file, its text, the message after "dataset '<file>', ")
    (
        "missing.jsonl",  # a blank line before it: line 4 is the third row
        '{"question": "1+1=", "solution": "2"}\n\n{"question": "2+2=", "solution": "4"}\n{"solution": "6"}\n',
        f"line 4: {PROMPT} is missing; its columns: ['solution']",
    ),
    (
        "null.jsonl",
        '{"question": "1+1=", "solution": "2"}\n{"question": null, "solution": "4"}\n',
        f"line 2: {PROMPT} is null",
    ),
    ("blank.jsonl", '{"question": "  ", "solution": "2"}\n', f"line 1: {PROMPT} is empty"),
    (
        "number.jsonl",
        '{"question": 7, "solution": "2"}\n',
        f"line 1: {PROMPT} must be text or a list of chat messages, got int 7",
    ),
    (
        "chat.jsonl",
        '{"question": [{"content": "hi"}], "solution": "2"}\n',
        f"line 1: {PROMPT} has message 1 that is not a {{'role': ..., 'content': ...}} dict: {{'content': 'hi'}}",
    ),
    (
        "answer.jsonl",
        '{"question": "1+1=", "solution": "2"}\n{"question": "2+2=", "solution": null}\n',
        "line 2: column 'solution' (--answer-column), which reward accuracy needs, is null",
    ),
    # a quoted prompt over two lines: the empty one below it is on line 4
    ("lines.csv", 'question,solution\n"1+1\n=",2\n"",4\n', f"line 4: {PROMPT} is null"),
]


@pytest.mark.parametrize("name, text, message", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_the_first_bad_row_stops_the_run_before_the_model_loads(name, text, message, tmp_path, capsys):
    (tmp_path / name).write_text(text)
    # no such model: a message about the data shows that the rows were checked first
    argv = ["train", "--model", str(tmp_path / "no-model"), "--dataset", str(tmp_path / name)]
    argv += ["--prompt-column", "question", "--answer-column", "solution", "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    expected = f"grpo-kernels train: error: dataset {str(tmp_path / name)!r}, {message}"
    assert capsys.readouterr().err.splitlines() == [expected]


def test_rows_are_checked_for_the_arguments_of_a_reward_of_your_own_and_parquet_rows_by_number(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "level_rewards.py").write_text("def level_reward(completions, level, **columns):\n    return level\n")
    monkeypatch.chdir(tmp_path)
    import datasets

    rows = [{"question": "1+1=", "level": 1}, {"question": "2+2=", "level": None}, {"question": None, "level": 2}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    # the write's own progress bar, unless an earlier test in this process turned datasets' bars off (the trainer's
    # reader does): not what is checked below
    capsys.readouterr()
    chat = tmp_path / "chat.jsonl"  # every row good, a chat-format prompt among them
    chat.write_text('{"question": [{"role": "user", "content": "1+1="}], "level": 1}\n{"question": "2", "level": 2}\n')
    base = ["train", "--model", str(tmp_path / "no-model"), "--prompt-column", "question"]
    base += ["--reward-funcs", "format,level_rewards:level_reward", "--output-dir", str(tmp_path / "run")]
    assert main([*base, "--dataset", str(tmp_path / "d.parquet")]) == 2
    parquet = str(tmp_path / "d.parquet")
    expected = (
        f"grpo-kernels train: error: dataset {parquet!r}, row 2: column 'level' (an argument of reward "
        "level_rewards:level_reward), is null"
    )
    assert capsys.readouterr().err.splitlines() == [expected]
    assert main([*base, "--dataset", str(chat)]) == 2  # the rows pass; the model is what is missing
    assert "model folder" in capsys.readouterr().err


def test_help_lists_the_data_formats_and_a_reward_of_your_own(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fmt in (".jsonl (one JSON object per line)", ".json", ".csv (a header row)", ".parquet", "hub dataset"):
        assert fmt in text
    assert "--reward-funcs myrewards:digit_reward,format calls digit_reward from ./myrewards.py" in text


def test_a_module_function_reward_resolves_from_the_current_folder(tmp_path, monkeypatch):
    from grpo_kernels.trainer.data import load_reward_funcs

    (tmp_path / "cwd_rewards_probe.py").write_text("def digit_reward(completions, **columns):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])  # as a console script
    (func,) = load_reward_funcs("cwd_rewards_probe:digit_reward")
    assert func(["x"]) == [1.0]
    assert str(tmp_path) not in sys.path  # the lookup leaves sys.path as it found it


def test_trls_solution_column_is_the_answer_when_answer_column_is_left_at_its_default():
    from grpo_kernels.rewards import accuracy_reward
    from grpo_kernels.trainer.rowcheck import check_rows

    rows = [{"prompt": "1+1=", "solution": "2"}, {"prompt": "2+2=", "solution": "4"}]
    check_rows(rows, Columns(), [accuracy_reward], "dataset 'd.jsonl'", lambda i: f"line {i + 1}")
    kwargs = reward_columns(rows, Columns(), repeat=1)
    assert accuracy_reward(["<answer>2</answer>", "<answer>5</answer>"], **kwargs) == [1.0, 0.0]
