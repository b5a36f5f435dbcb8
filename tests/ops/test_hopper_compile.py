"""Ahead-of-time compile of every Triton row kernel for sm_90a (H100/H200) on a machine without a GPU.

For each (BLOCK_V, num_warps) row of `triton_logits._block_config`, each logits dtype and the main constexpr flag
combinations, `triton.compile` lowers the kernel to PTX; the `ptxas` shipped with Triton then assembles it with -v
and we read registers and spills. Asserts: no spill stores or loads, and 16-byte vector loads where the rows are
aligned. `pytest -s` shows the table.

The compile runs in a subprocess without TRITON_INTERPRET: under the interpreter `@triton.jit` yields an
InterpretedFunction, which `triton.compile` cannot take (and tests/conftest.py sets the variable on CPU machines).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Representative vocabularies, one per row of the block-size table (BLOCK_V, num_warps):
VOCABS = (
    256,  # (256, 1): largest BLOCK_V of the one-warp row
    1000,  # (1024, 4)
    4096,  # (4096, 8): one tile
    32000,  # (4096, 8): Llama-2, 8 tiles
    151936,  # (8192, 16): Qwen2.5/3, 19 tiles
)
DTYPES = ("fp32", "bf16", "fp16")
FLOAT_ARGS = ("k2", "inv_tau", "inv_tau_lo", "lo", "hi", "delta", "eps_high", "beta", "sapo_pos", "sapo_neg")
OPTIONAL_PTRS = {
    "h_ptr": "HAS_ENT",
    "hw_ptr": "HAS_ENT",
    "old_ptr": "HAS_OLD",
    "ref_ptr": "HAS_REF",
    "rho_ptr": "HAS_RATIO",
}
FP32_PTRS = (
    "logp_ptr", "ent_ptr", "state_ptr", "parts_ptr", "g_ptr", "h_ptr", "adv_ptr", "old_ptr", "ref_ptr", "rho_ptr", "w_ptr", "hw_ptr",
)  # fmt: skip


def _configs():
    """(label, kernel name, logits dtype, V, constexprs) for every compile."""
    fused_flags = ("HAS_OLD", "HAS_REF", "HAS_RATIO", "HAS_ENT", "HAS_DELTA", "BIAS_KL")
    out = []
    for vocab in VOCABS:
        for dtype in DTYPES:
            out.append(("stats", "row_stats_fwd_kernel", dtype, vocab, {"ALIGNED": True}))
            out.append(("grad+H", "row_stats_bwd_kernel", dtype, vocab, {"HAS_ENT": True, "ALIGNED": True}))
            everything = dict.fromkeys(fused_flags, True)
            out.append(
                (
                    "fused clip all",
                    "fused_token_grad_fwd_kernel",
                    dtype,
                    vocab,
                    dict(LOSS=0, ALIGNED=True, **everything),
                )
            )
    # The remaining flag combinations at the production shape (bf16, V = 151936), plus the unaligned variants.
    vocab, dtype = 151936, "bf16"
    out.append(("stats unaligned", "row_stats_fwd_kernel", dtype, vocab, {"ALIGNED": False}))
    out.append(("vocab shard partials", "shard_partials_fwd_kernel", dtype, vocab, {"ALIGNED": True}))
    out.append(("grad", "row_stats_bwd_kernel", dtype, vocab, {"HAS_ENT": False, "ALIGNED": True}))
    out.append(("grad+H unaligned", "row_stats_bwd_kernel", dtype, vocab, {"HAS_ENT": True, "ALIGNED": False}))
    for loss, name in ((0, "clip"), (1, "cispo"), (2, "sapo")):
        out.append(
            (
                f"fused {name} plain",
                "fused_token_grad_fwd_kernel",
                dtype,
                vocab,
                dict(LOSS=loss, ALIGNED=True, **dict.fromkeys(fused_flags, False)),
            )
        )
        if loss:
            out.append(
                (
                    f"fused {name} all",
                    "fused_token_grad_fwd_kernel",
                    dtype,
                    vocab,
                    dict(LOSS=loss, ALIGNED=True, **dict.fromkeys(fused_flags, True)),
                )
            )
    out.append(
        (
            "fused clip all unaligned",
            "fused_token_grad_fwd_kernel",
            dtype,
            vocab,
            dict(LOSS=0, ALIGNED=False, **dict.fromkeys(fused_flags, True)),
        )
    )
    return out  # fmt: skip


def _ptxas_candidates(triton_dir: Path) -> list[Path]:
    bin_dir = triton_dir / "backends" / "nvidia" / "bin"
    # ptxas-blackwell is the newer one (Triton uses it for sm_90+); the plain one may reject newer PTX versions.
    return [p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()]


def _compile_all() -> list[dict]:
    """Runs in the subprocess: compile every config, assemble with ptxas -v, return one dict per config."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from grpo_kernels.ops import triton_logits

    ptxas = _ptxas_candidates(Path(triton.__file__).parent)
    if not ptxas:
        raise RuntimeError("no ptxas in triton/backends/nvidia/bin")
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for label, kernel_name, dtype, vocab, flags in _configs():
        kernel = getattr(triton_logits, kernel_name)
        jit = kernel.fn  # under the triton.heuristics wrapper
        block_v, num_warps = triton_logits._block_config(vocab)
        constexprs = dict(flags, BLOCK_V=block_v)
        # A flag that is False because its input is None: that pointer is a None constexpr, as at launch.
        for ptr, flag in OPTIONAL_PTRS.items():
            if ptr in jit.arg_names and not flags.get(flag, True):
                constexprs[ptr] = None
        signature, attrs = {}, {}
        for i, name in enumerate(jit.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in ("x_ptr", "out_ptr"):
                signature[name] = f"*{dtype}"
            elif name == "y_ptr":
                signature[name] = "*i64"
            elif name == "logp_ptr" and kernel_name == "fused_token_grad_fwd_kernel":
                signature[name] = "*fp64"  # the fused pass stores ℓ in float64
            elif name in FP32_PTRS:
                signature[name] = "*fp32"
            elif name in FLOAT_ARGS:
                signature[name] = "fp32"
            else:
                signature[name] = "i32"  # N, T, V and the (unspecialized) strides
            # What the launcher's specialization sees: 16-byte aligned tensors, V = 151936 etc. divisible by 16.
            if signature[name].startswith("*") or (name == "V" and vocab % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            ptx_path = Path(tmp) / "k.ptx"
            ptx_path.write_text(ptx)
            report, errors = None, []
            for exe in ptxas:
                proc = subprocess.run(
                    [str(exe), "-v", "-arch=sm_90a", str(ptx_path), "-o", str(Path(tmp) / "k.cubin")],
                    check=False,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode == 0:
                    report = proc.stdout + proc.stderr
                    break
                errors.append(f"{exe.name}: {proc.stderr.strip()[-300:]}")
            if report is None:
                raise RuntimeError(f"ptxas failed for {label} {dtype} V={vocab}: {errors}")
        regs = re.search(r"Used (\d+) registers", report)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        rows.append(
            {
                "label": label,
                "kernel": kernel_name,
                "dtype": dtype,
                "vocab": vocab,
                "block_v": block_v,
                "num_warps": num_warps,
                "regs": int(regs.group(1)),
                "spill_stores": int(spill.group(1)),
                "spill_loads": int(spill.group(2)),
                "smem": int(compiled.metadata.shared),
                "aligned": bool(flags.get("ALIGNED")),
                "vector_loads": bool(re.search(r"ld\.global[^\n]*\.v[24]\.", ptx)),
                "ptxas": exe.name,
            }
        )
    return rows


@pytest.fixture(scope="module")
def hopper_rows() -> list[dict]:
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no ASTSource/GPUTarget AOT API: {exc}")
    if not _ptxas_candidates(Path(triton.__file__).parent):
        pytest.skip("Triton ships no ptxas here (triton/backends/nvidia/bin), so sm_90a cannot be assembled")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the launch default; silences Triton 3.9's notice about it
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__], check=False, capture_output=True, text=True, env=env, cwd=repo, timeout=1800
    )
    if proc.returncode != 0:
        raise AssertionError(f"AOT compile subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\nsm_90a (H100/H200) register / spill / shared-memory table, ptxas -v:")
    print(f"{'kernel':<28}{'config':<26}{'dtype':<6}{'V':>7}{'BLOCK_V':>8}{'warps':>6}{'regs':>6}"
          f"{'spill st/ld':>13}{'smem B':>8}{'vec ld':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['kernel']:<28}{r['label']:<26}{r['dtype']:<6}{r['vocab']:>7}{r['block_v']:>8}{r['num_warps']:>6}"
            f"{r['regs']:>6}{r['spill_stores']:>7}/{r['spill_loads']:<5}{r['smem']:>8}{'yes' if r['vector_loads'] else 'no':>7}"
        )
    return rows


def test_hopper_compile_registers_and_spills(hopper_rows):
    """One test (not three) so that pytest-xdist does not compile the whole set once per worker."""
    assert len(hopper_rows) == len(_configs())
    spilled = [r for r in hopper_rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, f"register spills: {spilled}"
    # The ALIGNED hint (strides are not specialized, so Triton cannot see row alignment by itself) must turn the
    # tile loads into 16-byte vectors whenever the mask `o_v < V` is constant over 16 lanes (V % 16 == 0).
    scalar = [
        (r["kernel"], r["label"], r["dtype"], r["vocab"])
        for r in hopper_rows
        if r["aligned"] and r["vocab"] % 16 == 0 and not r["vector_loads"]
    ]
    assert not scalar, f"aligned rows compiled to scalar loads: {scalar}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
