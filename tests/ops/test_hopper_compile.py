"""Ahead-of-time compile of every Triton row kernel for sm_90a (H100/H200) on a machine without a GPU.

For each (BLOCK_V, num_warps) row of `triton_logits._block_config`, each logits dtype (fp16 from V = 32000, below
which it runs bf16's plans) and the main constexpr flag combinations, `tests/ops/hopper_aot.py` compiles the kernel
with the assembler and flags of the Triton under test and reads registers and spills from ptxas -v. Asserts: no
spill stores or loads, and 16-byte vector loads where the rows are aligned. `pytest -s` shows the table.

Triton versions: the environment's, plus each folder named in GRPO_KERNELS_TRITON_SITES (os.pathsep-separated
`pip install --target` folders; `.ci/run` installs the oldest supported Triton there, 3.5, and 3.6), which compile
the fp32 and bf16 plans of V >= 32000 and the flag combinations (`SITE_VOCABS`).
"""

from __future__ import annotations

import os

import pytest

from . import hopper_aot
from .hopper_aot import FUSED_FLAGS, config

SITES_VARIABLE = "GRPO_KERNELS_TRITON_SITES"
# Representative vocabularies, one per row of the block-size table (BLOCK_V, num_warps), and the largest benchmark one:
VOCABS = (
    256,  # (256, 1): largest BLOCK_V of the one-warp row
    1000,  # (1024, 4)
    4096,  # (4096, 8): one tile
    16000,  # (4096, 8): 4 tiles, the last one partial
    32000,  # (8192, 8): Llama-2, 4 tiles; (4096, 4) for 16-bit statistics and fused rows, 8 tiles
    151936,  # (8192, 16): Qwen2.5/3, 19 tiles; (8192, 8) for 16-bit statistics; the fused kernel's split plan,
    # (4096, 8) fp32 and (8192, 8) 16-bit, each row split in 7 or 4 (`_split_plan`)
    262144,  # (8192, 16): Gemma-3, 32 tiles; the fused kernel's split plan, each row split in 11 or 6
)
DTYPES = ("fp32", "bf16", "fp16")
# fp16 runs bf16's plan at every V (the 16-bit rows); its own compile differs only in the conversion of a loaded
# element, so it is compiled where the 16-bit plans differ from fp32's, V >= 32000 (bf16 covers every row).
FP16_VOCABS = tuple(v for v in VOCABS if v >= 32000)
# An older Triton (a GRPO_KERNELS_TRITON_SITES folder) compiles the vocabularies models ship with, V >= 32000, in
# fp32 and bf16, and the flag combinations; the small-V rows, fp16 (bf16's plans) and the fused-linear folds are
# compiled on the environment's (newest) Triton.
SITE_VOCABS = FP16_VOCABS


def triton_sites() -> list[str | None]:
    """None (the environment's Triton) and the extra Triton folders of GRPO_KERNELS_TRITON_SITES."""
    extra = [p for p in os.environ.get(SITES_VARIABLE, "").split(os.pathsep) if p]
    return [None, *extra]


def site_id(site: str | None) -> str:
    return "env" if site is None else os.path.basename(os.path.normpath(site))


def _configs(site: str | None = None) -> list[dict]:
    """Every config on the environment's Triton; on an older one (`site`), those of SITE_VOCABS in fp32 and bf16
    and the flag combinations."""
    vocabs, fp16 = (VOCABS, FP16_VOCABS) if site is None else (SITE_VOCABS, ())
    pairs = [(vocab, dtype) for vocab in vocabs for dtype in DTYPES if dtype != "fp16" or vocab in fp16]
    out = [cfg for vocab, dtype in pairs for cfg in hopper_aot.main_configs(vocab, dtype)]
    # The remaining flag combinations at the production shape (bf16, V = 151936), plus the unaligned variants.
    vocab, dtype = 151936, "bf16"
    out.append(config("stats unaligned", "row_stats_fwd_kernel", dtype, vocab, {"ALIGNED": False}))
    out.append(config("vocab shard partials", "shard_partials_fwd_kernel", dtype, vocab, {"ALIGNED": True}))
    out.append(config("grad", "row_grad_kernel", dtype, vocab, {"HAS_ENT": False, "ALIGNED": True}))
    out.append(config("grad+H unaligned", "row_grad_kernel", dtype, vocab, {"HAS_ENT": True, "ALIGNED": False}))
    for loss, name in ((0, "clip"), (1, "cispo"), (2, "sapo")):
        plain = {"LOSS": loss, "ALIGNED": True, **dict.fromkeys(FUSED_FLAGS, False)}
        out.append(config(f"fused {name} plain", "fused_token_grad_fwd_kernel", dtype, vocab, plain))
        if loss:
            every = {"LOSS": loss, "ALIGNED": True, **dict.fromkeys(FUSED_FLAGS, True)}
            out.append(config(f"fused {name} all", "fused_token_grad_fwd_kernel", dtype, vocab, every))
    every = {"LOSS": 0, "ALIGNED": False, **dict.fromkeys(FUSED_FLAGS, True)}
    out.append(config("fused clip all unaligned", "fused_token_grad_fwd_kernel", dtype, vocab, every))
    # The fused 16-bit plan of two 8-warp programs per SM (V = 50257, realigned rows) without its options: the
    # tightest fit under its 128-register cap.
    plain = {"LOSS": 0, "ALIGNED": False, "HEAD": True, **dict.fromkeys(FUSED_FLAGS, False)}
    out.append(config("fused clip plain 8 warps", "fused_token_grad_fwd_kernel", dtype, 50257, plain))
    if site is not None:
        return out
    # The fused-linear folds (ops/linear_folds_triton.py): fp32 logits tiles, the gradient in the GEMM dtype.
    for width in (200, 4096):
        out.append(config("linear stats", "linear_stats_fwd_kernel", "fp32", width, {}, "linear_folds_triton"))
        for grad_dtype in DTYPES:
            for has_h in (False, True):
                label = "linear grad+H" if has_h else "linear grad"
                out.append(
                    config(label, "linear_grad_bwd_kernel", grad_dtype, width, {"HAS_H": has_h}, "linear_folds_triton")
                )
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\nsm_90a register / spill / shared-memory table, Triton {rows[0]['triton']}, {rows[0]['ptxas']} -v:")
    print(f"{'kernel':<28}{'config':<25}{'dtype':<6}{'V':>7}{'BLOCK_V':>8}{'warps':>6}{'stages':>7}{'maxnreg':>8}"
          f"{'regs':>5}{'spill st/ld':>12}{'smem B':>8}{'in flight B':>12}")  # fmt: skip
    for r in rows:
        flight = "/".join(str(lp["bytes_per_program"]) for lp in r["loops"]) or "-"
        print(
            f"{r['kernel']:<28}{r['label']:<25}{r['dtype']:<6}{r['vocab']:>7}{r['block_v']:>8}{r['num_warps']:>6}"
            f"{r['num_stages']:>7}{r['maxnreg'] or '-':>8}{r['regs']:>5}{r['spill_stores']:>6}/{r['spill_loads']:<5}"
            f"{r['smem']:>8}{flight:>12}"
        )


def _require_aot(site: str | None) -> None:
    if site is None:
        triton = pytest.importorskip("triton")
        try:
            from triton.backends.compiler import GPUTarget  # noqa: F401
            from triton.compiler import ASTSource  # noqa: F401
        except ImportError as exc:
            pytest.skip(f"this Triton has no ASTSource/GPUTarget AOT API: {exc}")
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        if not os.path.exists(os.path.join(bin_dir, "ptxas")):
            pytest.skip("Triton ships no ptxas here (triton/backends/nvidia/bin), so sm_90a cannot be assembled")
    elif not os.path.isdir(os.path.join(site, "triton")):
        raise AssertionError(f"{SITES_VARIABLE} names {site}, which holds no triton package")


@pytest.mark.slow
@pytest.mark.parametrize("site", triton_sites(), ids=site_id)
def test_hopper_compile_registers_and_spills(site, aot_cache):
    """One test per Triton (not three) so that pytest-xdist does not compile the whole set once per worker. The
    specializations test_performance_model.py compiles too (same Triton, kernel, launch plan and flags) come from
    the run's compile cache (`aot_cache`) when it has compiled them first, and the other way round."""
    _require_aot(site)
    configs = _configs(site)
    rows = hopper_aot.compile_rows(configs, site, cache=aot_cache)
    print_table(rows)
    assert len(rows) == len(configs)
    spilled = [(r["label"], r["dtype"], r["vocab"], r["regs"], r["spill_stores"], r["spill_loads"]) for r in rows
               if r["spill_stores"] or r["spill_loads"]]  # fmt: skip
    assert not spilled, f"register spills on Triton {rows[0]['triton']}: {spilled}"
    # The ALIGNED hint (strides are not specialized, so Triton cannot see row alignment by itself) must turn the
    # tile loads into 16-byte vectors whenever the mask `o_b < V − v0` is constant over 16 lanes (V % 16 == 0).
    scalar = [(r["label"], r["dtype"], r["vocab"]) for r in rows
              if r["flags"].get("ALIGNED") and r["vocab"] % 16 == 0 and not r["vector_loads"]]  # fmt: skip
    assert not scalar, f"aligned rows compiled to scalar loads: {scalar}"


def test_ci_tests_the_oldest_triton():
    """CI must exercise the compile on the oldest supported Triton too, not silently on the environment's only."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the extra Triton folders are optional")
    assert len(triton_sites()) > 1, f"CI runs without {SITES_VARIABLE}: .ci/run installs the older Tritons"


def test_compile_cache_entries_are_whole_and_locked_one_holder_at_a_time(tmp_path):
    """The compile cache the AOT tests share: an entry reads back as written (written whole: no temporary file
    left beside it), with its cubin, and as updated (its SASS readings, added later); a missing one is None; and
    while one holder has a key's lock another that will not wait is told so (False) instead of compiling the same
    specialization again."""
    cache = hopper_aot.CompileCache(tmp_path / "cache")
    assert cache.load("k") is None
    entry = {"regs": 40, "spill_stores": 0, "spill_loads": 0, "sass_code": None, "sass_loops": None}
    cache.store("k", entry, b"\x7fELF")
    assert cache.load("k") == entry and cache.cubin("k") == b"\x7fELF"
    cache.update("k", {**entry, "sass_code": [[0, "EXIT", 0]], "sass_loops": []})
    assert cache.load("k") == {**entry, "sass_code": [[0, "EXIT", 0]], "sass_loops": []}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k.cubin", "k.json"]
    with cache.lock("k", wait=False) as held:
        assert held
        with cache.lock("k", wait=False) as other:  # another open of the lock file: another holder
            assert not other
    with cache.lock("k", wait=False) as again:  # released
        assert again
