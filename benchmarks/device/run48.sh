#!/usr/bin/env bash
# Device run 48 (nvidia-h200-x2, ~5 minutes; session 6): run 43 (below) again on the session-6 tree, whose Zipf router runs inside the attention graph in both systems. The session's
# final tree (busy-polling ranks, asynchronous sampling, merges of one run bookkept with slices) against the barriers,
# every scenario in alternating launches (run 40's one-launch-per-family matrix drifted ~45% between its first and
# last cells). (1) GPU tests and fp32 2-GPU tokens == CPU (defrag + hold); (2) GPT-OSS-20B cut to 8 layers,
# bf16, C=256: streaming/defrag + 30 ms hold vs all-gather EP, clean, compute hog, +5 ms bursts, NVLink hog, 2 rounds
# (barrier launch, streaming launch, twice), medians. Output: env.txt, tokens.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph  # the default when this run was made (session 6 made the host router the default again)
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" "defrag:hold_fill=1,hold_us=3000"
P=$(mktemp -d /tmp/run48.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 310 --rounds 2 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean,compute-hog,delay-5ms,nvlink-hog --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | cut -c1-200
