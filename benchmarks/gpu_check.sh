#!/usr/bin/env bash
# One prepared GPU check (about 5 minutes): the three seed scenarios and the benchmarks that
# answer them, with absolute times and T_eff against the device's measured memory copy.
# Installs nothing beyond the project itself (no network there): run from the repo root,
#   bash benchmarks/gpu_check.sh            # on the lent GPU machine (or on CPU, slower)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp}/gpu_check.log"
run() { echo; echo "\$ $*"; timeout 300 "$@" 2>&1 | tee -a "$out" || echo "(failed: $*)"; }
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee -a "$out" || true
run python3 examples/mixed_state_gpu.py                          # seed 000
run python3 examples/diffusion3d.py --n 32                       # seed 001
run python3 examples/wave_scan_parity.py --n 256 --steps 2000    # seed 004, the report's size
run python3 benchmarks/diffusion3d.py --sizes 64 128 256 --no-diffrax
run python3 benchmarks/wave_scan_parity.py --n 256 --steps 2000 --quick
run python3 benchmarks/lotka_volterra.py --quick
echo "log: $out"
