#!/usr/bin/env bash
# Device run 105 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 13's last tree (default attention cap 1024, the
# startup heap frozen out of the collector, direct Triton launches). (1) fp32 2-GPU tokens == CPU; (2) the issue-7
# matrix at C=256, 20B-L8, bf16, 2 rounds: streaming/defrag with and without the 30 ms wave hold (the bench's setting
# and `dataflow run`'s default policy) against all-gather EP, clean, compute hog on GPU 1, +5 ms link bursts, NVLink
# hog; (3) the direct Triton launch re-tested, the order reversed (run 103 ran direct first in every round):
# DATAFLOW_TRITON_LAUNCH=jit then direct, C=256, clean, 3 rounds. Output: env.txt, tokens.txt, ep256.md, ab.md, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run105.XXXX)
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P/m" --budget 320 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,streaming-defrag,ag-ep" \
  --scenarios clean,compute-hog,delay-5ms,nvlink-hog --concurrency 256 --new-tokens 64:128 > "$P/m.log" 2>&1
echo "matrix exit $?" | tee -a "$OUT/env.txt"; cp "$P/m/ep_bench.md" "$OUT/ep256.md"
grep "^| " "$OUT/ep256.md" | grep -v "^|---" | cut -c1-170
timeout 110 python3 benchmarks/gpu_ep_bench.py --out "$P/ab" --budget 100 --rounds 3 \
  --variants "jit:DATAFLOW_TRITON_LAUNCH=jit;direct:DATAFLOW_TRITON_LAUNCH=direct" \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 \
  > "$P/ab.log" 2>&1
echo "ab exit $?" | tee -a "$OUT/env.txt"; cp "$P/ab/ep_bench.md" "$OUT/ab.md"; grep "^| " "$OUT/ab.md" | grep -v "^|---" | cut -c1-170
grep -i "error\|failed\|timed out\|skipped\|out of memory" "$P/m.log" "$P/ab.log" | grep -v "TCPStore\|should dump\|frame #" | head -5 | tee -a "$OUT/env.txt"
tar czf "$OUT/logs.tgz" -C "$P" .
