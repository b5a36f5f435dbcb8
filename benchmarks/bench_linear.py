"""Fused linear GRPO (issue 7): time and peak memory of hidden states -> loss -> ∂hidden, ∂weight, side by side.
Results land in benchmarks/results/linear-<device>.{json,md}.

    python benchmarks/bench_linear.py                     # the GPU table: H ∈ {3584, 4096}, V = 151936, B·T ∈ {8192, 32768}
    python benchmarks/bench_linear.py --tiny --device cpu # the same code path at toy sizes on the CPU (a smoke test)

Contenders, all computing the same loss (the workload of bench_loss.py: dapo, beta = 0.04, clip-higher) and the
gradients of hidden and the lm_head weight, in bf16:
- materialized: logits = hidden @ weight.T (bf16, B·T x V), then grpo_kernels.grpo_loss: the baseline of the targets
  ("lm_head matmul + our logits-path loss");
- fused_linear: grpo_kernels.fused_linear_grpo_loss; fused_linear_strided: the same on hidden = last[:, :-1], the
  view a trainer passes (row blocks then follow each sequence);
- trl_chunked: TRL 1.16's ChunkedLogProbFunction (ℓ and H from hidden, in tiles), then TRL's loss math in torch;
- liger: Liger-Kernel's LigerFusedLinearGRPOLoss (no entropy: it computes less than the others).
A contender that is not installed or fails gets a row that says so.

Targets (issue 7, on an H100/H200): fused_linear peak memory ≤ 1/8 of materialized, time ≤ 1.15 x materialized.
Peak memory counts everything allocated during the call, the returned ∂hidden and ∂weight included (they are the
same size for every contender: ∂weight alone is V·H·2 bytes, 1.2 GiB at H = 4096); "transient" excludes them.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py, when run from anywhere
import harness

SEQ_LEN = 1024  # B·T is split as B sequences of 1024 completion tokens
# (B·T, H, V): the hidden widths of Qwen2.5-7B and Llama-3-8B, Qwen's vocabulary
GPU_SHAPES = [(n, h, 151936) for h in (3584, 4096) for n in (8192, 32768)]
TINY_SHAPES = [(128, 64, 1000), (256, 48, 777)]  # H not a power of two, V not a multiple of any tile


@dataclass(frozen=True)
class Workload:
    """bench_loss.py's workload: TRL 1.16's default loss type with a KL term and DAPO's clip-higher."""

    loss_type: str = "dapo"
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    temperature: float = 1.0


@dataclass
class Inputs:
    last: torch.Tensor  # [B, T+1, H] the model's final hidden states, requires grad
    hidden: torch.Tensor  # [B, T, H] contiguous copy of last[:, :-1], requires grad (a leaf)
    weight: torch.Tensor  # [V, H] lm_head, requires grad
    ids: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] float, tail padding
    old_logp: torch.Tensor  # [B, T]
    ref_logp: torch.Tensor  # [B, T]

    def zero_grad(self) -> None:
        for t in (self.last, self.hidden, self.weight):
            t.grad = None

    def grad_bytes(self) -> int:
        return sum(
            t.grad.numel() * t.grad.element_size() for t in (self.last, self.hidden, self.weight) if t.grad is not None
        )


def make_inputs(tokens: int, width: int, vocab: int, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, length = max(1, tokens // SEQ_LEN), min(tokens, SEQ_LEN)
    dtype = torch.bfloat16
    last = torch.randn(batch, length + 1, width, device=device, generator=gen).to(dtype).requires_grad_()
    hidden = last.detach()[:, :-1].contiguous().requires_grad_()
    # logits of std ~2, as a trained head gives: softmax neither flat nor one-hot
    weight = (torch.randn(vocab, width, device=device, generator=gen) * (2 / math.sqrt(width))).to(dtype)
    weight.requires_grad_()
    ids = torch.randint(0, vocab, (batch, length), device=device, generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch, 1), device=device, generator=gen)
    mask = (torch.arange(length, device=device) < lengths).float()
    with torch.no_grad():  # ratios around 1, as after one optimizer step: old/ref = current ℓ + noise
        logp = torch.empty(batch, length, device=device)
        w32 = weight.float()
        for b in range(batch):
            z = hidden[b].float() @ w32.T
            logp[b] = z.gather(-1, ids[b, :, None]).squeeze(-1) - z.logsumexp(-1)
    noise = lambda s: s * torch.randn(batch, length, device=device, generator=gen)
    return Inputs(
        last,
        hidden,
        weight,
        ids,
        torch.randn(batch, device=device, generator=gen),
        mask,
        logp + noise(0.05),
        logp + noise(0.1),
    )


def trl_loss(logp: torch.Tensor, inp: Inputs, w: Workload) -> torch.Tensor:
    """TRL 1.16's _compute_loss for the workload (token-level ratio, dapo with one process)."""
    adv = inp.advantages.unsqueeze(1)
    ratio = torch.exp(logp - inp.old_logp)
    clipped = torch.clamp(ratio, 1 - w.epsilon_low, 1 + w.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    per_token = per_token + w.beta * (torch.exp(inp.ref_logp - logp) - (inp.ref_logp - logp) - 1)
    return (per_token * inp.mask).sum() / inp.mask.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------------------------
# Contenders: each build(w, device) returns step(inp) -> loss, having run the backward.


def _build_materialized(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from grpo_kernels import grpo_loss

    backend = "triton" if device == "cuda" else "torch"

    def step(inp: Inputs) -> torch.Tensor:
        logits = inp.hidden @ inp.weight.T  # [B, T, V] bf16: the tensor the fused path never makes
        out = grpo_loss(
            logits, inp.ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, backend=backend, **asdict(w)
        )
        out.loss.backward()
        return out.loss.detach()

    return step


def _build_fused(strided: bool) -> Callable:
    def build(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
        from grpo_kernels.fused_linear import fused_linear_grpo_loss

        backend = "triton" if device == "cuda" else "torch"

        def step(inp: Inputs) -> torch.Tensor:
            hidden = inp.last[:, :-1] if strided else inp.hidden
            out = fused_linear_grpo_loss(
                hidden,
                inp.weight,
                inp.ids,
                inp.advantages,
                inp.mask,
                inp.old_logp,
                inp.ref_logp,
                backend=backend,
                **asdict(w),
            )
            out.loss.backward()
            return out.loss.detach()

        return step

    return build


def _build_trl(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # the vocabulary tile GRPOTrainer uses

    def step(inp: Inputs) -> torch.Tensor:
        batch, length, width = inp.hidden.shape
        logp, _entropy, *_ = ChunkedLogProbFunction.apply(
            inp.hidden.view(-1, width),
            inp.weight,
            None,
            inp.ids.view(-1),
            w.temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("entropy",),  # entropy: TRL logs it, as we compute it
        )
        loss = trl_loss(logp.view(batch, length), inp, w)
        loss.backward()
        return loss.detach()

    return step


def _build_liger(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled: Liger's default on the GPU (torch.compile of its loss math); the CPU dry run skips the compiler.
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=w.beta,
        use_ref_model=True,
        loss_type=w.loss_type,
        epsilon_low=w.epsilon_low,
        epsilon_high=w.epsilon_high,
        temperature=w.temperature,
        compiled=device == "cuda",
    )

    def step(inp: Inputs) -> torch.Tensor:
        out = loss_fn(
            inp.hidden,
            inp.weight,
            inp.ids,
            inp.mask,
            inp.advantages,
            ref_per_token_logps=inp.ref_logp,
            old_per_token_logps=inp.old_logp,
        )
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()

    return step


CONTENDERS: dict[str, tuple[Callable, str]] = {
    "materialized": (_build_materialized, "hidden @ W.T in bf16, then grpo_kernels.grpo_loss (the baseline)"),
    "fused_linear": (_build_fused(False), "grpo_kernels.fused_linear_grpo_loss"),
    "fused_linear_strided": (_build_fused(True), "the same on hidden = last_hidden[:, :-1] (a strided view)"),
    "trl_chunked": (_build_trl, "TRL 1.16 ChunkedLogProbFunction (ℓ, H) + TRL's loss math"),
    "liger": (_build_liger, "Liger-Kernel LigerFusedLinearGRPOLoss (computes no entropy)"),
}


# ----------------------------------------------------------------------------------------------------------------
# Measurement


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _call(step: Callable, inp: Inputs, device: str) -> tuple[float, int | None, int, float]:
    """(ms, peak bytes above the inputs or None on CPU, bytes of the gradients left, loss)."""
    inp.zero_grad()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(inp)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), torch.cuda.max_memory_allocated() - before, inp.grad_bytes(), float(loss)
    before = harness.rss_bytes()
    reset = harness.reset_peak_rss()
    t0 = time.perf_counter()
    loss = step(inp)
    ms = (time.perf_counter() - t0) * 1e3
    peak = harness.peak_rss_bytes() - before if reset else None
    return ms, peak, inp.grad_bytes(), float(loss)


def bench_contender(name: str, w: Workload, inp: Inputs, device: str, warmup: int, reps: int) -> dict[str, Any]:
    build, _ = CONTENDERS[name]
    try:
        step = build(w, device)
    except ImportError as err:
        return {"status": "missing", "why": f"{type(err).__name__}: {err}"}
    try:
        for _ in range(warmup):  # compilation and autotuning happen here, outside the timing
            _call(step, inp, device)
        calls = [_call(step, inp, device) for _ in range(reps)]
    except Exception as err:  # noqa: BLE001 - a contender's failure is a row, not the end of the run
        oom = isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)
        return {"status": "oom" if oom else "error", "why": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        inp.zero_grad()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    peaks = [c[1] for c in calls if c[1] is not None]
    peak = max(peaks) if peaks else None
    return {
        "status": "ok",
        "ms": harness.summarize_ms([c[0] for c in calls]),
        "peak_bytes": peak,
        "transient_bytes": None if peak is None else peak - calls[-1][2],
        "loss": calls[-1][3],
    }


def reference_loss(inp: Inputs, w: Workload, tokens: int) -> dict[str, Any]:
    """The float64 oracle's loss on logits = hidden @ weight.T from the same bf16 values (B·T <= 8192 only: its
    float64 (B·T, V) temporaries take ~50 GB at 8192 x 151936)."""
    if tokens > 8192:
        return {"status": "skipped", "why": "B·T > 8192: the float64 logits would not fit"}
    sys.path.insert(0, str(harness.REPO_ROOT))
    try:
        from reference import reference_grpo_loss

        with torch.no_grad():
            logits = inp.hidden.detach().double() @ inp.weight.detach().double().T
            out = reference_grpo_loss(
                logits, inp.ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, **asdict(w)
            )
            return {"status": "ok", "loss": float(out.loss)}
    except Exception as err:  # noqa: BLE001 - e.g. out of memory on an 80 GB card: the table says so
        return {"status": "error", "why": f"{type(err).__name__}: {str(err)[:200]}"}
    finally:
        logits = out = None
        gc.collect()
        if inp.hidden.is_cuda:
            torch.cuda.empty_cache()


def ratios(row: dict[str, Any], name: str) -> dict[str, float | None]:
    """name / materialized, for time, peak and transient memory."""
    ours, base = row["contenders"].get(name, {}), row["contenders"].get("materialized", {})
    if ours.get("status") != "ok" or base.get("status") != "ok":
        return {"time": None, "peak": None, "transient": None}
    div = lambda a, b: None if a is None or not b else a / b
    return {
        "time": div(ours["ms"]["median"], base["ms"]["median"]),
        "peak": div(ours["peak_bytes"], base["peak_bytes"]),
        "transient": div(ours["transient_bytes"], base["transient_bytes"]),
    }


def to_markdown(payload: dict[str, Any]) -> str:
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
            "without them. TFLOP/s counts the 3 GEMMs any path needs (logits, ∂hidden, ∂weight: 6·N·V·H). Rel. err: the "
            "loss against the float64 oracle on the same bf16 inputs (B·T <= 8192); paths that round the logits to bf16 "
            "sit near 1e-4, the fused path keeps them in fp32."
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
        fmt = lambda x: "–" if x is None else f"{x:.3f}"
        rrows.append(
            [
                row["tokens"],
                row["width"],
                fmt(r["time"]),
                fmt(r["peak"]),
                fmt(r["transient"]),
                fmt(row["ratios"]["fused_linear_strided"]["time"]),
            ]
        )
    lines += [
        harness.markdown_table(
            ["B·T", "H", "time ratio", "peak ratio", "transient ratio", "time ratio (strided hidden)"], rrows, "rrrrrr"
        ),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy shapes: exercise every code path in seconds")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; 1 with --tiny)")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 5; 2 with --tiny)")
    p.add_argument("--budget-s", type=float, default=240.0, help="no new shape starts after this many seconds")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS)
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.warmup = (1 if args.tiny else 2) if args.warmup is None else args.warmup
    args.reps = (2 if args.tiny else 5) if args.reps is None else args.reps
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_linear: no CUDA device; run with --tiny --device cpu for the dry run")
        return 2
    names = [n for n in args.contenders.split(",") if n]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contender(s) {sorted(unknown)}; choose from {list(CONTENDERS)}")
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    w = Workload()
    dev = harness.device_info(args.device)
    payload: dict[str, Any] = {
        "benchmark": "fused linear GRPO loss (issue 7)",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": harness.git_revision(),
        "versions": harness.versions(),
        "device": dev,
        "tiny": args.tiny,
        "workload": asdict(w),
        "contenders": {n: CONTENDERS[n][1] for n in names},
        "rows": [],
    }
    stem = harness.RESULTS_DIR / f"linear-{harness.device_slug(dev)}"
    t_start = time.perf_counter()
    for tokens, width, vocab in shapes:
        row: dict[str, Any] = {"tokens": tokens, "width": width, "vocab": vocab, "contenders": {}}
        if time.perf_counter() - t_start > args.budget_s:
            row["contenders"] = {
                n: {"status": "skipped", "why": f"time budget {args.budget_s:.0f} s spent"} for n in names
            }
        else:
            inp = make_inputs(tokens, width, vocab, args.device)
            row["reference"] = reference_loss(inp, w, tokens)
            for name in names:
                res = bench_contender(name, w, inp, args.device, args.warmup, args.reps)
                row["contenders"][name] = res
                shown = (
                    f"{res['ms']['median']:.2f} ms, peak {harness.fmt_bytes(res['peak_bytes'])}"
                    if res["status"] == "ok"
                    else res["status"] + ": " + res.get("why", "")[:200]
                )
                print(f"bench_linear: N={tokens} H={width} V={vocab} {name}: {shown}", flush=True)
            del inp
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        row["ratios"] = {n: ratios(row, n) for n in ("fused_linear", "fused_linear_strided")}
        payload["rows"].append(row)
        harness.write_json(stem.with_suffix(".json"), payload)  # after every shape: a killed run keeps what it had
    harness.write_text(stem.with_suffix(".md"), to_markdown(payload))
    print(to_markdown(payload))
    print(f"bench_linear: wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
