#!/usr/bin/env bash
# The whole GPU check in one command, within 7 minutes by construction (per-phase budgets: benchmarks/gpu_check.py).
#
#     bash benchmarks/fetch_wheels.sh        # first, on a machine with the package registry (see benchmarks/README.md)
#     bash benchmarks/gpu_check.sh           # then, from the repository root, on the GPU machine
#     bash benchmarks/gpu_check.sh --dry-run # every phase at toy sizes on the CPU
#
# Nothing is installed from the network: the wheels in benchmarks/.wheels/ are installed (pip --no-index) for the
# modules the machine lacks. Results: benchmarks/results/, and gpu_check.{tar.gz,json,md,log} in $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
