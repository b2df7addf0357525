#!/usr/bin/env bash
# Device run 67 (nvidia-h200-x2, TWO GPUs, ~9 minutes): written in session 8 for the next session with two GPUs. The
# device-routed dispatch (DATAFLOW_DISPATCH=device, NOTES §25) in the 2-process setting, where it was never run:
# (1) fp32 2-GPU tokens == CPU with it on (defrag, defrag + hold); (2) the matrix, GPT-OSS-20B cut to 8 layers, bf16,
# C=256: all-gather EP and streaming/defrag + 30 ms hold with --variants host / device, clean, compute hog on GPU 1,
# +5 ms bursts, NVLink hog, 2 rounds. Output: env.txt, tokens.txt, ep.md. Questions: does it keep run 66's gain
# (+21-28% on one GPU) with NCCL sends of the packed batch, and does it win back the compute-hog result the routing
# round trip cost (3.0x with the host router against 2.0x with the graph router, §22 item 2)?
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
DATAFLOW_DISPATCH=device bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run67.XXXX)
timeout 450 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 440 --rounds 2 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --variants "host:DATAFLOW_DISPATCH=host;device:DATAFLOW_DISPATCH=device" --scenarios clean,compute-hog,delay-5ms,nvlink-hog \
  --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out" "$P/ep.log" | head -5 >> "$OUT/env.txt"
