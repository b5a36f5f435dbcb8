"""Smoke tests of the benchmarks at toy sizes: the GPU check's dry run (every phase and every contender, on the CPU),
a kill of its headline phase, the loss table's supervisor against scripted workers (a crash, a hang, a broken
context, the budget), and the CPU table's fresh-process mode leave JSON, markdown and PNG that say what they should.
The dry runs need Triton's interpreter and skip, saying why, where it cannot run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench_loss, gpu_check
from benchmarks.lib import harness, runner, traffic
from benchmarks.lib.contenders import CONTENDERS, FAULT_ENV, faults
from benchmarks.lib.linear import CONTENDERS as LINEAR_CONTENDERS
from benchmarks.lib.measure import NOT_REACHED
from benchmarks.lib.workload import Workload

from .conftest import INTERPRETER_BLOCKER, needs_triton_cpu

REPO = Path(__file__).resolve().parent.parent
needs_interpreter = pytest.mark.skipif(
    INTERPRETER_BLOCKER is not None, reason=f"the dry run runs Triton's interpreter: {INTERPRETER_BLOCKER}"
)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()  # the benchmark sets them for its own run
    yield
    torch.set_num_threads(threads)


def _check_results(stem: Path, mode: str, shapes: dict[int, list[str]], vocab: int, broken=()) -> dict:
    """The loss table at `shapes` (B·T: the contenders run there, in order): every row there, every contender that
    ran agrees with the others on the loss and the gradient, the markdown and the plot say so."""
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["mode"] == mode
    assert payload["device"]["type"] == "cpu" and payload["device"]["name"]
    assert payload["versions"]["torch"] and "liger-kernel" in payload["versions"] and "trl" in payload["versions"]
    assert payload["copy_bandwidth"]["GBps"] > 0
    assert "one read of the logits" in payload["bytes_counted"]
    everyone = list(dict.fromkeys(n for names in shapes.values() for n in names))
    assert list(payload["contenders"]) == everyone
    records = {(r["contender"], r["BT"]): r for r in payload["records"]}
    assert list(records) == [(c, bt) for bt, names in shapes.items() for c in names]
    for bt, names in shapes.items():
        for name in names:
            r = records[name, bt]
            if name == "liger":
                assert r["status"] in ("missing", "unsupported") and r["note"], r
                continue
            if (name, bt) in broken:
                assert r["status"] == "error" and "illegal memory access" in r["note"], r
                continue
            assert r["status"] == "ok", r
            assert r["V"] == vocab and r["B"] * r["T"] == bt
            t = r["time_ms"]
            assert 0 < t["p20"] <= t["median"] <= t["p80"] and t["n"] >= 1
            assert r["peak_bytes"] is not None and r["peak_bytes"] >= 0
            assert r["GBps"] > 0 and r["copy_bw_fraction"] > 0
            # Every contender computes the same loss and gradient on the same inputs.
            assert r["checked_against"] == ("eager" if "eager" in names else "ours")
            assert r["loss_rel_diff"] < 1e-5 and r["grad_norm_rel_diff"] < 1e-4, r
            assert math.isfinite(r["loss"])
        assert records["ours", bt]["time_vs_ours"] == 1.0
    md = stem.with_suffix(".md").read_text()
    assert payload["device"]["name"] in md.splitlines()[0]
    assert "| V | B·T | contender | median ms |" in md and "## Headline" in md
    for name in everyone:
        rows = [line for line in md.splitlines() if line.startswith(f"| {vocab} | ") and f"| {name} |" in line]
        assert len(rows) == sum(name in names for names in shapes.values()), rows
    assert "**missing**" in md or "**unsupported**" in md
    png = stem.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    return payload


def test_quantiles():
    assert harness.quantile([5, 1, 4, 2, 3], 0.5) == 3
    assert harness.quantile([1, 2, 3, 4, 5], 0.2) == pytest.approx(1.8)
    stats = harness.summarize_ms([10.0, 1.0, 2.0])
    assert (stats["p20"], stats["median"], stats["n"]) == (pytest.approx(1.4), 2.0, 3)


def test_revision_without_git(tmp_path, monkeypatch):
    """A checkout that travelled without its .git still records its revision: the variable, else the file."""
    monkeypatch.setattr(harness, "_git_head", lambda: None)
    monkeypatch.setattr(harness, "REVISION_FILE", tmp_path / "REVISION")
    monkeypatch.delenv(harness.REVISION_ENV, raising=False)
    assert harness.git_revision() is None
    (tmp_path / "REVISION").write_text("abc123+dirty\n")
    assert harness.git_revision() == "abc123+dirty (recorded by fetch_wheels.sh)"
    monkeypatch.setenv(harness.REVISION_ENV, "def456")
    assert harness.git_revision() == "def456"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead, not reaped


def test_phase_timeout_kills_its_processes(tmp_path):
    """A phase's command that outlives its budget is killed with the processes it started; its output is logged."""
    child = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    ctx = {"log_path": tmp_path / "log", "env": dict(os.environ)}
    assert gpu_check._run([sys.executable, "-c", child], 3.0, ctx) == "timeout"
    grandchild = int((tmp_path / "log").read_text().split()[0])
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert gpu_check._run([sys.executable, "-c", "print('done')"], 30.0, ctx) == 0


def test_budgets_share_the_time_and_end_by_the_limit():
    """The check's budgets leave a rerun: 7 minutes at most. A '+' phase gets its budget and the slack before it; a
    phase never eats what the phases after it are kept, so phases that each run to their limit and 10 s past it
    (a killed phase's teardown) still end the check within its limit."""
    phases = list(gpu_check.PHASES)
    assert sum(p.budget_s for p in phases) == gpu_check.TOTAL_S
    assert gpu_check.TOTAL_S + gpu_check.MARGIN_S <= gpu_check.LIMIT_S <= 7 * 60
    assert next(p.name for p in phases if p.takes_slack) == "loss_headline" == phases[2].name
    left = gpu_check.TOTAL_S - 5 - 30  # env took 5 s of its 45, kernel_tests 30 of its 90
    assert gpu_check.allowance(phases, 2, left) == 90 + 40 + 60
    assert gpu_check.allowance(phases, 3, left - 190) == 55  # the headline used it all: l2 still gets its budget
    for overrun in (0.0, 10.0):
        left = float(gpu_check.TOTAL_S)
        given = []
        for i in range(len(phases)):
            given.append(gpu_check.allowance(phases, i, left))
            left -= given[-1] + overrun if given[-1] >= 5 else 0  # under 5 s the phase is skipped (main)
        assert left >= -overrun, given  # only the last phase's teardown runs past TOTAL_S
        if overrun == 0:
            assert given == [p.budget_s for p in phases], given  # on time: every phase its budget, no more
        assert gpu_check.TOTAL_S - left <= gpu_check.LIMIT_S - gpu_check.MARGIN_S + overrun
    # --only: a phase alone gets its budget (the dry run's, three times as much)
    assert gpu_check.allowance([phases[3]], 0, 55, scale=1) == 55
    assert gpu_check.allowance([phases[3]], 0, 500, scale=3) == 165


def test_real_run_commands(tmp_path):
    """What the GPU run starts (the dry run tests the same commands at toy sizes): the headline shape, the loss
    table's budget inside its phase's, no dry-run flag anywhere."""
    ctx = {"python": "python", "dry": False, "results": tmp_path, "script": "gpu_check.py", "loss_stem": "cuda-X",
           "linear_stem": "linear-cuda-X", "phase_deadline": time.time() + 100}  # fmt: skip
    cmds = {p.name: gpu_check.commands(p.name, ctx) for p in gpu_check.PHASES}
    flat = [arg for phase in cmds.values() for cmd in phase for arg in cmd]
    assert not {"--dry-run", "--tiny", "cpu"} & set(flat)
    (head,) = cmds["loss_headline"]
    assert head[head.index("--shapes") + 1] == "bf16:151936:16384" and "--no-plot" in head
    assert 80 <= int(head[head.index("--budget-s") + 1]) <= 100 - gpu_check.SUPERVISOR_MARGIN_S
    assert head[head.index("--contender-timeout-s") + 1] == str(gpu_check.CONTENDER_TIMEOUT_S)
    (rest,) = cmds["loss_rest"]
    assert "--resume" in rest and "--shapes" not in rest and "--contenders" not in rest
    assert cmds["other_gpu_tests"][0][-4:] == ["tests", "-m", "gpu", "--ignore=tests/test_gpu.py"]
    assert cmds["linear_rest"][0][cmds["linear_rest"][0].index("--shapes") + 1] == "rest"
    assert cmds["report"] == []  # no loss table to plot yet


@needs_triton_cpu
def test_l2_grid_switch_is_set_and_undone(monkeypatch):
    """traffic.fused_grid sets triton_logits.FUSED_GRID (the launcher reads it at every launch) and records the grid
    each launch used, and undoes both; without the switch in the package it says so and changes nothing."""
    from grpo_kernels.ops import triton_logits

    kernel = triton_logits.fused_token_grad_fwd_kernel
    if not hasattr(triton_logits, "FUSED_GRID"):
        with pytest.raises(NotImplementedError, match="no FUSED_GRID switch"), traffic.fused_grid("sms"):
            pass
        assert triton_logits.fused_token_grad_fwd_kernel is kernel
        monkeypatch.setattr(triton_logits, "FUSED_GRID", None, raising=False)  # as the package will have it
    batch, length, vocab = 1, 3, 16
    x, ids = torch.randn(batch, length, vocab), torch.randint(0, vocab, (batch, length))
    ones = torch.ones(batch, length)
    with traffic.fused_grid("sms") as probe:
        assert triton_logits.FUSED_GRID == "sms" and triton_logits.fused_token_grad_fwd_kernel is probe
        triton_logits.fused_token_grad(x, ids, 1.0, advantages=ones, old_logp=None, ref_logp=None, rho=None,
                                       weight=ones, entropy_weight=None, cfg=Workload(beta=0.0).config(),
                                       out=torch.empty_like(x))  # fmt: skip
    assert probe.programs == {batch * length}  # the interpreter: one program per row
    assert triton_logits.FUSED_GRID is None and triton_logits.fused_token_grad_fwd_kernel is kernel


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module `name` (VALUE = 1)."""
    import base64
    import hashlib
    import zipfile

    tags = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": tags,
    }

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{name}-1.0.dist-info/RECORD"] = record + f"{name}-1.0.dist-info/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return path


def test_carried_wheels_install_only_what_is_missing(tmp_path):
    """The env phase installs a carried wheel whose module is missing (from the file, --no-index), not one whose
    module this Python has."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "grpo_bench_probe")
    _wheel(wheels, "pytest")  # present here: left alone
    installed = gpu_check.install_carried_wheels(wheels, site, lambda text: None)
    assert installed == ["grpo_bench_probe-1.0-py3-none-any.whl"]
    assert (site / "grpo_bench_probe" / "__init__.py").read_text() == "VALUE = 1\n"
    assert not (site / "pytest").exists()


@needs_interpreter
def test_gpu_check_dry_run(tmp_path):
    """`gpu_check.py --dry-run`: every phase, in order, on the CPU under the Triton interpreter, every contender of
    both tables at toy size (trl and compile included: installed here). A fake sticky CUDA error of ours_inplace at
    the second loss shape costs that row only: a new process goes on with the rows left, the rows before it are not
    redone. Each loss row is written as soon as it is timed, ours first, compile last; $OUT gets the bundle."""
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OUT=str(out), PYTHON=sys.executable)  # gpu_check.sh's Python
    env[FAULT_ENV] = "ours_inplace@24"
    env.pop(harness.REVISION_ENV, None)
    (tmp_path / "wheels").mkdir()  # none carried: the env phase installs nothing, whatever this checkout holds
    cmd = ["bash", "benchmarks/gpu_check.sh", "--dry-run", "--results-dir", str(results)]
    cmd += ["--wheels", str(tmp_path / "wheels")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((results / "gpu_check" / "gpu_check.json").read_text())
    phases = [p["phase"] for p in summary["phases"]]
    assert phases == [p.name for p in gpu_check.PHASES] == list(summary["budgets_s"])
    assert all(p["rc"] == 0 and not p["timed_out"] for p in summary["phases"]), summary["phases"]
    log = (results / "gpu_check" / "gpu_check.log").read_text()
    assert "6 skipped" in log  # tests/test_gpu.py collected and reported (no CUDA here)
    assert "needs a CUDA GPU" in log  # other_gpu_tests: `-m gpu` selected tests/test_compile.py's and they skip
    assert summary["git"] and summary["git"] in log
    # The headline phase wrote each row as it was timed, in the order of CONTENDERS.
    headline = log.split("phase loss_headline:")[1].split("phase l2:")[0]
    written = [line.split("written:")[1].split(":")[0].strip() for line in headline.splitlines() if "written:" in line]
    assert written == ["ours", "ours_inplace", "eager", "trl", "liger", "compile"], written
    ceilings = json.loads(next(results.glob("ceilings-cpu-*.json")).read_text())
    assert ceilings["copy_bandwidth"]["GBps"] > 0 and ceilings["matmul"]["TFLOPs"] > 0
    warm = ceilings["warmup"]  # our kernels, compiled in the env phase at the headline's dtype and V
    assert (warm["dtype"], warm["V"], warm["BT"]) == gpu_check.DRY_LOSS_HEADLINE, warm
    assert all(warm[n]["status"] == "ok" and warm[n]["first_call_s"] > 0 for n in ("ours", "ours_inplace")), warm
    _check_l2(json.loads(next(results.glob("l2-cpu-*.json")).read_text()))
    every = ["ours", "ours_inplace", "eager", "trl", "liger", "compile"]
    payload = _check_results(results / "dry-cpu", "dry-run", {16: every, 24: ["ours", "ours_inplace", "eager"]}, 64,
                             broken={("ours_inplace", 24)})  # fmt: skip
    assert payload["git"] == summary["git"]
    process = {(r["contender"], r["BT"]): r["process"] for r in payload["records"]}
    # ours at 24 ran before the fault and is kept; eager ran in the second process, after it.
    assert process["ours", 24] == process["ours_inplace", 24] == 0 and process["eager", 24] == 1, process
    compiled = next(r for r in payload["records"] if r["contender"] == "compile")
    assert compiled["status"] == "ok" and "aot_eager" in compiled["note"], compiled
    linear = json.loads((results / "linear-cpu.json").read_text())
    assert [(r["tokens"], r["width"], r["vocab"]) for r in linear["rows"]] == [(32, 16, 100), (48, 16, 77)]
    head, rest = linear["rows"]
    assert list(head["contenders"]) == list(LINEAR_CONTENDERS) and list(rest["contenders"]) == ["materialized",
                                                                                                  "fused_linear"]
    assert head["contenders"]["liger"]["status"] == "missing"
    for row in linear["rows"]:
        ref = row["reference"]["loss"]
        assert row["reference"]["status"] == "ok"
        for name, res in row["contenders"].items():
            if name == "liger":
                continue
            assert res["status"] == "ok", (name, res)
            # materialized and trl_chunked round the logits to bf16 (within 1e-2 of the oracle); the fused path
            # keeps them in fp32 (within 1e-5)
            bf16_logits = name in ("materialized", "trl_chunked")
            assert abs(res["loss"] - ref) <= (1e-2 if bf16_logits else 1e-5) * abs(ref), (name, res)
    assert "| 48 | 16 | 77 | fused_linear |" in (results / "linear-cpu.md").read_text()
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"dry-cpu.json", "dry-cpu.png", "linear-cpu.md", "gpu_check/gpu_check.log"} <= names, names
    assert (out / "gpu_check.md").read_text().startswith("# GPU check (dry run)")


def _check_l2(payload: dict) -> None:
    """The L2 phase's rows at the dry run's shape: each launch timed, as bandwidth and as a fraction of the copy."""
    (shape,) = payload["shapes"]
    rows = {r["name"]: r for r in shape["rows"]}
    want = {"copy", "row_stats", "row_grad", "row_stats + row_grad", "row_grad, chunk cold", "row_grad, chunk warm"}
    assert want <= set(rows), rows
    fused = {n: r for n, r in rows.items() if n.startswith("fused_token_grad")}
    if fused["fused_token_grad [l2]"]["status"] == "ok":  # the grid switch is in this checkout: both grids ran
        assert set(fused) == {"fused_token_grad [sms]", "fused_token_grad [l2]"}, fused
    else:  # it is not: both grid rows say so, and the default grid ran
        assert all(fused[f"fused_token_grad [{g}]"]["status"] == "unsupported" for g in ("sms", "l2")), fused
        want.add("fused_token_grad [default]")
    for name in want | {n for n, r in fused.items() if r["status"] == "ok"}:
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["time_ms"]["median"] > 0 and r["GBps"] > 0 and r["copy_fraction"] > 0, r
        assert r["GBps"] == pytest.approx(r["bytes"] / (r["time_ms"]["median"] / 1e3) / 1e9)
    assert rows["copy"]["copy_fraction"] == pytest.approx(1.0)
    assert rows["row_stats"]["bytes"] == shape["S_bytes"] and rows["row_grad"]["bytes"] == 2 * shape["S_bytes"]
    programs = [r["programs"] for n, r in fused.items() if r["status"] == "ok"]
    assert programs and all(p == [shape["BT"]] for p in programs), programs  # the interpreter: a program per row
    (orders,) = payload["pass2_orders"]  # the fused kernel's pass 2 in the launcher's order, then in row order
    assert [r["order"] for r in orders["rows"]] == ["launcher's", "row order"], orders
    assert all("error" not in r and r["time_ms"]["median"] > 0 and r["GBps"] > 0 for r in orders["rows"]), orders
    assert orders["rows"][1]["window_tiles"] == orders["rows"][1]["tiles"], orders  # row order: the whole row
    (splits,) = payload["row_splits"]  # the fused kernel's row split: the default (none at this toy row), then 2
    assert [(r["split"], r["default"]) for r in splits["rows"]] == [(1, True), (2, False)], splits
    assert all("error" not in r and r["time_ms"]["median"] > 0 and r["GBps"] > 0 for r in splits["rows"]), splits


@needs_interpreter
def test_headline_killed_after_its_first_contender_keeps_ours(tmp_path):
    """`gpu_check.py --dry-run --only loss_headline`, the phase killed (SIGKILL to its process group, as at its
    deadline) the moment the second contender starts: ours's row, written first, is in the results, complete; every
    other contender's row is there too, marked as not reached."""
    results = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env[FAULT_ENV] = "kill:ours_inplace"
    env.pop("OUT", None)
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--only", "loss_headline", "--results-dir",
           str(results)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]  # a phase that was killed fails the check
    (phase,) = json.loads((results / "gpu_check" / "gpu_check.json").read_text())["phases"]
    assert phase["phase"] == "loss_headline" and phase["rc"] == -signal.SIGKILL, phase
    payload = json.loads((results / "dry-cpu.json").read_text())
    records = {r["contender"]: r for r in payload["records"]}
    assert list(records) == list(CONTENDERS)
    ours = records.pop("ours")
    assert ours["status"] == "ok" and ours["time_ms"]["n"] >= 1 and math.isfinite(ours["loss"]), ours
    assert all(r["status"] == NOT_REACHED and "stopped" in r["note"] for r in records.values()), records
    md = (results / "dry-cpu.md").read_text()
    assert "| 64 | 16 | ours | " in md and md.count("**not_reached**") == len(CONTENDERS) - 1, md
    written = [line for line in proc.stdout.splitlines() if "written:" in line]
    assert len(written) == 1 and "ours:" in written[0], written


# A stand-in for runner.shape_worker that speaks its protocol without torch: each row of the spec's todo as
# FAKE_PLAN says ("ok", "crash": SIGKILL halfway through a message, "hang", "broken": the row with a sticky error,
# then exit 3). Before each row it notes which rows the results file already holds (FAKE_SEEN), to show that each
# row was written at once.
FAKE_WORKER = r"""
import json, os, signal, sys, time
spec, plan = json.loads(sys.argv[1]), json.loads(os.environ["FAKE_PLAN"])
for dtype, vocab, tokens, name in spec["todo"]:
    on_disk = json.load(open(os.environ["FAKE_RESULTS"]))["records"]
    with open(os.environ["FAKE_SEEN"], "a") as f:
        done = [[r["contender"], r["BT"], r["status"]] for r in on_disk if r["status"] != "not_reached"]
        f.write(json.dumps({"start": [name, tokens], "written": done}) + "\n")
    print("@@START " + json.dumps({"key": [dtype, vocab, tokens, name]}), flush=True)
    rec = {"contender": name, "dtype": dtype, "V": vocab, "BT": tokens, "B": 1, "T": tokens, "status": "ok",
           "note": "", "time_ms": {"median": 1.0, "p20": 1.0, "p80": 1.0, "n": 1}, "peak_bytes": 0, "GBps": 1.0,
           "copy_bw_fraction": None, "loss": 1.0, "grad_norm": 1.0}
    what = "excluded" if name in spec["excluded"] else plan.get(name, "ok")
    if what == "crash":  # killed in the middle of a message
        sys.stdout.write('@@RECORD {"record": {"contender": ')
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "hang":
        time.sleep(600)
    if what in ("excluded", "broken"):
        rec.update(status="error", time_ms=None, note=spec["excluded"].get(name, "RuntimeError: illegal memory access"))
    print("@@RECORD " + json.dumps({"record": rec}), flush=True)
    if what == "broken":
        print("@@BROKEN " + json.dumps({"key": [dtype, vocab, tokens, name], "note": rec["note"]}), flush=True)
        sys.exit(3)
"""


def _supervise(tmp_path, plan: dict[str, str], argv: list[str]) -> tuple[dict, list[dict]]:
    """runner.run_supervised with FAKE_WORKER as its child: the payload it leaves on disk and what the child saw."""
    stem = tmp_path / "table"
    args = bench_loss.parse_args(["--dry-run", "--out", str(stem), *argv])
    w = Workload()
    payload = bench_loss.new_payload(args, w, argv)
    payload["copy_bandwidth"] = {"GBps": 1.0, "bytes": 1}
    env = dict(os.environ, FAKE_PLAN=json.dumps(plan), FAKE_SEEN=str(tmp_path / "seen"),
               FAKE_RESULTS=str(stem.with_suffix(".json")))  # fmt: skip
    runner.run_supervised(args, w, payload, stem, command=lambda spec: ([sys.executable, "-c", FAKE_WORKER,
                                                                         json.dumps(spec)], env))  # fmt: skip
    seen = [json.loads(line) for line in (tmp_path / "seen").read_text().splitlines()]
    return json.loads(stem.with_suffix(".json").read_text()), seen


def test_supervisor_gives_each_failure_its_own_row(tmp_path):
    """A contender whose process dies, one that hangs past --contender-timeout-s and one that breaks the CUDA context
    each cost their own row at that shape (and are left out after it); a new process goes on with the rows left, and
    no row done before is redone. Every row is on disk before the next one starts."""
    plan = {"ours_inplace": "crash", "eager": "hang", "trl": "broken"}
    argv = ["--shapes", "fp32:64:16,fp32:64:24", "--contenders", "ours,ours_inplace,eager,trl,compile",
            "--contender-timeout-s", "2", "--budget-s", "120"]  # fmt: skip
    payload, seen = _supervise(tmp_path, plan, argv)
    rows = {(r["contender"], r["BT"]): r for r in payload["records"]}
    assert [(r["status"], r["process"]) for r in (rows[n, 16] for n in ("ours", "compile"))] == [("ok", 0), ("ok", 3)]
    assert "process died (killed by signal 9)" in rows["ours_inplace", 16]["note"]
    assert rows["eager", 16]["note"].startswith("timed out: still running after 2 s")
    assert "illegal memory access" in rows["trl", 16]["note"]
    assert [rows[n, 16]["process"] for n in ("ours_inplace", "eager", "trl")] == [0, 1, 2]
    for name in ("ours_inplace", "eager", "trl"):
        assert rows[name, 16]["status"] == rows[name, 24]["status"] == "error"
        assert rows[name, 24]["note"].startswith("left out from fp32 V=64 B·T=16 on:"), rows[name, 24]
    assert rows["ours", 24]["status"] == rows["compile", 24]["status"] == "ok"
    assert len(payload["notes"]) == 3 and all("a new process went on" in n for n in payload["notes"])
    assert [s["start"] for s in seen] == [["ours", 16], ["ours_inplace", 16], ["eager", 16], ["trl", 16],
                                          ["compile", 16], *([n, 24] for n in ("ours", "ours_inplace", "eager",
                                                                               "trl", "compile"))]  # fmt: skip
    assert seen[4]["written"] == [["ours", 16, "ok"], ["ours_inplace", 16, "error"], ["eager", 16, "error"],
                                  ["trl", 16, "error"]]  # fmt: skip


def test_supervisor_stops_at_its_budget(tmp_path):
    """At --budget-s the supervisor stops the child wherever it is: the rows done stay, the one it was timing and
    the ones after it say why they have no figures."""
    argv = ["--shapes", "fp32:64:16", "--contenders", "ours,ours_inplace,eager", "--budget-s", "3"]
    payload, seen = _supervise(tmp_path, {"ours_inplace": "hang"}, argv)
    rows = {r["contender"]: r for r in payload["records"]}
    assert rows["ours"]["status"] == "ok"
    assert rows["ours_inplace"]["status"] == rows["eager"]["status"] == NOT_REACHED
    assert rows["ours_inplace"]["note"] == "not reached: the run's time budget (3 s) ran out while it ran"
    assert rows["eager"]["note"] == "not reached: the run's time budget (3 s) was spent before it"
    assert [s["start"] for s in seen] == [["ours", 16], ["ours_inplace", 16]]


def test_bad_fault_and_budget_name_what_is_wrong(monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "explode:ours")
    with pytest.raises(ValueError, match=f"{FAULT_ENV}='explode:ours'"):
        faults()
    with pytest.raises(SystemExit):
        bench_loss.parse_args(["--dry-run"])
    assert f"{FAULT_ENV}='explode:ours'" in capsys.readouterr().err
    monkeypatch.delenv(FAULT_ENV)
    with pytest.raises(SystemExit):
        bench_loss.parse_args(["--dry-run", "--budget-s", "-1"])
    assert "--budget-s must be >= 0, got -1.0" in capsys.readouterr().err


def test_cpu_mode_fresh_processes(tmp_path):
    """The CPU table's mode: one fresh worker process per contender, shape and round (one worker here, for time: the
    dry run above compares the contenders; the parent runs in this process to spare a second start of torch)."""
    stem = tmp_path / "cpu"
    contenders = ["liger", "ours"]
    argv = ["--device", "cpu", "--contenders", ",".join(contenders), "--tokens", "16", "--vocabs", "64",
            "--copy-mib", "16", "--rounds", "1", "--reps", "2", "--warmup", "1", "--worker-timeout-s", "100",
            "--out", str(stem)]  # fmt: skip
    assert bench_loss.main(argv) == 0
    payload = _check_results(stem, "cpu", {16: contenders}, 64)
    assert "fresh process" in payload["peak_memory_method"]
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    assert ok and all(r["inputs_bytes"] > 0 and r["cpu_time_ms"]["median"] > 0 for r in ok)
    assert all(r["first_call_ms"]["median"] > 0 and r["build_ms"]["median"] >= 0 for r in ok)
    md = stem.with_suffix(".md").read_text()
    assert "CPU-time ms" in md and "first call ms" in md and "First call:" in md


def test_cpu_default_shapes():
    """The CPU table's default shapes: V=32000 at three B·T and Qwen's vocabulary at B·T=1024, all fp32."""
    args = bench_loss.parse_args(["--device", "cpu"])
    assert args.shapes == [("fp32", 32000, 1024), ("fp32", 32000, 2048), ("fp32", 32000, 4096), ("fp32", 151936, 1024)]
    assert bench_loss.parse_args(["--device", "cpu", "--tokens", "64"]).shapes == [
        ("fp32", 32000, 64),
        ("fp32", 151936, 64),
    ]
