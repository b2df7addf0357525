#!/usr/bin/env bash
# Device run 46 (nvidia-h200-x2, ~6 minutes; session 6). Run 45's host-vs-graph router A/B was within the drift
# (two rounds, 0.82x-1.07x per round). (1) GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, 3 alternating rounds:
# all-gather EP; streaming/defrag + 30 ms hold with and without hold_ahead=1 (owners hold for the next layer's wave
# of both homes: fewer expert batches per layer, NOTES §19), each with the Zipf router in the graph and on the host.
# (2) One profiled streaming launch (phase timers of both ranks). (3) C=512 per rank, ag-ep vs streaming, one round.
# Output: env.txt, ep20.md, phases.txt, ep512.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run46.XXXX)
S="streaming-defrag:hold_fill=1;hold_us=30000"
timeout 300 python3 benchmarks/gpu_ep_bench.py --out "$P/20" --budget 290 --rounds 3 --systems "$S,$S;hold_ahead=1,ag-ep" \
  --variants "graph:DATAFLOW_KEYED_ROUTER=graph;host:DATAFLOW_KEYED_ROUTER=host" --scenarios clean --concurrency 256 \
  --new-tokens 64:128 > "$P/ep20.log" 2>&1
echo "ep20 exit $?" | tee -a "$OUT/env.txt"; cp "$P/20/ep_bench.md" "$OUT/ep20.md"; grep "^| " "$OUT/ep20.md" | cut -c1-200
d="$P/prof"; mkdir -p "$d"
DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$d/rank{rank}.prof" timeout 90 python3 benchmarks/gpu_ep_bench.py \
  --out "$d" --budget 80 --systems "$S" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$d.log" 2>&1
echo "prof exit $?" >> "$OUT/env.txt"
{ grep "^| streaming" "$d/ep_bench.md" | cut -c1-200; for k in 0 1; do echo "=== rank $k"; head -16 "$d/rank$k.prof.phases.txt"; done; } > "$OUT/phases.txt" 2>&1
head -20 "$OUT/phases.txt"
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/512" --budget 140 --systems "$S,ag-ep" --scenarios clean --concurrency 512 \
  --new-tokens 64:128 > "$P/ep512.log" 2>&1
echo "ep512 exit $?" | tee -a "$OUT/env.txt"; cp "$P/512/ep_bench.md" "$OUT/ep512.md"; grep "^| " "$OUT/ep512.md" | cut -c1-200
tail -n 3 "$P/ep512.log" >> "$OUT/env.txt"
