"""The performance model of docs/performance.md, read off the sm_90a compile at the vocabularies of real models.

For each Triton (3.6 and newer, as in test_hopper_compile.py), each reference device (H100: 132 SMs, 50 MiB L2; H200:
132 SMs, 60 MiB L2 as torch reports it), bf16 and fp32 logits, B·T = 16384 rows and each vocabulary of VOCABS, the
four row kernels are compiled with the launch plan the launcher picks on that device (each distinct plan once: the
plan, not V, decides the code). From the compile:
- bytes in flight per SM = resident programs x bytes in flight per program / SMs (PTX: cp.async groups outstanding x
  bytes per group), averaged over all SMs; target IN_FLIGHT_PER_SM (32 KiB): by Little's law 4.3 TB/s at 1 µs;
- the instruction-issue bound: SASS instructions one warp issues per row (the tile loops' common path per tile,
  the target's tile once, the peeled tail as one more tile plus its mask), 4 warp instructions per cycle per SM
  at 1.98 GHz, over min(grid, SMs) busy SMs, as the DRAM traffic it allows (read, plus the gradient write where
  there is one); target ISSUE_MARGIN x the copy rate (5.4 TB/s);
- for the fused kernel, the L2 trade: the rows in flight of each grid, the share of pass-2 reads that miss L2 when
  they exceed L2_FRACTION of it (assumed linear: 1 − budget/rows in flight), and the predicted time of both grids
  (DRAM time with the misses against issue time at 1/ISSUE_MARGIN efficiency); the launcher's default grid must be
  the faster prediction, and the L2-sized grid must keep its rows within the budget.
Every figure is a prediction from the compile; `pytest -s` prints the tables.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from grpo_kernels.ops import triton_logits

from ..once import computed_once
from . import hopper_aot, sass_model
from .test_hopper_compile import _require_aot, site_id, triton_sites

TOKENS = 16384  # B·T of the benchmark's headline shapes
VOCABS = (
    32000,  # Llama-2
    32768,  # Mistral: exactly 8 tiles, no tail
    50257,  # GPT-2: odd, so the loads cannot be proven 16-byte aligned (V is not divisible by 16)
    50304,  # GPT-NeoX / padded GPT-2
    128256,  # Llama-3
    129280,  # DeepSeek-V3
    151936,  # Qwen2.5 / Qwen3
    152064,  # Qwen2 (72B)
    262144,  # Gemma-3
)
DTYPES = ("bf16", "fp32")
DEVICES = (("H100", 50 << 20, "50 MiB"), ("H200", 60 << 20, "60 MB"))  # L2 as torch reports it
COPY_BANDWIDTH = triton_logits.COPY_BANDWIDTH  # B/s: the copy rate measured on an H200 (132 SMs)
ISSUE_MARGIN = triton_logits.ISSUE_MARGIN  # the issue bound must clear the copy rate by this much
LATENCY = 0.7e-6  # s: loaded DRAM latency
CLOCK = 1.98e9  # Hz: H100/H200 SXM boost clock; each SM issues 4 warp instructions per cycle
# The full model's assumptions, at their pessimistic end (docs/performance.md, section 6).
SUSTAINED_CLOCK = 1.755e9  # Hz: a sustained clock under load (the boost clock is 1.98 GHz)
DRAM_LATENCY = 0.8e-6  # s: a loaded DRAM access
L2_LATENCY = 0.4e-6  # s: an L2 hit under load
FUSED = "fused_token_grad_fwd_kernel"
KERNELS = (  # (label, kernel, flags, DRAM bytes per logit byte counted by the bound)
    ("stats", "row_stats_fwd_kernel", {"ALIGNED": True}, 1),
    ("grad+H", "row_grad_kernel", {"HAS_ENT": True, "ALIGNED": True}, 2),
    ("fused clip all", FUSED, {"LOSS": 0, "ALIGNED": True, **dict.fromkeys(hopper_aot.FUSED_FLAGS, True)}, 2),
    ("shard partials", "shard_partials_fwd_kernel", {"ALIGNED": True}, 1),
)


def modern_sites() -> list[str | None]:
    """The Tritons the model is asserted on: the environment's and each GRPO_KERNELS_TRITON_SITES folder of 3.6 or
    newer (3.5 stays in the register/spill test of test_hopper_compile.py)."""
    return [s for s in triton_sites() if s is None or "triton-3.5" not in s]


def _plan(kernel: str, dtype: str, vocab: int, l2: int, grid: str | None, flags: dict) -> tuple:
    """What decides the compiled code of one launch: the block config, the launch heuristics' stages and register
    cap on this device (as the kernels' own heuristics compute them), the flags, V's alignment, and for the fused
    kernel whether its pass 2 wraps (`ROTATE`)."""
    import torch

    x = torch.empty(0, dtype=getattr(torch, hopper_aot.TORCH_DTYPES[dtype]))
    saved = triton_logits.REFERENCE_L2_BYTES, triton_logits.FUSED_GRID
    triton_logits.REFERENCE_L2_BYTES, triton_logits.FUSED_GRID = l2, grid
    try:
        split = 1
        if kernel == FUSED:  # its plan, row split (a constexpr: V's) and ROTATE, as the launcher picks them
            block_v, warps, split = hopper_aot.fused_layout(triton_logits, vocab, dtype, flags, False,
                                                            {"kernel": kernel})  # fmt: skip
        else:
            block_v, warps = triton_logits._block_config(vocab, False, hopper_aot.narrow_plan(kernel, dtype))
        args = {"x_ptr": x, "BLOCK_V": block_v, "V": vocab, "num_warps": warps, "ALIGNED": flags.get("ALIGNED", True),
                "HEAD": flags.get("HEAD", False), "SPLIT": split}  # fmt: skip
        stages, maxnreg = triton_logits._launch_plan(args, two_pass=kernel == FUSED)
        if split > 1:
            window = triton_logits._split_window(vocab, x.element_size(), block_v, warps, split,
                                                 triton_logits.REFERENCE_SMS, l2)  # fmt: skip
        else:
            window = triton_logits._pass2_tiles(vocab, x.element_size(), block_v, warps, triton_logits.REFERENCE_SMS,
                                                l2)  # fmt: skip
        rotate = kernel == FUSED and triton_logits._rotates(window, -(-vocab // split), block_v)
    finally:
        triton_logits.REFERENCE_L2_BYTES, triton_logits.FUSED_GRID = saved
    return (kernel, dtype, block_v, warps, stages, maxnreg, vocab % 16 == 0, rotate, split,
            tuple(sorted(flags.items())))  # fmt: skip


def configs_for(site: str | None) -> tuple[list[dict], list[dict]]:
    """(distinct compiles, model rows): each model row names the compile it reads by `plan`."""
    compiles: dict[tuple, dict] = {}
    rows = []
    for device, l2, l2_name in DEVICES:
        for dtype in DTYPES:
            for vocab in VOCABS:
                for label, kernel, flags, dram in KERNELS:
                    # a contiguous (B, T, V) tensor's rows: aligned, or realigned from their 16-element boundary
                    flags = {**flags, "ALIGNED": vocab % 16 == 0, "HEAD": vocab % 16 != 0}
                    grids = ("default", "sms", "l2") if kernel == FUSED else ("default",)
                    for grid in grids:
                        mode = None if grid == "default" else grid
                        key = _plan(kernel, dtype, vocab, l2, mode, flags)
                        if key not in compiles:
                            compiles[key] = hopper_aot.config(
                                label, kernel, dtype, vocab, flags, l2_bytes=l2, grid=mode
                            )
                        row = {"device": device, "l2": l2, "l2_name": l2_name, "label": label, "kernel": kernel}
                        rows.append(
                            {**row, "dtype": dtype, "vocab": vocab, "grid_mode": grid, "dram": dram, "plan": key}
                        )
    return list(compiles.values()), rows


COMPILED_KEYS = ("regs", "smem", "num_stages", "maxnreg", "tail_slots", "group", "spill_stores", "spill_loads",
                 "triton", "cache")  # fmt: skip


def predict(row: dict, compiled: dict, sms: int = triton_logits.REFERENCE_SMS, **device) -> dict:
    """The model of one (device, kernel, dtype, V, grid) from its compile; `device`: row_model's clock and copy
    rate where they are not the Hopper ones."""
    l2 = row["l2"]
    elem = hopper_aot.ELEMENT_BYTES[row["dtype"]]
    vocab, block_v, warps = row["vocab"], compiled["block_v"], compiled["num_warps"]
    row_bytes = vocab * elem
    two_pass = row["kernel"] == FUSED
    mode = None if row["grid_mode"] == "default" else row["grid_mode"]
    split = compiled.get("split", 1)  # the fused kernel's row split (`_default_split`): SPLIT programs per row
    if split > 1:
        grid = triton_logits._split_grid(TOKENS, split, elem, block_v, warps, sms)
    else:
        grid = triton_logits._grid_size(TOKENS, vocab, elem, two_pass, sms, l2, warps, mode)
    occupancy = hopper_aot.programs_per_sm(compiled["regs"], warps, compiled["smem"])
    resident = min(grid, sms * occupancy)
    in_flight = resident // split  # rows
    # The tile loops are the software-pipelined ones (the tail and dead-row loops are short or load nothing).
    pipelined = [lp["bytes_per_program"] for lp in compiled["loops"] if lp["pipelined"]]
    per_program = min(pipelined) if pipelined else 0
    # Each pass is one tile loop: over every tile, the last one overlapping the one before (`_tail_tile`), or over
    # the full tiles, the ragged tail then one masked tile outside the loop (`_load_tail`: counted with the row's
    # other code, on the walked path).
    loops = compiled["sass_loops"]
    passes = 2 if two_pass else 1
    assert len(loops) == passes, f"expected one tile loop per pass: {loops}"
    per_thread = block_v // (32 * warps)  # logits per thread per tile
    trips = _tile_trips(compiled, vocab, passes, split)
    per_row = 0.0
    for lp, n in zip(loops, trips, strict=True):
        per_row += n * lp["instructions"] + (lp["once"] if n else 0)
    cycles_per_row = per_row * warps / 4
    busy = min(resident, sms)
    issue = busy * row_bytes / split * CLOCK / cycles_per_row * row["dram"]
    out = {
        **row,
        **{k: compiled[k] for k in COMPILED_KEYS},
        "block_v": block_v,
        "warps": warps,
        "grid": grid,
        "occupancy": occupancy,
        "resident": resident,
        "flight_program": per_program,
        "flight_sm": resident * per_program / sms,
        "sass_per_tile": [lp["instructions"] for lp in loops],
        "once": [lp["once"] for lp in loops],
        "ex2": [lp["ex2"] for lp in loops],
        "vec": 16 // elem,
        "per_thread": per_thread,
        "issue": issue,
        "issue_per_sm": issue / busy,
        "l2_set": in_flight * row_bytes if two_pass else None,
        "split": split,
        "in_flight": in_flight,
    }
    # A split program's row is its slice: row_model's floor bytes, and its rows in flight (resident programs x
    # slice bytes = rows in flight x row bytes) for pass 2's misses, each program walking grid / split rows' slices.
    sliced = {**row, "vocab": vocab / split}
    out.update(row_model(sliced, compiled, grid // split, resident, trips, sms=sms, **device))
    if two_pass:
        budget = triton_logits.L2_FRACTION * l2
        miss = max(0.0, 1.0 - budget / out["l2_set"])
        floor = 2 * row_bytes  # read + gradient write per row: the traffic floor
        dram_time = floor * (1 + miss / 2) / COPY_BANDWIDTH  # a missed pass-2 read is a second read of the row
        out["miss"] = miss
        # Issue at 1 / ISSUE_MARGIN efficiency (the margin the issue target leaves for it), against DRAM time.
        out["predicted"] = floor / max(dram_time, floor * ISSUE_MARGIN / issue)  # floor bytes per second
    return out


def _tile_trips(compiled: dict, vocab: int, passes: int, split: int = 1) -> list[int]:
    """Trips of each pass's tile loop: over the full tiles where a masked tail tile follows the loop (`tail_slots`),
    else over every tile, the last one overlapping; of a row split in `split`, over its longest slice (the
    programs of a row wait for each other once per row, so the longest sets the pace)."""
    block_v = compiled["block_v"]
    tiles = vocab // block_v if compiled["tail_slots"] else -(-vocab // block_v)
    return [-(-tiles // split)] * passes


def row_model(row: dict, compiled: dict, grid: int, resident: int, trips: list[int],
              clock: float = SUSTAINED_CLOCK, copy: float = COPY_BANDWIDTH, sms: int = triton_logits.REFERENCE_SMS,
              mufu_per_clk: float = sass_model.MUFU_PER_CLK) -> dict:  # fmt: skip
    """Everything a row costs, from the SASS (tests/ops/sass_model.py): the instructions one warp issues per row (the
    program's setup shared by its rows, the row loop with its tile loops at their trips), the pipe bounds they give
    (issue 4/clk/SM, MUFU 16 lanes/clk/SM, ALU 64 lanes/clk/SM), and the latency bound: the time one CTA takes per
    row on the timeline of sass_model.simulate, overlapped across the resident CTAs. Pass 2's loads take the L2
    latency for the share of the row still in L2, DRAM latency for the rest, and its misses cost DRAM traffic."""
    two_pass = row["kernel"] == FUSED
    rows_per_program = -(-TOKENS // grid)
    row_bytes = row["vocab"] * hopper_aot.ELEMENT_BYTES[row["dtype"]]
    miss = max(0.0, 1.0 - triton_logits.L2_FRACTION * row["l2"] / (resident * row_bytes)) if two_pass else 0.0
    key = (tuple(trips), rows_per_program, miss, clock)
    timelines = compiled.setdefault("timelines", {})  # the same compile at the same trips: walked once
    if key not in timelines:
        timelines[key] = _timeline(compiled, trips, rows_per_program, miss, clock, two_pass)
    row_cycles, per_row, loop_instr, leads, regions = timelines[key]
    warps = compiled["num_warps"]
    busy = min(resident, sms)
    floor = row_bytes * row["dram"]

    def rate(warp_instr: float, per_clk: float) -> float:
        return busy * per_clk * clock / (warp_instr * warps) * floor if warp_instr else float("inf")

    out = {
        "per_row": per_row,
        "outside_loops": per_row["issue"] - loop_instr,
        "leads": leads,
        "row_cycles": row_cycles,
        "row_regions": regions,
        "full_issue": rate(per_row["issue"], sass_model.ISSUE_PER_CLK),
        "full_mufu": rate(per_row["mufu"], mufu_per_clk),
        "full_alu": rate(per_row["alu"], sass_model.ALU_PER_CLK),
        "full_latency": resident * floor * clock / row_cycles,
        "full_dram": copy * floor / (floor + miss * row_bytes),
        "full_miss": miss,
    }
    out["full_min"] = min(out[k] for k in ("full_issue", "full_mufu", "full_alu", "full_latency", "full_dram"))
    out["binding"] = min(("issue", "mufu", "alu", "latency", "dram"), key=lambda k: out[f"full_{k}"])
    return out


def _timeline(compiled: dict, trips: list[int], rows_per_program: int, miss: float, clock: float, two_pass: bool):
    """(cycles per row, warp instructions per row by pipe, those in the tile loops, each tile loop's lead)."""
    if "instructions" not in compiled:  # parsed once per compile, its properties read once
        compiled["instructions"] = sass_model.expand(compiled["sass_code"])
    code = compiled["instructions"]
    st = sass_model.structure(code)
    simulated = min(rows_per_program, 3)
    seq, starts, off = sass_model.walk_rows(code, trips, simulated)
    dram_cycles, l2_cycles = DRAM_LATENCY * clock, L2_LATENCY * clock
    # after pass 1's last tile loop: the row re-read
    pass2_from = st.tile_loops[len(st.tile_loops) // 2 - 1][1] if two_pass else len(code)

    def latency(i: int) -> float:
        if ".STRONG." in code[i].text:  # a row split's exchange (`_split_row_scan`): words just stored, in L2
            return l2_cycles
        return (1 - miss) * l2_cycles + miss * dram_cycles if pass2_from < i < st.row_back else dram_cycles

    share = max(1, compiled["num_warps"] // 4)  # the CTA's warps per scheduler
    times = sass_model.simulate(code, seq, share, latency, off)
    ends = [*starts[1:], len(seq)]
    setup_t, first_t = times[starts[0]], times[ends[0]] - times[starts[0]]
    steady_t = (times[ends[-1]] - times[ends[0]]) / (simulated - 1) if simulated > 1 else first_t
    row_cycles = (setup_t + first_t + (rows_per_program - 1) * steady_t) / rows_per_program
    counts = sass_model.pipe_counts(code, seq[starts[-1] : ends[-1]])
    setup = sass_model.pipe_counts(code, seq[: starts[0]])
    per_row = {k: counts[k] + setup[k] / rows_per_program for k in counts}
    loop_instr = sum(1 for i in seq[starts[-1] : ends[-1]] if st.tile_loop_at[i] is not None)
    leads = [sass_model.pipelined_lead(code, lp) for lp in st.tile_loops]
    regions = sass_model.row_regions(code, st.tile_loops, seq, times, starts[-1], ends[-1], share)
    return row_cycles, per_row, loop_instr, leads, regions


def print_full_model(
    rows: list[dict], device: str, copy: float = COPY_BANDWIDTH, clock: float = SUSTAINED_CLOCK
) -> None:
    first = rows[0]
    print(
        f"\nFull row model, Triton {first['triton']}, {device}, B·T = {TOKENS}; assumptions: clock "
        f"{clock / 1e9:.3f} GHz, DRAM latency {DRAM_LATENCY * 1e6:.1f} µs, L2 hit {L2_LATENCY * 1e6:.1f} µs, "
        f"copy rate {copy / 1e12:.2f} TB/s, issue 4/clk/SM, MUFU 16/clk/SM, ALU 64/clk/SM, barrier "
        f"{sass_model.BARRIER} cycles; TB/s of floor traffic (predictions)"
    )
    print(f"{'kernel':<16}{'dtype':<6}{'V':>7}{'grid':>7}{'CTA/SM':>7}{'stages':>7}{'SASS/tile':>10}{'per row':>9}"
          f"{'outside':>8}{'lead':>10}{'issue':>7}{'MUFU':>7}{'ALU':>7}{'latency':>8}{'DRAM':>7}{'min':>7}"
          "  bound")  # fmt: skip
    for m in rows:
        leads = "/".join(f"{x:.2f}" for x in m["leads"] if x is not None) or "-"
        print(
            f"{m['label']:<16}{m['dtype']:<6}{m['vocab']:>7}{m['grid']:>7}{m['occupancy']:>7}{m['num_stages']:>7}"
            f"{'+'.join(map(str, m['sass_per_tile'])):>10}{m['per_row']['issue']:>9.0f}{m['outside_loops']:>8.0f}"
            f"{leads:>10}{m['full_issue'] / 1e12:>7.2f}{m['full_mufu'] / 1e12:>7.2f}{m['full_alu'] / 1e12:>7.2f}"
            f"{m['full_latency'] / 1e12:>8.2f}{m['full_dram'] / 1e12:>7.2f}{m['full_min'] / 1e12:>7.2f}  {m['binding']}"
        )


def print_row_timeline(rows: list[dict], device: str, copy: float = COPY_BANDWIDTH,
                       clock: float = SUSTAINED_CLOCK) -> None:  # fmt: skip
    """Where a steady row of the fused kernel spends its cycles on the timeline (sass_model.row_regions), against the
    cycles a row may take at the copy rate with the resident programs (predictions)."""
    print(f"\nFused kernel's row timeline, {device} (cycles per row; issue + stall + wait per region)")
    for m in rows:
        if m["kernel"] != FUSED:
            continue
        floor = m["vocab"] * hopper_aot.ELEMENT_BYTES[m["dtype"]] * m["dram"] / m["split"]  # as row_model counts it
        budget = m["resident"] * floor * clock / copy
        parts = ", ".join(
            f"{name} {sum(c.values()):.0f} ({c['issue']:.0f}+{c['stall']:.0f}+{c['wait']:.0f})"
            for name, c in m["row_regions"].items()
        )
        print(f"  {m['dtype']} V={m['vocab']}: {sum(sum(c.values()) for c in m['row_regions'].values()):.0f} "
              f"(copy rate: {budget:.0f}): {parts}")  # fmt: skip


def print_model(rows: list[dict]) -> None:
    first = rows[0]
    print(
        f"\nPerformance model, Triton {first['triton']}, sm_90a, B·T = {TOKENS}, 132 SMs, L2 {first['l2_name']} "
        f"({first['device']}); issue TB/s: the DRAM traffic the instruction issue allows, target >= "
        f"{ISSUE_MARGIN * COPY_BANDWIDTH / 1e12:.1f}"
    )
    print(f"{'kernel':<16}{'dtype':<6}{'V':>7}{'grid':>11}{'stages':>7}{'regs':>5}{'smem KiB':>9}{'CTA/SM':>7}"
          f"{'resident':>9}{'KiB/SM':>8}{'L2 MiB':>8}{'miss':>6}{'SASS/tile':>10}{'issue TB/s':>11}")  # fmt: skip
    for m in rows:
        l2 = "-" if m["l2_set"] is None else f"{m['l2_set'] / 2**20:.1f}"
        miss = "-" if m["l2_set"] is None else f"{m['miss']:.2f}"
        grid = f"{m['grid']}" + ("" if m["kernel"] != FUSED else f" {m['grid_name']}")
        print(
            f"{m['label']:<16}{m['dtype']:<6}{m['vocab']:>7}{grid:>11}{m['num_stages']:>7}{m['regs']:>5}"
            f"{m['smem'] / 1024:>9.1f}{m['occupancy']:>7}{m['resident']:>9}{m['flight_sm'] / 1024:>8.1f}{l2:>8}"
            f"{miss:>6}{'+'.join(map(str, m['sass_per_tile'])):>10}{m['issue'] / 1e12:>11.2f}"
        )


# The target, per kernel and shape: min(issue, MUFU, ALU, latency, DRAM) of the full row model at least the copy
# rate, on each device and Triton (docs/performance.md, section 4). The split plan's rows (`_split_plan`: V > 65536,
# two 8-warp programs per SM, each row split so that its rows in flight fit L2) hide most of the waits each slice
# repeats (pass starts, reductions, the exchange) behind the SM's other program, and miss nothing in pass 2.
def _below(model: list[dict]) -> list[tuple]:
    """The shapes of the launcher's default plans whose full model is below the copy rate."""
    return [(m["triton"], m["device"], m["label"], m["dtype"], m["vocab"], round(m["full_min"] / 1e12, 2), m["binding"])
            for m in model if m["grid_mode"] == "default" and m["full_min"] < COPY_BANDWIDTH * (1 - 1e-9)]  # fmt: skip


@pytest.mark.slow  # the first test of `model`: it computes the model, so it starts first
def test_every_row_meets_the_copy_rate(model):
    """Everything a row costs (tests/ops/sass_model.py: every SASS instruction of the row at its trips, the pipe
    bounds, the timeline of waits, the resident CTAs' overlap, pass 2's L2 misses), at the pessimistic end of the
    assumptions: min(issue, MUFU, ALU, latency, DRAM) >= the copy rate, for every kernel, dtype, vocabulary and
    device."""
    below = _below(model)
    assert not below, f"below the copy rate ({COPY_BANDWIDTH / 1e12} TB/s): {below}"


def test_in_flight_target_follows_littles_law():
    """32 KiB per SM over 132 SMs covers the copy rate at 0.7 µs with 40 % to spare (22.8 KB needed)."""
    needed = COPY_BANDWIDTH * LATENCY / triton_logits.REFERENCE_SMS
    assert 1.3 * needed <= triton_logits.IN_FLIGHT_PER_SM <= 2 * needed


@pytest.fixture(scope="module", params=modern_sites(), ids=site_id)  # ~25 s per Triton on a quiet 2-core machine
def model(request, aot_cache) -> list[dict]:
    """The model of every row on one Triton, computed once per test run: the xdist worker that comes second, or a
    later setup of this fixture, reads it back from the run's cache (test_every_row_meets_the_copy_rate, marked
    slow, starts first; tests/conftest.py)."""
    site = request.param
    _require_aot(site)
    out = computed_once(aot_cache, f"performance-model-{site_id(site)}", lambda: _model(site, aot_cache))
    for device, _, _ in DEVICES:
        print_model([m for m in out if m["device"] == device and m["grid_mode"] == "default"])
        print_full_model([m for m in out if m["device"] == device and m["grid_mode"] == "default"], f"sm_90a, {device}")
        print_row_timeline([m for m in out if m["device"] == device and m["grid_mode"] == "default"], device)
    return out


def _model(site: str | None, aot_cache: Path) -> list[dict]:
    compiles, rows = configs_for(site)
    by_plan = {}
    results = hopper_aot.compile_rows(compiles, site, sass=True, cache=aot_cache)
    for cfg, compiled in zip(compiles, results, strict=True):
        by_plan[_plan(cfg["kernel"], cfg["dtype"], cfg["vocab"], cfg["l2_bytes"], cfg["grid"], cfg["flags"])] = compiled
    out = [predict(row, by_plan[row["plan"]]) for row in rows]
    for m in out:  # which grid the default is, for the table
        if m["kernel"] == FUSED:
            same = [o for o in out if o["kernel"] == FUSED and o["device"] == m["device"] and o["dtype"] == m["dtype"]
                    and o["vocab"] == m["vocab"] and o["grid_mode"] == "l2"]  # fmt: skip
            m["grid_name"] = "l2" if same and same[0]["grid"] == m["grid"] else "sms"
    return out


def test_tile_loops_do_one_exp2_per_logit(model):
    """The common path of each tile loop holds all of its work: one exp2 per logit of the thread (pass 1: one
    more per accumulator of the thread, the rescale: one per thread, or one per slot where GROUP is 1), so the
    instructions counted once per row cannot hide per-tile work. ptxas may recompute one exp2 in the loop rather
    than hold it in a register (Triton 3.6, the fused kernel at bf16 V = 50257 under its 168-register cap): one
    more per loop is allowed, and counted in the model like any other instruction of the loop."""
    wrong = []
    for m in model:
        slots = m["per_thread"] // m["vec"] // m["group"]  # each accumulator's rescale in pass 1 (`_group`)
        expected = [m["per_thread"] + slots, m["per_thread"]] if m["kernel"] == FUSED else [m["per_thread"] + slots]
        if m["kernel"] == "row_grad_kernel":
            expected = [m["per_thread"]]
        if len(m["ex2"]) != len(expected) or not all(e <= n <= e + 1 for n, e in zip(m["ex2"], expected)):
            wrong.append((m["label"], m["dtype"], m["vocab"], m["ex2"], expected))
    assert not wrong, f"tile loops with another exp2 count than one per logit: {wrong}"


def test_launcher_issue_figures_match_the_compile(model):
    """The fused grid's default comes from the launcher's own issue figures (FUSED_ISSUE_BYTES_PER_SM): they stay
    within 20 % of what each compiled plan gives per busy SM, wherever the two grids differ."""
    off = []
    for m in model:
        alternatives = {o["grid"] for o in model if o["kernel"] == FUSED and _same_shape(o, m)}
        if m["kernel"] != FUSED or len(alternatives) < 2:  # one grid either way: the figure decides nothing
            continue
        planned = triton_logits.FUSED_ISSUE_BYTES_PER_SM[hopper_aot.ELEMENT_BYTES[m["dtype"]]]
        if not 0.8 <= m["issue_per_sm"] / planned <= 1.2:
            off.append((m["dtype"], m["vocab"], m["grid_mode"], round(m["issue_per_sm"] / 1e9, 1), planned / 1e9))
    assert not off, f"compiled issue per SM (GB/s) far from FUSED_ISSUE_BYTES_PER_SM: {off}"


def _same_shape(a: dict, b: dict) -> bool:
    return (a["device"], a["dtype"], a["vocab"], a["triton"]) == (b["device"], b["dtype"], b["vocab"], b["triton"])


def test_no_spills_and_bytes_in_flight(model):
    spilled = [(m["label"], m["dtype"], m["vocab"], m["grid_mode"], m["spill_stores"], m["spill_loads"])
               for m in model if m["spill_stores"] or m["spill_loads"]]  # fmt: skip
    assert not spilled, f"register spills: {spilled}"
    short = [(m["device"], m["label"], m["dtype"], m["vocab"], m["grid_mode"], round(m["flight_sm"])) for m in model
             if m["flight_sm"] < triton_logits.IN_FLIGHT_PER_SM]  # fmt: skip
    assert not short, f"fewer than {triton_logits.IN_FLIGHT_PER_SM} bytes in flight per SM: {short}"
    # The register ceiling of the launch plan holds the residency the pipeline depth was sized for.
    under = []
    for m in model:
        mode = None if m["grid_mode"] == "default" else m["grid_mode"]
        planned = triton_logits._pipeline(m["block_v"], hopper_aot.ELEMENT_BYTES[m["dtype"]], m["vocab"],
                                          m["kernel"] == FUSED, triton_logits.REFERENCE_SMS, m["l2"], m["warps"],
                                          mode)[1]  # fmt: skip
        if m["occupancy"] < planned:
            under.append((m["label"], m["dtype"], m["vocab"], m["grid_mode"], m["occupancy"], planned))
    assert not under, f"fewer resident programs per SM than planned: {under}"


def pass2_hits(window: float, in_flight: float, budget: float) -> dict:
    """The share of the fused kernel's pass-2 reads that find their line in L2, for a pass 2 that takes the last
    `window` of the row first (`triton_logits.pass2_window`; 1: row order), `in_flight` bytes of rows in flight and
    `budget` bytes of L2 for them. A tile waits for its re-read while every program reads on in pass 1: the window's
    tiles for window x in_flight / 2 bytes of them, the others for (1 + window) x in_flight / 2. Under LRU a tile
    hits while that fits the budget; under random replacement with probability exp(−that / budget). The model
    assumes the share linear in the budget (`row_model`)."""
    near, far = window * in_flight / 2, (1 + window) * in_flight / 2
    return {
        "linear": min(1.0, budget / in_flight),
        "lru": window * (near <= budget * (1 + 1e-9)) + (1 - window) * (far <= budget * (1 + 1e-9)),
        "random": window * math.exp(-near / budget) + (1 - window) * math.exp(-far / budget),
    }


def test_pass2_window_hits(model):
    """The order of pass 2 the launcher picks (`pass2_window`) finds at least as many of its re-reads in L2 as row
    order, under LRU and under random replacement, at every fused row of the default grid; and the model's linear
    share lies between the two rules, so that neither an LRU-like nor a random L2 would make it look pessimistic or
    flattering by more than the two bounds the table prints."""
    rows, worse, outside = {}, [], []
    for m in model:
        if m["kernel"] == FUSED and m["grid_mode"] == "default":
            rows[(m["device"], m["dtype"], m["vocab"])] = m
    print("\nPass 2's L2 hits (share of its reads; predictions): the launcher's order against row order")
    print(f"{'device':<7}{'dtype':<6}{'V':>7}{'MiB':>7}{'window':>7}{'model':>7}{'LRU':>12}{'random':>12}")
    for (device, dtype, vocab), m in sorted(rows.items()):
        row_bytes = vocab * hopper_aot.ELEMENT_BYTES[dtype]
        window = triton_logits.pass2_window(m["in_flight"], row_bytes, m["l2"])
        budget = triton_logits.L2_FRACTION * m["l2"]
        ours, plain = pass2_hits(window, m["l2_set"], budget), pass2_hits(1.0, m["l2_set"], budget)
        if any(ours[k] < plain[k] - 1e-9 for k in ("lru", "random")):
            worse.append((device, dtype, vocab, window, ours, plain))
        if not ours["random"] - 1e-9 <= ours["linear"] <= ours["lru"] + 1e-9:
            outside.append((device, dtype, vocab, ours))
        print(f"{device:<7}{dtype:<6}{vocab:>7}{m['l2_set'] / 2**20:>7.1f}{window:>7.2f}{ours['linear']:>7.2f}"
              f"{ours['lru']:>6.2f}/{plain['lru']:<5.2f}{ours['random']:>6.2f}/{plain['random']:<5.2f}")  # fmt: skip
    assert rows, "no fused rows in the model"
    assert not worse, f"the launcher's pass-2 order finds fewer re-reads in L2 than row order: {worse}"
    assert not outside, f"the model's linear hit share outside the LRU and random bounds: {outside}"


# The launcher judges the L2-sized grid's issue with one figure per element size (FUSED_ISSUE_BYTES_PER_SM), and
# the Tritons' compiles differ by about 3 %: a grid whose compiled issue bound clears the target by less than that
# may go either way.
GRID_DEAD_BAND = 1.03


def test_fused_grid_trade(model):
    """The L2-sized grid keeps its rows within L2_FRACTION of L2; the default grid is the faster of the two
    predictions (within 2 %) among those whose issue bound clears the target (by GRID_DEAD_BAND) and that leave at
    most L2_GRID_IDLE of the SMs idle: the issue rate of the SMs the L2-sized grid leaves idle against the DRAM
    traffic of the full grid's misses. It is also the
    faster of the two (within 2 %) by the full row model, whose latency bound the launcher's trade leaves out."""
    fused = [m for m in model if m["kernel"] == FUSED]
    over = [(m["device"], m["dtype"], m["vocab"], round(m["l2_set"] / 2**20, 1)) for m in fused
            if m["grid_mode"] == "l2" and m["l2_set"] > triton_logits.L2_FRACTION * m["l2"]]  # fmt: skip
    assert not over, f"L2-sized grid's rows in flight exceed {triton_logits.L2_FRACTION} of L2: {over}"
    print("\nFused grid trade (predicted floor bytes per second: issue at 80 % against DRAM with the pass-2 misses):")
    slower = []
    for m in fused:
        if m["grid_mode"] != "default":
            continue
        alt = {o["grid_mode"]: o for o in fused if (o["device"], o["dtype"], o["vocab"]) == (m["device"], m["dtype"],
               m["vocab"]) and o["grid_mode"] != "default"}  # fmt: skip
        best = max(alt.values(), key=lambda o: o["predicted"])
        print(f"  {m['device']} {m['dtype']} V={m['vocab']}: sms grid {alt['sms']['grid']} "
              f"{alt['sms']['predicted'] / 1e12:.2f} TB/s (miss {alt['sms']['miss']:.2f}), l2 grid "
              f"{alt['l2']['grid']} {alt['l2']['predicted'] / 1e12:.2f} TB/s; default {m['grid_name']}")  # fmt: skip
        busy = min(alt["sms"]["grid"], triton_logits.REFERENCE_SMS) * (1 - triton_logits.L2_GRID_IDLE)
        eligible = [o for o in alt.values() if o["issue"] >= GRID_DEAD_BAND * ISSUE_MARGIN * COPY_BANDWIDTH
                    and min(o["grid"], triton_logits.REFERENCE_SMS) >= busy]  # fmt: skip
        best = max(eligible or alt.values(), key=lambda o: o["predicted"])
        if m["predicted"] < 0.98 * best["predicted"]:
            slower.append((m["device"], m["dtype"], m["vocab"], m["grid_name"], best["grid_mode"]))
        # and by everything a row costs (test_every_row_meets_the_copy_rate's model), latency included, which the
        # launcher's own trade leaves out
        best = max(alt.values(), key=lambda o: o["full_min"])
        if m["full_min"] < 0.98 * best["full_min"]:
            slower.append((m["device"], m["dtype"], m["vocab"], m["grid_name"], best["grid_mode"], "full model"))
    assert not slower, f"the default fused grid is not the faster prediction: {slower}"


def test_cache_policy_in_the_ptx(model):
    """evict_last only where a row is read twice (the fused kernel's pass 1), evict_first on every gradient store,
    as the PTX of each Triton states it. Triton 3.9 puts the L2 policy on the pipelined copies; 3.6's cp.async
    lowering drops it, so on 3.6 a row without a masked tail tile carries no evict_last at all (the model counts on
    no hint either way)."""
    for m in model:
        cache, version = m["cache"], tuple(int(v) for v in m["triton"].split(".")[:2])
        where = (m["triton"], m["label"], m["dtype"], m["vocab"], cache)
        if m["kernel"] == FUSED and (version >= (3, 9) or m["tail_slots"]):
            # 3.6 makes the policy only for plain loads: the masked tail tile's, where a row has one
            assert "evict_last" in cache["policies"], where
        else:
            assert "evict_last" not in cache["policies"], where  # read once: never kept in L2 on purpose
            assert not any("evict_last" in form for form in cache["loads"] + cache["copies"]), where
        if m["kernel"] in (FUSED, "row_grad_kernel"):  # the gradient: V-wide stores, all streaming
            wide = [form for form in cache["stores"] if form != "st.global"]  # st.global alone: ℓ and H scalars
            assert wide and all("L1::evict_first" in form for form in wide), where
            if m["kernel"] == "row_grad_kernel":
                assert cache["stores"] == ["st.global.L1::evict_first.L2::cache_hint"], where
        hinted = all("L2::cache_hint" in form for form in cache["copies"])
        assert cache["copies"], where  # the tile loops are pipelined on every version
        assert hinted == (version >= (3, 9)), where


def test_grid_switch(monkeypatch):
    """GRPO_KERNELS_FUSED_GRID (or triton_logits.FUSED_GRID) forces either grid; anything else is refused."""
    monkeypatch.delenv(triton_logits.FUSED_GRID_VARIABLE, raising=False)
    assert triton_logits.fused_grid_mode() is None
    row = 151936 * 2
    sms, l2 = triton_logits.REFERENCE_SMS, triton_logits.REFERENCE_L2_BYTES
    for mode, expected in (("sms", 132), ("l2", int(l2 * triton_logits.L2_FRACTION) // row)):
        monkeypatch.setenv(triton_logits.FUSED_GRID_VARIABLE, mode)
        assert triton_logits.fused_grid_mode() == mode
        assert (
            triton_logits._grid_size(TOKENS, 151936, 2, True, sms, l2, 16, triton_logits.fused_grid_mode()) == expected
        )
    monkeypatch.setattr(triton_logits, "FUSED_GRID", "sms")  # the attribute wins over the variable
    assert triton_logits.fused_grid_mode() == "sms"
    monkeypatch.setattr(triton_logits, "FUSED_GRID", "half")
    with pytest.raises(ValueError, match="GRPO_KERNELS_FUSED_GRID"):
        triton_logits.fused_grid_mode()


PIPELINED_PTX = """
$L__BB0_7:
\tcp.async.wait_group \t3;
\tld.shared.v4.b32 \t{%r1, %r2, %r3, %r4}, [%r5];
\tcp.async.cg.shared.global.L2::cache_hint [ %r82 + 0 ], [ %rd96 + 0 ], 0x10, %r83, %rd49;
\tcp.async.cg.shared.global.L2::cache_hint [ %r84 + 0 ], [ %rd97 + 0 ], 0x10, %r85, %rd49;
\tcp.async.commit_group;
\t@%p57 bra \t$L__BB0_7;
$L__BB0_8:
\tbra.uni \t$L__BB0_9;
"""
PLAIN_PTX = """
$L__BB0_2:
\t@%p4 ld.global.L1::evict_last.L2::cache_hint.v4.b32 { %r57, %r58, %r59, %r60 }, [ %rd91 + 0 ], %rd92;
\t@%p5 ld.global.L1::evict_last.L2::cache_hint.v4.b32 { %r61, %r62, %r63, %r64 }, [ %rd93 + 0 ], %rd92;
\tld.global.b16 { %rs1 }, [ %rd46 + 0 ];
$L__BB0_3:
\t@%p6 bra \t$L__BB0_2;
"""


def test_ptx_and_sass_loop_analysis():
    """The PTX and SASS readings on known snippets: a 5-stage pipeline of two 16-byte copies per thread, a plain
    loop; a SASS tile loop with a branch over the target's tile, and a loop without exp2 (not a tile loop)."""
    (body,) = hopper_aot.innermost_loops(PIPELINED_PTX)
    assert hopper_aot.loop_loads_in_flight(body) == {"pipelined": True, "groups": 4, "bytes": 128, "vec16_per_iter": 2}
    (body,) = hopper_aot.innermost_loops(PLAIN_PTX)
    assert hopper_aot.loop_loads_in_flight(body) == {"pipelined": False, "groups": 1, "bytes": 34, "vec16_per_iter": 2}
    assert hopper_aot.innermost_loops("$L__BB0_1:\n\tbra.uni \t$L__BB0_2;\n$L__BB0_2:\n") == []
    sass = [
        (0x100, "MUFU.EX2 R1, R2", 0),
        (0x110, "@P2 BRA 0x140", 0),
        (0x120, "ISETP.NE.U32.AND P3, PT, R6, UR5, PT", 0),
        (0x130, "FSEL R7, R7, -INF , P3", 0),
        (0x140, "FADD R3, R1, R4", 0),
        (0x150, "@P0 BRA 0x100", 0),
        (0x160, "IADD3 R5, R5, 0x1, RZ", 0),
        (0x170, "@P1 BRA 0x160", 0),
        (0x180, "EXIT", 0),
    ]
    assert hopper_aot.sass_tile_loops(sass_model.parse_sass(_sass(sass))) == [{"instructions": 4, "once": 2, "ex2": 1}]
    assert hopper_aot.programs_per_sm(64, 16, 16448) == 2
    assert hopper_aot.programs_per_sm(111, 16, 65600) == 1
    assert hopper_aot.programs_per_sm(64, 16, 230 << 10) == 0


def test_one_nvdisasm_run_reads_each_kernel_as_cuobjdump_does(aot_cache):
    """The model reads the kernels' SASS from one nvdisasm run over all of their code (`hopper_aot.disassemble`:
    the code sections back to back, each code address rebased to its own kernel's start, the control bits read
    from the encodings). Each kernel's instructions, addresses, branch and call targets and control bits are the
    ones `cuobjdump -sass` shows for its cubin alone: the stats, gradient and fused kernels on sm_90a (calls,
    returns, convergence points, warp syncs) and, with Triton's Blackwell ptxas, stats and fused on sm_100a
    (branches on uniform predicates)."""
    _require_aot(None)
    configs = hopper_aot.main_configs(151936, "bf16")
    if Path(hopper_aot.triton_tool("ptxas-blackwell")).exists():
        configs += [{**configs[0], "arch": 100}, {**configs[2], "arch": 100}]
    rows = hopper_aot.compile_rows(configs, None, sass=True, cache=aot_cache, cuobjdump=True)
    for row in rows:
        assert row["sass_code"], row["label"]
        assert row["sass_code"] == row["cuobjdump_code"], (row["label"], row.get("arch", 90))


# ------------------------------------------------------------------------------------------------------------------
# Blackwell (sm_100a): compiled and modelled, reported, not gated. The B200 figures are assumptions: 148 SMs; a
# sustained clock of 1.755 GHz (the Hopper figure's 0.89 of boost, applied to the 1.98 GHz boost that public spec
# listings give; NVIDIA publishes none); copy rate 7.2 TB/s (the 8 TB/s HBM3e of NVIDIA's HGX B200 sheet at the H200's
# measured 4.3 of 4.8 TB/s); MUFU still 16 lanes/clk/SM. The launch plans are the H200's (60 MB of L2), the grids
# are sized for 148 SMs.
B200 = {"sms": 148, "clock": 1.755e9, "copy": 8.0e12 * 4.3 / 4.8}


@pytest.fixture(scope="module")
def blackwell(aot_cache) -> list[dict]:
    _require_aot(None)
    if not Path(hopper_aot.triton_tool("ptxas-blackwell")).exists():
        pytest.skip("this Triton ships no Blackwell ptxas")
    _, rows = configs_for(None)
    rows = [r for r in rows if r["device"] == "H200" and r["grid_mode"] == "default"]
    compiles: dict[tuple, dict] = {}
    for r in rows:
        if r["plan"] not in compiles:
            flags = dict(r["plan"][-1])
            compiles[r["plan"]] = hopper_aot.config(r["label"], r["kernel"], r["dtype"], r["vocab"], flags,
                                                    l2_bytes=r["l2"], arch=100)  # fmt: skip
    plans = list(compiles)
    compiled = hopper_aot.compile_rows([compiles[p] for p in plans], None, sass=True, cache=aot_cache)
    compiled = dict(zip(plans, compiled, strict=True))
    out = [{**predict({**r, "device": "B200"}, compiled[r["plan"]], **B200), "ptxas": compiled[r["plan"]]["ptxas"]}
           for r in rows]  # fmt: skip
    print(f"\nB200 (sm_100a, {out[0]['ptxas']}), assumed: {B200['sms']} SMs, {B200['clock'] / 1e9:.3f} GHz, copy rate "
          f"{B200['copy'] / 1e12:.2f} TB/s, MUFU 16/clk/SM (reported, not asserted)")  # fmt: skip
    print_full_model(out, "B200", copy=B200["copy"], clock=B200["clock"])
    return out


@pytest.mark.slow
def test_blackwell_compile(blackwell):
    """sm_100a with Triton's Blackwell ptxas: 0 spills in every plan; the rows whose MUFU bound is below the B200
    copy rate are printed (Blackwell kept 16 exp2/clk/SM while its bandwidth nearly doubled)."""
    spilled = [(m["label"], m["dtype"], m["vocab"], m["spill_stores"], m["spill_loads"]) for m in blackwell
               if m["spill_stores"] or m["spill_loads"]]  # fmt: skip
    assert not spilled, f"sm_100a register spills: {spilled}"
    mufu = sorted({(m["label"], m["dtype"]) for m in blackwell if m["full_mufu"] < B200["copy"]})
    print(f"MUFU below the B200 copy rate: {mufu or 'none'}")


def _sass(lines: list[tuple[int, str, int]]) -> str:
    """cuobjdump-style text: each instruction, then the word whose top 23 bits are its control bits."""
    return "".join(f"        /*{a:04x}*/                   {t} ;   /* 0x0000000000000000 */\n"
                   f"                                  /* 0x{c << 41:016x} */\n" for a, t, c in lines)  # fmt: skip


def _ctrl(stall: int = 1, sets: int = 7, waits: int = 0) -> int:
    return stall | sets << 5 | 7 << 8 | waits << 11


ROW_SASS = [  # a row loop (0x00 to 0xa0) around a 2-stage tile loop (0x40 to 0x80)
    (0x00, "S2R R0, SR_TID.X", _ctrl()),
    (0x10, "LDG.E R1, desc[UR4][R2.64]", _ctrl(sets=0)),  # a scalar load: SB0
    (0x20, "LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64]", _ctrl()),  # the prologue's copy of tile 0
    (0x30, "LDGDEPBAR", _ctrl()),
    (0x40, "DEPBAR.LE SB0, 0x0", _ctrl()),  # no group left outstanding: this trip's tile is in
    (0x50, "MUFU.EX2 R2, R3", _ctrl()),
    (0x60, "LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64]", _ctrl()),  # the next tile's copy
    (0x70, "LDGDEPBAR", _ctrl()),
    (0x80, "@P0 BRA 0x40", _ctrl()),
    (0x90, "FADD R4, R1, R2", _ctrl(waits=1)),  # waits on SB0: the scalar load
    (0xA0, "@P1 BRA 0x0", _ctrl()),
    (0xB0, "EXIT", _ctrl()),
]


def test_sass_row_timeline():
    """The walk and the timeline on a hand-made row: 3 trips of a tile loop with one copy group outstanding, at
    1 cycle per instruction and 100 cycles per load. Each trip waits for its tile, issued a trip before (lead
    1 − 2/5 tiles: the copy sits 2 of 5 instructions after the wait); the last trip's copy (tile 3 of 3) is off and
    completes at once; the scalar load is long done when the row ends."""
    code = sass_model.parse_sass(_sass(ROW_SASS))
    assert [c.stall for c in code] == [1] * 12 and code[1].sets_sb == 0 and code[9].waits == [0]
    st = sass_model.structure(code)
    assert (st.row_head, st.row_back, st.tile_loops) == (0, 10, [(4, 8)])
    seq, starts, off = sass_model.walk_rows(code, [3], 1)
    assert seq == [0, 1, 2, 3, *[4, 5, 6, 7, 8] * 3, 9, 10] and starts == [0]
    assert off == {16}  # the third trip's copy
    times = sass_model.simulate(code, seq, 1, lambda i: 100.0, off)
    assert times[4] == 102 and times[9] == 204 and times[14] == 306 and times[-1] == 313
    assert sass_model.pipelined_lead(code, st.tile_loops[0]) == pytest.approx(0.6)
    counts = sass_model.pipe_counts(code, seq)
    assert (counts["issue"], counts["mufu"], counts["ldg"]) == (21, 3, 1)


def test_sass_walk_refuses_a_call():
    """A call on the walked path is refused: the walk would count the CALL and not the routine it runs. A call that
    a conditional branch skips (a 64-bit division's slow path, skipped when its operands fit 32 bits) is off the
    path: the walk takes the branch."""
    call, ret = (0x90, "CALL.REL.NOINC 0xc0", _ctrl()), (0xC0, "RET.REL.NODEC R12 0x0", _ctrl())
    rows = [*ROW_SASS[:9], call, *ROW_SASS[10:], ret]  # the call in place of the row's FADD
    code = sass_model.parse_sass(_sass(rows))
    with pytest.raises(ValueError, match="call on the walked path"):
        sass_model.walk_rows(code, [3], 1)
    skipped = [*ROW_SASS[:9], (0x90, "@!P2 BRA 0xb0", _ctrl()), (0xA0, "CALL.REL.NOINC 0xe0", _ctrl()),
               (0xB0, "FADD R4, R1, R2", _ctrl(waits=1)), (0xC0, "@P1 BRA 0x0", _ctrl()), (0xD0, "EXIT", _ctrl()),
               (0xE0, "RET.REL.NODEC R12 0x0", _ctrl())]  # fmt: skip
    code = sass_model.parse_sass(_sass(skipped))
    seq, _, _ = sass_model.walk_rows(code, [3], 1)
    assert seq == [0, 1, 2, 3, *[4, 5, 6, 7, 8] * 3, 9, 11, 12]  # the branch taken over the call


def test_tiles_in_flight_switch(monkeypatch):
    """GRPO_KERNELS_TILES_IN_FLIGHT (or triton_logits.TILES_IN_FLIGHT) sets the least tiles in flight the pipeline
    plans; anything outside 1 to 8 is refused."""
    monkeypatch.delenv(triton_logits.TILES_IN_FLIGHT_VARIABLE, raising=False)
    assert triton_logits.tiles_in_flight() == triton_logits.DEFAULT_TILES_IN_FLIGHT
    plan = (8192, 2, 151936, False, triton_logits.REFERENCE_SMS, triton_logits.REFERENCE_L2_BYTES, 16)
    assert triton_logits._pipeline(*plan)[0] == 1 + triton_logits.DEFAULT_TILES_IN_FLIGHT
    monkeypatch.setenv(triton_logits.TILES_IN_FLIGHT_VARIABLE, "1")
    assert triton_logits._pipeline(*plan)[0] == 2
    monkeypatch.setattr(triton_logits, "TILES_IN_FLIGHT", 2)  # the attribute wins over the variable
    assert triton_logits._pipeline(*plan)[0] == 3
    for bad in (0, 9, "three"):
        monkeypatch.setattr(triton_logits, "TILES_IN_FLIGHT", bad)
        with pytest.raises(ValueError, match="GRPO_KERNELS_TILES_IN_FLIGHT"):
            triton_logits.tiles_in_flight()


def test_blackwell_plan_gives_fp32_single_pass_one_program_per_sm(monkeypatch):
    """On sm_100 the single-pass fp32 plan at 16 warps runs one program per SM (128 registers): sm_100's ptxas spills
    a pipelined fp32 row at the 64 registers of two (test_blackwell_compile); sm_90 keeps two."""
    import torch

    args = {"x_ptr": torch.empty(0, dtype=torch.float32), "BLOCK_V": 8192, "V": 128256, "num_warps": 16,
            "ALIGNED": True}  # fmt: skip
    stages = 1 + triton_logits.DEFAULT_TILES_IN_FLIGHT
    assert triton_logits._launch_plan(args, two_pass=False) == (stages, 64)
    monkeypatch.setattr(triton_logits, "REFERENCE_ARCH", 100)
    assert triton_logits._launch_plan(args, two_pass=False) == (stages, 128)
    bf16 = {**args, "x_ptr": torch.empty(0, dtype=torch.bfloat16)}
    assert triton_logits._launch_plan(bf16, two_pass=False) == (stages, 64)


# The row split across the CTAs of a cluster (Triton's `num_ctas`), priced on today's fused plans: not launched, and
# not in CI (each split is one more compile); docs/performance.md, section 4, quotes this table.
CLUSTER_VARIABLE = "GRPO_KERNELS_CLUSTER_MODEL"
CLUSTER_SHAPES = (("fp32", 128256, (1, 2, 4)), ("bf16", 128256, (1, 2)), ("bf16", 262144, (2, 4)))


def cluster_split(compiled: dict, dtype: str, vocab: int, split: int, l2: int = DEVICES[0][1],
                  sms: int = triton_logits.REFERENCE_SMS) -> dict:  # fmt: skip
    """The fused kernel with each row split across the `split` CTAs of a cluster, one CTA per SM (the plan's), so
    sms / split rows in flight: `row_model` with each cluster as one program over the row (every CTA walks the
    row's whole code, its tile loops at the row's trips, each tile split between the CTAs; each cluster wait at
    sass_model.CLUSTER_WAIT)."""
    occupancy = hopper_aot.programs_per_sm(compiled["regs"], compiled["num_warps"], compiled["smem"])
    assert occupancy >= 1, compiled
    rows = sms // split  # rows in flight
    row = {"kernel": FUSED, "dtype": dtype, "vocab": vocab, "l2": l2, "dram": 2}
    m = row_model(row, compiled, rows, rows, _tile_trips(compiled, vocab, 2), sms=sms)
    return {"dtype": dtype, "vocab": vocab, "split": split, "rows": rows, "miss": m["full_miss"],
            "per_row": m["per_row"]["issue"], "issue": m["full_issue"], "latency": m["full_latency"],
            "dram": m["full_dram"]}  # fmt: skip


@pytest.mark.slow
def test_cluster_split_priced(aot_cache):
    """docs/performance.md, section 4: the fused kernel compiled with `num_ctas` (Triton 3.9, sm_90a, H100), 0
    spills, and the claims made of it: a split's issue and latency bounds fall below the one-CTA kernel's, no split
    of a bf16 row reaches the copy rate, and fp32 at V = 128256 split in two gains but stays below it. Run with
    GRPO_KERNELS_CLUSTER_MODEL=1 (`pytest -s` prints the table)."""
    if os.environ.get(CLUSTER_VARIABLE) != "1":
        pytest.skip(f"set {CLUSTER_VARIABLE}=1 to price the cluster split (one compile per split)")
    _require_aot(None)
    flags = {"LOSS": 0, "ALIGNED": True, **dict.fromkeys(hopper_aot.FUSED_FLAGS, True), "SPLIT": 1}  # one program
    shapes = [(dtype, vocab, split) for dtype, vocab, splits in CLUSTER_SHAPES for split in splits]
    configs = [hopper_aot.config("fused clip all", FUSED, dtype, vocab, flags, num_ctas=split)
               for dtype, vocab, split in shapes]  # fmt: skip
    compiled = hopper_aot.compile_rows(configs, None, sass=True, cache=aot_cache)
    spilled = [(s, c["spill_stores"]) for s, c in zip(shapes, compiled, strict=True) if c["spill_stores"]]
    assert not spilled, spilled
    out = {s: cluster_split(c, *s) for s, c in zip(shapes, compiled, strict=True)}
    print(f"\nFused kernel, rows split across a cluster (Triton {compiled[0]['triton']}, sm_90a, H100, cluster wait "
          f"{sass_model.CLUSTER_WAIT} cycles assumed; TB/s of floor traffic, predictions)")  # fmt: skip
    print(f"{'dtype':<6}{'V':>7}{'split':>6}{'rows':>6}{'miss':>6}{'per row':>9}{'issue':>7}{'latency':>8}{'DRAM':>7}")
    for m in out.values():
        print(f"{m['dtype']:<6}{m['vocab']:>7}{m['split']:>6}{m['rows']:>6}{m['miss']:>6.2f}{m['per_row']:>9.0f}"
              f"{m['issue'] / 1e12:>7.2f}{m['latency'] / 1e12:>8.2f}{m['dram'] / 1e12:>7.2f}")  # fmt: skip

    def best(m: dict) -> float:
        return min(m["issue"], m["latency"], m["dram"])

    one = out[("fp32", 128256, 1)], out[("bf16", 128256, 1)]
    for m in out.values():
        base = one[0] if m["dtype"] == "fp32" else one[1]
        if m["split"] > 1 and m["vocab"] == base["vocab"]:
            assert m["issue"] < base["issue"] and m["latency"] < base["latency"], m
    assert all(best(m) < COPY_BANDWIDTH for m in out.values() if m["dtype"] == "bf16")
    assert best(one[0]) < best(out[("fp32", 128256, 2)]) < COPY_BANDWIDTH
