#!/usr/bin/env bash
# Device run 90 (nvidia-h200-x2, TWO GPUs, ~4 minutes): session 11, last. Can more waves in flight hide a delayed
# link? With one wave per home (attention cap 256 = C), a +5 ms burst on the only link stalls every token of both homes
# (run 85: streaming keeps 0.66 of its clean rate, all-gather EP 0.70). With --attn-cap 128 a home's 256 decodes run as
# two attention batches, two waves; hold_fill=0.5 lets an owner run one wave's expert batch without waiting for the
# other (hold_fill=1 would wait for both). (A) all-gather EP and streaming at cap 256, clean and +5 ms bursts;
# (B) streaming at cap 128 with hold_fill=1 and 0.5, the same scenarios, with the wave timeline. One round each,
# 20B-L8, bf16, C=256. Output: env.txt, ep_a.md, ep_b.md, timelines_b.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
A=$(mktemp -d /tmp/run90a.XXXX); B=$(mktemp -d /tmp/run90b.XXXX)
timeout 160 python3 benchmarks/gpu_ep_bench.py --out "$A" --budget 150 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,delay-5ms \
  --concurrency 256 --new-tokens 64:128 > "$A/ep.log" 2>&1
echo "A exit $?" | tee -a "$OUT/env.txt"; cp "$A/ep_bench.md" "$OUT/ep_a.md"; grep "^| " "$OUT/ep_a.md" | grep -v "^|---" | cut -c1-200 | head -6
DATAFLOW_TIMELINE=1 timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$B" --budget 140 --rounds 1 --attn-cap 128 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,streaming-defrag:hold_fill=0.5;hold_us=30000" \
  --scenarios clean,delay-5ms --concurrency 256 --new-tokens 64:128 > "$B/ep.log" 2>&1
echo "B exit $?" | tee -a "$OUT/env.txt"; cp "$B/ep_bench.md" "$OUT/ep_b.md"; grep "^| " "$OUT/ep_b.md" | grep -v "^|---" | cut -c1-200 | head -6
python3 benchmarks/wave_timeline.py "$B"/timeline_*.json > "$OUT/timelines_b.txt" 2>&1
grep -E "^==|several homes|^  (cycle|to holder|holder queue)" "$OUT/timelines_b.txt"
