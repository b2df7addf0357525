#!/usr/bin/env bash
# Device run 87 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 11, last. (1) 20B-L8 at C=64 per rank, streaming against
# all-gather EP, clean and compute hog on GPU 1, one round (run 81's cell with this session's tree); (2) run 84's A/B
# again (session 11's tree against 334df14, 20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold, 2 rounds):
# run 84 gave +17.3% and -2.7% (that launch with one ~130 ms stall). This tree also has the review mend b1486f2.
# Before the call: mkdir -p .df/ab && git archive 334df14 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, ep20_c64.md, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run87.XXXX)
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 140 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog \
  --concurrency 64 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep c64 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep20_c64.md"; grep "^| " "$OUT/ep20_c64.md" | grep -v "^|---" | cut -c1-200
AB_TIMEOUT=90 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 75 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
grep -E "^===|execute:sample|loop" "$OUT/phases.txt" | head -24
