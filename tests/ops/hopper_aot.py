"""Ahead-of-time sm_90a (H100/H200) compiles of the Triton row kernels, on a machine without a GPU.

`compile_rows(configs, site)` runs `python hopper_aot.py` in a subprocess (without TRITON_INTERPRET: under the
interpreter `@triton.jit` yields an InterpretedFunction that `triton.compile` cannot take), with `site` (a folder
holding another Triton, from `pip install --target`) first on the path. The subprocess lowers each kernel with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, so the cubin comes from the assembler and the
flags this Triton itself uses (plain `ptxas` for sm_90 on Triton 3.5/3.6, `ptxas-blackwell` on 3.9), with the
NUM_STAGES and maxnreg the kernels' launch heuristics pick; it reads registers and spills from that ptxas run's -v
log and the loads in flight from the PTX, and (`sass`) the SASS from nvdisasm, one run for all the cubins.

Loads in flight, per thread, of each innermost loop of the PTX (a loop is a branch back to an earlier label):
- software-pipelined (cp.async into shared memory): the loop issues one commit group per iteration and waits with
  `cp.async.wait_group N` for the oldest, so N + 1 groups are outstanding while it waits: (N + 1) x the cp.async
  bytes of one iteration;
- plain loads: the `ld.global` bytes of one iteration (ptxas issues a tile's independent loads together).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import importlib
import io
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.once import file_lock, write_whole  # the repository is on the path here and in the compile subprocess

try:
    from . import sass_model
except ImportError:  # run as a script (the compile subprocess)
    import sass_model  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch attribute names
FLOAT_ARGS = ("k2", "inv_tau", "inv_tau_lo", "lo", "hi", "delta", "eps_high", "beta", "sapo_pos", "sapo_neg", "inv_t")
# (pointer, flag): the pointer is None (a None constexpr, as at launch) when its kernel's flag is False
OPTIONAL_PTRS = (
    ("h_ptr", "HAS_ENT"), ("hw_ptr", "HAS_ENT"), ("old_ptr", "HAS_OLD"), ("ref_ptr", "HAS_REF"),
    ("rho_ptr", "HAS_RATIO"), ("h_ptr", "HAS_H"),
)  # fmt: skip
FP32_PTRS = (
    "logp_ptr", "ent_ptr", "state_ptr", "parts_ptr", "g_ptr", "h_ptr", "adv_ptr", "old_ptr", "ref_ptr", "rho_ptr",
    "w_ptr", "hw_ptr", "z_ptr", "max_ptr", "sum_exp_ptr", "sum_exp_z_ptr", "target_ptr", "lse_ptr", "mean_z_ptr",
)  # fmt: skip
LOGITS_DTYPE_PTRS = ("x_ptr", "out_ptr", "dz_ptr")  # the ones in the logits' (or GEMM's) dtype
ID_PTRS = ("y_ptr", "ids_ptr")
FUSED_FLAGS = ("HAS_OLD", "HAS_REF", "HAS_RATIO", "HAS_ENT", "HAS_DELTA", "BIAS_KL")


def config(label: str, kernel: str, dtype: str, vocab: int, flags: dict, module: str = "triton_logits", **plan) -> dict:
    """One compile: `kernel` of grpo_kernels.ops.`module` for logits of `dtype` and vocabulary (or tile) width
    `vocab`, with the constexpr `flags`. `plan`: `l2_bytes` (the device the launch plan is for; the reference
    H100's 50 MiB by default), `grid` ("sms" or "l2": a forced fused grid), `arch` (the compute capability
    compiled for: 90, sm_90a, by default; 100 for sm_100a) and `num_ctas` (Triton's cluster option: each program's
    tensors split across that many CTAs; 1 by default)."""
    return {"label": label, "kernel": kernel, "dtype": dtype, "vocab": vocab, "flags": flags, "module": module, **plan}


def main_configs(vocab: int, dtype: str) -> list[dict]:
    """The three kernels a training step runs: stats, the gradient with the entropy term, the fused kernel with
    every clipped-loss option on."""
    return [
        config("stats", "row_stats_fwd_kernel", dtype, vocab, {"ALIGNED": True}),
        config("grad+H", "row_grad_kernel", dtype, vocab, {"HAS_ENT": True, "ALIGNED": True}),
        config(
            "fused clip all",
            "fused_token_grad_fwd_kernel",
            dtype,
            vocab,
            {"LOSS": 0, "ALIGNED": True, **dict.fromkeys(FUSED_FLAGS, True)},
        ),
    ]


def compile_rows(
    configs: list[dict], site: str | None = None, sass: bool = False, cache: Path | None = None,
    cuobjdump: bool = False,
) -> list[dict]:  # fmt: skip
    """Compile `configs` in a subprocess (Triton from `site` when given); one result dict per config. `sass`: also
    disassemble the cubins (`disassemble`: one nvdisasm run) and count the instructions of their tile loops
    (`sass_loops`). `cache`: a folder of compile results (`CompileCache`) to read each specialization from, or to
    add it to; None compiles all. `cuobjdump`: also each cubin's code from a `cuobjdump -sass` run of its own
    (`cuobjdump_code`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, str(REPO), env.get("PYTHONPATH")]))
    request = {"configs": configs, "sass": sass, "cache": str(cache) if cache else None, "cuobjdump": cuobjdump}
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps(request),
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise AssertionError(f"AOT compile subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------------
# PTX and ptxas log analysis (pure functions, also used on hand-written PTX in the tests)


_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_CP_ASYNC = re.compile(r"\bcp\.async\.(?:ca|cg)\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+);")
_LD_GLOBAL = re.compile(r"\bld\.global\S*?(?:\.v(\d))?\.[bsuf](\d+)\s")


def innermost_loops(ptx: str) -> list[list[str]]:
    """The bodies (header label to back branch) of the loops that contain no other loop, in program order."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [lines[a : b + 1] for a, b in sorted(set(inner))]


def loop_loads_in_flight(body: list[str]) -> dict:
    """Bytes per thread that one loop keeps in flight (see the module docstring)."""
    cp_bytes = sum(int(m.group(1), 0) for line in body if (m := _CP_ASYNC.search(line)))
    waits = [int(m.group(1)) for line in body if (m := _WAIT.search(line))]
    ld_bytes, vec16 = 0, 0
    for line in body:
        if m := _LD_GLOBAL.search(line):
            size = int(m.group(1) or 1) * int(m.group(2)) // 8
            ld_bytes += size
            vec16 += size == 16
    cp16 = sum(1 for line in body if (m := _CP_ASYNC.search(line)) and int(m.group(1), 0) == 16)
    if cp_bytes:
        groups = (max(waits) + 1) if waits else 1
        return {"pipelined": True, "groups": groups, "bytes": groups * cp_bytes, "vec16_per_iter": cp16}
    return {"pipelined": False, "groups": 1, "bytes": ld_bytes, "vec16_per_iter": vec16}


def sass_tile_loops(code: list[sass_model.Instr]) -> list[dict]:
    """Each innermost SASS loop (a BRA back to a lower address) that evaluates exp2 (the tile loops), in program
    order: `instructions`, what one warp issues per tile on the common path, and `once`, the instructions that
    a predicated forward branch inside the loop skips (the target's own tile: run once per row, not per tile);
    `ex2` counts the common path's MUFU.EX2."""
    loops = []
    for c in code:
        if (m := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", c.text)) and int(m.group(1), 16) < c.addr:
            loops.append((int(m.group(1), 16), c.addr))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    out = []
    for a, b in sorted(set(inner)):
        body = [c for c in code if a <= c.addr <= b]
        skipped = set()
        for c in body:
            m = re.search(r"^@!?U?P\d\s+BRA\b.*?0x([0-9a-f]+)", c.text)
            if m and c.addr < int(m.group(1), 16) <= b:
                skipped |= {x.addr for x in body if c.addr < x.addr < int(m.group(1), 16)}
        common = [c.text for c in body if c.addr not in skipped]
        if any("MUFU.EX2" in t for t in common):
            out.append(
                {
                    "instructions": len(common),
                    "once": len(body) - len(common),
                    "ex2": sum("MUFU.EX2" in t for t in common),
                }
            )
    return out


def cache_hints(ptx: str) -> dict:
    """The L2 and L1 cache behaviour the PTX asks for: the `createpolicy` L2 policies it makes, and the distinct
    qualifier sets of its global loads, pipelined copies and stores (e.g. `st.global.L1::evict_first`)."""

    def forms(pattern: str) -> list[str]:
        return sorted({re.sub(r"\.(v\d|b\d+|[suf]\d+)", "", m) for m in re.findall(pattern, ptx)})

    return {
        "policies": sorted(set(re.findall(r"createpolicy\S*?L2::(\w+)", ptx))),
        "loads": forms(r"\b(ld\.global[.\w:]*)"),
        "copies": forms(r"\b(cp\.async\.c[ga][.\w:]*)"),
        "stores": forms(r"\b(st\.global[.\w:]*)"),
    }


def ptxas_report(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from a ptxas -v log."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs or not spill:
        raise ValueError(f"not a ptxas -v log: {log[-500:]!r}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


NARROW_KERNELS = {"row_stats_fwd_kernel": "scan", "shard_partials_fwd_kernel": "scan",
                  "fused_token_grad_fwd_kernel": "fused"}  # fmt: skip


def narrow_plan(kernel: str, dtype: str) -> str:
    """`_block_config`'s `narrow` as the launcher passes it for `kernel` over `dtype` logits (`_narrow_plan`)."""
    return NARROW_KERNELS.get(kernel, "") if ELEMENT_BYTES[dtype] == 2 else ""


def programs_per_sm(regs: int, num_warps: int, smem: int) -> int:
    """Resident programs per sm_90 SM: 64 Ki registers (allocated per warp in units of 256), 64 warps, 32 blocks,
    228 KiB of shared memory (1 KiB reserved per block, at most 227 KiB for one)."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = (65536 // regs_per_warp) // num_warps
    by_smem = (228 << 10) // (smem + 1024) if smem <= 227 << 10 else 0
    return max(0, min(by_regs, 64 // num_warps, 32, by_smem))


# ------------------------------------------------------------------------------------------------------------------
# The subprocess


def _ptxas_name(arch: int = 90) -> str:
    """The assembler this Triton's NVIDIA backend runs for sm_`arch`."""
    from triton.backends.nvidia import compiler as nv

    try:
        tool = nv.get_ptxas(arch)
    except TypeError:  # Triton <= 3.5: one ptxas for every architecture
        tool = nv.get_ptxas()
    return Path(tool.path).name


def _specialize(cfg: dict) -> dict:
    """What `triton.compile` gets for `cfg` (the launch plan the kernels' heuristics pick), before any compile."""
    import torch

    module = importlib.import_module(f"grpo_kernels.ops.{cfg['module']}")
    kernel = getattr(module, cfg["kernel"])
    jit = kernel.fn if hasattr(kernel, "values") else kernel  # under a triton.heuristics wrapper, or not
    vocab, dtype, flags = cfg["vocab"], cfg["dtype"], dict(cfg["flags"])
    if "HEAD" in getattr(kernel, "values", {}):  # a config that does not name it: the plain unaligned path
        flags.setdefault("HEAD", False)
    # The device the launch plan is for (the heuristics see a CPU tensor, so they plan for the reference device's
    # figures: set them to this config's: L2 and compute capability), and the fused grid it forces, if any.
    device = {"REFERENCE_L2_BYTES": cfg.get("l2_bytes"), "FUSED_GRID": cfg.get("grid"),
              "REFERENCE_ARCH": cfg.get("arch"), "ROW_SPLIT": flags.get("SPLIT")}  # fmt: skip
    saved = {name: getattr(module, name) for name in device if hasattr(module, name)}
    for name, value in saved.items():
        setattr(module, name, device[name] if device[name] is not None else value)
    try:
        split = 1
        if cfg["module"] == "triton_logits":  # the plain path (neither ALIGNED nor HEAD) as the launchers plan it
            scalar = not flags.get("ALIGNED", True) and not flags.get("HEAD")
            narrow = narrow_plan(cfg["kernel"], dtype)
            if cfg["kernel"] == "fused_token_grad_fwd_kernel":  # its plan and row split, as its launcher's
                block_v, num_warps, split = fused_layout(module, vocab, dtype, flags, scalar, cfg)
            else:
                block_v, num_warps = module._block_config(vocab, scalar, narrow)
        else:  # the fused-linear folds: BLOCK_V columns per step, Triton's default 4 warps
            block_v, num_warps = module._block_v(vocab), 4
        # What the launch heuristics pick for a tensor of this dtype on the reference device (CPU tensor: the
        # heuristics fall back to the reference H100/H200 figures).
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        probe = {
            "x_ptr": torch.empty(0, dtype=torch_dtype),
            "V": vocab,
            "BLOCK_V": block_v,
            "num_warps": num_warps,
            **flags,
        }
        # constexpr parameters with a default the config does not set (the fused kernel's SPLIT, SPIN): the default
        constexprs = {p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}
        constexprs.update(flags, BLOCK_V=block_v)
        options = {"num_warps": num_warps}
        if "ws_ptr" in jit.arg_names:  # the fused kernel's row split
            probe["ws_ptr"] = torch.empty(0, split, 3, dtype=torch.int64) if split > 1 else None
            probe["SPLIT"] = split
            constexprs["SPIN"] = flags.get("SPIN", module.SPLIT_SPIN if split > 1 else 0)
        if "window" in jit.arg_names and split > 1:  # a split row's window, of its slice (`_fused_plan`)
            probe["window"] = module._split_window(vocab, ELEMENT_BYTES[dtype], block_v, num_warps, split,
                                                   module.REFERENCE_SMS, module.REFERENCE_L2_BYTES,
                                                   cfg.get("arch", 90))  # fmt: skip
        elif "window" in jit.arg_names:  # the fused kernel's pass-2 window, as its launcher computes it
            probe["window"] = module._pass2_tiles(vocab, ELEMENT_BYTES[dtype], block_v, num_warps,
                                                  module.REFERENCE_SMS, module.REFERENCE_L2_BYTES, scalar,
                                                  cfg.get("arch", 90), bool(flags.get("HEAD")))  # fmt: skip
        for name, heur in getattr(kernel, "values", {}).items():  # in order: later heuristics see earlier ones
            if name in flags:
                continue
            probe[name] = heur(probe)
            if name == "maxnreg":
                options["maxnreg"] = probe[name]
            else:
                constexprs[name] = probe[name]
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    for ptr, flag in OPTIONAL_PTRS:
        if ptr in jit.arg_names and flag in flags and not flags[flag]:
            constexprs[ptr] = None
    if "ws_ptr" in jit.arg_names and constexprs["SPLIT"] == 1:  # the row split's workspace: none without one
        constexprs["ws_ptr"] = None
    signature, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in LOGITS_DTYPE_PTRS:
            signature[name] = f"*{dtype}"
        elif name in ID_PTRS or name == "ws_ptr":
            signature[name] = "*i64"
        elif name == "logp_ptr" and cfg["kernel"] in ("fused_token_grad_fwd_kernel", "row_stats_fwd_kernel"):
            signature[name] = "*fp64"  # ℓ is stored in float64
        elif name in FP32_PTRS:
            signature[name] = "*fp32"
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"  # N, T, V and the (unspecialized) strides
        # What the launcher's specialization sees: 16-byte aligned tensors, V = 151936 etc. divisible by 16, the
        # fused-linear tiles' row strides (multiples of 256 columns) too.
        if signature[name].startswith("*") or (name == "V" and vocab % 16 == 0) or name in ("stride_z", "stride_dz"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if cfg.get("num_ctas", 1) > 1:  # a program split across the CTAs of a cluster (priced, not launched)
        options["num_ctas"] = cfg["num_ctas"]
    plan = {"block_v": block_v, "num_warps": num_warps, "num_stages": constexprs.get("NUM_STAGES", 1),
            "tail_slots": constexprs.get("TAIL_SLOTS"), "maxnreg": options.get("maxnreg"),
            "split": constexprs.get("SPLIT", 1), "group": constexprs.get("GROUP", 1)}  # fmt: skip
    return {"jit": jit, "signature": signature, "constexprs": constexprs, "attrs": attrs, "options": options,
            "arch": cfg.get("arch", 90), "plan": plan, "name": f"{cfg['module']}.{cfg['kernel']}"}  # fmt: skip


def fused_layout(module, vocab: int, dtype: str, flags: dict, scalar: bool, cfg: dict) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, SPLIT) of a fused-kernel config as `_fused_plan` picks them (`_fused_layout`, the
    output its own tensor) on the device the module's reference figures are set to (a config's SPLIT flag is its
    ROW_SPLIT: `_specialize`); `num_ctas` compiles (a cluster per row) are not split."""
    arch, head = cfg.get("arch", 90), bool(flags.get("HEAD"))
    narrow = narrow_plan(cfg["kernel"], dtype)
    if cfg.get("num_ctas", 1) > 1:
        return *module._fused_block_config(vocab, scalar, narrow, head, arch), 1
    return module._fused_layout(vocab, ELEMENT_BYTES[dtype], scalar, narrow, head, bool(flags.get("ALIGNED")),
                                module.REFERENCE_SMS, module.REFERENCE_L2_BYTES, arch)  # fmt: skip


def _assemble(spec: dict, seen: dict) -> tuple[dict, bytes]:
    """Compile one specialization: (what the tests read off the compile, the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG: make_cubin prints ptxas' -v log
        compiled = triton.compile(
            ASTSource(fn=spec["jit"], signature=spec["signature"], constexprs=spec["constexprs"], attrs=spec["attrs"]),
            target=GPUTarget("cuda", spec["arch"], 32),
            options=spec["options"],
        )
    key = compiled.hash
    if key not in seen:  # the same specialization again (V is not a constexpr): a cache hit prints no log
        seen[key] = ptxas_report(log.getvalue())
    regs, spill_st, spill_ld = seen[key]
    ptx = compiled.asm["ptx"]
    threads = 32 * spec["plan"]["num_warps"]
    loops = [loop_loads_in_flight(body) for body in innermost_loops(ptx)]
    out = {
        "triton": triton.__version__,
        "ptxas": _ptxas_name(spec["arch"]),
        "regs": regs,
        "spill_stores": spill_st,
        "spill_loads": spill_ld,
        "smem": int(compiled.metadata.shared),
        "vector_loads": bool(re.search(r"(ld\.global[^\n]*\.v[24]\.|cp\.async[^\n]*0x10)", ptx)),
        "cache": cache_hints(ptx),
        "loops": [{**lp, "bytes_per_program": lp["bytes"] * threads} for lp in loops],
        "sass_loops": None,
        "sass_code": None,
    }
    return out, compiled.asm["cubin"]


def triton_tool(name: str) -> str:
    """A CUDA binary tool shipped with the running Triton (triton/backends/nvidia/bin)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def code_section(cubin: bytes) -> bytes:
    """The machine code of a cubin's one kernel: its `.text.<kernel>` section (a cubin is a little-endian ELF64)."""
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # section headers: (name offset, type, flags, address, file offset, size)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]

    def name(header: tuple) -> bytes:
        start = names + header[0]
        return cubin[start : cubin.index(b"\0", start)]

    texts = [cubin[h[4] : h[4] + h[5]] for h in headers if name(h).startswith(b".text.")]
    if len(texts) != 1:
        raise ValueError(f"a cubin with {len(texts)} code sections, not one kernel's")
    return texts[0]


_RAW_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
# The instructions of these kernels whose last operand is a code address (a branch or call target, a convergence
# point), which raw disassembly prints from the start of the whole binary.
_CODE_ADDRESS = re.compile(r"^((?:@!?U?P\w+\s+)?(?:BRA|BSSY|WARPSYNC\.COLLECTIVE|CALL\.REL|RET\.REL)\b.*?)0x(\w+)$")


def disassemble(cubins: list[bytes], arch: int) -> list[list[sass_model.Instr]]:
    """Each sm_`arch`a cubin's SASS as `sass_model` reads it (what `cuobjdump -sass` shows for the cubin alone), from
    one nvdisasm run for them all, since its start-up (about half a second) is most of what a disassembly costs:
    the kernels' code back to back, disassembled as raw code, each instruction's code address rebased to its own
    kernel's start, its control bits read from its encoding (the top 23 bits of its second 64-bit word)."""
    if not cubins:
        return []
    codes = [code_section(cubin) for cubin in cubins]
    starts = [0, *itertools.accumulate(map(len, codes[:-1]))]
    blob = b"".join(codes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "code.bin"
        path.write_bytes(blob)
        dump = subprocess.run([triton_tool("nvdisasm"), "-b", f"SM{arch}a", str(path)], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
    out: list[list[sass_model.Instr]] = [[] for _ in codes]
    for m in _RAW_INSTR.finditer(dump):
        addr, text = int(m.group(1), 16), m.group(2)
        k = bisect.bisect_right(starts, addr) - 1
        if k and (target := _CODE_ADDRESS.match(text)):
            text = f"{target.group(1)}0x{int(target.group(2), 16) - starts[k]:x}"
        ctrl = int.from_bytes(blob[addr + 8 : addr + 16], "little") >> 41
        out[k].append(sass_model.Instr(addr - starts[k], text, ctrl))
    for code, instrs in zip(codes, out, strict=True):
        if len(instrs) != len(code) // 16:
            raise AssertionError(f"nvdisasm read {len(instrs)} instructions of a kernel of {len(code) // 16}")
    return out


def cuobjdump_sass(cubin: bytes) -> list[sass_model.Instr]:
    """One cubin's SASS from `cuobjdump -sass` (a run of its own): what `disassemble` is checked against."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        command = [triton_tool("cuobjdump"), "-sass", str(path)]
        dump = subprocess.run(command, check=True, capture_output=True, text=True)
    return sass_model.parse_sass(dump.stdout)


def sass_readings(code: list[sass_model.Instr]) -> dict:
    """The SASS readings of a kernel: its tile loops and the compact code the row model walks."""
    return {"sass_loops": sass_tile_loops(code), "sass_code": sass_model.compact(code)}


# ------------------------------------------------------------------------------------------------------------------
# The compile cache: one entry per (Triton, sources, specialization), shared by the tests and the xdist workers


def _sources_hash() -> str:
    """The package's and this reader's sources: a change to a kernel, its plan or the analysis is another key."""
    digest = hashlib.sha256()
    files = [*sorted((REPO / "grpo_kernels").rglob("*.py")), Path(__file__).resolve(), Path(sass_model.__file__)]
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(spec: dict, sources: str) -> str:
    import triton

    parts = {
        "triton": triton.__version__,
        "sources": sources,
        "kernel": spec["name"],
        "arch": spec["arch"],
        "signature": spec["signature"],
        "constexprs": sorted((k, repr(v)) for k, v in spec["constexprs"].items()),
        "attrs": sorted((list(k), v) for k, v in spec["attrs"].items()),
        "options": spec["options"],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class CompileCache:
    """Compile results on disk under `root` (entry `KEY.json`, cubin `KEY.cubin`), each written once, atomically (a
    temporary file renamed into place), while holding `KEY.lock`: a process that finds an entry locked compiles
    the others first and then waits for it, so two processes never compile the same specialization. An entry
    compiled without its SASS readings gets them later (`update`)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def load(self, key: str) -> dict | None:
        entry = self.root / f"{key}.json"
        return json.loads(entry.read_text()) if entry.exists() else None

    def cubin(self, key: str) -> bytes:
        return (self.root / f"{key}.cubin").read_bytes()

    def store(self, key: str, out: dict, cubin: bytes) -> None:
        self._write(f"{key}.cubin", cubin)  # first: an entry never names a missing cubin
        self.update(key, out)

    def update(self, key: str, out: dict) -> None:
        self._write(f"{key}.json", json.dumps(out).encode())

    def _write(self, name: str, data: bytes) -> None:
        write_whole(self.root / name, data)

    def lock(self, key: str, wait: bool):
        """Yields True with `KEY.lock` held, or False when another process holds it and `wait` is False."""
        return file_lock(self.root / f"{key}.lock", wait)


def _compile_all(configs: list[dict], sass: bool, cache: CompileCache | None, cuobjdump: bool = False) -> list[dict]:
    seen: dict = {}
    specs = [_specialize(cfg) for cfg in configs]
    sources = _sources_hash()
    keys = [cache_key(spec, sources) for spec in specs]
    found: dict[str, dict] = {}
    cubins: dict[str, bytes] = {}  # the ones compiled here

    def compile_here(i: int) -> dict:
        entry, cubins[keys[i]] = _assemble(specs[i], seen)
        return entry

    if cache is None:
        for i, key in enumerate(keys):
            if key not in found:
                found[key] = compile_here(i)
    else:

        def read_or_compile(i: int, wait: bool) -> bool:
            """The entry of specs[i], compiled here if nobody has; False: another process holds it (not waiting)."""
            if keys[i] in found:
                return True
            if (entry := cache.load(keys[i])) is not None:
                found[keys[i]] = entry
                return True
            with cache.lock(keys[i], wait) as held:
                if held:
                    if (entry := cache.load(keys[i])) is None:  # nobody wrote it while we waited
                        entry = compile_here(i)
                        cache.store(keys[i], entry, cubins[keys[i]])
                    found[keys[i]] = entry
                return held

        # first the entries no other process is compiling, then wait for the others
        later = [i for i in range(len(specs)) if not read_or_compile(i, wait=False)]
        for i in later:
            read_or_compile(i, wait=True)

    def cubin(key: str) -> bytes:
        return cubins[key] if key in cubins else cache.cubin(key)  # type: ignore[union-attr]

    if sass:  # the kernels still without SASS readings, disassembled together, one nvdisasm run per architecture
        arch = dict(zip(keys, (spec["arch"] for spec in specs), strict=True))
        missing = [key for key in found if found[key]["sass_code"] is None]
        for a in sorted({arch[key] for key in missing}):
            batch = [key for key in missing if arch[key] == a]
            for key, code in zip(batch, disassemble([cubin(key) for key in batch], a), strict=True):
                found[key].update(sass_readings(code))
                if cache is not None:
                    cache.update(key, found[key])
    rows = [{**cfg, **spec["plan"], **found[key]} for cfg, spec, key in zip(configs, specs, keys, strict=True)]
    if cuobjdump:  # each kernel's code as cuobjdump -sass shows it, disassembled alone (the check of `disassemble`)
        for row, key in zip(rows, keys, strict=True):
            row["cuobjdump_code"] = sass_model.compact(cuobjdump_sass(cubin(key)))
    return rows


def _main() -> None:
    request = json.loads(sys.stdin.read())
    cache = CompileCache(Path(request["cache"])) if request.get("cache") else None
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # a fresh cache: every kernel is assembled here, with its log
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"  # the launch default; silences Triton 3.9's notice about it
        rows = _compile_all(request["configs"], request["sass"], cache, request["cuobjdump"])
    print(json.dumps(rows))


if __name__ == "__main__":
    _main()
