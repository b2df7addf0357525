#!/usr/bin/env bash
# Device run 21 (nvidia-h200-x2, ~4 minutes): A/B of the engine's host->device index copies through
# pinned memory (runtime/executors/device_index.py) against the pageable copies that synchronized the host with
# the stream (DATAFLOW_PAGEABLE_H2D=1, a switch that existed for this run only). GPT-OSS-20B cut to 8
# layers, bf16, C=256, 64-128 new tokens; streaming/defrag with and without a 30 ms wave hold; ag-ep.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run21.XXXX)
SYS="streaming-defrag,streaming-defrag:hold_fill=1;hold_us=30000"
COMMON="--scenarios clean,delay,clean --concurrency 256 --new-tokens 64:128"
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/pinned" --budget 190 --systems "$SYS,ag-ep" $COMMON > "$OUT/pinned.log" 2>&1
echo "pinned exit $?" | tee -a "$OUT/env.txt"; cp "$P/pinned/ep_bench.md" "$OUT/pinned.md"; grep "^|" "$OUT/pinned.md"
DATAFLOW_PAGEABLE_H2D=1 timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/pageable" --budget 140 --systems "$SYS" $COMMON > "$OUT/pageable.log" 2>&1
echo "pageable exit $?" | tee -a "$OUT/env.txt"; cp "$P/pageable/ep_bench.md" "$OUT/pageable.md"; grep "^|" "$OUT/pageable.md"
