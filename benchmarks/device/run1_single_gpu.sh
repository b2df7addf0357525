#!/usr/bin/env bash
# Device run 1 (nvidia-h200-x2, uses GPU 0): kernel tests on the GPU, kernel timings, then the
# CUDA executor's correctness and timing sections. Each step has its own time limit so one
# failure does not eat the whole call. Usage: bash benchmarks/device/run1_single_gpu.sh $OUT
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export CUDA_VISIBLE_DEVICES=0
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__)'; } 2>&1 | tee $OUT/env.txt
timeout 120 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/kernels_tests.txt
timeout 150 python3 benchmarks/kernels_bench.py --out $OUT 2>&1 | tail -60 > $OUT/kernels_bench.log; tail -5 $OUT/kernels_bench.log
timeout 260 python3 benchmarks/gpu_bench.py --out $OUT --sections correctness,executor 2>&1 | tee $OUT/gpu_bench.log | tail -80
