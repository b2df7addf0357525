#!/usr/bin/env bash
# Device run 13 (nvidia-h200-x2, ~8 minutes): the wave hold on the GPUs, and GPT-OSS-120B cut to 18 layers
# (expert-sharded weights: each rank holds its 64 experts per layer, ~56.5 GiB).
# (A) GPT-OSS-20B cut to 8 layers, bf16, C=256 per rank: streaming/defrag without and with the wave hold vs
#     all-gather EP, clean / delay bursts / NVLink hog.
# (B) GPT-OSS-120B cut to 18 layers, bf16, C=128 per rank: streaming/defrag + hold vs all-gather EP, clean / delay.
# Output: env.txt, ep20.{log,md}, ep120.{log,md} (5 files).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; { date -u; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; } > "$OUT/env.txt" 2>&1
P=$(mktemp -d /tmp/run13.XXXX)
S20="streaming-defrag,streaming-defrag:hold_fill=1;hold_us=3000,streaming-defrag:hold_fill=0.9;hold_us=1000,ag-ep"
timeout 280 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 260 --systems "$S20" --scenarios clean,delay,nvlink-hog --concurrency 256 > "$OUT/ep20.log" 2>&1
echo "ep20 exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep20.md"; cat "$OUT/ep20.md"
timeout 300 python3 benchmarks/gpu_ep_bench.py --out "$P/b" --model gpt-oss-120b --budget 280 --systems "streaming-defrag:hold_fill=1;hold_us=3000,ag-ep" --scenarios clean,delay --concurrency 128 > "$OUT/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/b/ep_bench.md" "$OUT/ep120.md"; cat "$OUT/ep120.md"
nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/env.txt"
