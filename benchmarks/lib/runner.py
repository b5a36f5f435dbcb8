"""Where the loss table runs: the GPU table in a supervised child process (one that a contender's broken CUDA context
costs its own rows, not the run), the CPU table in a fresh process per contender, shape and round.

    python -m benchmarks.lib.runner --shape-worker SPEC_JSON   # the child of `run_supervised`
    python -m benchmarks.lib.runner --worker SPEC_JSON         # the child of `run_cpu`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import harness, report
from .contenders import CONTENDERS, make_step
from .measure import ContextBroken, Meter, bench_shape, build_contenders, copy_bandwidth, fail, grad_norm, new_record
from .measure import logits_bytes_moved
from .workload import DTYPES, Workload, make_inputs, reference_loss, split_tokens


def child_command(kind: str, spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """A fresh Python running this module (`kind`: --shape-worker or --worker), with this checkout importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(harness.REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "benchmarks.lib.runner", kind, json.dumps(spec)], env


def _emit(kind: str, data: Any) -> None:
    print(f"@@{kind} {json.dumps(data)}", flush=True)


def shape_worker(spec: dict[str, Any]) -> int:
    """The GPU table's process (also --dry-run's, on the CPU): every remaining shape, every contender, alternating.
    Reports each finished shape to the supervisor on stdout as it goes."""
    device = spec["device"]
    if device == "cpu":
        torch.set_num_threads(spec["threads"])
    w = Workload(**spec["workload"])
    meter = Meter(device)
    excluded: dict[str, str] = spec["excluded"]
    if spec["measure_copy"]:
        _emit("COPY", {"copy_bandwidth": copy_bandwidth(device, spec["copy_bytes"]), "peak_method": meter.peak_method})
    built = build_contenders([n for n in spec["contenders"] if n not in excluded], w, device)
    for dtype_name, vocab, tokens in spec["shapes"]:
        shape = (dtype_name, vocab, tokens)
        batch, length = split_tokens(tokens)
        need = batch * (length + 1) * vocab * DTYPES[dtype_name].itemsize
        free = meter.free_bytes()
        skip = None
        if time.time() > spec["deadline"]:
            skip = f"not run: the run's time budget ({spec['budget_s']:.0f} s) was spent"
        elif free is not None and need > 0.9 * free:
            skip = f"not run: the inputs ({harness.fmt_bytes(need)}) don't fit ({harness.fmt_bytes(free)} free)"
        if skip:
            recs = [new_record(n, batch, length, vocab, dtype_name) for n in spec["contenders"]]
            for r in recs:
                r.update(status="skipped", note=skip)
        else:
            t0 = time.perf_counter()
            try:
                recs = bench_shape(spec["contenders"], excluded, shape, w, meter, spec, built)
            except ContextBroken as e:
                _emit("BROKEN", {"shape": shape, "contender": e.contender, "note": e.note})
                os._exit(3)  # no teardown: it would touch the broken context
            print(f"[{dtype_name} V={vocab} BT={tokens}] {time.perf_counter() - t0:.1f} s", flush=True)
            for r in recs:
                print("   ", report.one_line(r), flush=True)
        _emit("SHAPE", {"shape": shape, "records": recs})
    return 0


def run_supervised(args: argparse.Namespace, w: Workload, payload: dict[str, Any], out_stem: Path) -> None:
    """Run the table in a child process, shape by shape. If a contender breaks the CUDA context, a new child goes on
    from that shape without it (its rows say why), so one faulty kernel costs its own rows, not the run."""
    shapes = [tuple(s) for s in args.shapes]
    done: set[tuple] = set()
    excluded: dict[str, str] = {}
    t_start = time.perf_counter()
    deadline = time.time() + args.budget_s
    while len(done) < len(shapes):
        spec = {
            "device": args.device,
            "contenders": args.contenders,
            "excluded": excluded,
            "shapes": [s for s in shapes if s not in done],
            "workload": asdict(w),
            "measure_copy": "copy_bandwidth" not in payload,
            "copy_bytes": args.copy_bytes,
            "deadline": deadline,
            "budget_s": args.budget_s,
            "reps": args.reps,
            "min_reps": args.min_reps,
            "warmup": args.warmup,
            "shape_budget_s": args.shape_budget_s,
            "threads": args.threads,
        }
        cmd, env = child_command("--shape-worker", spec)
        broken = None
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith("@@"):
                    print(line, end="", flush=True)
                    continue
                kind, data = line[2:].split(" ", 1)
                data = json.loads(data)
                if kind == "COPY":
                    payload["copy_bandwidth"] = data["copy_bandwidth"]
                    payload["peak_memory_method"] = data["peak_method"]
                elif kind == "SHAPE":
                    payload["records"].extend(data["records"])
                    done.add(tuple(data["shape"]))
                    report.finish(payload, out_stem, png=False)  # a run cut short still leaves every shape done so far
                elif kind == "BROKEN":
                    broken = data
        if broken is not None:
            dtype_name, vocab, tokens = broken["shape"]
            excluded[broken["contender"]] = (
                f"left out from {dtype_name} V={vocab} B·T={tokens} on: it broke the CUDA context there "
                f"({broken['note'][:160]})"
            )
            payload["notes"].append(f"{broken['contender']} broke the CUDA context: {broken['note']}")
            continue
        if proc.returncode != 0 or len(done) < len(shapes):
            note = f"not run: the benchmark process exited with code {proc.returncode} before this shape"
            for dtype_name, vocab, tokens in (s for s in shapes if s not in done):
                batch, length = split_tokens(tokens)
                for n in args.contenders:
                    rec = new_record(n, batch, length, vocab, dtype_name)
                    rec.update(status="error", note=note)
                    payload["records"].append(rec)
            break
    payload["wall_s"] = time.perf_counter() - t_start


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
