#!/usr/bin/env bash
# Sourced by run.sh as `. benchmarks/device/start.sh OUT` (from the repository root on the lent machine): OUT made
# and absolute; the wheels the machine lacks (pydantic, pyzmq, ...: carried in .whl/, see README.md) installed into
# /tmp/site; the NCCL settings those machines need (no NVLink multicast: it fails there, and point-to-point needs
# none); OUT/env.txt started with the date and the hash of the tree's sources (the device copy's .git may be stale).
set -u
OUT=${1:?out dir}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
# the tree is not installed there: kernels/ is importable as dataflow_kernels (pyproject.toml's package-dir) by a link
ln -sfn "$PWD/kernels" /tmp/site/dataflow_kernels
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
