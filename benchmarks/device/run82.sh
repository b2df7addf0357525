#!/usr/bin/env bash
# Device run 82 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 11, first. (1) gpu_bench correctness on GPU 0 and
# (2) fp32 2-GPU NCCL tokens == CPU under the wave hold: session 10's last mends (334df14: routed_rows.pack_tail and
# unpack inside the graph bodies) never ran on a GPU. (3) Where a wave's layer goes (benchmarks/wave_timeline.py,
# DATAFLOW_TIMELINE=1): 20B-L8, bf16, C=256, streaming/defrag + 30 ms hold, and the same with hold_ahead=1 (an owner
# holds its own wave's expert batch for the other home's announced wave), clean and +5 ms link bursts, one round.
# Output: env.txt, gpu_bench.md, tokens.txt, ep.md, timelines.txt, timeline_*.json.gz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run82.XXXX)
DATAFLOW_TIMELINE=1 timeout 260 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 250 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,streaming-defrag:hold_fill=1;hold_us=30000;hold_ahead=1" \
  --scenarios clean,delay-5ms --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| streaming" "$OUT/ep.md" | cut -c1-200
grep -i "error\|failed\|timed out" "$P/ep.log" | head -5 | tee -a "$OUT/env.txt"
python3 benchmarks/wave_timeline.py "$P"/timeline_*.json > "$OUT/timelines.txt" 2>&1; cat "$OUT/timelines.txt"
for f in "$P"/timeline_*.json; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
