#!/usr/bin/env bash
# One prepared GPU check (the steps' limits add up to 540 s; ~7 minutes on an H200): the three
# seed scenarios and the benchmarks that answer issues #12 and #15, with absolute times, T_eff
# against the device's own large copy, the gradient/forward ratio, where a solve's time goes
# kernel by kernel (kernel_profile.py), and the neural-ODE table against diffrax.
# Installs nothing beyond the project itself (no network there): run from the repo root,
#   bash benchmarks/gpu_check.sh            # on the lent GPU machine
#   SMALL=1 bash benchmarks/gpu_check.sh    # tiny sizes: a dry run of every step on CPU
#   ONLY="diffusion neural" bash benchmarks/gpu_check.sh   # only the steps named
# Each step has its own time limit, so one slow step cannot take the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
outdir="${OUT:-/tmp}"
log="$outdir/gpu_check.log"
: >"$log"
step() {  # step SECONDS NAME CMD...: run CMD under a time limit, its output also in NAME.txt
    local limit=$1 name=$2; shift 2
    [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
    echo; echo "\$ $* (limit ${limit}s)" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$outdir/$name.txt" | tee -a "$log" >/dev/null
    local rc=${PIPESTATUS[0]}
    echo "[$name: rc $rc, $((SECONDS - t0)) s]" | tee -a "$log"
    tail -n 40 "$outdir/$name.txt"
}
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee -a "$log"
if [[ -n "${SMALL:-}" ]]; then
    N3=32 NB=32 BATCHES=8 STACK=16 WN=64 WSTEPS=50
else
    N3=256 NB=160 BATCHES=${BATCHES:-256} STACK=256 WN=256 WSTEPS=2000
fi
step 90 seeds python3 -c "
import runpy, sys
for argv in (['examples/mixed_state_gpu.py', '--quick'], ['examples/diffusion3d.py', '--n', '32'],
             ['examples/wave_scan_parity.py', '--n', '$WN', '--steps', '$WSTEPS']):
    print('##', *argv); sys.argv = argv; runpy.run_path(argv[0], run_name='__main__')
"
step 125 neural python3 benchmarks/neural_ode.py --batches "$BATCHES" --variants vmap,stacked \
    --stacked-batch "$STACK" --adjoints "${ADJOINTS:-auto,interpolating,backsolve}" --no-diffrax-backsolve \
    --rounds 5 --number 3 --budget 5 --compile-reps 1
step 120 diffusion python3 benchmarks/diffusion3d.py --sizes "$N3" --no-diffrax --no-padded --rounds 3
step 70 profile bash -c "for a in 'fixed' 'adaptive' 'fixed grad'; do
    python3 benchmarks/kernel_profile.py $N3 float64 \$a --top 16; done"
step 40 stage64 python3 benchmarks/stage_vjp.py "$NB" float64 --grad --rounds 5 --rhs seed
step 30 stage32 python3 benchmarks/stage_vjp.py "$NB" float32 --grad --rounds 5 --rhs seed
step 45 wave python3 benchmarks/wave_scan_parity.py --n "$WN" --steps "$WSTEPS" --rounds 3
step 20 lv python3 benchmarks/lotka_volterra.py --quick --no-torch
echo "log: $log"
