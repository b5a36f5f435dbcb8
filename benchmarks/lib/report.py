"""The benchmarks' reports: for the loss table the derived figures (ratios to ours, agreement of the losses), the
markdown with its headline and the PNG plot (`finish` writes all three beside each other); then the fused-linear
table's markdown and the GPU check's own two (the device's ceilings, the L2 question). Somewhat over 400 lines: the
report code of every table in one place, so a change to how results read is made here alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from . import harness, traffic
from .contenders import BASELINE
from .workload import LOGIT_STD, SEQ_LEN


def one_line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['contender']:>13}: {r['status']} {r['note']}"
    t = r["time_ms"]
    return (
        f"{r['contender']:>13}: {t['median']:9.2f} ms [{t['p20']:.2f}, {t['p80']:.2f}]  "
        f"peak +{harness.fmt_bytes(r['peak_bytes']):>10}  {r['GBps']:7.1f} GB/s  loss {r['loss']:.6g}"
    )


def annotate(payload: dict[str, Any]) -> None:
    """Fill the derived figures: fraction of the copy bandwidth, ratios to ours, agreement of the losses."""
    bw = payload.get("copy_bandwidth", {}).get("GBps")
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in payload["records"]:
        by_shape.setdefault((r["dtype"], r["V"], r["BT"]), {})[r["contender"]] = r
    for recs in by_shape.values():
        base = recs.get(BASELINE)
        ref = next((recs[n] for n in ("eager", BASELINE) if n in recs and recs[n]["loss"] is not None), None)
        for r in recs.values():
            if r["status"] == "ok" and r["GBps"] and bw:
                r["copy_bw_fraction"] = r["GBps"] / bw
            if base and base["status"] == "ok" and r["status"] == "ok" and r["time_ms"] and base["time_ms"]:
                r["time_vs_ours"] = r["time_ms"]["median"] / base["time_ms"]["median"]
                if r.get("cpu_time_ms") and base.get("cpu_time_ms"):
                    r["cpu_time_vs_ours"] = r["cpu_time_ms"]["median"] / base["cpu_time_ms"]["median"]
                if base["peak_bytes"]:
                    r["mem_vs_ours"] = r["peak_bytes"] / base["peak_bytes"]
            oracle = payload.get("reference_check") or {}
            if (
                oracle.get("status") == "ok"
                and r["loss"] is not None
                and (r["dtype"], r["V"], r["BT"]) == (oracle["dtype"], oracle["V"], oracle["B"] * oracle["T"])
            ):
                r["reference_rel_diff"] = abs(r["loss"] - oracle["loss"]) / max(abs(oracle["loss"]), 1e-12)
            if ref is not None and r["loss"] is not None and ref["loss"] is not None:
                r["loss_rel_diff"] = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
                if r["grad_norm"] is not None and ref["grad_norm"]:
                    r["grad_norm_rel_diff"] = abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
                r["checked_against"] = ref["contender"]


def headline(payload: dict[str, Any]) -> list[str]:
    """Per dtype and contender: geometric means, over the shapes where both ran, of time and peak memory relative to
    ours; then the same at the largest shape where ours ran (or what kept the contender from it)."""
    lines = []
    records = payload["records"]
    for dtype_name in dict.fromkeys(r["dtype"] for r in records):
        at = {(r["contender"], r["V"], r["BT"]): r for r in records if r["dtype"] == dtype_name}
        ours = [k[1:] for k, r in at.items() if k[0] == BASELINE and r["status"] == "ok"]
        if not ours:
            lines.append(f"- {dtype_name}: ours did not run, so there are no ratios.")
            continue
        vocab, tokens = max(ours, key=lambda k: k[0] * k[1])
        for name in payload["contenders"]:
            if name == BASELINE:
                continue
            mine = [at[name, *k] for k in ours if at.get((name, *k), {}).get("time_vs_ours")]
            big = at.get((name, vocab, tokens))
            where = f"at the largest shape (V={vocab}, B·T={tokens})"
            if not mine:
                states = sorted({r["status"] for k, r in at.items() if k[0] == name})
                lines.append(f"- **{name}**, {dtype_name}: no shape ran ({', '.join(states)}).")
                continue
            t = harness.geomean([r["time_vs_ours"] for r in mine])
            c = harness.geomean([r["cpu_time_vs_ours"] for r in mine if "cpu_time_vs_ours" in r])
            m = harness.geomean([r["mem_vs_ours"] for r in mine if "mem_vs_ours" in r])
            cpu = f" ({c:.2f}× in CPU time)" if math.isfinite(c) else ""
            line = f"- **{name}**, {dtype_name}: {t:.2f}× ours' time{cpu}, {_ratio(m)} ours' peak memory (geometric "
            line += f"mean over {len(mine)} shapes); {where}: "
            if big is not None and big.get("time_vs_ours"):
                line += f"{big['time_vs_ours']:.2f}× time, {_ratio(big.get('mem_vs_ours', math.nan))} memory"
                line += _first_call(big, at.get((BASELINE, vocab, tokens))) + "."
            else:
                line += f"{big['status'] if big else 'not run'}."
            lines.append(line)
    return lines


def _first_call(r: dict[str, Any], ours: dict[str, Any] | None) -> str:
    """', first call N ms (ours' M ms)' where the first call in a fresh process was timed (CPU mode)."""
    if not r.get("first_call_ms") or not (ours or {}).get("first_call_ms"):
        return ""
    return f", first call {r['first_call_ms']['median']:.0f} ms (ours' {ours['first_call_ms']['median']:.0f} ms)"


def _ratio(x: float) -> str:
    return f"{x:.2f}×" if math.isfinite(x) else "–×"  # peak 0 above the inputs: no ratio


FIRST_CALL = (
    " First call: the wall-clock time of the first call in a fresh process (median over the processes), what a new "
    "process pays once for lazy initialization and compilation; the median excludes it."
)


def to_markdown(payload: dict[str, Any]) -> str:
    dev = payload["device"]
    v = payload["versions"]
    bw = payload.get("copy_bandwidth", {})
    title = f"# GRPO loss, forward + backward: {dev['name']} ({payload['mode']})"
    head = [
        title,
        "",
        f"Made by `{payload['command']}` on {payload['created']}, git {payload['git']}.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" if val else f"{k} (not installed)" for k, val in v.items()) + ".",
        "",
        (
            f"Device: {_device_line(dev)}. Measured copy bandwidth: **{bw.get('GBps', math.nan):.1f} GB/s** "
            f"(a {harness.fmt_bytes(bw.get('bytes'))} copy, bytes read + written)."
        ),
        "",
        (
            f"Workload: {_workload_line(payload['workload'])}. Time: median [p20, p80] of {payload['timing']}. "
            f"Peak memory: {payload.get('peak_memory_method', 'not measured yet')}, so it includes the returned "
            "gradient unless in place. "
            "GB/s counts one read of the logits and one write of their gradient (2·B·T·V·itemsize bytes); "
            "'% copy' is that over the measured copy bandwidth. ×ours: median time and peak memory over ours' "
            "(below 1: less than ours). Δloss, Δ‖∂‖: relative difference of the loss and of the gradient's norm "
            "from eager's (ours' where eager did not run)."
            + (FIRST_CALL if any(r.get("first_call_ms") for r in payload["records"]) else "")
        ),
        "",
        "## Headline",
        "",
        *headline(payload),
        "",
    ]
    with_cpu = any(r.get("cpu_time_ms") for r in payload["records"])
    with_first = any(r.get("first_call_ms") for r in payload["records"])
    headers = (
        ["V", "B·T", "contender", "median ms", "[p20, p80]"]
        + (["CPU-time ms"] if with_cpu else [])
        + (["first call ms"] if with_first else [])
        + ["peak above inputs", "GB/s", "% copy", "×ours time", "×ours mem", "Δloss", "Δ‖∂‖", "note"]
    )
    body = []
    for dtype_name in dict.fromkeys(r["dtype"] for r in payload["records"]):
        rows = []
        for r in payload["records"]:
            if r["dtype"] != dtype_name:
                continue
            if r["status"] != "ok":
                rows.append(
                    [r["V"], r["BT"], r["contender"]]
                    + ["–"] * (len(headers) - 4)
                    + [f"**{r['status']}**: {r['note']}".replace("|", "/")]
                )
                continue
            t = r["time_ms"]
            cpu = [f"{r['cpu_time_ms']['median']:.0f}" if r.get("cpu_time_ms") else "–"] if with_cpu else []
            if with_first:
                cpu.append(f"{r['first_call_ms']['median']:.0f}" if r.get("first_call_ms") else "–")
            rows.append(
                [
                    r["V"],
                    r["BT"],
                    r["contender"],
                    f"{t['median']:.2f}",
                    f"[{t['p20']:.2f}, {t['p80']:.2f}]",
                    *cpu,
                    harness.fmt_bytes(r["peak_bytes"]),
                    f"{r['GBps']:.1f}",
                    f"{100 * r['copy_bw_fraction']:.0f}%" if r.get("copy_bw_fraction") else "–",
                    f"{r['time_vs_ours']:.2f}" if "time_vs_ours" in r else "–",
                    f"{r['mem_vs_ours']:.2f}" if "mem_vs_ours" in r else "–",
                    f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "–",
                    f"{r['grad_norm_rel_diff']:.1e}" if "grad_norm_rel_diff" in r else "–",
                    (r.get("note") or "").replace("|", "/"),
                ]
            )
        align = "rrl" + "r" * (len(headers) - 4) + "l"
        body += [f"## {dtype_name} logits", "", harness.markdown_table(headers, rows, align), ""]
    body += ["## Contenders", ""] + [f"- `{n}`: {d}" for n, d in payload["contenders"].items()]
    oracle = payload.get("reference_check")
    if oracle and oracle.get("status") == "ok":
        diffs = ", ".join(
            f"{r['contender']} {r['reference_rel_diff']:.1e}" for r in payload["records"] if "reference_rel_diff" in r
        )
        where = f"{oracle['dtype']}, V={oracle['V']}, B·T={oracle['B'] * oracle['T']}"
        body += ["", f"Reference check: the float64 oracle of reference/ gives loss {oracle['loss']:.9g} at {where}; "]
        body[-1] += f"relative differences: {diffs}."
    elif oracle:
        body += ["", f"Reference check: {oracle['status']} ({oracle.get('note', '')})."]
    if payload.get("notes"):
        body += ["", "## Notes", ""] + [f"- {n}" for n in payload["notes"]]
    return "\n".join(head + body) + "\n"


def _device_line(dev: dict[str, Any]) -> str:
    if dev["type"] == "cuda":
        return (
            f"{dev['name']} (sm {dev['capability']}, {harness.fmt_bytes(dev['memory_bytes'])}, CUDA {dev['cuda']}, "
            f"driver {dev.get('driver')}), host {dev['host_cpu']}"
        )

    def load(key: str) -> str:
        return ", ".join(f"{x:.2f}" for x in dev.get(key, [])) or "–"

    return (
        f"{dev['name']}, {dev['host_cpu_count']} cores, torch threads {dev.get('torch_threads')}, "
        f"{harness.fmt_bytes(dev.get('memory_bytes'))} RAM; load average (1, 5, 15 min) {load('load_average')} "
        f"at the start, {load('load_average_end')} at the end: other processes' load inflates wall-clock times, "
        "less so the CPU time"
    )


def _workload_line(w: dict[str, Any]) -> str:
    return ", ".join(f"{k}={val}" for k, val in w.items()) + (
        "; per-sequence advantages, old and reference log-probs given, completion mask with tail padding, "
        f"random logits of std {LOGIT_STD}, T = min({SEQ_LEN}, B·T)"
    )


def plot_figure(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in payload["records"] if r["status"] == "ok"]
    panels = list(dict.fromkeys((r["dtype"], r["V"]) for r in payload["records"]))
    fig, axes = plt.subplots(2, len(panels), figsize=(max(4.2 * len(panels), 8.5), 7.5), squeeze=False)
    names = list(payload["contenders"])
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    for j, (dtype_name, vocab) in enumerate(panels):
        for n in names:
            pts = sorted(
                (r["BT"], r["time_ms"]["median"], r["peak_bytes"])
                for r in recs
                if r["contender"] == n and r["dtype"] == dtype_name and r["V"] == vocab
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            style = {"marker": "o", "color": colors[n], "label": n, "linestyle": "--" if "inplace" in n else "-"}
            axes[0, j].plot(xs, [p[1] for p in pts], **style)
            axes[1, j].plot(xs, [p[2] / 2**20 for p in pts], **style)
        axes[0, j].set_title(f"{dtype_name}, V = {vocab}")
        for i, label in enumerate(("fwd+bwd time, median (ms)", "peak memory above inputs (MiB)")):
            ax = axes[i, j]
            ax.set_xscale("log", base=2)
            if i == 0 or min((y for line in ax.get_lines() for y in line.get_ydata()), default=1.0) >= 1.0:
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=1.0)  # in-place contenders can peak at ~0 MiB above the inputs
                ax.set_ylim(bottom=0)
            ax.set_xlabel("B·T (tokens)")
            if j == 0:
                ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle(f"GRPO loss forward+backward on {payload['device']['name']}", y=0.995, fontsize=11)
    if labels:  # none when no contender ran anywhere (every shape skipped)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(payload: dict[str, Any], out_stem: Path, png: bool = True) -> None:
    annotate(payload)
    harness.write_json(out_stem.with_suffix(".json"), payload)
    harness.write_text(out_stem.with_suffix(".md"), to_markdown(payload))
    if png:
        plot_figure(payload, out_stem.with_suffix(".png"))



# ----------------------------------------------------------------------------------------------------------------
# The fused-linear table


def _fmt3(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def linear_markdown(payload: dict[str, Any]) -> str:
    """The fused-linear table (benchmarks/bench_linear.py) and its ratios to the materialized baseline."""
    dev = payload["device"]
    lines = [
        f"# Fused linear GRPO on {dev['name']} ({dev['type']})",
        "",
        (
            f"{payload['timestamp']} · git {payload['git']} · torch {payload['versions'].get('torch')} · "
            f"triton {payload['versions'].get('triton')} · trl {payload['versions'].get('trl')} · "
            f"liger-kernel {payload['versions'].get('liger-kernel')}"
        ),
        "",
        (
            f"Workload: {payload['workload']}, bf16 hidden/weight, T = {SEQ_LEN}. Time: median (p20–p80) of forward + "
            "backward. Peak: allocated during the call above the inputs, the returned gradients included; transient: "
            "without them. TFLOP/s counts the 3 GEMMs any path needs (logits, ∂hidden, ∂weight: 6·N·V·H). Rel. err: "
            "the loss against the float64 oracle on the same bf16 inputs (B·T <= 8192); paths that round the logits to "
            "bf16 sit near 1e-4, the fused path keeps them in fp32."
        ),
        "",
    ]
    headers = ["B·T", "H", "V", "contender", "time ms", "TFLOP/s", "peak", "transient", "loss", "rel. err", "status"]
    rows = []
    for row in payload["rows"]:
        flops = 6 * row["tokens"] * row["vocab"] * row["width"]
        ref = row.get("reference", {})
        for name, res in row["contenders"].items():
            if res["status"] == "ok":
                ms = res["ms"]
                err = "–"
                if ref.get("status") == "ok":
                    err = f"{abs(res['loss'] - ref['loss']) / max(abs(ref['loss']), 1e-12):.1e}"
                rows.append(
                    [
                        row["tokens"],
                        row["width"],
                        row["vocab"],
                        name,
                        f"{ms['median']:.2f} ({ms['p20']:.2f}–{ms['p80']:.2f})",
                        f"{flops / ms['median'] / 1e9:.0f}",
                        harness.fmt_bytes(res["peak_bytes"]),
                        harness.fmt_bytes(res["transient_bytes"]),
                        f"{res['loss']:.6f}",
                        err,
                        "ok",
                    ]
                )
            else:
                rows.append(
                    [
                        row["tokens"],
                        row["width"],
                        row["vocab"],
                        name,
                        "–",
                        "–",
                        "–",
                        "–",
                        "–",
                        "–",
                        f"{res['status']}: {res.get('why', '')[:120]}",
                    ]
                )
    lines += [harness.markdown_table(headers, rows, "rrrlrrrrrrl"), ""]
    lines += ["## fused_linear against materialized (targets: time ≤ 1.15, peak ≤ 0.125)", ""]
    rrows = []
    for row in payload["rows"]:
        r = row["ratios"]["fused_linear"]
        rrows.append(
            [
                row["tokens"],
                row["width"],
                _fmt3(r["time"]),
                _fmt3(r["peak"]),
                _fmt3(r["transient"]),
                _fmt3(row["ratios"]["fused_linear_strided"]["time"]),
            ]
        )
    lines += [
        harness.markdown_table(
            ["B·T", "H", "time ratio", "peak ratio", "transient ratio", "time ratio (strided hidden)"], rrows, "rrrrrr"
        ),
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The GPU check's own figures: the device's ceilings and the L2 question


def traffic_markdown(payload: dict[str, Any]) -> str:
    """The L2 question's table (benchmarks/lib/traffic.py): each launch's time, bandwidth and fraction of the copy's."""
    caches = payload.get("caches") or {}
    lines = [
        f"# The L2 question on {payload['device']['name']}",
        "",
        (
            f"git {payload['git']}; {caches.get('multiprocessors', '–')} SMs, "
            f"L2 {harness.fmt_bytes(caches.get('L2_bytes'))}. Single launches of the Triton launchers timed with CUDA "
            "events (wall-clock on a CPU). S = B·T·V·itemsize, the logits' bytes. Bytes counted: the least each "
            "launch must move (a re-read that hits L2 not counted); GB/s is that over the median time, '% copy' "
            "that over the copy's GB/s at the same shape. A low figure says the launch is slower than memory allows, "
            "not why: an issue-bound kernel runs as long with its re-read in L2 as in DRAM. The chunk rows answer "
            "the question directly: the same gradient launch on the same rows, read cold (after a write of twice "
            "L2's size) and warm (right after the statistics pass read them)."
        ),
        "",
    ]
    headers = ["dtype", "V", "B·T", "launch", "median ms", "[p20, p80]", "bytes", "GB/s", "% copy", "programs", "note"]
    rows = []
    for shape in payload["shapes"]:
        if shape.get("error"):
            rows.append([shape["dtype"], shape["V"], shape["BT"], "–", *["–"] * 6,
                         f"**error**: {shape['error'][:200]}".replace("|", "/")])  # fmt: skip
        for r in shape["rows"]:
            head = [shape["dtype"], shape["V"], shape["BT"], r["name"]]
            if r["status"] != "ok":
                rows.append([*head, "–", "–", harness.fmt_bytes(r["bytes"]), "–", "–", "–", f"**{r['status']}**: "
                             f"{r['note']}".replace("|", "/")])  # fmt: skip
                continue
            t = r["time_ms"]
            fraction = f"{100 * r['copy_fraction']:.0f}%" if r.get("copy_fraction") else "–"
            programs = ", ".join(str(p) for p in r["programs"]) if r.get("programs") else "–"
            spread = f"[{t['p20']:.3f}, {t['p80']:.3f}]"
            rows.append([*head, f"{t['median']:.3f}", spread, harness.fmt_bytes(r["bytes"]), f"{r['GBps']:.1f}",
                         fraction, programs, r["what"].replace("|", "/")])  # fmt: skip
    lines += [harness.markdown_table(headers, rows, "lrrlrrrrrrl"), ""]
    for shape in payload["shapes"]:
        ratios = [
            (label, traffic.time_ratio(shape, a, b))
            for label, a, b in (
                ("fused [l2] / fused [sms]", "fused_token_grad [l2]", "fused_token_grad [sms]"),
                ("fused [l2] / (row_stats + row_grad)", "fused_token_grad [l2]", "row_stats + row_grad"),
                ("row_grad chunk warm / cold", "row_grad, chunk warm", "row_grad, chunk cold"),
            )
        ]
        said = [f"{label} {x:.2f}" for label, x in ratios if x is not None]
        if said:
            where = f"{shape['dtype']}, V={shape['V']}, B·T={shape['BT']}"
            lines.append(f"- {where}: time ratios " + "; ".join(said) + ".")
    return "\n".join(lines) + "\n"


def ceilings_markdown(payload: dict[str, Any]) -> str:
    """The device's measured copy bandwidth and matrix-product rate, with where it ran."""
    bw, mm = payload["copy_bandwidth"], payload["matmul"]
    return (
        f"# Ceilings of {payload['device']['name']}\n\n"
        f"git {payload['git']}; versions: "
        + ", ".join(f"{k} {v}" if v else f"{k} (not installed)" for k, v in payload["versions"].items())
        + f".\n\n- copy: **{bw['GBps']:.1f} GB/s** ({harness.fmt_bytes(bw['bytes'])} copied, bytes read + written)\n"
        f"- matrix product: **{mm['TFLOPs']:.1f} TFLOP/s** ({mm['n']}³, {mm['dtype']}, random values)\n"
        + _warmup_lines(payload.get("warmup"))
    )


def _warmup_lines(warm: dict[str, Any] | None) -> str:
    """Our contenders' first calls in the env phase, which compiled their kernels for the headline phase."""
    if not warm:
        return ""
    where = f"{warm['dtype']}, V={warm['V']}, B·T={warm['BT']}"
    lines = []
    for name in ("ours", "ours_inplace"):
        r = warm.get(name, {})
        if r.get("status") == "ok":
            lines.append(f"- {name} warmed up at {where}: first call {r['first_call_s']:.1f} s (its kernels "
                         f"compiled), second {1e3 * r['second_call_s']:.1f} ms\n")  # fmt: skip
        else:
            lines.append(f"- {name} warm-up at {where} failed: {r.get('note', 'not run')}\n")
    return "".join(lines)
