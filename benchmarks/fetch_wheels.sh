#!/usr/bin/env bash
# Fetch what the GPU check needs and the GPU machine lacks, as wheels for its Python (3.12, manylinux x86_64), into
# benchmarks/.wheels/ (ignored by git; it travels with the GPU run), and record this checkout's git revision beside
# them, since the GPU machine gets the working tree without its .git.
#
#     bash benchmarks/fetch_wheels.sh        # on a machine that reaches the package registry; rerun before each run
#
# The GPU machine has torch, triton, transformers, accelerate and the pure-Python libraries datasets builds on
# (pyarrow, pandas, fsspec, xxhash, ...), but not these: trl and liger-kernel (contenders), and datasets, dill and
# multiprocess, which trl.trainer.utils imports. All are pure Python; multiprocess ships one wheel per Python
# version, so the pinned Python version picks the right one.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=benchmarks/.wheels
PY=${PYTHON:-python3}
PACKAGES=(trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$DEST" "${PACKAGES[@]}"
rev=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || rev="$rev+dirty"
echo "$rev" > "$DEST/REVISION"
ls -1 "$DEST"
echo "fetch_wheels: $(du -sh "$DEST" | cut -f1) in $DEST (revision $rev); carry it with the GPU run"
