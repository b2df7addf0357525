#!/usr/bin/env bash
# Device run 50 (nvidia-h200-x2, ~9 minutes; session 7): asynchronous dispatch (an attention batch whose in-graph
# routing is still on its way to the host is dispatched later; DATAFLOW_ASYNC_ROUTE; NOTES §22) and the Triton router
# kernel compiled once per shape. (1) GPU tests and fp32 2-GPU tokens == CPU (defrag, defrag + hold: the model's own
# router, in the graph, now dispatched asynchronously); keyed_router_check.py (bits, one draw's device time, served);
# (2) GPT-OSS-20B cut to 8 layers, bf16, C=256, clean and compute hog, the Zipf router in the graph in both systems:
# all-gather EP, streaming/defrag + 30 ms hold with asynchronous dispatch (`async`) and without (`sync`), 2 rounds;
# (3) the same with the router on the host (run 43's setting), 1 round. Host time per batch hidden behind any
# device work (the paper's definition) is a new column. Output: env.txt, tokens.txt, router.txt, ep_graph.md, ep_host.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
timeout 120 python3 benchmarks/device/keyed_router_check.py > "$OUT/router.txt" 2>&1; echo "router check exit $?" >> "$OUT/env.txt"
grep -v "^ \|Warning\|capture_end" "$OUT/router.txt" | tail -8
P=$(mktemp -d /tmp/run50.XXXX)
DATAFLOW_KEYED_ROUTER=graph timeout 280 python3 benchmarks/gpu_ep_bench.py --out "$P/graph" --budget 270 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --variants "async:DATAFLOW_ASYNC_ROUTE=1;sync:DATAFLOW_ASYNC_ROUTE=0" \
  --scenarios clean,compute-hog --concurrency 256 --new-tokens 64:128 > "$P/graph.log" 2>&1
echo "ep graph exit $?" | tee -a "$OUT/env.txt"; cp "$P/graph/ep_bench.md" "$OUT/ep_graph.md"; grep "^| " "$OUT/ep_graph.md" | grep -v "^| system\|^|---" | cut -c1-220
DATAFLOW_KEYED_ROUTER=host timeout 100 python3 benchmarks/gpu_ep_bench.py --out "$P/host" --budget 95 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 256 \
  --new-tokens 64:128 > "$P/host.log" 2>&1
echo "ep host exit $?" | tee -a "$OUT/env.txt"; cp "$P/host/ep_bench.md" "$OUT/ep_host.md"; grep "^| " "$OUT/ep_host.md" | grep -v "^| system\|^|---" | cut -c1-220
for f in "$P"/*.log; do echo "== $f"; grep -i "error\|failed\|timed out" "$f" | head -5; tail -n 2 "$f"; done > "$OUT/logs_tail.txt"
