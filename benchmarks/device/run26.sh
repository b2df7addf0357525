#!/usr/bin/env bash
# Device run 26 (nvidia-h200-x2, ~1 minute): the 2-rank CUDA transport tests (direct NCCL and c10d) after
# the c10d int16 fix.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_dist.py tests/test_transport_nccl_lib.py \
  -k "cuda or nccl" > "$OUT/pytest.txt" 2>&1; echo "pytest exit $?" | tee -a "$OUT/env.txt"; tail -4 "$OUT/pytest.txt"
