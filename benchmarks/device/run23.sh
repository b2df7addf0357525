#!/usr/bin/env bash
# Device run 23 (nvidia-h200-x2, ~5 minutes): (1) the 2-rank CUDA transport tests (direct NCCL and c10d)
# after the launcher kept the inherited PYTHONPATH; (2) issue 7's interference matrix with the direct
# NCCL path: streaming/defrag + 30 ms wave hold vs all-gather EP, GPT-OSS-20B cut to 8 layers, bf16,
# C=256, 64-128 new tokens, clean / compute hog on GPU 1 / NVLink hog / delay bursts / clean again.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transport_dist.py tests/test_transport_nccl_lib.py \
  -k "cuda_exchange_direct_nccl or nccl_lib" > "$OUT/pytest.txt" 2>&1; echo "pytest exit $?" | tee -a "$OUT/env.txt"; tail -3 "$OUT/pytest.txt"
P=$(mktemp -d /tmp/run23.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 320 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean,compute-hog,nvlink-hog,delay,clean --concurrency 256 --new-tokens 64:128 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"; grep -A 30 "^| system" "$OUT/ep.md"
