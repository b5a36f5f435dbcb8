"""The latency model of docs/performance.md, read off the sm_90a compile at the benchmark shapes.

For each Triton (as in test_hopper_compile.py) and each benchmark shape (B·T = 16384 rows), from the compiled
kernel: the loads one program keeps in flight (PTX: cp.async groups outstanding x bytes per group, or one
iteration's ld.global bytes), the resident programs per SM (registers, shared memory), the grid the launcher
picks for the reference device (132 SMs, 50 MiB L2), and from those:
- bytes in flight per SM = resident programs x bytes in flight per program / SMs, averaged over all SMs; target
  IN_FLIGHT_PER_SM (32 KiB), which by Little's law sustains 4.3 TB/s at 1 µs of latency (3.0 MB at 0.7 µs);
- L2 working set of the fused kernel (pass 2 re-reads the row) = resident rows x row bytes; target <= L2 / 2.
Printed, not asserted: the instruction issue bound, from the SASS instructions per tile of each tile loop (4 warp
instructions per cycle per SM at 1.98 GHz), as the DRAM traffic it allows. `pytest -s` prints the table.
"""

from __future__ import annotations

import pytest

from grpo_kernels.ops import triton_logits

from . import hopper_aot
from .test_hopper_compile import _require_aot, site_id, triton_sites

TOKENS = 16384  # B·T of the benchmark's headline shapes
SHAPES = (("bf16", 151936), ("fp32", 151936), ("bf16", 262144), ("fp32", 262144), ("bf16", 32000))
COPY_BANDWIDTH = 4.3e12  # B/s: the copy rate measured on an H200 (132 SMs)
LATENCY = 0.7e-6  # s: loaded DRAM latency
CLOCK = 1.98e9  # Hz: H100/H200 SXM boost clock; each SM issues 4 warp instructions per cycle
DRAM_PER_LOGIT_BYTE = {"stats": 1, "grad+H": 2, "fused clip all": 2}  # read (+ gradient write; pass 2 from L2)


def model(rows: list[dict], sms: int, l2_bytes: int) -> list[dict]:
    out = []
    for r in rows:
        two_pass = r["kernel"] == "fused_token_grad_fwd_kernel"
        row_bytes = r["vocab"] * hopper_aot.ELEMENT_BYTES[r["dtype"]]
        grid = triton_logits._grid_size(TOKENS, row_bytes, two_pass, sms, l2_bytes)
        occupancy = hopper_aot.programs_per_sm(r["regs"], r["num_warps"], r["smem"])
        resident = min(grid, sms * occupancy)
        per_program = min(lp["bytes_per_program"] for lp in r["loops"])
        # Instruction issue bound: every tile loop (both passes of the fused kernel) runs once per tile.
        cycles_per_tile = sum(lp["instructions"] for lp in r["sass_loops"]) * r["num_warps"] / 4
        tile_bytes = r["block_v"] * hopper_aot.ELEMENT_BYTES[r["dtype"]]
        issue_rate = min(resident, sms) * tile_bytes * CLOCK / cycles_per_tile * DRAM_PER_LOGIT_BYTE[r["label"]]
        out.append(
            {
                **r,
                "grid": grid,
                "occupancy": occupancy,
                "resident": resident,
                "flight_program": per_program,
                "flight_sm": resident * per_program / sms,
                "l2_set": resident * row_bytes if two_pass else None,
                "sass_per_tile": [lp["instructions"] for lp in r["sass_loops"]],
                "issue_rate": issue_rate,
            }
        )
    return out


def print_model(rows: list[dict], l2_bytes: int) -> None:
    print(f"\nLatency model, Triton {rows[0]['triton']}, sm_90a, B·T = {TOKENS}, 132 SMs, L2 {l2_bytes >> 20} MiB:")
    print(f"{'kernel':<16}{'dtype':<6}{'V':>7}{'stages':>7}{'regs':>5}{'smem KiB':>9}{'CTA/SM':>7}{'grid':>6}"
          f"{'resident':>9}{'KiB/prog':>9}{'KiB/SM':>8}{'L2 MiB':>8}{'SASS/tile':>10}{'issue TB/s':>11}")  # fmt: skip
    for m in rows:
        l2 = "-" if m["l2_set"] is None else f"{m['l2_set'] / 2**20:.1f}"
        print(
            f"{m['label']:<16}{m['dtype']:<6}{m['vocab']:>7}{m['num_stages']:>7}{m['regs']:>5}"
            f"{m['smem'] / 1024:>9.1f}{m['occupancy']:>7}{m['grid']:>6}{m['resident']:>9}"
            f"{m['flight_program'] / 1024:>9.0f}{m['flight_sm'] / 1024:>8.1f}{l2:>8}"
            f"{'+'.join(map(str, m['sass_per_tile'])):>10}{m['issue_rate'] / 1e12:>11.2f}"
        )


def test_in_flight_target_follows_littles_law():
    """32 KiB per SM over 132 SMs covers the copy rate at 0.7 µs with 40 % to spare (22.8 KB needed)."""
    needed = COPY_BANDWIDTH * LATENCY / triton_logits.REFERENCE_SMS
    assert 1.3 * needed <= triton_logits.IN_FLIGHT_PER_SM <= 2 * needed


@pytest.mark.parametrize("site", triton_sites(), ids=site_id)
def test_bytes_in_flight_and_l2_working_set(site):
    _require_aot(site)
    configs = [cfg for dtype, vocab in SHAPES for cfg in hopper_aot.main_configs(vocab, dtype)]
    sms, l2 = triton_logits.REFERENCE_SMS, triton_logits.REFERENCE_L2_BYTES
    rows = model(hopper_aot.compile_rows(configs, site, sass=True), sms, l2)
    print_model(rows, l2)
    short = [(m["label"], m["dtype"], m["vocab"], round(m["flight_sm"])) for m in rows
             if m["flight_sm"] < triton_logits.IN_FLIGHT_PER_SM]  # fmt: skip
    assert not short, f"fewer than {triton_logits.IN_FLIGHT_PER_SM} bytes in flight per SM: {short}"
    spilled = [m["label"] for m in rows if m["l2_set"] is not None and m["l2_set"] > l2 * triton_logits.L2_FRACTION]
    assert not spilled, f"rows in flight exceed {triton_logits.L2_FRACTION} of L2: {spilled}"
    # The register ceiling of the launch plan holds the residency the pipeline depth was sized for.
    planned = {
        (m["label"], m["dtype"], m["vocab"]): triton_logits._pipeline(
            m["block_v"], hopper_aot.ELEMENT_BYTES[m["dtype"]], m["vocab"], m["label"].startswith("fused"), sms, l2
        )[1]
        for m in rows
    }
    under = [(k, m["occupancy"]) for m in rows if m["occupancy"] < planned[k := (m["label"], m["dtype"], m["vocab"])]]
    assert not under, f"fewer resident programs per SM than planned: {under}"


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


def test_ptx_loop_analysis():
    """The PTX reading on known snippets: a 5-stage pipeline of two 16-byte copies per thread, a plain loop."""
    (body,) = hopper_aot.innermost_loops(PIPELINED_PTX)
    assert hopper_aot.loop_loads_in_flight(body) == {"pipelined": True, "groups": 4, "bytes": 128, "vec16_per_iter": 2}
    (body,) = hopper_aot.innermost_loops(PLAIN_PTX)
    assert hopper_aot.loop_loads_in_flight(body) == {"pipelined": False, "groups": 1, "bytes": 34, "vec16_per_iter": 2}
    assert hopper_aot.innermost_loops("$L__BB0_1:\n\tbra.uni \t$L__BB0_2;\n$L__BB0_2:\n") == []
    sass = (
        "        /*0100*/                   MUFU.EX2 R1, R2 ;\n"
        "        /*0110*/                   FADD R3, R1, R4 ;\n"
        "        /*0120*/               @P0 BRA 0x100 ;\n"
        "        /*0130*/                   IADD3 R5, R5, 0x1, RZ ;\n"
        "        /*0140*/               @P1 BRA 0x130 ;\n"
        "        /*0150*/                   EXIT ;\n"
    )
    assert hopper_aot.sass_tile_loops(sass) == [{"instructions": 3, "ex2": 1}]  # the second loop has no exp2
    assert hopper_aot.programs_per_sm(64, 16, 16448) == 2
    assert hopper_aot.programs_per_sm(111, 16, 65600) == 1
    assert hopper_aot.programs_per_sm(64, 16, 230 << 10) == 0
