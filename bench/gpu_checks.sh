#!/bin/bash
# The device checks of the async GPU issue in one call (see README "Performance"):
#   CUDA tests, the async GPU benchmark, and where the GPU makes the test suite slower.
# Run from the repository root on a machine with one GPU; logs go to $OUT (or ./gpu_out).
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -z "$NO_WHEELS" ] && ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc; free -g | head -2; df -h /dev/shm /tmp . | cat
  python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
STEPS=${STEPS:-"cuda_tests bench async_tests probe suite"}
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  case " $STEPS " in *" ${name%_*} "*|*" $name "*) ;; *) return;; esac
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"; }
step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
  tests/dist_checkpointing/test_staging_pool.py tests/dist_checkpointing/test_checkpointer.py
step bench ${BENCH_LIMIT:-330} python3 bench/bench_async_gpu.py --size-gb ${SIZE_GB:-4} --saves 4 \
  --timeout 100 --json "$OUT/async_gpu.json" --device ${DEVICE:-cuda}
step async_tests 120 python3 -m pytest -q -p no:cacheprovider -x -n 4 \
  tests/dist_checkpointing/test_async_save.py
for cv in visible hidden; do
  if [ $cv = hidden ]; then export CUDA_VISIBLE_DEVICES=; fi
  step probe_$cv 60 bash -c 'time python3 -c "import torch; torch.cuda.is_available()";
    time python3 -c "import ckpt_tool.dist_checkpointing"'
  step suite_$cv ${SUITE_LIMIT:-60} python3 -m pytest -q -p no:cacheprovider -n 8 --durations=12 \
    tests/dist_checkpointing/test_serialization_multiproc.py tests/dist_checkpointing/test_fully_parallel.py
done
unset CUDA_VISIBLE_DEVICES
cat "$OUT/steps.txt"
