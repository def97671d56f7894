#!/bin/bash
# The checks that need the lent GPU machine (one GPU, 16 cores), one call each:
#
#   bash bench/device_checks.sh gpu       the CUDA tests (pytest -m cuda over the whole suite)
#                                         and bench/bench_async_gpu.py, every mode
#   bash bench/device_checks.sh scaling   bench/bench_scaling.py --size-mb 6000
#                                         --build-ranks 8 --counts 1 2 4 8, workers and
#                                         torchrun; no run starts after $BUDGET s
#
# Run from the repository root. Packages the machine's image lacks travel as wheels in .whl/
# (isal, megatron-core 0.16.1, typer 0.28; cp312 manylinux, git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     isal==1.9.1 megatron-core==0.16.1 typer==0.28.0
# and are installed into $SITE (default /tmp/site) first. Each step runs under `timeout`, a
# failing step does not stop the next; logs go to $OUT (default bench/out/device), a summary with
# the result tables is printed last.
#
# The device tool's calls, back to back (the machine stays warm only ~30 s between calls;
# 15 min of device time cover its start, ~1-2 min, and both):
#   run(command="bash bench/device_checks.sh gpu", carry=[".whl"], timeout_s=300)
#     ~4 min: install + env ~10 s, CUDA tests ~30-60 s, then modes until BUDGET (210 s from
#     the start) at most 60 s each, 2 GiB x 3 saves
#   run(command="BUDGET=400 bash bench/device_checks.sh scaling", carry=[".whl"], timeout_s=540)
#     build (real Megatron-Core writer, 8 ranks) + disk floor + runs until BUDGET s from the
#     start, the last run at most RUN_TIMEOUT (90) s more, then the table: <= BUDGET + 130 s.
#     Set BUDGET to the device time left after the first call minus ~150 s (at most 400).
#
# Knobs (environment): SIZE_GB, SAVES, MODES, BUDGET (gpu); SIZE_MB, BUILD_RANKS, COUNTS,
# TARGETS, REPEAT, BUDGET, FLOOR_MB, RUN_TIMEOUT, HIDDEN (scaling); WHEELS, SITE; DEVICE=cpu
# runs the gpu step without a GPU (a dry run: the figures then mean nothing).
set -u
what=${1:-}
case "$what" in gpu|scaling) ;; *) echo "usage: $0 gpu|scaling" >&2; exit 2;; esac
OUT=${OUT:-bench/out/device}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}; SITE=${SITE:-/tmp/site}
T0=$SECONDS
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl > "$OUT/steps.txt" 2>&1 || { cat "$OUT/steps.txt"; exit 2; }
  export PYTHONPATH=$SITE:$PWD
else
  echo "no wheels in $WHEELS: isal, megatron-core, typer as installed" | tee "$OUT/steps.txt"
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc; free -g | head -2; df -h /dev/shm /tmp . | cat; uptime
  python3 -c "
import sys, torch, importlib.metadata as md
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())
for n in ('typer', 'isal', 'megatron-core', 'numpy', 'tensorstore', 'safetensors', 'rich'):
    try: print(n, md.version(n))
    except Exception as e: print(n, 'missing', e)
import importlib.util, ckpt_tool, typer, isal
print('imports ok:', ckpt_tool.__file__, 'megatron.core:', getattr(importlib.util.find_spec('megatron.core'), 'origin', None))"
  command -v torchrun ckpt || echo "torchrun/ckpt not on PATH: python3 -m ... instead"
} > "$OUT/env.txt" 2>&1
echo "wheels + env: $((SECONDS - T0)) s" >> "$OUT/steps.txt"

step() {  # step NAME LIMIT_S COMMAND...: the command under timeout, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
}

if [ "$what" = gpu ]; then
  # 4 tests (tests/dist_checkpointing/test_staging_pool.py), ~15-25 s of collection first
  step cuda_tests 100 python3 -m pytest -m cuda -q -p no:cacheprovider -rs --durations=8 tests
  # one process per mode, most wanted first; no mode starts after $BUDGET s from our start
  modes=${MODES:-floor,ours-checkpointer,ours-fork,ours-persistent,mcore-fork,mcore-persistent,dcp,ours-persistent-cached,ours-fork-cached}
  left=$(( ${BUDGET:-210} - (SECONDS - T0) ))
  step async_gpu $((left + 75)) python3 bench/bench_async_gpu.py --size-gb "${SIZE_GB:-2}" \
    --saves "${SAVES:-3}" --modes "$modes" --timeout 60 --budget-s "$left" \
    --json "$OUT/async_gpu.json" --device "${DEVICE:-cuda}"
  echo; echo "== summary (gpu), $((SECONDS - T0)) s"; cat "$OUT/steps.txt"
  grep -E "passed|failed|error|skipped|no tests ran" "$OUT/cuda_tests.log" | tail -3
  grep -E ": (failed|timed out|skipped|not started)" "$OUT/async_gpu.log"
  sed -n '/^async save of/,$p' "$OUT/async_gpu.log"
else
  # no run starts after $BUDGET s from our start; the last may take $RUN_TIMEOUT s more
  left=$(( ${BUDGET:-420} - (SECONDS - T0) )); rt=${RUN_TIMEOUT:-90}
  step scaling $((left + rt + 30)) python3 bench/bench_scaling.py --size-mb "${SIZE_MB:-6000}" \
    --build-ranks "${BUILD_RANKS:-8}" --counts ${COUNTS:-1 2 4 8} \
    --targets ${TARGETS:-torch_dist safetensors reshard dcp} --modes workers torchrun \
    --repeat "${REPEAT:-1}" --budget-s "$left" --floor-mb "${FLOOR_MB:-3000}" \
    --run-timeout "$rt" --work bench/out/scaling_work ${HIDDEN:+--hidden "$HIDDEN"}
  rm -rf bench/out/scaling_work
  echo; echo "== summary (scaling), $((SECONDS - T0)) s"; cat "$OUT/steps.txt"
  grep -E "^(failed|timed out|budget)|Traceback|Error" "$OUT/scaling.log" | head -20
  grep -E "^(machine|source|import torch|disk floor)|^  N=" "$OUT/scaling.log"
  sed -n '/^code /,$p' "$OUT/scaling.log"
fi
