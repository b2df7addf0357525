#!/usr/bin/env bash
# Device run 49 (nvidia-h200-x2, ~8 minutes; session 7): the Zipf router's in-graph draw as one Triton kernel
# (lab/zipf_triton.py; NOTES §22). (1) keyed_router_check.py: the kernel's and the torch draw's bits
# on the GPU against the host router (20B and 120B shapes), one 192-row draw's device time each way, a served fp32
# run routed in the graph vs on the host; (2) GPT-OSS-20B cut to 8 layers, bf16, C=256, clean and compute hog:
# streaming/defrag + 30 ms hold vs all-gather EP, the router in the graph (the kernel) or on the host in both
# systems, one launch pair per placement, alternating graph, host, graph, host. Output: env.txt, router.txt,
# ep_graph_r{1,2}.md, ep_host_r{1,2}.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 150 python3 benchmarks/device/keyed_router_check.py > "$OUT/router.txt" 2>&1; echo "router check exit $?" >> "$OUT/env.txt"
cat "$OUT/router.txt" | tail -8
P=$(mktemp -d /tmp/run49.XXXX)
for r in 1 2; do
  for where in graph host; do
    DATAFLOW_KEYED_ROUTER=$where timeout 110 python3 benchmarks/gpu_ep_bench.py --out "$P/$where$r" --budget 100 \
      --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 256 \
      --new-tokens 64:128 > "$P/$where$r.log" 2>&1
    echo "ep $where round $r exit $?" | tee -a "$OUT/env.txt"; cp "$P/$where$r/ep_bench.md" "$OUT/ep_${where}_r$r.md"
    grep "^| " "$OUT/ep_${where}_r$r.md" | grep -v "^| system\|^|---" | cut -c1-200
  done
done
for f in "$P"/*.log; do echo "== $f"; tail -n 3 "$f"; done > "$OUT/logs_tail.txt"
