"""Where the loss table runs: the GPU table in a supervised child process, each row written as soon as it is timed (a
contender that breaks the CUDA context or its process costs its own row, not the run), the CPU table in a fresh
process per contender, shape and round.

    python -m benchmarks.lib.runner --shape-worker SPEC_JSON   # the child of `run_supervised`
    python -m benchmarks.lib.runner --worker SPEC_JSON         # the child of `run_cpu`
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import harness, report
from .contenders import CONTENDERS, faults, make_step
from .measure import (
    NOT_REACHED,
    ContextBroken,
    Meter,
    copy_bandwidth,
    fail,
    grad_norm,
    logits_bytes_moved,
    new_record,
    time_contender,
)
from .workload import DTYPES, Workload, make_inputs, reference_loss, split_tokens


def child_command(kind: str, spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """A fresh Python running this module (`kind`: --shape-worker or --worker), with this checkout importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(harness.REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "benchmarks.lib.runner", kind, json.dumps(spec)], env


def _emit(kind: str, data: Any) -> None:
    print(f"@@{kind} {json.dumps(data)}", flush=True)


Key = tuple[str, int, int, str]  # (dtype, V, B·T, contender): one row of the table


def shape_worker(spec: dict[str, Any]) -> int:
    """The GPU table's process (also --dry-run's, on the CPU): the rows of spec["todo"], shape by shape, each
    contender in CONTENDERS order. Says which row it starts (@@START) and sends each row as soon as it is timed
    (@@RECORD), so the supervisor writes it before the next contender starts."""
    device = spec["device"]
    if device == "cpu":
        torch.set_num_threads(spec["threads"])
    w = Workload(**spec["workload"])
    meter = Meter(device)
    excluded: dict[str, str] = spec["excluded"]
    if spec["measure_copy"]:
        _emit("COPY", {"copy_bandwidth": copy_bandwidth(device, spec["copy_bytes"]), "peak_method": meter.peak_method})
    todo = [tuple(k) for k in spec["todo"]]
    built: dict[str, Any] = {}  # contender -> its function, or the text of why it could not be built
    for shape in dict.fromkeys(k[:3] for k in todo):
        dtype_name, vocab, tokens = shape
        batch, length = split_tokens(tokens)
        need = batch * (length + 1) * vocab * DTYPES[dtype_name].itemsize
        free = meter.free_bytes()
        too_big = free is not None and need > 0.9 * free
        inp = None
        for name in (k[3] for k in todo if k[:3] == shape):
            _emit("START", {"key": [*shape, name]})
            rec = new_record(name, batch, length, vocab, dtype_name)
            status, why = CONTENDERS[name].availability(device)
            if name in excluded:
                rec.update(status="error", note=excluded[name])
            elif status != "ok":
                rec.update(status=status, note=why)
            elif too_big:
                note = f"not run: the inputs ({harness.fmt_bytes(need)}) don't fit ({harness.fmt_bytes(free)} free)"
                rec.update(status="skipped", note=note)
            else:
                if name not in built:  # built when first needed: a slow import (trl) delays no contender before it
                    try:
                        built[name] = CONTENDERS[name].build(w, device)
                    except Exception as e:  # noqa: BLE001
                        built[name] = f"{type(e).__name__}: {e}"[:300]
                if isinstance(built[name], str):
                    rec.update(status="error", note=built[name])
                else:
                    rec["note"] = getattr(built[name], "note", "")
                    if inp is None:
                        inp = make_inputs(batch, length, vocab, DTYPES[dtype_name], device)
                    try:
                        time_contender(name, built[name], inp, meter, spec, rec)
                    except ContextBroken as e:
                        _emit("RECORD", {"record": rec})
                        _emit("BROKEN", {"key": [*shape, name], "note": e.note})
                        os._exit(3)  # no teardown: it would touch the broken context
            _emit("RECORD", {"record": rec})
        inp = None  # free the inputs before the allocator's cache
        meter.free()
    return 0


def _key(rec: dict[str, Any]) -> Key:
    return rec["dtype"], rec["V"], rec["BT"], rec["contender"]


def _kill_own_group() -> None:
    """The GPU check's deadline, simulated (FAULT_ENV kind "kill"): SIGKILL to this process's group, as gpu_check.py
    sends to a phase, when this process leads its group; else to itself alone (so that bench_loss.py run directly
    cannot take its caller's group down; its worker then ends at its next write to the closed pipe)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_text(rc: int | None) -> str:
    if rc is not None and rc < 0:
        return f"killed by signal {-rc}"
    return f"exit code {rc}"


def run_supervised(
    args: argparse.Namespace,
    w: Workload,
    payload: dict[str, Any],
    out_stem: Path,
    command: Callable[[dict[str, Any]], tuple[list[str], dict[str, str]]] | None = None,
) -> None:
    """Run the table's rows in a child process (`command(spec)`, by default `shape_worker` in a fresh Python), each
    row written to the results as soon as the child sends it. Every row is in the results from the start, as
    "not reached", so a run killed at any moment leaves a valid table: the rows timed so far, the others marked.

    A contender that breaks the CUDA context, kills its process (a crash) or outlives --contender-timeout-s costs its
    own row: a new child goes on with the rows left, without that contender (its later rows say why). At
    --budget-s the child is stopped wherever it is, and the rows left say so."""
    command = command or (lambda spec: child_command("--shape-worker", spec))
    t_start = time.perf_counter()
    deadline = time.time() + args.budget_s
    rows: dict[Key, dict[str, Any]] = {}
    for dtype_name, vocab, tokens in (tuple(s) for s in args.shapes):
        batch, length = split_tokens(tokens)
        for name in args.contenders:
            rec = new_record(name, batch, length, vocab, dtype_name)
            rec.update(status=NOT_REACHED, note="not reached: the run was stopped before this contender was timed")
            rows[_key(rec)] = rec
            payload["records"].append(rec)
    report.finish(payload, out_stem, png=False)
    excluded: dict[str, str] = {}
    kills = [f for f in faults() if f.kind == "kill"]
    why_left = "not reached: the benchmark process ended before this contender"
    for attempt in range(len(args.contenders) + 1):  # each new child follows a contender that cost its own row
        todo = [k for k, r in rows.items() if r["status"] == NOT_REACHED]
        if not todo:
            break
        spec = {
            "device": args.device,
            "excluded": excluded,
            "todo": todo,
            "workload": asdict(w),
            "measure_copy": "copy_bandwidth" not in payload,
            "copy_bytes": args.copy_bytes,
            "reps": args.reps,
            "min_reps": args.min_reps,
            "warmup": args.warmup,
            "contender_budget_s": args.contender_budget_s,
            "threads": args.threads,
        }
        child = _Child(*command(spec))
        for kind, data in child.messages(deadline, args.contender_timeout_s or None):
            if kind == "COPY":
                payload["copy_bandwidth"] = data["copy_bandwidth"]
                payload["peak_memory_method"] = data["peak_method"]
            elif kind == "START":
                key = tuple(data["key"])
                if any(f.contender == key[3] and f.tokens in (None, key[2]) for f in kills):
                    _kill_own_group()
            elif kind == "RECORD":
                rec = rows[_key(data["record"])]
                rec.clear()
                rec.update(data["record"], process=attempt)
                report.finish(payload, out_stem, png=False)
                print(f"[{rec['dtype']} V={rec['V']} BT={rec['BT']}] written:", report.one_line(rec), flush=True)
        culprit = None if child.running is None else rows[child.running]
        if child.ended == "deadline":
            why_left = f"not reached: the run's time budget ({args.budget_s:.0f} s) was spent before it"
            if culprit is not None:
                culprit["note"] = f"not reached: the run's time budget ({args.budget_s:.0f} s) ran out while it ran"
            break
        if culprit is None:  # the child finished its rows, or died between two of them
            if child.rc != 0:
                why_left = f"not reached: the benchmark process ended ({_exit_text(child.rc)}) before this contender"
                payload["notes"].append(f"the benchmark process ended with {_exit_text(child.rc)} between two rows")
            break
        if child.ended == "timeout":
            note = f"timed out: still running after {args.contender_timeout_s:.0f} s, its process was killed"
        elif child.broken is not None:
            note = culprit["note"]  # the child sent the row with the error that broke the context
        else:
            note = f"its process died ({_exit_text(child.rc)}) while it was being timed"
        culprit.update(status="error", note=note, process=attempt)
        dtype_name, vocab, tokens, name = child.running
        excluded[name] = f"left out from {dtype_name} V={vocab} B·T={tokens} on: {note[:200]}"
        payload["notes"].append(f"{name} at {dtype_name} V={vocab} B·T={tokens}: {note}; a new process went on")
        report.finish(payload, out_stem, png=False)
    for rec in rows.values():
        if rec["status"] == NOT_REACHED and rec["note"].startswith("not reached: the run was stopped"):
            rec["note"] = why_left
    payload["wall_s"] = time.perf_counter() - t_start
    report.finish(payload, out_stem, png=False)


class _Child:
    """One worker process: its protocol lines (`messages`), the row it was timing when it ended (`running`), how it
    ended (`ended`: "exit", "deadline" or "timeout": killed by the supervisor) and its exit code."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        # The same process group as the supervisor: the GPU check's kill of a phase reaches the worker too.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     errors="replace", env=env)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.running: Key | None = None
        self.broken: dict[str, Any] | None = None
        self.ended = "exit"
        self.rc: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def messages(self, deadline: float, contender_timeout_s: float | None) -> Iterator[tuple[str, Any]]:
        """The child's @@ messages as they come (its other output is echoed), until it exits or is killed: at the
        wall-clock `deadline`, or when one row has run for `contender_timeout_s`."""
        started = time.time()
        while True:
            timeout_first = bool(self.running and contender_timeout_s and started + contender_timeout_s < deadline)
            limit = started + contender_timeout_s if timeout_first else deadline  # type: ignore[operator]
            try:
                line = self.lines.get(timeout=max(0.0, limit - time.time()))
            except queue.Empty:
                self.ended = "timeout" if timeout_first else "deadline"
                self.proc.kill()
                break
            if line is None:
                break
            try:
                kind, text = line[2:].split(" ", 1) if line.startswith("@@") else ("", "")
                data = json.loads(text) if kind else None
            except ValueError:  # a message cut short (the child killed mid-line): output, not a message
                kind = ""
            if not kind:
                print(line, end="", flush=True)
                continue
            if kind == "START":
                self.running, started = tuple(data["key"]), time.time()
            elif kind == "RECORD":
                self.running = None
            elif kind == "BROKEN":
                self.broken = data
            yield kind, data
        self.rc = self.proc.wait()
        if self.broken is not None:
            self.running = tuple(self.broken["key"])


# ----------------------------------------------------------------------------------------------------------------
# CPU mode: each contender in a fresh process, so its peak RSS is its own


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one contender at one shape (inside a fresh `--worker` process) and report times and peak RSS. The first
    call's time is the contender's first-call cost in a fresh process (lazy imports, compilation, caches);
    `build_ms` is what building the contender took before it (its imports)."""
    torch.set_num_threads(spec["threads"])
    w = Workload(**spec["workload"])
    name = spec["contender"]
    rec = new_record(name, spec["B"], spec["T"], spec["V"], spec["dtype"])
    meter = Meter("cpu")
    try:
        t0 = time.perf_counter()
        fn = CONTENDERS[name].build(w, "cpu")
        build_ms = (time.perf_counter() - t0) * 1e3
        rec["note"] = getattr(fn, "note", "")
        inp = make_inputs(spec["B"], spec["T"], spec["V"], DTYPES[spec["dtype"]], "cpu")
        if CONTENDERS[name].inplace:
            inp.pristine = inp.full.clone()  # restoring by a copy is 20x faster than regenerating on a CPU
        step = make_step(CONTENDERS[name], fn, inp)
        times, cpu_times, peak, first_ms = [], [], 0, None
        for i in range(spec["warmup"] + spec["reps"]):
            ms, peak_i, (loss, grad) = meter.call(step)
            if i == 0:
                first_ms = ms
                rec["loss"] = float(loss)
                rec["grad_norm"] = grad_norm(grad)
            del loss, grad
            if CONTENDERS[name].inplace:
                inp.refill()
            if i >= spec["warmup"]:
                times.append(ms)
                cpu_times.append(meter.last_cpu_ms)
                peak = max(peak, peak_i)
        rec.update(
            times=times,
            cpu_times=cpu_times,
            first_call_ms=first_ms,
            build_ms=build_ms,
            peak_bytes=peak,
            inputs_bytes=inp.nbytes,
            peak_method=meter.peak_method,
        )
    except Exception as e:  # noqa: BLE001
        fail(rec, meter, e)
    return rec


def run_cpu(args: argparse.Namespace, w: Workload, payload: dict[str, Any], out_stem: Path) -> None:
    """Every shape: rounds of fresh processes, the contenders' order rotated each round, so that background load on
    a shared machine falls on every contender alike."""
    payload["peak_memory_method"] = (
        "each contender in a fresh process: peak RSS (VmHWM, reset before each call) minus RSS before the call"
    )
    payload["copy_bandwidth"] = copy_bandwidth("cpu", args.copy_bytes)
    t_start = time.perf_counter()
    for dtype_name, vocab, tokens in args.shapes:
        batch, length = split_tokens(tokens)
        recs = {n: new_record(n, batch, length, vocab, dtype_name) for n in args.contenders}
        runnable = []
        for n in args.contenders:
            status, why = CONTENDERS[n].availability("cpu")
            if status != "ok":
                recs[n].update(status=status, note=why)
            else:
                runnable.append(n)
        samples: dict[str, dict[str, list[float]]] = {
            n: {"times": [], "cpu_times": [], "first": [], "build": []} for n in runnable
        }
        for r in range(args.rounds):
            for n in runnable[r % len(runnable) :] + runnable[: r % len(runnable)]:
                if recs[n]["status"] != "ok":
                    continue
                spec = {
                    "contender": n,
                    "B": batch,
                    "T": length,
                    "V": vocab,
                    "dtype": dtype_name,
                    "workload": asdict(w),
                    "threads": args.threads,
                    "warmup": args.warmup,
                    "reps": max(1, args.reps // args.rounds),
                }
                res = _spawn_worker(spec, args.worker_timeout_s)
                rec = recs[n]
                if res.get("status") != "ok":
                    rec.update(status=res.get("status", "error"), note=res.get("note", ""))
                    continue
                samples[n]["times"] += res["times"]
                samples[n]["cpu_times"] += res["cpu_times"]
                samples[n]["first"].append(res["first_call_ms"])
                samples[n]["build"].append(res["build_ms"])
                rec["note"] = res.get("note", "")
                rec["peak_bytes"] = max(rec["peak_bytes"] or 0, res["peak_bytes"])
                rec["loss"] = res["loss"] if rec["loss"] is None else rec["loss"]
                rec["grad_norm"] = res["grad_norm"] if rec["grad_norm"] is None else rec["grad_norm"]
                rec["inputs_bytes"] = res["inputs_bytes"]
        itemsize = DTYPES[dtype_name].itemsize
        for n in runnable:
            rec = recs[n]
            if rec["status"] == "ok" and samples[n]["times"]:
                rec["time_ms"] = harness.summarize_ms(samples[n]["times"])
                rec["cpu_time_ms"] = harness.summarize_ms(samples[n]["cpu_times"])
                rec["first_call_ms"] = harness.summarize_ms(samples[n]["first"])
                rec["build_ms"] = harness.summarize_ms(samples[n]["build"])
                rec["GBps"] = logits_bytes_moved(rec, itemsize) / (rec["time_ms"]["median"] / 1e3) / 1e9
        print(f"[{dtype_name} V={vocab} BT={tokens}]", flush=True)
        for n in args.contenders:
            print("   ", report.one_line(recs[n]), flush=True)
        payload["records"].extend(recs[n] for n in args.contenders)
        report.finish(payload, out_stem, png=False)
    payload["wall_s"] = time.perf_counter() - t_start
    payload["device"]["load_average_end"] = list(os.getloadavg())


def _spawn_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    cmd, env = child_command("--worker", spec)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"worker timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        killed = proc.returncode in (-9, 137)
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:240]
        return {"status": "oom" if killed else "error", "note": f"worker exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def reference_check(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """The float64 oracle's loss on the first shape's inputs (--dry-run), to set every contender's loss beside."""
    dtype_name, vocab, tokens = args.shapes[0]
    batch, length = split_tokens(tokens)
    inp = make_inputs(batch, length, vocab, DTYPES[dtype_name], "cpu")
    try:
        loss = reference_loss(inp.full.detach()[:, :-1].double(), *inp.tensors, w)
    except Exception as e:  # noqa: BLE001 - the oracle missing or failing is a line of the report, not a crash
        return {"status": "error", "note": f"{type(e).__name__}: {e}"[:240]}
    return {"status": "ok", "loss": loss, "B": batch, "T": length, "V": vocab, "dtype": dtype_name}


if __name__ == "__main__":
    kind, spec_json = sys.argv[1], sys.argv[2]
    if kind == "--worker":
        print(json.dumps(worker(json.loads(spec_json))), flush=True)
        sys.exit(0)
    sys.exit(shape_worker(json.loads(spec_json)))
