#!/usr/bin/env bash
# The whole GPU check in one command, under 8 minutes on an H200: the GPU tests, then the GPU benchmark table.
#
#     bash benchmarks/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#
# A GPU machine may lack trl and liger-kernel and have no network: whatever the benchmark needs and the machine
# lacks is installed from the pure-Python wheels in benchmarks/wheels/ (trl, liger-kernel, and datasets, dill,
# multiprocess, which trl.trainer.utils imports), into a private folder put on PYTHONPATH.
# Results: benchmarks/results/<device>.{json,md,png}; copies go to $OUT too when that is set (the device tool's
# folder of files to bring back), with the logs.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HERE=benchmarks
WHEELS=$HERE/wheels
SITE=${GPU_CHECK_SITE:-/tmp/grpo_bench_site}
LOGDIR=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # grpo_kernels and reference/ from this checkout, installed or not
T0=$(date +%s)

# module -> wheel name; only what is missing is installed, so the machine's own versions stay. One wheel at a time
# (multiprocess comes per Python version: the first that installs wins), so one misfit costs only its module.
for pair in trl:trl liger_kernel:liger_kernel datasets:datasets dill:dill multiprocess:multiprocess; do
    mod=${pair%%:*}
    whl=${pair#*:}
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)" 2>/dev/null && continue
    ok=0
    for f in "$WHEELS"/"$whl"-*.whl; do
        [ -e "$f" ] || continue
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$f" 2>/dev/null; then
            echo "gpu_check: $mod was missing; installed $(basename "$f") into $SITE"
            ok=1
            break
        fi
    done
    [ $ok = 1 ] || echo "gpu_check: $mod is missing and no wheel in $WHEELS installs here; its contender will say so"
done
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"

"$PY" - <<'EOF'
import torch
from importlib import metadata
print("gpu_check:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE", "| torch", torch.__version__)
for name in ("triton", "trl", "liger-kernel", "transformers", "datasets"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name} missing")
EOF

# 1. The GPU tests (kernels against the oracle on a real device), capped so the benchmark always gets its turn.
tests_rc=0
timeout "${GPU_TEST_TIMEOUT_S:-150}" "$PY" -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$LOGDIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu_check: GPU tests exit code $tests_rc ($(( $(date +%s) - T0 )) s so far)"
if [ "$tests_rc" = 124 ]; then
    echo "gpu_check: the GPU tests hit their ${GPU_TEST_TIMEOUT_S:-150} s cap (GPU_TEST_TIMEOUT_S); going on to the benchmark"
    tests_rc=3  # not 124, which a caller would read as this whole script timing out
fi

# 2. The benchmark table. --budget-s stops starting new shapes in time; each shape finishes within --shape-budget-s
#    of timed rounds, so the whole script stays under 8 minutes.
elapsed=$(( $(date +%s) - T0 ))
budget=$(( ${GPU_CHECK_TOTAL_S:-450} - elapsed - 200 ))  # leaves ~150 s for the fused-linear table below
[ "$budget" -lt 60 ] && budget=60
"$PY" benchmarks/bench_loss.py --device cuda --budget-s "$budget" "$@" 2>&1 | tee "$LOGDIR/bench_loss.log"
bench_rc=${PIPESTATUS[0]}

# 3. The fused-linear table (hidden states + lm_head weight -> loss, logits never materialized).
timeout 150 "$PY" benchmarks/bench_linear.py --device cuda --budget-s 110 2>&1 | tee "$LOGDIR/bench_linear.log"
linear_rc=${PIPESTATUS[0]}
echo "gpu_check: fused-linear benchmark exit code $linear_rc"

if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/linear-cuda-*.json benchmarks/results/linear-cuda-*.md "$OUT"/ 2>/dev/null
    cp benchmarks/results/cuda-*.json benchmarks/results/cuda-*.md benchmarks/results/cuda-*.png "$OUT"/ 2>/dev/null
fi
echo "gpu_check: done in $(( $(date +%s) - T0 )) s; tests exit $tests_rc, benchmark exit $bench_rc"
echo "gpu_check: results in benchmarks/results/ (cuda-<device>.json, .md, .png)${OUT:+ and copied to $OUT}"
exit $(( bench_rc != 0 ? bench_rc : tests_rc == 5 ? 0 : tests_rc ))
