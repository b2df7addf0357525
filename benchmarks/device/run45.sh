#!/usr/bin/env bash
# Device run 45 (nvidia-h200-x2, ~7 minutes; session 6): the Zipf router inside the attention graph (NOTES §21).
# (1) GPU tests and fp32 2-GPU tokens == CPU (defrag + hold); keyed_router_check.py: the in-graph router's draws on
# the GPU against the host's (bits), and a served fp32 run routed in the graph vs on the host; (2) GPT-OSS-20B cut
# to 8 layers, bf16, C=256, clean: streaming/defrag + 30 ms hold with the router on the host (`host`, as in run 43)
# and in the graph (`graph`) vs all-gather EP (router in the graph), 2 alternating rounds; (3) GPT-OSS-120B cut to
# 18 layers, C=128, clean and compute hog, 2 alternating rounds (run44.sh's question, with this tree).
# Output: env.txt, tokens.txt, router.txt, ep20.md, ep120.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" "defrag:hold_fill=1,hold_us=3000"
timeout 120 python3 benchmarks/device/keyed_router_check.py > "$OUT/router.txt" 2>&1; echo "router check exit $?" >> "$OUT/env.txt"
tail -4 "$OUT/router.txt"
P=$(mktemp -d /tmp/run45.XXXX)
timeout 170 python3 benchmarks/gpu_ep_bench.py --out "$P/20" --budget 160 --rounds 2 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --variants "host:DATAFLOW_KEYED_ROUTER=host;graph:DATAFLOW_KEYED_ROUTER=graph" --scenarios clean --concurrency 256 \
  --new-tokens 64:128 > "$P/ep20.log" 2>&1
echo "ep20 exit $?" | tee -a "$OUT/env.txt"; cp "$P/20/ep_bench.md" "$OUT/ep20.md"; grep "^| " "$OUT/ep20.md" | cut -c1-200
timeout 290 python3 benchmarks/gpu_ep_bench.py --out "$P/120" --model gpt-oss-120b --budget 280 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 128 \
  --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/120/ep_bench.md" "$OUT/ep120.md"; grep "^| " "$OUT/ep120.md" | cut -c1-200
for f in "$P/ep20.log" "$P/ep120.log"; do tail -n 3 "$f"; done > "$OUT/logs_tail.txt"
